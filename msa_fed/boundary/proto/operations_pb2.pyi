from msa_fed.boundary.proto import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Promotion(_message.Message):
    __slots__ = ("version", "promoted_at", "promoted_by", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_AT_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    promoted_at: float
    promoted_by: str
    reason: str
    def __init__(self, version: _Optional[int] = ..., promoted_at: _Optional[float] = ..., promoted_by: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("model", "current", "promotions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    model: _registry_pb2.CombinedModelInfo
    current: bool
    promotions: _containers.RepeatedCompositeFieldContainer[Promotion]
    def __init__(self, model: _Optional[_Union[_registry_pb2.CombinedModelInfo, _Mapping]] = ..., current: _Optional[bool] = ..., promotions: _Optional[_Iterable[_Union[Promotion, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "current_version")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    current_version: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., current_version: _Optional[int] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PromoteModelRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SiteStatus(_message.Message):
    __slots__ = ("name", "token", "token_revoked_at", "registered", "registered_at", "last_heartbeat", "deregistered_at", "deregistered_by", "deregistration_reason", "connected", "predictor_sha256", "sample_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DEREGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    DEREGISTERED_BY_FIELD_NUMBER: _ClassVar[int]
    DEREGISTRATION_REASON_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    token_revoked_at: float
    registered: bool
    registered_at: float
    last_heartbeat: float
    deregistered_at: float
    deregistered_by: str
    deregistration_reason: str
    connected: bool
    predictor_sha256: str
    sample_sha256: str
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ..., token_revoked_at: _Optional[float] = ..., registered: _Optional[bool] = ..., registered_at: _Optional[float] = ..., last_heartbeat: _Optional[float] = ..., deregistered_at: _Optional[float] = ..., deregistered_by: _Optional[str] = ..., deregistration_reason: _Optional[str] = ..., connected: _Optional[bool] = ..., predictor_sha256: _Optional[str] = ..., sample_sha256: _Optional[str] = ...) -> None: ...

class ListSiteStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSiteStatusResponse(_message.Message):
    __slots__ = ("sites",)
    SITES_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[SiteStatus]
    def __init__(self, sites: _Optional[_Iterable[_Union[SiteStatus, _Mapping]]] = ...) -> None: ...

class OpsDeregisterSiteRequest(_message.Message):
    __slots__ = ("name", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "sites", "topology", "status", "started_at", "ended_at", "model_version", "error", "started_by")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_BY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    sites: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    status: str
    started_at: float
    ended_at: float
    model_version: int
    error: str
    started_by: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., sites: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ..., status: _Optional[str] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., model_version: _Optional[int] = ..., error: _Optional[str] = ..., started_by: _Optional[str] = ...) -> None: ...

class StartJobRequest(_message.Message):
    __slots__ = ("job_id", "name", "sites", "topology")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    sites: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., sites: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ...) -> None: ...

class FinishJobRequest(_message.Message):
    __slots__ = ("job_id", "status", "model_version", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    model_version: int
    error: str
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., model_version: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobLogLine(_message.Message):
    __slots__ = ("seq", "time", "text")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    text: str
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class AppendJobLogRequest(_message.Message):
    __slots__ = ("job_id", "lines")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., lines: _Optional[_Iterable[str]] = ...) -> None: ...

class GetJobLogRequest(_message.Message):
    __slots__ = ("job_id", "after", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class JobLog(_message.Message):
    __slots__ = ("lines", "total", "dropped")
    LINES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedCompositeFieldContainer[JobLogLine]
    total: int
    dropped: int
    def __init__(self, lines: _Optional[_Iterable[_Union[JobLogLine, _Mapping]]] = ..., total: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...
