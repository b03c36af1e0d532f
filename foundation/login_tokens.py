"""Where `shepherd login` keeps an operator's tokens: one JSON file only its owner can read.

The file is ``shepherd/tokens.json`` in the user's configuration directory (``$XDG_CONFIG_HOME``, else
``~/.config``), the directory created mode 0700 and the file written whole with mode 0600 (foundation/files.py).
A file others may read is refused, not used: its refresh token may already be someone else's. Processes that
refresh the tokens at once take turns through a lock file beside it, so that an issuer that rotates refresh
tokens does not see the same one used twice (which it takes for a theft, ending the login).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import stat
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from foundation.files import replace_file
from foundation.secret_files import SecretFileError, read_secret_file

TOKENS_FILE = "tokens.json"


class TokenCacheError(Exception):
    """The tokens file cannot be used; str() names the file and why."""


@dataclass(frozen=True)
class CachedLogin:
    """An operator's login as kept: at which issuer, through which client, for which API, who, and the tokens."""

    issuer: str
    client_id: str
    audience: str
    subject: str
    groups: tuple[str, ...]
    access_token: str
    expires_at: float  # time.time() of the access token's expiry
    refresh_token: str | None

    def is_for(self, issuer: str, client_id: str, audience: str) -> bool:
        """Whether this login is at that issuer, through that client, for that API."""
        return (self.issuer, self.client_id, self.audience) == (issuer, client_id, audience)


def tokens_path(environ: Mapping[str, str] | None = None) -> Path:
    """The tokens file: under $XDG_CONFIG_HOME when it is an absolute path (the XDG rule), else ~/.config."""
    environ = os.environ if environ is None else environ
    configured = environ.get("XDG_CONFIG_HOME", "")
    base = Path(configured) if configured and Path(configured).is_absolute() else Path.home() / ".config"
    return base / "shepherd" / TOKENS_FILE


def save_login(path: Path, login: CachedLogin) -> None:
    """Write the login to path (mode 0600), creating its directory (mode 0700) as needed."""
    _private_directory(path.parent)
    replace_file(path, json.dumps(asdict(login), indent=1).encode(), 0o600)


def load_login(path: Path) -> CachedLogin | None:
    """The login kept at path; None when there is none; TokenCacheError when the file cannot serve."""
    if not path.exists():
        return None
    try:
        document = json.loads(read_secret_file(path))
        return CachedLogin(
            issuer=_text(document, "issuer"),
            client_id=_text(document, "client_id"),
            audience=_text(document, "audience"),
            subject=_text(document, "subject"),
            groups=tuple(str(group) for group in document.get("groups", [])),
            access_token=_text(document, "access_token"),
            expires_at=float(document["expires_at"]),
            refresh_token=document.get("refresh_token") or None,
        )
    except SecretFileError as error:
        raise TokenCacheError(f"the tokens file {path} {error}") from None
    except (ValueError, KeyError, TypeError):
        raise TokenCacheError(f"the tokens file {path} is not one shepherd login wrote; run shepherd logout") from None


def forget_login(path: Path) -> bool:
    """Remove the tokens file; whether there was one."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


@contextlib.asynccontextmanager
async def refresh_turn(path: Path) -> AsyncIterator[None]:
    """Hold the lock of the tokens file while a refresh reads, renews and writes it (another process waits)."""
    _private_directory(path.parent)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing it lets the lock go


def _private_directory(directory: Path) -> None:
    """The directory, created mode 0700 with its missing parents (the XDG rule for the configuration directory);
    one of ours that others may enter is closed to them."""
    try:
        missing = [folder for folder in (directory, *directory.parents) if not folder.exists()]
        for folder in reversed(missing):  # mkdir(parents=True) would give the parents the umask's mode
            folder.mkdir(mode=0o700, exist_ok=True)
        status = directory.stat()
        if status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) & 0o077:
            directory.chmod(0o700)
    except OSError as error:
        raise TokenCacheError(f"cannot make the directory {directory}: {error.strerror or error}") from None


def _text(document: dict[str, Any], name: str) -> str:
    value = document[name]
    if not isinstance(value, str):
        raise TypeError(name)
    return value
