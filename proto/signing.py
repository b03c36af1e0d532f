"""What a heartbeat's signature covers: the agent signs these bytes, the heartbeat server checks them.

Part of the agent API as much as its messages are, so both sides take it from here.
"""

from __future__ import annotations

SIGNING_CONTEXT = b"shepherd-heartbeat-v1"
NONCE_SIZE = 16
SIGNATURE_SIZE = 64


def signing_payload(machine_id: str, sent_at_unix_ms: int, nonce: bytes) -> bytes:
    """The bytes a heartbeat's signature covers."""
    return (
        b"\0".join([SIGNING_CONTEXT, machine_id.encode()])
        + b"\0"
        + sent_at_unix_ms.to_bytes(8, "big", signed=True)
        + nonce
    )
