"""Whether a file is an executable a machine can run, whole: what the agent executable is checked for before a
worker hands it out. A file caught half written, or replaced by something else (an error page saved by a failed
download, an empty file), would fail every takeover on every machine.

What can be told from the bytes is told: an ELF binary must hold every segment and table its header points to (the
section headers come last, so a file cut short lacks them), a script must start with a whole ``#!`` line, and a zip
archive after it (a Python zipapp, as the reference agent) must be whole. A script cut short elsewhere cannot be
told; writing the file beside and renaming it over avoids that.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

from foundation.files import ReloadedFile

ELF_MAGIC = b"\x7fELF"
SCRIPT_MAGIC = b"#!"
# Linux reads at most this much of a #! line (BINPRM_BUF_SIZE): a longer one is cut.
MAX_SCRIPT_LINE = 256
ZIP_LOCAL_FILE_HEADER = b"PK\x03\x04"
# ELF header fields: (class 1 is 32-bit, 2 is 64-bit) -> struct formats of the header from e_phoff to e_shnum, and
# of a program header's p_offset and p_filesz, with the offsets they start at.
_ELF_LAYOUT = {
    1: ("IIIHHHHHH", 0x1C, "I", 0x04, "I", 0x10),
    2: ("QQIHHHHHH", 0x20, "Q", 0x08, "Q", 0x20),
}


class NotAnExecutable(ValueError):
    """A file that is no whole executable; the message names the file and what is wrong."""


def read_executable(path: Path) -> bytes:
    """The bytes of the executable at path; NotAnExecutable naming the file when it cannot be read or is no whole
    executable."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise NotAnExecutable(f"cannot read {path}: {error.strerror or error}") from None
    problem = executable_problem(data)
    if problem is not None:
        raise NotAnExecutable(f"{path} {problem}")
    return data


def executable_problem(data: bytes) -> str | None:
    """What makes data no whole executable, as the end of a sentence about the file; None when nothing does."""
    if not data:
        return "is empty"
    if data.startswith(ELF_MAGIC):
        return _elf_problem(data)
    if data.startswith(SCRIPT_MAGIC):
        return _script_problem(data)
    return f"is neither an ELF binary nor a script starting with #! (it starts with {data[:16]!r})"


def _elf_problem(data: bytes) -> str | None:
    cut_short = "is an ELF binary cut short (half written?)"
    if len(data) < 6:
        return cut_short
    # e_ident: the class (32 or 64 bits) at 4, the byte order at 5 (1 little-endian, 2 big-endian).
    layout = _ELF_LAYOUT.get(data[4])
    if layout is None or data[5] not in (1, 2):
        return "is an ELF binary of an unknown class or byte order"
    header_format, header_at, offset_format, offset_at, size_format, size_at = layout
    order = "<" if data[5] == 1 else ">"
    try:
        phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum, _shstrndx = struct.unpack_from(
            order + header_format, data, header_at
        )
        ends = [shoff + shentsize * shnum if shoff else 0, phoff + phentsize * phnum]
        for index in range(phnum):
            entry = phoff + index * phentsize
            (offset,) = struct.unpack_from(order + offset_format, data, entry + offset_at)
            (size,) = struct.unpack_from(order + size_format, data, entry + size_at)
            ends.append(offset + size)
    except struct.error:
        return cut_short
    return cut_short if max(ends) > len(data) else None


def _script_problem(data: bytes) -> str | None:
    line_end = data.find(b"\n", 0, MAX_SCRIPT_LINE)
    if line_end < 0:
        return f"starts with #! but has no end of that line within {MAX_SCRIPT_LINE} bytes"
    if data.startswith(ZIP_LOCAL_FILE_HEADER, line_end + 1):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                broken = archive.testzip()
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError):
            return "is a script with a zip archive (a Python zipapp) cut short or damaged (half written?)"
        if broken is not None:
            return f"is a script with a zip archive (a Python zipapp) whose member {broken} is damaged"
    return None


def agent_executable_file(path: Path) -> ReloadedFile[bytes]:
    """The agent executable a takeover uploads, read again when the file changed; a file that is no whole
    executable is kept from use (and at start, a SettingsError naming agent_executable_path)."""
    return ReloadedFile(
        path,
        read_executable,
        what="agent executable",
        setting="agent_executable_path",
        describe=lambda data: f"{len(data):,} bytes; takeovers from now on upload it",
    )
