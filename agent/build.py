"""Build the agent executable: one file that runs on a Linux machine of this host's architecture with nothing
installed, no Python at all.

PyInstaller packs the interpreter and its OpenSSL, the reference agent, the ``proto`` messages, h2 and the native
parts of PyNaCl and protobuf into one ELF file (its one-file mode), which unpacks them into the machine's temporary
directory when it starts. The file carries what it needs of the machine in an ELF section of its own (the
architecture, the C library and the oldest glibc its parts were linked against), which the workers read before
they upload it (foundation.executables).

A PyInstaller build takes a quarter of a minute, so builds are kept in a cache (``$SHEPHERD_AGENT_BUILD_CACHE``,
else ``~/.cache/shepherd/agent-builds``) under a digest of everything that goes in: the sources, the entry point,
the Python and the versions of PyInstaller and the packed libraries. The same inputs give the same file.

``--zipapp-python INTERPRETER`` builds the old zipapp instead: a script that needs that interpreter with protobuf
and PyNaCl on the machine (it carries h2 itself). An escape hatch for a machine that has them, never the default.

Usage: ``python -m agent.build OUT [--no-heartbeats] [--zipapp-python INTERPRETER]``
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipapp
import zipfile
from pathlib import Path

import agent
import proto
from foundation.executables import MANIFEST_SECTION, executable_target
from foundation.files import replace_file

AGENT_DIR = Path(agent.__file__).parent
PROTO_DIR = Path(proto.__file__).parent
PROJECT_DIR = AGENT_DIR.parent
# Archive name -> source file: all of agent/ but this builder, and of proto/ what
# the agent speaks (the messages and the heartbeat signature), not the generator.
SOURCES: dict[str, Path] = {
    **{f"agent/{path.name}": path for path in sorted(AGENT_DIR.glob("*.py")) if path.name != "build.py"},
    **{
        f"proto/{name}": PROTO_DIR / name
        for name in ("__init__.py", "takeover_pb2.py", "agent_api_pb2.py", "signing.py")
    },
}
ENTRY_POINT = "import sys\n\nfrom agent.reference import main\n\nsys.exit(main())\n"
# The same agent, told to answer the takeover and exit: what a host running a
# thousand simulated machines can hold (see bench/bringup.py).
NO_HEARTBEATS_ENTRY_POINT = (
    "import os\nimport sys\n\nfrom agent.reference import HEARTBEATS_VARIABLE, main\n\n"
    'os.environ[HEARTBEATS_VARIABLE] = "off"\nsys.exit(main())\n'
)
# What the agent imports on the machine, and what it never needs: the PyInstaller analysis follows every import of
# the libraries, among them code generators, test frameworks and codecs an agent never loads.
HIDDEN_IMPORTS = ("agent.heartbeat", "agent.grpc_channel", "agent.grpc_messages", "pkgutil", "_cffi_backend")
EXCLUDED_MODULES = (
    # The agent speaks gRPC through agent.grpc_channel, not grpcio (17 MiB of native code and threads of its own).
    "grpc",
    "grpc_tools",
    # protobuf's containers import numpy when it is there: wherever numpy is installed beside Shepherd (Ironic's
    # test server brings it), the analysis would pack it, 15 MiB the agent never uses.
    "numpy",
    "bcrypt",
    "unittest",
    "pydoc",
    "tkinter",
    "multiprocessing",
    "decimal",
    "_decimal",
    "xml",
    "pyexpat",
    "lzma",
    "bz2",
    # Hashes beyond what the agent uses (OpenSSL's, besides the ssl module's own) and the Unicode database.
    "_hashlib",
    "unicodedata",
)
# Whose versions decide what the build packs.
PACKED_DISTRIBUTIONS = ("pyinstaller", "h2", "hpack", "hyperframe", "pynacl", "protobuf", "cffi")
# Pure-Python libraries of the agent: the zipapp carries them, so its interpreter needs only protobuf and PyNaCl.
PURE_PYTHON_LIBRARIES = ("h2", "hpack", "hyperframe")
CACHE_VARIABLE = "SHEPHERD_AGENT_BUILD_CACHE"
# glibc's symbol versions, as objdump prints a binary's version references.
_GLIBC_VERSION = re.compile(r"\bGLIBC_(\d+)\.(\d+)(?:\.\d+)?\b")
# Fixed timestamps and modes: the same sources always give the same zipapp bytes.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
ZIP_FILE_MODE = 0o644


class BuildError(RuntimeError):
    """The agent could not be built; the message says which step failed and what it printed."""


def build_agent_executable(out_path: Path, *, heartbeats: bool = True, zipapp_python: str | None = None) -> Path:
    """Write the agent executable to out_path, mode 0755, atomically; returns out_path.

    Without heartbeats the agent answers the takeover and exits. With zipapp_python, a zipapp for that interpreter
    (the escape hatch) instead of the self-contained executable.
    """
    data = zipapp_executable(zipapp_python, heartbeats=heartbeats) if zipapp_python else onefile(heartbeats=heartbeats)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # A rename: whoever runs or uploads out_path sees the old file or the new, never half of one.
    replace_file(out_path, data, 0o755)
    return out_path


def onefile(*, heartbeats: bool = True) -> bytes:
    """The self-contained agent executable's bytes, from the cache or built (and cached) now."""
    entry = ENTRY_POINT if heartbeats else NO_HEARTBEATS_ENTRY_POINT
    cached = cache_dir() / f"agent-{platform.machine()}-{inputs_digest(entry)[:24]}"
    if cached.is_file():
        return cached.read_bytes()
    data = _build_onefile(entry)
    cached.parent.mkdir(parents=True, exist_ok=True)
    replace_file(cached, data, 0o755)
    return data


def cache_dir() -> Path:
    """Where finished builds are kept: $SHEPHERD_AGENT_BUILD_CACHE, else the user's cache directory."""
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shepherd" / "agent-builds"


def inputs_digest(entry: str) -> str:
    """SHA-256 over everything a build packs: sources, entry point, this Python and the packed libraries' versions."""
    digest = hashlib.sha256()
    for name, source in sorted(SOURCES.items()):
        digest.update(f"{name}\0".encode() + source.read_bytes() + b"\0")
    digest.update(entry.encode())
    digest.update(f"{sys.version}\0{sys.executable}\0".encode())
    for distribution in PACKED_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{distribution}={version}\0".encode())
    digest.update(" ".join((*HIDDEN_IMPORTS, *EXCLUDED_MODULES)).encode())
    return digest.hexdigest()


def _build_onefile(entry: str) -> bytes:
    for tool in ("objcopy", "objdump"):
        if shutil.which(tool) is None:
            raise BuildError(f"building the agent needs {tool} (binutils) on PATH")
    with tempfile.TemporaryDirectory(prefix="shepherd-agent-build-") as work_name:
        work = Path(work_name)
        script = work / "shepherd_agent.py"
        script.write_text(entry)
        command = [
            sys.executable, "-m", "PyInstaller", "--onefile", "--strip", "--noconfirm", "--log-level", "WARN",
            "--name", "agent", "--distpath", str(work / "dist"), "--workpath", str(work / "build"),
            "--specpath", str(work), "--paths", str(PROJECT_DIR),
            *(f"--hidden-import={module}" for module in HIDDEN_IMPORTS),
            *(f"--exclude-module={module}" for module in EXCLUDED_MODULES),
            str(script),
        ]  # fmt: skip
        # A fixed hash seed and source date: the same inputs give the same bytes.
        environment = {**os.environ, "PYTHONHASHSEED": "0", "SOURCE_DATE_EPOCH": "315532800"}
        _run(command, "PyInstaller", env=environment, cwd=work)
        executable = work / "dist" / "agent"
        manifest = _requirements(executable, work / "unpacked")
        manifest_file = work / "manifest.json"
        manifest_file.write_text(json.dumps(manifest, sort_keys=True))
        _run(
            ["objcopy", f"--add-section={MANIFEST_SECTION}={manifest_file}", str(executable)],
            "objcopy",
            cwd=work,
        )
        data = executable.read_bytes()
    target = executable_target(data)
    if target.arch is None:
        raise BuildError("the built agent is no ELF executable of a known architecture")
    return data


def _requirements(executable: Path, unpack_dir: Path) -> dict[str, str]:
    """What the built executable needs of a machine: its C library and the newest glibc symbol version any part
    of it (the bootloader, the interpreter, every native library) references."""
    from PyInstaller.archive.readers import CArchiveReader

    archive = CArchiveReader(str(executable))
    unpack_dir.mkdir()
    binaries = [executable]
    for index, (name, entry) in enumerate(archive.toc.items()):
        # Typecode "b": a shared library or extension module, unpacked as a file at start.
        if entry[-1] == "b":
            path = unpack_dir / f"{index}.bin"
            path.write_bytes(archive.extract(name))
            binaries.append(path)
    newest = (0, 0)
    for binary in binaries:
        listing = _run(["objdump", "-p", str(binary)], "objdump")
        for major, minor in _GLIBC_VERSION.findall(listing):
            newest = max(newest, (int(major), int(minor)))
    # Each TOC entry ends (..., uncompressed length, compressed flag, typecode).
    unpacked = sum(entry[-3] for entry in archive.toc.values())
    manifest = {"format": "1", "unpacked_kib": str(unpacked // 1024 + 1)}
    if newest != (0, 0):
        manifest["glibc"] = f"{newest[0]}.{newest[1]}"
    return manifest


def _run(command: list[str], what: str, **options: object) -> str:
    completed = subprocess.run(command, capture_output=True, text=True, check=False, **options)  # type: ignore[call-overload]
    if completed.returncode != 0:
        tail = " | ".join((completed.stderr or completed.stdout).strip().splitlines()[-15:])
        raise BuildError(f"{what} failed (exit status {completed.returncode}): {tail}")
    return str(completed.stdout)


def agent_archive(*, heartbeats: bool = True) -> bytes:
    """The zip archive (without shebang): the sources and a __main__ that runs the reference agent."""
    members = {name: source.read_bytes() for name, source in SOURCES.items()}
    for library in PURE_PYTHON_LIBRARIES:
        root = Path(importlib.import_module(library).__file__ or "").parent
        members |= {f"{library}/{path.relative_to(root)}": path.read_bytes() for path in sorted(root.rglob("*.py"))}
    members["__main__.py"] = (ENTRY_POINT if heartbeats else NO_HEARTBEATS_ENTRY_POINT).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, ZIP_EPOCH)
            # Stored, not deflated: the bytes then do not depend on the zlib version either.
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = (0o100000 | ZIP_FILE_MODE) << 16
            archive.writestr(info, members[name])
    return buffer.getvalue()


def zipapp_executable(python: str, *, heartbeats: bool = True) -> bytes:
    """The zipapp for python: a #! line and the archive; it runs only where python has protobuf and PyNaCl."""
    executable = io.BytesIO()
    zipapp.create_archive(io.BytesIO(agent_archive(heartbeats=heartbeats)), executable, interpreter=python)
    return executable.getvalue()


def main(argv: list[str] | None = None) -> int:
    """``python -m agent.build OUT``: build the agent executable and print its path; 1 when the build failed."""
    parser = argparse.ArgumentParser(prog="python -m agent.build", description="Build the agent executable.")
    parser.add_argument("out", type=Path, help="where to write the executable")
    parser.add_argument(
        "--no-heartbeats", action="store_true", help="answer the takeover and exit, sending no heartbeats"
    )
    parser.add_argument(
        "--zipapp-python",
        metavar="INTERPRETER",
        help="escape hatch: a zipapp run by INTERPRETER, which must have protobuf and PyNaCl on the "
        "machine, instead of the self-contained executable",
    )
    args = parser.parse_args(argv)
    try:
        out = build_agent_executable(args.out, heartbeats=not args.no_heartbeats, zipapp_python=args.zipapp_python)
    except BuildError as error:
        print(f"python -m agent.build: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
