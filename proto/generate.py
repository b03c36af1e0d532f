"""Regenerate the Python modules from the .proto files, or check they match.

Run from anywhere: ``python -m proto.generate`` writes ``*_pb2.py`` and
``*_pb2.pyi`` beside each ``.proto``; ``--check`` writes them to a temporary
directory instead and exits non-zero, naming the files, when they differ.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent


def proto_files() -> list[Path]:
    """The .proto files beside this module, in name order."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into out_dir/proto/, returning the generated files."""
    from grpc_tools import protoc  # a test/dev dependency, needed only here

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(sources)}")
    return sorted((out_dir / "proto").glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Names of generated files that differ from what the .proto files produce."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = PROTO_DIR / path.name
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    """Regenerate the modules, or with --check only say which are stale; 1 when any is."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only check that the generated code is current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"generated code is stale: {', '.join(stale)}; run python -m proto.generate", file=sys.stderr)
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
