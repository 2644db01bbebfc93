from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterSiteRequest(_message.Message):
    __slots__ = ("name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("server_time", "latest_combined_version")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    LATEST_COMBINED_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    latest_combined_version: int
    def __init__(self, server_time: _Optional[float] = ..., latest_combined_version: _Optional[int] = ...) -> None: ...

class GetSiteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListSitesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSitesResponse(_message.Message):
    __slots__ = ("sites",)
    SITES_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[SiteInfo]
    def __init__(self, sites: _Optional[_Iterable[_Union[SiteInfo, _Mapping]]] = ...) -> None: ...

class DeregisterSiteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeregisterSiteResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class SiteInfo(_message.Message):
    __slots__ = ("name", "registered_at", "last_heartbeat", "labels", "predictor", "sample")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    registered_at: float
    last_heartbeat: float
    labels: _containers.ScalarMap[str, str]
    predictor: ArtifactInfo
    sample: ArtifactInfo
    def __init__(self, name: _Optional[str] = ..., registered_at: _Optional[float] = ..., last_heartbeat: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., predictor: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., sample: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class PredictorMeta(_message.Message):
    __slots__ = ("output_kind", "n_features", "classes_json")
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    N_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CLASSES_JSON_FIELD_NUMBER: _ClassVar[int]
    output_kind: str
    n_features: int
    classes_json: str
    def __init__(self, output_kind: _Optional[str] = ..., n_features: _Optional[int] = ..., classes_json: _Optional[str] = ...) -> None: ...

class SampleMeta(_message.Message):
    __slots__ = ("rows", "cols", "dtype")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    dtype: str
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("site", "upload_id", "kind", "sha256", "size", "created_at", "predictor", "sample")
    SITE_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    site: str
    upload_id: str
    kind: str
    sha256: str
    size: int
    created_at: float
    predictor: PredictorMeta
    sample: SampleMeta
    def __init__(self, site: _Optional[str] = ..., upload_id: _Optional[str] = ..., kind: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., created_at: _Optional[float] = ..., predictor: _Optional[_Union[PredictorMeta, _Mapping]] = ..., sample: _Optional[_Union[SampleMeta, _Mapping]] = ...) -> None: ...

class PredictorHeader(_message.Message):
    __slots__ = ("upload_id", "sha256", "size", "output_kind", "n_features")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    N_FEATURES_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    sha256: str
    size: int
    output_kind: str
    n_features: int
    def __init__(self, upload_id: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., output_kind: _Optional[str] = ..., n_features: _Optional[int] = ...) -> None: ...

class UploadPredictorRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PredictorHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PredictorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class SampleHeader(_message.Message):
    __slots__ = ("upload_id", "sha256", "rows", "cols", "dtype")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    sha256: str
    rows: int
    cols: int
    dtype: str
    def __init__(self, upload_id: _Optional[str] = ..., sha256: _Optional[str] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class UploadSampleRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SampleHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SampleHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class CombinedModelHeader(_message.Message):
    __slots__ = ("upload_id", "sha256", "size", "manifest_json")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    sha256: str
    size: int
    manifest_json: str
    def __init__(self, upload_id: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class UploadCombinedModelRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: CombinedModelHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[CombinedModelHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class CombinedModelInfo(_message.Message):
    __slots__ = ("version", "upload_id", "sha256", "size", "manifest_json", "created_at", "created_by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    upload_id: str
    sha256: str
    size: int
    manifest_json: str
    created_at: float
    created_by: str
    def __init__(self, version: _Optional[int] = ..., upload_id: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., manifest_json: _Optional[str] = ..., created_at: _Optional[float] = ..., created_by: _Optional[str] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("site",)
    SITE_FIELD_NUMBER: _ClassVar[int]
    site: str
    def __init__(self, site: _Optional[str] = ...) -> None: ...

class DownloadCombinedModelRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("artifact", "combined_model", "chunk")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    COMBINED_MODEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    combined_model: CombinedModelInfo
    chunk: bytes
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., combined_model: _Optional[_Union[CombinedModelInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...
