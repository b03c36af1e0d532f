from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TakeoverInit(_message.Message):
    __slots__ = ("machine_id", "endpoint", "ca_certificate", "ca_certificates", "refused_for_seconds_before_stopping")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FOR_SECONDS_BEFORE_STOPPING_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    endpoint: str
    ca_certificate: bytes
    ca_certificates: _containers.RepeatedScalarFieldContainer[bytes]
    refused_for_seconds_before_stopping: int
    def __init__(self, machine_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., ca_certificate: _Optional[bytes] = ..., ca_certificates: _Optional[_Iterable[bytes]] = ..., refused_for_seconds_before_stopping: _Optional[int] = ...) -> None: ...

class TakeoverSuccess(_message.Message):
    __slots__ = ("init_message", "key", "warnings")
    INIT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    init_message: TakeoverInit
    key: bytes
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, init_message: _Optional[_Union[TakeoverInit, _Mapping]] = ..., key: _Optional[bytes] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class TakeoverError(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class TakeoverResponse(_message.Message):
    __slots__ = ("success", "error")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    success: TakeoverSuccess
    error: TakeoverError
    def __init__(self, success: _Optional[_Union[TakeoverSuccess, _Mapping]] = ..., error: _Optional[_Union[TakeoverError, _Mapping]] = ...) -> None: ...
