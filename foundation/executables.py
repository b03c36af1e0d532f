"""Whether a file is an executable a machine can run, whole: what the agent executable is checked for before a
worker hands it out. A file caught half written, or replaced by something else (an error page saved by a failed
download, an empty file), would fail every takeover on every machine.

What can be told from the bytes is told: an ELF binary must hold every segment and table its header points to (the
section headers come last, so a file cut short lacks them), a script must start with a whole ``#!`` line, and a zip
archive after it (a Python zipapp, as the reference agent) must be whole. A script cut short elsewhere cannot be
told; writing the file beside and renaming it over avoids that.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from foundation.files import ReloadedFile

ELF_MAGIC = b"\x7fELF"
SCRIPT_MAGIC = b"#!"
# Linux reads at most this much of a #! line (BINPRM_BUF_SIZE): a longer one is cut.
MAX_SCRIPT_LINE = 256
ZIP_LOCAL_FILE_HEADER = b"PK\x03\x04"
# The ELF section in which agent.build records what the executable needs of a machine: JSON, {"glibc": "2.36"}.
MANIFEST_SECTION = "shepherd_agent"
# ELF e_machine -> the architecture as `uname -m` names it (lifecycle.probe folds uname's other names into these).
ELF_MACHINES = {3: "i686", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64", 22: "s390x", 258: "loongarch64"}
# e_machine 21 (PowerPC 64) names its byte order in uname.
_PPC64 = 21
_PT_INTERP = 3
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


@dataclass(frozen=True)
class _Elf:
    """An ELF file's header fields that tell where its parts are."""

    data: bytes
    elf_class: int
    order: str
    phoff: int
    shoff: int
    phentsize: int
    phnum: int
    shentsize: int
    shnum: int
    shstrndx: int

    @classmethod
    def of(cls, data: bytes) -> _Elf:
        """The header of data; ValueError for an unknown class or byte order, struct.error for one cut short."""
        if len(data) < 6:
            raise struct.error("no ELF identification")
        # e_ident: the class (32 or 64 bits) at 4, the byte order at 5 (1 little-endian, 2 big-endian).
        layout = _ELF_LAYOUT.get(data[4])
        if layout is None or data[5] not in (1, 2):
            raise ValueError("is an ELF binary of an unknown class or byte order")
        order = "<" if data[5] == 1 else ">"
        phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(
            order + layout[0], data, layout[1]
        )
        return cls(data, data[4], order, phoff, shoff, phentsize, phnum, shentsize, shnum, shstrndx)

    def segments(self) -> list[tuple[int, int, int]]:
        """(p_type, p_offset, p_filesz) of every program header."""
        _, _, offset_format, offset_at, size_format, size_at = _ELF_LAYOUT[self.elf_class]
        found = []
        for index in range(self.phnum):
            entry = self.phoff + index * self.phentsize
            (p_type,) = struct.unpack_from(self.order + "I", self.data, entry)
            (offset,) = struct.unpack_from(self.order + offset_format, self.data, entry + offset_at)
            (size,) = struct.unpack_from(self.order + size_format, self.data, entry + size_at)
            found.append((p_type, offset, size))
        return found

    def section(self, wanted: str) -> bytes | None:
        """The contents of the section named wanted, or None."""
        if not self.shoff or self.shstrndx >= self.shnum:
            return None
        # sh_name (4 bytes), then sh_offset and sh_size: at 0x10/0x14 (32-bit) or 0x18/0x20 (64-bit).
        word, offset_at, size_at = ("I", 0x10, 0x14) if self.elf_class == 1 else ("Q", 0x18, 0x20)

        def header(index: int) -> tuple[int, int, int]:
            at = self.shoff + index * self.shentsize
            (name,) = struct.unpack_from(self.order + "I", self.data, at)
            (offset,) = struct.unpack_from(self.order + word, self.data, at + offset_at)
            (size,) = struct.unpack_from(self.order + word, self.data, at + size_at)
            return name, offset, size

        _, names_at, names_size = header(self.shstrndx)
        names = self.data[names_at : names_at + names_size]
        for index in range(self.shnum):
            name, offset, size = header(index)
            if names[name : names.find(b"\0", name)] == wanted.encode():
                return self.data[offset : offset + size]
        return None


def _elf_problem(data: bytes) -> str | None:
    cut_short = "is an ELF binary cut short (half written?)"
    try:
        elf = _Elf.of(data)
        ends = [elf.shoff + elf.shentsize * elf.shnum if elf.shoff else 0, elf.phoff + elf.phentsize * elf.phnum]
        ends += [offset + size for _, offset, size in elf.segments()]
    except ValueError as unknown:
        return str(unknown)
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


@dataclass(frozen=True)
class ExecutableTarget:
    """What machine an executable runs on, as its file says: None for what the file does not tell (a script runs
    wherever its interpreter does)."""

    # As `uname -m` names it: x86_64, aarch64, ...
    arch: str | None = None
    # "glibc" or "musl" for a dynamically linked ELF, "static" for one that needs no C library.
    libc: str | None = None
    # The oldest glibc it runs with, as (major, minor), when the build recorded it.
    glibc: tuple[int, int] | None = None
    # What a one-file executable unpacks into the machine's temporary directory when it starts, in KiB; None for
    # an executable that unpacks nothing (or does not say).
    unpacked_kib: int | None = None

    def describe(self) -> str:
        """E.g. "x86_64, glibc 2.36 or newer", "aarch64, static", "a script (any architecture)"."""
        if self.arch is None:
            return "a script (any architecture)"
        if self.libc == "glibc" and self.glibc is not None:
            return f"{self.arch}, glibc {self.glibc[0]}.{self.glibc[1]} or newer"
        return f"{self.arch}, {self.libc}"


def executable_target(data: bytes) -> ExecutableTarget:
    """The machine data runs on: read from the ELF header, its program interpreter and the agent's manifest
    section; an empty target for anything but an ELF file, and no C library for an ELF file whose parts cannot be
    read. data should be a whole executable (executable_problem)."""
    if not data.startswith(ELF_MAGIC) or len(data) < 0x14:
        return ExecutableTarget()
    try:
        elf = _Elf.of(data)
    except (ValueError, struct.error):
        return ExecutableTarget()
    (machine,) = struct.unpack_from(elf.order + "H", data, 0x12)
    arch = ELF_MACHINES.get(machine, f"ELF machine {machine}")
    if machine == _PPC64:
        arch = "ppc64le" if elf.order == "<" else "ppc64"
    try:
        interpreters = [data[offset : offset + size] for p_type, offset, size in elf.segments() if p_type == _PT_INTERP]
        manifest = elf.section(MANIFEST_SECTION)
    except struct.error:
        return ExecutableTarget(arch=arch)
    libc = "static" if not interpreters else "musl" if b"ld-musl" in interpreters[0] else "glibc"
    glibc = unpacked_kib = None
    if manifest is not None:
        try:
            recorded = json.loads(manifest)
            major, minor = str(recorded.get("glibc", "")).split(".")[:2]
            glibc = (int(major), int(minor))
            unpacked_kib = int(recorded["unpacked_kib"])
        except (ValueError, AttributeError, KeyError, TypeError):
            pass
    return ExecutableTarget(arch=arch, libc=libc, glibc=glibc, unpacked_kib=unpacked_kib)


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of data, in hex: how an agent build is named in logs, doctor and the event log."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class AgentExecutable:
    """An agent executable as a takeover hands it out: its bytes, the machine it runs on and its SHA-256."""

    data: bytes = field(repr=False)
    target: ExecutableTarget
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> AgentExecutable:
        """The executable of those bytes, with the machine it runs on and its SHA-256."""
        return cls(data=data, target=executable_target(data), sha256=sha256_hex(data))

    def describe(self) -> str:
        """E.g. "16,517,464 bytes, sha256 77cdcabb..., for x86_64, glibc 2.36 or newer"."""
        return f"{len(self.data):,} bytes, sha256 {self.sha256}, for {self.target.describe()}"


def read_agent_executable(path: Path) -> AgentExecutable:
    """The agent executable at path; NotAnExecutable naming the file, as read_executable."""
    return AgentExecutable.of(read_executable(path))


def agent_executable_file(path: Path) -> ReloadedFile[AgentExecutable]:
    """The agent executable a takeover uploads, read again when the file changed; a file that is no whole
    executable is kept from use (and at start, a SettingsError naming agent_executable_path)."""
    return ReloadedFile(
        path,
        read_agent_executable,
        what="agent executable",
        setting="agent_executable_path",
        describe=lambda agent: f"{agent.describe()}; takeovers from now on upload it",
    )
