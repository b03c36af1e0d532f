"""The reference takeover agent, run on a machine as the uploaded executable.

It reads one TakeoverInit on standard input, answers one TakeoverResponse on
standard output and exits. It makes an ed25519 key for itself and keeps the
private half (32 raw bytes, mode 0600) in ``agent.key`` beside the
executable, or in ``$SHEPHERD_AGENT_STATE_DIR``, to sign its heartbeats.

Only protobuf, cryptography and the ``proto`` package are needed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from google.protobuf.message import DecodeError

from proto import takeover_pb2

KEY_FILE = "agent.key"


def state_dir() -> Path:
    configured = os.environ.get("SHEPHERD_AGENT_STATE_DIR")
    return Path(configured) if configured else Path(sys.argv[0]).resolve().parent


def write_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(raw)
    os.replace(temporary, path)


def answer(init_bytes: bytes) -> takeover_pb2.TakeoverResponse:
    init = takeover_pb2.TakeoverInit()
    try:
        init.ParseFromString(init_bytes)
    except DecodeError as error:
        return takeover_pb2.TakeoverResponse(
            error=takeover_pb2.TakeoverError(message=f"malformed TakeoverInit on stdin: {error}")
        )
    if not init.machine_id:
        return takeover_pb2.TakeoverResponse(error=takeover_pb2.TakeoverError(message="TakeoverInit has no machine_id"))
    key = Ed25519PrivateKey.generate()
    try:
        write_private_key(state_dir() / KEY_FILE, key)
    except OSError as error:
        return takeover_pb2.TakeoverResponse(error=takeover_pb2.TakeoverError(message=f"cannot keep my key: {error}"))
    warnings = []
    if not init.ca_certificate:
        warnings.append("no CA certificate given; the system trust store will be used")
    return takeover_pb2.TakeoverResponse(
        success=takeover_pb2.TakeoverSuccess(
            init_message=init,
            key=key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
            warnings=warnings,
        )
    )


def main() -> int:
    response = answer(sys.stdin.buffer.read())
    sys.stdout.buffer.write(response.SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
