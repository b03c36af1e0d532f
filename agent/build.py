"""Pack the reference agent into one executable file: a zipapp with a shebang.

The file runs with the given Python (by default this one), which must have
protobuf and cryptography; on the simulated machines that is the worker's own.
Only the reference agent and the ``proto`` package go in, so what runs on a
machine does not depend on the rest of Shepherd.

Usage: ``python -m agent.build OUT [--python INTERPRETER]``
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import zipapp
import zipfile
from pathlib import Path

import agent
import proto

AGENT_DIR = Path(agent.__file__).parent
PROTO_DIR = Path(proto.__file__).parent
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
# Fixed timestamps and modes: the same sources always give the same bytes.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
ZIP_FILE_MODE = 0o644


def agent_archive(*, heartbeats: bool = True) -> bytes:
    """The zip archive (without shebang): the sources and a __main__ that runs the reference agent."""
    members = {name: source.read_bytes() for name, source in SOURCES.items()}
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


def build_agent_executable(out_path: Path, python: str = sys.executable, *, heartbeats: bool = True) -> Path:
    """Write the agent executable to out_path: mode 0755, written atomically; returns out_path.

    Without heartbeats the agent answers the takeover and exits.
    """
    executable = io.BytesIO()
    # zipapp adds the shebang line to the ready-made archive.
    zipapp.create_archive(io.BytesIO(agent_archive(heartbeats=heartbeats)), executable, interpreter=python)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    temporary = Path(temporary_name)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(executable.getvalue())
            file.flush()
            os.fsync(file.fileno())
        temporary.chmod(0o755)
        # A rename: whoever runs or uploads out_path sees the old file or the new, never half of one.
        os.replace(temporary, out_path)
    finally:
        temporary.unlink(missing_ok=True)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.build", description="Build the reference agent executable.")
    parser.add_argument("out", type=Path, help="where to write the executable")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the shebang (default: this one)")
    parser.add_argument(
        "--no-heartbeats", action="store_true", help="answer the takeover and exit, sending no heartbeats"
    )
    args = parser.parse_args(argv)
    print(build_agent_executable(args.out, args.python, heartbeats=not args.no_heartbeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
