"""What gRPC puts on top of an HTTP/2 stream, as the agent's channel reads it: the five-byte message prefix, the
call's status in the trailers, and the status a reset or a proxy's answer stands for (gRPC over HTTP/2).

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

import h2.errors

# gRPC's status codes by number, as the grpc-status trailer gives them.
STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
# The status of a call whose HTTP/2 stream the server reset, by the reset's error code (gRPC over HTTP/2).
RESET_STATUS = {
    h2.errors.ErrorCodes.REFUSED_STREAM: "UNAVAILABLE",
    h2.errors.ErrorCodes.CANCEL: "CANCELLED",
    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM: "RESOURCE_EXHAUSTED",
    h2.errors.ErrorCodes.INADEQUATE_SECURITY: "PERMISSION_DENIED",
}
# The status of an answer without grpc-status, by its HTTP status (a proxy's answer, not a gRPC server's).
HTTP_STATUS = {"400": "INTERNAL", "401": "UNAUTHENTICATED", "403": "PERMISSION_DENIED", "404": "UNIMPLEMENTED"}
# The answers the agent reads are a few dozen bytes; anything near this is not Shepherd talking.
MAX_MESSAGE_SIZE = 64 * 1024
PREFIX_SIZE = 5


class RpcError(Exception):
    """A call that ended without its answer: gRPC's status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...), what the
    server or the connection said, and the trailing metadata the server sent with the status."""

    def __init__(self, code: str, details: str, trailers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.trailers = dict(trailers or {})


@dataclass
class CallStream:
    """What the server sent on one call's stream so far."""

    data: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    # The call's status once the stream ended without one in its headers: a reset, a lost connection.
    failure: RpcError | None = None

    def has_message(self) -> bool:
        """Whether a whole message waits in the buffer (or a prefix that message() refuses)."""
        if len(self.data) < PREFIX_SIZE:
            return False
        size = int.from_bytes(self.data[1:PREFIX_SIZE], "big")
        return size > MAX_MESSAGE_SIZE or len(self.data) >= PREFIX_SIZE + size

    def message(self) -> bytes | None:
        """The next whole message received, taken from the buffer, or None while it is incomplete."""
        if len(self.data) < PREFIX_SIZE:
            return None
        compressed, size = self.data[0], int.from_bytes(self.data[1:PREFIX_SIZE], "big")
        if compressed:
            raise RpcError("INTERNAL", "the server sent a compressed message, which the agent never asked for")
        if size > MAX_MESSAGE_SIZE:
            raise RpcError("RESOURCE_EXHAUSTED", f"the server sent a message of {size} bytes")
        if len(self.data) < PREFIX_SIZE + size:
            return None
        message = bytes(self.data[PREFIX_SIZE : PREFIX_SIZE + size])
        del self.data[: PREFIX_SIZE + size]
        return message

    def status(self) -> RpcError | None:
        """How the ended stream ended: None for OK, else the error."""
        if self.failure is not None:
            return self.failure
        code = self.headers.get("grpc-status")
        if code is None:
            http = self.headers.get(":status", "")
            name = HTTP_STATUS.get(http, "UNAVAILABLE" if http in ("429", "502", "503", "504") else "UNKNOWN")
            return RpcError(name, f"an answer without a gRPC status (HTTP {http or 'status missing'})", self.headers)
        if code == "0":
            return None
        name = STATUS_NAMES[int(code)] if code.isdigit() and int(code) < len(STATUS_NAMES) else "UNKNOWN"
        details = urllib.parse.unquote(self.headers.get("grpc-message", ""))
        return RpcError(name, details or f"status {code}", self.headers)


def error_name(code: int | None) -> str:
    """An HTTP/2 error code's name, or its number when h2 does not know it."""
    if code is None:
        return "no error code"
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return f"error code {code}"


def framed(message: bytes) -> bytes:
    """message with gRPC's prefix: not compressed, then its length in four bytes."""
    return len(message).to_bytes(PREFIX_SIZE, "big") + message
