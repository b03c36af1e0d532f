"""Pack the reference agent into one executable file: a zip with a shebang.

The file runs with the given Python (by default this one), which must have
protobuf and cryptography; on the simulated machines that is the worker's own.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["agent/__init__.py", "agent/reference.py", "proto/__init__.py", "proto/takeover_pb2.py"]
MAIN = "import sys\nfrom agent.reference import main\nsys.exit(main())\n"
# Fixed timestamps: the same sources always give the same bytes.
EPOCH = (1980, 1, 1, 0, 0, 0)


def agent_archive() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in SOURCES:
            archive.writestr(zipfile.ZipInfo(name, EPOCH), (ROOT / name).read_bytes())
        archive.writestr(zipfile.ZipInfo("__main__.py", EPOCH), MAIN)
    return buffer.getvalue()


def build_agent_executable(out_path: Path, python: str = sys.executable) -> Path:
    """Write the agent executable to out_path (mode 0755, atomically)."""
    content = f"#!{python}\n".encode() + agent_archive()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(content)
    temporary.chmod(0o755)
    os.replace(temporary, out_path)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the reference agent executable.")
    parser.add_argument("out", type=Path, help="where to write it")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the shebang")
    args = parser.parse_args(argv)
    print(build_agent_executable(args.out, args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
