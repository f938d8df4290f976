import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TryStartRequest(_message.Message):
    __slots__ = ("namespace", "key", "fingerprint", "lease_ttl", "retention", "attempt_id", "wait")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    fingerprint: bytes
    lease_ttl: _duration_pb2.Duration
    retention: _duration_pb2.Duration
    attempt_id: str
    wait: _duration_pb2.Duration
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., attempt_id: _Optional[str] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TryStartResponse(_message.Message):
    __slots__ = ("started", "in_progress", "completed", "fingerprint_mismatch")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    started: ClaimStarted
    in_progress: ClaimInProgress
    completed: ClaimCompleted
    fingerprint_mismatch: FingerprintMismatch
    def __init__(self, started: _Optional[_Union[ClaimStarted, _Mapping]] = ..., in_progress: _Optional[_Union[ClaimInProgress, _Mapping]] = ..., completed: _Optional[_Union[ClaimCompleted, _Mapping]] = ..., fingerprint_mismatch: _Optional[_Union[FingerprintMismatch, _Mapping]] = ...) -> None: ...

class ClaimStarted(_message.Message):
    __slots__ = ("lease_token", "lease_expires_at", "attempt", "checkpoint")
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    lease_token: int
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    checkpoint: bytes
    def __init__(self, lease_token: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., checkpoint: _Optional[bytes] = ...) -> None: ...

class ClaimInProgress(_message.Message):
    __slots__ = ("lease_expires_at", "attempt")
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class ClaimCompleted(_message.Message):
    __slots__ = ("response", "completed_at", "expires_at")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    completed_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, response: _Optional[bytes] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class FingerprintMismatch(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("namespace", "key", "lease_token", "response", "retention")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    lease_token: int
    response: bytes
    retention: _duration_pb2.Duration
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., lease_token: _Optional[int] = ..., response: _Optional[bytes] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("completed_at", "expires_at")
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    completed_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace", "key", "lease_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    lease_token: int
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., lease_token: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("namespace", "key", "lease_token", "lease_ttl", "checkpoint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    lease_token: int
    lease_ttl: _duration_pb2.Duration
    checkpoint: bytes
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., lease_token: _Optional[int] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., checkpoint: _Optional[bytes] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_at",)
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("absent", "in_progress", "completed")
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    absent: KeyAbsent
    in_progress: KeyInProgress
    completed: KeyCompleted
    def __init__(self, absent: _Optional[_Union[KeyAbsent, _Mapping]] = ..., in_progress: _Optional[_Union[KeyInProgress, _Mapping]] = ..., completed: _Optional[_Union[KeyCompleted, _Mapping]] = ...) -> None: ...

class KeyAbsent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeyInProgress(_message.Message):
    __slots__ = ("lease_expires_at", "attempt", "fingerprint")
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    fingerprint: bytes
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., fingerprint: _Optional[bytes] = ...) -> None: ...

class KeyCompleted(_message.Message):
    __slots__ = ("response", "fingerprint", "completed_at", "expires_at")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    fingerprint: bytes
    completed_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, response: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class MarkProcessedRequest(_message.Message):
    __slots__ = ("consumer", "event_ids", "retention")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    event_ids: _containers.RepeatedScalarFieldContainer[str]
    retention: _duration_pb2.Duration
    def __init__(self, consumer: _Optional[str] = ..., event_ids: _Optional[_Iterable[str]] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class MarkProcessedResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProcessedEvent]
    def __init__(self, results: _Optional[_Iterable[_Union[ProcessedEvent, _Mapping]]] = ...) -> None: ...

class ProcessedEvent(_message.Message):
    __slots__ = ("event_id", "already_processed", "processed_at")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_AT_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    already_processed: bool
    processed_at: _timestamp_pb2.Timestamp
    def __init__(self, event_id: _Optional[str] = ..., already_processed: _Optional[bool] = ..., processed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
