from msa_fed.boundary.proto import boundary_pb2 as _boundary_pb2
from msa_fed.boundary.proto import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("site", "agent_version", "predictor_sha256", "sample_sha256")
    SITE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    site: str
    agent_version: str
    predictor_sha256: str
    sample_sha256: str
    def __init__(self, site: _Optional[str] = ..., agent_version: _Optional[str] = ..., predictor_sha256: _Optional[str] = ..., sample_sha256: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    def __init__(self, sent_at: _Optional[float] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("call_id", "response", "sealed")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: _boundary_pb2.SiteResponse
    sealed: bytes
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[_boundary_pb2.SiteResponse, _Mapping]] = ..., sealed: _Optional[bytes] = ...) -> None: ...

class SiteToRelay(_message.Message):
    __slots__ = ("hello", "answer", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    answer: Answer
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., answer: _Optional[_Union[Answer, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("call_id", "job_id", "admin", "request", "sealed")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    job_id: str
    admin: str
    request: _boundary_pb2.SiteRequest
    sealed: bytes
    def __init__(self, call_id: _Optional[int] = ..., job_id: _Optional[str] = ..., admin: _Optional[str] = ..., request: _Optional[_Union[_boundary_pb2.SiteRequest, _Mapping]] = ..., sealed: _Optional[bytes] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class EndJob(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RelayToSite(_message.Message):
    __slots__ = ("welcome", "forward", "ping", "end_job")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    END_JOB_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    forward: Forward
    ping: Heartbeat
    end_job: EndJob
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., forward: _Optional[_Union[Forward, _Mapping]] = ..., ping: _Optional[_Union[Heartbeat, _Mapping]] = ..., end_job: _Optional[_Union[EndJob, _Mapping]] = ...) -> None: ...

class FetchPredictorRequest(_message.Message):
    __slots__ = ("job_id", "site")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    site: str
    def __init__(self, job_id: _Optional[str] = ..., site: _Optional[str] = ...) -> None: ...

class FetchSampleRequest(_message.Message):
    __slots__ = ("job_id", "site")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    site: str
    def __init__(self, job_id: _Optional[str] = ..., site: _Optional[str] = ...) -> None: ...

class OpenJobRequest(_message.Message):
    __slots__ = ("job_id", "sites")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., sites: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenJobResponse(_message.Message):
    __slots__ = ("connected",)
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    connected: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, connected: _Optional[_Iterable[str]] = ...) -> None: ...

class SiteCall(_message.Message):
    __slots__ = ("site", "request", "sealed")
    SITE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    site: str
    request: _boundary_pb2.SiteRequest
    sealed: bytes
    def __init__(self, site: _Optional[str] = ..., request: _Optional[_Union[_boundary_pb2.SiteRequest, _Mapping]] = ..., sealed: _Optional[bytes] = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("job_id", "timeout_s", "calls")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timeout_s: float
    calls: _containers.RepeatedCompositeFieldContainer[SiteCall]
    def __init__(self, job_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., calls: _Optional[_Iterable[_Union[SiteCall, _Mapping]]] = ...) -> None: ...

class SiteResult(_message.Message):
    __slots__ = ("site", "response", "status", "detail", "sealed")
    SITE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    site: str
    response: _boundary_pb2.SiteResponse
    status: str
    detail: str
    sealed: bytes
    def __init__(self, site: _Optional[str] = ..., response: _Optional[_Union[_boundary_pb2.SiteResponse, _Mapping]] = ..., status: _Optional[str] = ..., detail: _Optional[str] = ..., sealed: _Optional[bytes] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SiteResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SiteResult, _Mapping]]] = ...) -> None: ...

class CloseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CloseJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListConnectedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConnectedSite(_message.Message):
    __slots__ = ("site", "connected_at", "last_seen", "peer")
    SITE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    site: str
    connected_at: float
    last_seen: float
    peer: str
    def __init__(self, site: _Optional[str] = ..., connected_at: _Optional[float] = ..., last_seen: _Optional[float] = ..., peer: _Optional[str] = ...) -> None: ...

class ListConnectedResponse(_message.Message):
    __slots__ = ("sites",)
    SITES_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[ConnectedSite]
    def __init__(self, sites: _Optional[_Iterable[_Union[ConnectedSite, _Mapping]]] = ...) -> None: ...
