"""The privacy boundary as code: every message that may cross a site's boundary.

A site answers the coordinator only with the response types below; each is either published
material (the unlabelled sample, counts) or an aggregate of size O(p) / O(p^2) / O(parameters)
summed over the site's points (DESIGN.md section 4).  Nothing here is per labelled point.
:class:`Recorder` captures every request and response that crosses, for audits and the
privacy test.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from msa_fed.core.config import MIN_POINTS
from msa_fed.core.dc_terms import DCSums


#: arrays up to this size travel packed as bytes inside the message; larger ones are left to
#: Ray's zero-copy path (out-of-band buffers)
PACK_MAX_BYTES = 1 << 16
_ND, _SUMS = "__ndarray__", "__dcsums__"


def _each(fn, v):
    """``v`` with ``fn`` applied to each item of a tuple, list or dict; any other value as is."""
    if type(v) is tuple:
        return tuple(fn(x) for x in v)
    if type(v) is list:
        return [fn(x) for x in v]
    if type(v) is dict:
        return {k: fn(x) for k, x in v.items()}
    return v


def _pack(v):
    """A field value with small numeric arrays as (tag, dtype, shape, bytes) tuples.

    Ray's serializer spends ~0.1 ms on a dataclass holding a few small arrays (each becomes an
    out-of-band buffer); a tuple of bytes costs a few microseconds.  A DC round sends 2 p such
    messages, so this is most of the runtime's own share of the round latency.  (The protobuf
    codec, :mod:`msa_fed.boundary.wire`, checks every field and costs 1.3 to 3 times as much; it
    serves where a message leaves the process of a party it trusts.)
    """
    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.nbytes <= PACK_MAX_BYTES:
        return (_ND, v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, DCSums):
        return (_SUMS, tuple(_pack(getattr(v, f.name)) for f in fields(v)))
    return _each(_pack, v)


def _unpack(v):
    if type(v) is tuple and v and type(v[0]) is str:
        if len(v) == 4 and v[0] == _ND:
            return np.frombuffer(v[3], dtype=np.dtype(v[1])).reshape(v[2])
        if len(v) == 2 and v[0] == _SUMS:
            return DCSums(*(_unpack(x) for x in v[1]))
    return _each(_unpack, v)


def _rebuild(cls, packed):
    return cls(*(_unpack(x) for x in packed))


class Message:
    """Base of all boundary messages; ``arrays()`` lists every ndarray it carries.

    Messages serialise compactly (``__reduce__``: small arrays as raw bytes with dtype and
    shape); they rebuild as the same message, with read-only arrays, as Ray gives anyway.
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]  # every message is a dataclass

    def __reduce__(self):
        return (_rebuild, (type(self), tuple(_pack(getattr(self, f.name)) for f in fields(self))))

    def arrays(self) -> list[np.ndarray]:
        out = []

        def walk(v):
            if isinstance(v, np.ndarray):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, Message):
                out.extend(v.arrays())
            elif isinstance(v, DCSums):
                out.extend(v.arrays().values())

        for f in fields(self):
            walk(getattr(self, f.name))
        return out


# ------------------------------------------------------------------ coordinator -> site
@dataclass(frozen=True)
class JobSetup(Message):
    """Join a job (federated topology): the job's sites in order, this site's index, the sha256
    of every site's published predictor (the site fetches and checks them), the task, the loss,
    the union of the predictors' classes and the least number of points to aggregate over."""

    job_id: str
    sites: tuple
    index: int
    predictor_sha256: tuple
    task: str
    loss: str
    classes: np.ndarray | None = None
    min_points: int = MIN_POINTS


@dataclass(frozen=True)
class DomainModelSpec(Message):
    """How to compute Q(k | x): a Maxent classifier (feature map + theta) or GMSA's KDEs.

    feature_map : (name, params, arrays) of a built-in map, or None when ``custom_feature_map``
    (an in-process transformer object, only for the in-process API) is given.
    """

    kind: str  # "maxent" or "kde"
    n_sources: int
    feature_map: tuple | None = None
    custom_feature_map: Any = None
    theta: np.ndarray | None = None
    bandwidths: np.ndarray | None = None
    samples: tuple = ()  # the published unlabelled samples (KDE only)
    mu: float = 0.0  # Maxent: the L2 weight it was trained with (the site verifies the model)


def feature_map_fields(fmap) -> tuple[tuple | None, Any]:
    """(feature_map, custom_feature_map) message fields of a feature map: the state of a built-in
    map (name, params, arrays), or the object itself for a custom one (in-process API only)."""
    from msa_fed.core.features import FEATURE_MAPS, feature_map_state

    if fmap is None:
        return None, None
    if any(type(fmap) is cls for cls in FEATURE_MAPS.values()):
        return feature_map_state(fmap), None
    return None, fmap


def feature_map_of(state: tuple | None, custom):
    """Inverse of :func:`feature_map_fields`."""
    if state is None:
        return custom
    from msa_fed.core.features import feature_map_from_state

    return feature_map_from_state(*state)


def domain_model_spec(model, n_sources: int) -> DomainModelSpec:
    """The message that carries a fitted domain model to the sites (its own get_state)."""
    from msa_fed.core.domain_models import domain_model_state

    kind, params, arrays = domain_model_state(model)
    state, custom = feature_map_fields(model.feature_map)
    samples = tuple(arrays[f"kde_sample.{k}"] for k in range(n_sources) if f"kde_sample.{k}" in arrays)
    return DomainModelSpec(
        kind=kind,
        n_sources=n_sources,
        feature_map=state,
        custom_feature_map=custom,
        theta=arrays.get("theta"),
        bandwidths=arrays.get("bandwidths"),
        samples=samples,
        mu=float(params.get("mu", 0.0)),
    )


def domain_model_from_spec(spec: DomainModelSpec):
    """The domain model a :class:`DomainModelSpec` carries (its class's from_state)."""
    from msa_fed.core.domain_models import domain_model_from_state

    arrays = {"theta": spec.theta, "bandwidths": spec.bandwidths}
    arrays.update({f"kde_sample.{k}": s for k, s in enumerate(spec.samples)})
    arrays = {k: v for k, v in arrays.items() if v is not None}
    fmap = feature_map_of(spec.feature_map, spec.custom_feature_map)
    return domain_model_from_state(spec.kind, {"mu": spec.mu}, arrays, fmap, spec.n_sources)


@dataclass(frozen=True)
class PublishedSamples(Message):
    """The published unlabelled samples of a job's sites, in site order: given by the host of
    a site worker (in-process, cluster) so that the site can verify the domain model.  Not a
    request of the coordinator (the host's own copy of published material), so not one of
    REQUEST_TYPES; a site process never gets it (it fetches the samples from the registry)."""

    samples: tuple


@dataclass(frozen=True)
class ShardSetup(Message):
    feature_map: tuple | None
    custom_feature_map: Any
    n_sources: int
    dtype: str = "float64"
    device: str = "cpu"
    seed: int = 0
    workers_per_site: int = 1  # the site keeps the first of this many row blocks (msa_fed.site.shards)


@dataclass(frozen=True)
class ThetaRequest(Message):
    theta: np.ndarray
    step: int | None = None  # None: full shard; else the SGD step (mini-batch)
    batch_size: int = 0


@dataclass(frozen=True)
class RowRange(Message):
    """Rows [start, stop) of the site's published unlabelled sample (for a helper worker)."""

    start: int
    stop: int


@dataclass(frozen=True)
class QhatBroadcast(Message):
    qhat: np.ndarray
    eta: float


@dataclass(frozen=True)
class DCRequest(Message):
    z: np.ndarray
    eta: float
    what: tuple
    global_bound: float | None = None


@dataclass(frozen=True)
class HarmRequest(Message):
    """The site's verdict on a combined model: its loss on the site's labelled points at each
    row of ``z`` (m, p) (row 0: the model's z; the others: the mixtures the influence analysis
    re-solved without each site), and the site's own predictor's loss there."""

    z: np.ndarray
    eta: float


@dataclass(frozen=True)
class ChannelOffer(Message):
    """Open the direct data channel (:mod:`msa_fed.boundary.channel`): its mode and the
    coordinator's ephemeral certificate for this run (PEM text, public; empty in plain mode)."""

    mode: str
    peer_cert: str = ""


# ------------------------------------------------------------------ site -> coordinator
@dataclass(frozen=True)
class SiteInfo(Message):
    name: str
    n_features: int
    n_labeled: int  # a count, not data
    n_unlabeled: int
    task: str
    classes: np.ndarray | None = None  # class labels of the site's predictor (public)
    sample_in_model: bool = True  # the site's policy lets the model carry rows of its published sample


@dataclass(frozen=True)
class UnlabeledSample(Message):
    X: np.ndarray  # published by the site (DESIGN section 4)


@dataclass(frozen=True)
class GradSum(Message):
    loss: float
    grad: np.ndarray  # (p (D + 1),)
    n: int


@dataclass(frozen=True)
class QhatPartial(Message):
    sums: np.ndarray  # (p,)
    n: int
    epsilon: float = 0.0  # DP: epsilon this site has spent on the job so far (0 without DP)
    dp: bool = False  # the site answers with DP (its partial is over its published sample)


@dataclass(frozen=True)
class DCPartial(Message):
    sums: DCSums
    epsilon: float = 0.0  # DP: epsilon this site has spent on the job so far (0 without DP)


@dataclass(frozen=True)
class HarmAnswer(Message):
    """Two kinds of mean over the site's labelled points (per-point losses clipped to the
    site's loss_clip): the combined model's loss at each requested z (m,), and the site's own
    predictor's loss.  ``noisy``: DP noise was added (one DP answer);  ``tolerance``: the
    site's harm tolerance (policy, public);  ``signs_off``: False when the site's policy
    refuses a model that harms it beyond that tolerance (at row 0)."""

    combined: np.ndarray
    own: float
    n: int
    epsilon: float = 0.0
    noisy: bool = False
    tolerance: float = 0.0
    signs_off: bool = True


@dataclass(frozen=True)
class BoundMax(Message):
    value: float


@dataclass(frozen=True)
class Ack(Message):
    """incarnation: changes when the worker restarts; node_id: the Ray node it runs on ("" off Ray)."""

    incarnation: str = ""
    node_id: str = ""


@dataclass(frozen=True)
class ChannelAddress(Message):
    """Where the site's data channel listens, and the site's ephemeral certificate (PEM text, public)."""

    host: str
    port: int
    cert: str = ""
    node_id: str = ""


REQUEST_TYPES = (
    JobSetup,
    DomainModelSpec,
    ShardSetup,
    ThetaRequest,
    RowRange,
    QhatBroadcast,
    DCRequest,
    ChannelOffer,
    HarmRequest,
)
RESPONSE_TYPES = (
    SiteInfo,
    UnlabeledSample,
    GradSum,
    QhatPartial,
    DCPartial,
    BoundMax,
    Ack,
    ChannelAddress,
    HarmAnswer,
)


@dataclass
class Recorder:
    """Captures (direction, site, method, message) for every message that crosses.

    direction: "to_site" or "from_site"; message: a boundary message (None for a request
    without payload, e.g. ``info``).
    """

    records: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, direction: str, site: str, method: str, message: Message):
        with self._lock:
            self.records.append((direction, site, method, message))
