from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HeartbeatRequest(_message.Message):
    __slots__ = ("machine_id", "sent_at_unix_ms", "nonce", "signature")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    sent_at_unix_ms: int
    nonce: bytes
    signature: bytes
    def __init__(self, machine_id: _Optional[str] = ..., sent_at_unix_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("next_heartbeat_in_ms",)
    NEXT_HEARTBEAT_IN_MS_FIELD_NUMBER: _ClassVar[int]
    next_heartbeat_in_ms: int
    def __init__(self, next_heartbeat_in_ms: _Optional[int] = ...) -> None: ...
