"""Files written whole, with their mode from the start: never half written, never readable by whom it must not be;
and files read again when they change on disk, so a replacement takes effect without a restart."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from foundation.setting_values import SettingsError

log = logging.getLogger("shepherd.files")


def replace_file(path: Path, data: bytes, mode: int) -> None:
    """Write data to a new file beside path, created with mode (exclusively: no link or file is followed or
    reused), flush it to disk, and rename it over path. A reader sees the old file or the new one; an old file's
    mode is not kept."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        # The umask may have taken bits off mode: set it as asked.
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


# What stat says of a file, to tell that it changed without reading it: (device, inode, size, mtime and ctime in
# nanoseconds), or why it could not be stat'ed.
FileSignature = tuple[int, int, int, int, int] | str


def file_signature(path: Path) -> FileSignature:
    """The file's signature now, or why it cannot be stat'ed."""
    try:
        status = os.stat(path)
    except OSError as error:
        return error.strerror or str(error)
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


class FileChanges:
    """Whether files changed on disk since the last look, from stat alone: a look costs a stat call a file. A file
    renamed over, written in place, removed or put back is seen changed (the change time moves with every write,
    even one that sets the modification time back)."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self._seen = self._signature()

    def _signature(self) -> tuple[FileSignature, ...]:
        return tuple(file_signature(path) for path in self.paths)

    def look(self) -> bool:
        """Whether any of the files changed since the last look (the first: since this was made). Each change is
        told once; read the files after the look, so that a write after the read is told by the next one."""
        signature = self._signature()
        if signature == self._seen:
            return False
        self._seen = signature
        return True

    def as_last_seen(self) -> bool:
        """Whether the files are still as the last look saw them: after a read, False when one was written
        meanwhile, and what was read may be half of it."""
        return self._signature() == self._seen


T = TypeVar("T")


class ReloadedFile(Generic[T]):
    """What a file holds, as load makes it of the file, read again whenever the file changed on disk (FileChanges).

    For a file replaced while a process runs: the next call to current() after the replacement reads it, with no
    restart, and while nothing changed, current() costs a stat call. A replacement load refuses (unreadable, gone,
    malformed, half written) is logged once a change, naming what is wrong, and the last good contents are used on;
    one caught while it was being written is read again at the next call. load raises ValueError (or OSError) with a
    message that names the file. At start there is nothing before to use: a file load refuses is a SettingsError
    naming setting.
    """

    def __init__(
        self, path: Path, load: Callable[[Path], T], *, what: str, setting: str, describe: Callable[[T], str]
    ) -> None:
        self.path, self.what = path, what
        self._load, self._describe = load, describe
        # Stat'ed before the first read, so that a write after it is read at the next look.
        self._changes = FileChanges(path)
        try:
            self._value = load(path)
        except (OSError, ValueError) as problem:
            raise SettingsError(setting, str(problem)) from None

    def current(self) -> T:
        """The file's contents as load made them: read again if the file changed, else the last good ones."""
        if not self._changes.look():
            return self._value
        try:
            value = self._load(self.path)
        except (OSError, ValueError) as problem:
            # One written meanwhile may be whole by the next look, which sees the change and reads it again.
            if self._changes.as_last_seen():
                log.warning("%s not reloaded, the one read before is used on: %s", self.what, problem)
            return self._value
        if not self._changes.as_last_seen():
            return self._value  # written meanwhile: what was read may be half of it; the next look reads it again
        if value != self._value:
            self._value = value
            log.info("%s reloaded from %s: %s", self.what, self.path, self._describe(value))
        return self._value
