from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("next_heartbeat_in_ms", "outcome", "message", "server_time_unix_ms")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACCEPTED: _ClassVar[HeartbeatResponse.Outcome]
        NOT_ACCEPTED: _ClassVar[HeartbeatResponse.Outcome]
        STALE: _ClassVar[HeartbeatResponse.Outcome]
        RETRY_LATER: _ClassVar[HeartbeatResponse.Outcome]
        MALFORMED: _ClassVar[HeartbeatResponse.Outcome]
        REPLAYED: _ClassVar[HeartbeatResponse.Outcome]
    ACCEPTED: HeartbeatResponse.Outcome
    NOT_ACCEPTED: HeartbeatResponse.Outcome
    STALE: HeartbeatResponse.Outcome
    RETRY_LATER: HeartbeatResponse.Outcome
    MALFORMED: HeartbeatResponse.Outcome
    REPLAYED: HeartbeatResponse.Outcome
    NEXT_HEARTBEAT_IN_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    next_heartbeat_in_ms: int
    outcome: HeartbeatResponse.Outcome
    message: str
    server_time_unix_ms: int
    def __init__(self, next_heartbeat_in_ms: _Optional[int] = ..., outcome: _Optional[_Union[HeartbeatResponse.Outcome, str]] = ..., message: _Optional[str] = ..., server_time_unix_ms: _Optional[int] = ...) -> None: ...
