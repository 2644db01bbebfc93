from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NdArray(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("number", "integer", "text", "flag", "none")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLAG_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    number: float
    integer: int
    text: str
    flag: bool
    none: bool
    def __init__(self, number: _Optional[float] = ..., integer: _Optional[int] = ..., text: _Optional[str] = ..., flag: _Optional[bool] = ..., none: _Optional[bool] = ...) -> None: ...

class FeatureMap(_message.Message):
    __slots__ = ("name", "params", "arrays")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Scalar
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...
    class ArraysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: NdArray
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[NdArray, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.MessageMap[str, Scalar]
    arrays: _containers.MessageMap[str, NdArray]
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, Scalar]] = ..., arrays: _Optional[_Mapping[str, NdArray]] = ...) -> None: ...

class JobSetup(_message.Message):
    __slots__ = ("job_id", "sites", "index", "predictor_sha256", "task", "loss", "classes", "min_points")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    MIN_POINTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sites: _containers.RepeatedScalarFieldContainer[str]
    index: int
    predictor_sha256: _containers.RepeatedScalarFieldContainer[str]
    task: str
    loss: str
    classes: NdArray
    min_points: int
    def __init__(self, job_id: _Optional[str] = ..., sites: _Optional[_Iterable[str]] = ..., index: _Optional[int] = ..., predictor_sha256: _Optional[_Iterable[str]] = ..., task: _Optional[str] = ..., loss: _Optional[str] = ..., classes: _Optional[_Union[NdArray, _Mapping]] = ..., min_points: _Optional[int] = ...) -> None: ...

class DomainModelSpec(_message.Message):
    __slots__ = ("kind", "n_sources", "feature_map", "theta", "bandwidths", "samples", "mu")
    KIND_FIELD_NUMBER: _ClassVar[int]
    N_SOURCES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_MAP_FIELD_NUMBER: _ClassVar[int]
    THETA_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTHS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MU_FIELD_NUMBER: _ClassVar[int]
    kind: str
    n_sources: int
    feature_map: FeatureMap
    theta: NdArray
    bandwidths: NdArray
    samples: _containers.RepeatedCompositeFieldContainer[NdArray]
    mu: float
    def __init__(self, kind: _Optional[str] = ..., n_sources: _Optional[int] = ..., feature_map: _Optional[_Union[FeatureMap, _Mapping]] = ..., theta: _Optional[_Union[NdArray, _Mapping]] = ..., bandwidths: _Optional[_Union[NdArray, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[NdArray, _Mapping]]] = ..., mu: _Optional[float] = ...) -> None: ...

class ShardSetup(_message.Message):
    __slots__ = ("feature_map", "n_sources", "dtype", "device", "seed", "workers_per_site")
    FEATURE_MAP_FIELD_NUMBER: _ClassVar[int]
    N_SOURCES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_SITE_FIELD_NUMBER: _ClassVar[int]
    feature_map: FeatureMap
    n_sources: int
    dtype: str
    device: str
    seed: int
    workers_per_site: int
    def __init__(self, feature_map: _Optional[_Union[FeatureMap, _Mapping]] = ..., n_sources: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., seed: _Optional[int] = ..., workers_per_site: _Optional[int] = ...) -> None: ...

class ThetaRequest(_message.Message):
    __slots__ = ("theta", "step", "batch_size")
    THETA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    theta: NdArray
    step: int
    batch_size: int
    def __init__(self, theta: _Optional[_Union[NdArray, _Mapping]] = ..., step: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class QhatBroadcast(_message.Message):
    __slots__ = ("qhat", "eta")
    QHAT_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    qhat: NdArray
    eta: float
    def __init__(self, qhat: _Optional[_Union[NdArray, _Mapping]] = ..., eta: _Optional[float] = ...) -> None: ...

class DCRequest(_message.Message):
    __slots__ = ("z", "eta", "what", "global_bound")
    Z_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BOUND_FIELD_NUMBER: _ClassVar[int]
    z: NdArray
    eta: float
    what: _containers.RepeatedScalarFieldContainer[str]
    global_bound: float
    def __init__(self, z: _Optional[_Union[NdArray, _Mapping]] = ..., eta: _Optional[float] = ..., what: _Optional[_Iterable[str]] = ..., global_bound: _Optional[float] = ...) -> None: ...

class ChannelOffer(_message.Message):
    __slots__ = ("mode", "peer_cert")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PEER_CERT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    peer_cert: str
    def __init__(self, mode: _Optional[str] = ..., peer_cert: _Optional[str] = ...) -> None: ...

class HarmRequest(_message.Message):
    __slots__ = ("z", "eta")
    Z_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    z: NdArray
    eta: float
    def __init__(self, z: _Optional[_Union[NdArray, _Mapping]] = ..., eta: _Optional[float] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteRequest(_message.Message):
    __slots__ = ("method", "empty", "job_setup", "domain_model", "shard_setup", "theta", "row_range", "qhat", "dc", "channel_offer", "harm")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    JOB_SETUP_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_SETUP_FIELD_NUMBER: _ClassVar[int]
    THETA_FIELD_NUMBER: _ClassVar[int]
    ROW_RANGE_FIELD_NUMBER: _ClassVar[int]
    QHAT_FIELD_NUMBER: _ClassVar[int]
    DC_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_OFFER_FIELD_NUMBER: _ClassVar[int]
    HARM_FIELD_NUMBER: _ClassVar[int]
    method: str
    empty: Empty
    job_setup: JobSetup
    domain_model: DomainModelSpec
    shard_setup: ShardSetup
    theta: ThetaRequest
    row_range: RowRange
    qhat: QhatBroadcast
    dc: DCRequest
    channel_offer: ChannelOffer
    harm: HarmRequest
    def __init__(self, method: _Optional[str] = ..., empty: _Optional[_Union[Empty, _Mapping]] = ..., job_setup: _Optional[_Union[JobSetup, _Mapping]] = ..., domain_model: _Optional[_Union[DomainModelSpec, _Mapping]] = ..., shard_setup: _Optional[_Union[ShardSetup, _Mapping]] = ..., theta: _Optional[_Union[ThetaRequest, _Mapping]] = ..., row_range: _Optional[_Union[RowRange, _Mapping]] = ..., qhat: _Optional[_Union[QhatBroadcast, _Mapping]] = ..., dc: _Optional[_Union[DCRequest, _Mapping]] = ..., channel_offer: _Optional[_Union[ChannelOffer, _Mapping]] = ..., harm: _Optional[_Union[HarmRequest, _Mapping]] = ...) -> None: ...

class SiteSummary(_message.Message):
    __slots__ = ("name", "n_features", "n_labeled", "n_unlabeled", "task", "classes", "sample_kept_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    N_FEATURES_FIELD_NUMBER: _ClassVar[int]
    N_LABELED_FIELD_NUMBER: _ClassVar[int]
    N_UNLABELED_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_KEPT_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    n_features: int
    n_labeled: int
    n_unlabeled: int
    task: str
    classes: NdArray
    sample_kept_out: bool
    def __init__(self, name: _Optional[str] = ..., n_features: _Optional[int] = ..., n_labeled: _Optional[int] = ..., n_unlabeled: _Optional[int] = ..., task: _Optional[str] = ..., classes: _Optional[_Union[NdArray, _Mapping]] = ..., sample_kept_out: _Optional[bool] = ...) -> None: ...

class UnlabeledSample(_message.Message):
    __slots__ = ("X",)
    X_FIELD_NUMBER: _ClassVar[int]
    X: NdArray
    def __init__(self, X: _Optional[_Union[NdArray, _Mapping]] = ...) -> None: ...

class GradSum(_message.Message):
    __slots__ = ("loss", "grad", "n")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    loss: float
    grad: NdArray
    n: int
    def __init__(self, loss: _Optional[float] = ..., grad: _Optional[_Union[NdArray, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class QhatPartial(_message.Message):
    __slots__ = ("sums", "n", "epsilon", "dp")
    SUMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    sums: NdArray
    n: int
    epsilon: float
    dp: bool
    def __init__(self, sums: _Optional[_Union[NdArray, _Mapping]] = ..., n: _Optional[int] = ..., epsilon: _Optional[float] = ..., dp: _Optional[bool] = ...) -> None: ...

class Numeric(_message.Message):
    __slots__ = ("array", "scalar")
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    array: NdArray
    scalar: float
    def __init__(self, array: _Optional[_Union[NdArray, _Mapping]] = ..., scalar: _Optional[float] = ...) -> None: ...

class DCSums(_message.Message):
    __slots__ = ("L", "dL", "u", "du", "v", "dv", "n")
    L_FIELD_NUMBER: _ClassVar[int]
    DL_FIELD_NUMBER: _ClassVar[int]
    U_FIELD_NUMBER: _ClassVar[int]
    DU_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    DV_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    L: Numeric
    dL: Numeric
    u: Numeric
    du: Numeric
    v: Numeric
    dv: Numeric
    n: int
    def __init__(self, L: _Optional[_Union[Numeric, _Mapping]] = ..., dL: _Optional[_Union[Numeric, _Mapping]] = ..., u: _Optional[_Union[Numeric, _Mapping]] = ..., du: _Optional[_Union[Numeric, _Mapping]] = ..., v: _Optional[_Union[Numeric, _Mapping]] = ..., dv: _Optional[_Union[Numeric, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class DCPartial(_message.Message):
    __slots__ = ("sums", "epsilon")
    SUMS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    sums: DCSums
    epsilon: float
    def __init__(self, sums: _Optional[_Union[DCSums, _Mapping]] = ..., epsilon: _Optional[float] = ...) -> None: ...

class BoundMax(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: float
    def __init__(self, value: _Optional[float] = ...) -> None: ...

class HarmAnswer(_message.Message):
    __slots__ = ("combined", "own", "n", "epsilon", "noisy", "tolerance", "signs_off")
    COMBINED_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    NOISY_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    SIGNS_OFF_FIELD_NUMBER: _ClassVar[int]
    combined: NdArray
    own: float
    n: int
    epsilon: float
    noisy: bool
    tolerance: float
    signs_off: bool
    def __init__(self, combined: _Optional[_Union[NdArray, _Mapping]] = ..., own: _Optional[float] = ..., n: _Optional[int] = ..., epsilon: _Optional[float] = ..., noisy: _Optional[bool] = ..., tolerance: _Optional[float] = ..., signs_off: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("incarnation", "node_id")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    node_id: str
    def __init__(self, incarnation: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class ChannelAddress(_message.Message):
    __slots__ = ("host", "port", "cert", "node_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    cert: str
    node_id: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., cert: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class SiteFailure(_message.Message):
    __slots__ = ("kind", "text", "rule", "site", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    rule: str
    site: str
    detail: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., rule: _Optional[str] = ..., site: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class SiteResponse(_message.Message):
    __slots__ = ("method", "empty", "info", "sample", "grad", "qhat", "dc", "bound", "ack", "channel_address", "failure", "harm")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    QHAT_FIELD_NUMBER: _ClassVar[int]
    DC_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    HARM_FIELD_NUMBER: _ClassVar[int]
    method: str
    empty: Empty
    info: SiteSummary
    sample: UnlabeledSample
    grad: GradSum
    qhat: QhatPartial
    dc: DCPartial
    bound: BoundMax
    ack: Ack
    channel_address: ChannelAddress
    failure: SiteFailure
    harm: HarmAnswer
    def __init__(self, method: _Optional[str] = ..., empty: _Optional[_Union[Empty, _Mapping]] = ..., info: _Optional[_Union[SiteSummary, _Mapping]] = ..., sample: _Optional[_Union[UnlabeledSample, _Mapping]] = ..., grad: _Optional[_Union[GradSum, _Mapping]] = ..., qhat: _Optional[_Union[QhatPartial, _Mapping]] = ..., dc: _Optional[_Union[DCPartial, _Mapping]] = ..., bound: _Optional[_Union[BoundMax, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., channel_address: _Optional[_Union[ChannelAddress, _Mapping]] = ..., failure: _Optional[_Union[SiteFailure, _Mapping]] = ..., harm: _Optional[_Union[HarmAnswer, _Mapping]] = ...) -> None: ...
