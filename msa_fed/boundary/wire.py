"""The one codec of the boundary messages: :mod:`msa_fed.boundary.messages` <-> protobuf.

The schema is ``protos/msa_fed/v1/boundary.proto`` (generated code in
:mod:`msa_fed.boundary.proto`): ``SiteRequest`` is everything a coordinator may send a site,
``SiteResponse`` everything a site may return.  Both topologies use it: the cluster topology's
direct data channel (:mod:`msa_fed.boundary.channel`, one serialised message per frame) and the
federated relay (``relay.proto`` embeds the same two messages).

- :func:`to_proto` / :func:`from_proto`: a message object <-> a ``SiteRequest`` /
  ``SiteResponse``; :func:`encode` / :func:`decode`: the same as bytes.
- ``allowed`` is :data:`REQUESTS` or :data:`RESPONSES`: a message of the other direction, or any
  type not in the schema, is refused.
- Decoding checks every part and raises :class:`WireError` on anything else: unparsable bytes,
  a missing or unexpected body, a method name that is not an identifier, an array whose dtype is
  not in :data:`DTYPES`, with more than 8 dimensions, a negative dimension or a byte count that
  does not match its shape.  A peer can make a call fail, never run code (nothing is unpickled)
  or make the receiver allocate more than the message it sent.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet

from msa_fed.boundary import messages as m
from msa_fed.boundary.proto import boundary_pb2 as pb
from msa_fed.core.dc_terms import DCSums
from msa_fed.errors import PeerFault, PrivacyError

#: the dtypes an array may have on the wire: booleans, integers, floats, either byte order
DTYPES = frozenset(
    np.dtype(t).newbyteorder(order).str
    for t in ("b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8")
    for order in ("<", ">")
)
MAX_NDIM = 8
_METHOD = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class WireError(ValueError):
    """Bytes or a message that are not a valid boundary message here."""


class RemoteError(Exception):
    """An error the other end reported: ``kind`` is the error type's name; for a privacy policy's
    refusal (``kind == "PrivacyError"``) ``rule``, ``site`` and ``detail`` as the site gave them."""

    def __init__(self, kind: str, text: str, rule: str = "", site: str = "", detail: str = ""):
        super().__init__(f"{kind}: {text}")
        self.kind, self.text = kind, text
        self.rule, self.site, self.detail = rule, site, detail

    def exception(self) -> Exception:
        """The library error this stands for: a typed :class:`PrivacyError` for a policy's refusal
        (rule and site kept), else this RemoteError itself."""
        if self.kind == PrivacyError.__name__:
            return PrivacyError(self.rule, self.site, self.detail) if self.rule else PrivacyError(self.text)
        return self


# the body field of SiteRequest / SiteResponse for each message type (None: no payload)
_REQUEST_FIELDS = {
    m.JobSetup: "job_setup",
    m.DomainModelSpec: "domain_model",
    m.ShardSetup: "shard_setup",
    m.ThetaRequest: "theta",
    m.RowRange: "row_range",
    m.QhatBroadcast: "qhat",
    m.DCRequest: "dc",
    m.ChannelOffer: "channel_offer",
    m.HarmRequest: "harm",
}
_RESPONSE_FIELDS = {
    m.SiteInfo: "info",
    m.UnlabeledSample: "sample",
    m.GradSum: "grad",
    m.QhatPartial: "qhat",
    m.DCPartial: "dc",
    m.BoundMax: "bound",
    m.Ack: "ack",
    m.ChannelAddress: "channel_address",
    m.HarmAnswer: "harm",
}


def _types(classes) -> dict[str, type]:
    return {c.__name__: c for c in classes}


REQUESTS = _types(m.REQUEST_TYPES)
RESPONSES = _types(m.RESPONSE_TYPES)


def _direction(allowed: dict[str, type]):
    if allowed is REQUESTS or set(allowed.values()) <= set(_REQUEST_FIELDS):
        return pb.SiteRequest, _REQUEST_FIELDS
    if allowed is RESPONSES or set(allowed.values()) <= set(_RESPONSE_FIELDS):
        return pb.SiteResponse, _RESPONSE_FIELDS
    raise ValueError("allowed must be wire.REQUESTS or wire.RESPONSES (or a subset of one)")


# ------------------------------------------------------------------ arrays and scalars
def _put_array(out: pb.NdArray, v) -> None:
    if not isinstance(v, np.ndarray):
        raise WireError(f"expected an array, got {type(v).__name__}")
    if v.dtype.str not in DTYPES:
        raise WireError(f"cannot send an array of dtype {v.dtype}")
    if v.ndim > MAX_NDIM:
        raise WireError(f"cannot send an array of {v.ndim} dimensions")
    out.dtype = v.dtype.str
    out.shape.extend(int(s) for s in v.shape)
    out.data = np.ascontiguousarray(v).tobytes()


def _epsilon(v: float, what: str) -> float:
    """A site's epsilon spent: a finite number >= 0."""
    if not (math.isfinite(v) and v >= 0):
        raise WireError(f"{what}: epsilon must be a finite number >= 0")
    return float(v)


def _array(a: pb.NdArray, what: str) -> np.ndarray:
    if a.dtype not in DTYPES:
        raise WireError(f"{what}: array of dtype {a.dtype[:16]!r} not allowed")
    shape = tuple(a.shape)
    if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
        raise WireError(f"{what}: array shape {shape[: MAX_NDIM + 1]} not allowed")
    dtype = np.dtype(a.dtype)
    if math.prod(shape) * dtype.itemsize != len(a.data):
        raise WireError(f"{what}: array of shape {shape} and dtype {dtype} does not fill {len(a.data)} bytes")
    return np.frombuffer(a.data, dtype=dtype).reshape(shape)


def _opt_array(parent, name: str, what: str):
    return _array(getattr(parent, name), f"{what}.{name}") if parent.HasField(name) else None


def _put_scalar(out: pb.Scalar, v) -> None:
    if v is None:
        out.none = True
    elif isinstance(v, (bool, np.bool_)):
        out.flag = bool(v)
    elif isinstance(v, (int, np.integer)):
        out.integer = int(v)
    elif isinstance(v, (float, np.floating)):
        out.number = float(v)
    elif isinstance(v, str):
        out.text = v
    else:
        raise WireError(f"cannot send a parameter of type {type(v).__name__}")


def _scalar(s: pb.Scalar):
    kind = s.WhichOneof("kind")
    if kind is None:
        raise WireError("empty parameter")
    return None if kind == "none" else getattr(s, kind)


def _put_feature_map(out: pb.FeatureMap, state) -> None:
    try:
        name, params, arrays = state
    except (TypeError, ValueError):
        raise WireError("a feature map is sent as (name, params, arrays)") from None
    out.name = str(name)
    for k, v in dict(params).items():
        _put_scalar(out.params[str(k)], v)
    for k, v in dict(arrays).items():
        _put_array(out.arrays[str(k)], v)


def _feature_map(parent, what: str):
    if not parent.HasField("feature_map"):
        return None
    f = parent.feature_map
    return (
        f.name,
        {k: _scalar(v) for k, v in f.params.items()},
        {k: _array(v, f"{what}.feature_map.{k}") for k, v in f.arrays.items()},
    )


def _no_custom(msg):
    if getattr(msg, "custom_feature_map", None) is not None:
        raise WireError("a custom feature map object exists only in-process; it cannot cross a boundary")


def _put_numeric(out: pb.Numeric, v) -> None:
    if isinstance(v, np.ndarray):
        _put_array(out.array, v)
    elif isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
        out.scalar = float(v)
    else:
        raise WireError(f"cannot send a DC sum of type {type(v).__name__}")


def _numeric(parent, name: str):
    if not parent.HasField(name):
        return None
    n = getattr(parent, name)
    kind = n.WhichOneof("value")
    if kind is None:
        raise WireError(f"DC sum {name} is empty")
    return _array(n.array, f"DC sum {name}") if kind == "array" else n.scalar


# ------------------------------------------------------------------ message bodies
def _fill(body, msg) -> None:  # noqa: C901 - one branch per message type, the schema in code
    if isinstance(msg, m.JobSetup):
        body.job_id, body.index, body.task, body.loss = msg.job_id, int(msg.index), msg.task, msg.loss
        body.sites.extend(msg.sites)
        body.predictor_sha256.extend(msg.predictor_sha256)
        body.min_points = int(msg.min_points)
        if msg.classes is not None:
            _put_array(body.classes, np.asarray(msg.classes))
    elif isinstance(msg, m.DomainModelSpec):
        _no_custom(msg)
        body.kind, body.n_sources = msg.kind, int(msg.n_sources)
        if msg.feature_map is not None:
            _put_feature_map(body.feature_map, msg.feature_map)
        if msg.theta is not None:
            _put_array(body.theta, msg.theta)
        if msg.bandwidths is not None:
            _put_array(body.bandwidths, np.asarray(msg.bandwidths))
        for X in msg.samples:
            _put_array(body.samples.add(), np.asarray(X))
        body.mu = float(msg.mu)
    elif isinstance(msg, m.ShardSetup):
        _no_custom(msg)
        if msg.feature_map is not None:
            _put_feature_map(body.feature_map, msg.feature_map)
        body.n_sources, body.dtype, body.device = int(msg.n_sources), str(msg.dtype), str(msg.device)
        body.seed, body.workers_per_site = int(msg.seed), int(msg.workers_per_site)
    elif isinstance(msg, m.ThetaRequest):
        _put_array(body.theta, msg.theta)
        if msg.step is not None:
            body.step = int(msg.step)
        body.batch_size = int(msg.batch_size)
    elif isinstance(msg, m.RowRange):
        body.start, body.stop = int(msg.start), int(msg.stop)
    elif isinstance(msg, m.QhatBroadcast):
        _put_array(body.qhat, msg.qhat)
        body.eta = float(msg.eta)
    elif isinstance(msg, m.DCRequest):
        _put_array(body.z, msg.z)
        body.eta = float(msg.eta)
        body.what.extend(str(w) for w in msg.what)
        if msg.global_bound is not None:
            body.global_bound = float(msg.global_bound)
    elif isinstance(msg, m.ChannelOffer):
        body.mode, body.peer_cert = msg.mode, msg.peer_cert
    elif isinstance(msg, m.HarmRequest):
        _put_array(body.z, msg.z)
        body.eta = float(msg.eta)
    elif isinstance(msg, m.HarmAnswer):
        _put_array(body.combined, np.asarray(msg.combined))
        body.own, body.n, body.epsilon = float(msg.own), int(msg.n), float(msg.epsilon)
        body.noisy, body.tolerance, body.signs_off = bool(msg.noisy), float(msg.tolerance), bool(msg.signs_off)
    elif isinstance(msg, m.SiteInfo):
        body.name, body.task = msg.name, msg.task
        body.n_features, body.n_labeled = int(msg.n_features), int(msg.n_labeled)
        body.n_unlabeled = int(msg.n_unlabeled)
        body.sample_kept_out = not msg.sample_in_model
        if msg.classes is not None:
            _put_array(body.classes, np.asarray(msg.classes))
    elif isinstance(msg, m.UnlabeledSample):
        _put_array(body.X, msg.X)
    elif isinstance(msg, m.GradSum):
        body.loss, body.n = float(msg.loss), int(msg.n)
        _put_array(body.grad, msg.grad)
    elif isinstance(msg, m.QhatPartial):
        _put_array(body.sums, msg.sums)
        body.n = int(msg.n)
        body.epsilon = float(msg.epsilon)
        body.dp = bool(msg.dp)
    elif isinstance(msg, m.DCPartial):
        s = msg.sums
        if not isinstance(s, DCSums):
            raise WireError("DCPartial.sums must be DCSums")
        for f in fields(DCSums):
            v = getattr(s, f.name)
            if f.name == "n":
                body.sums.n = int(v)
            elif v is not None:
                _put_numeric(getattr(body.sums, f.name), v)
        body.sums.SetInParent()
        body.epsilon = float(msg.epsilon)
    elif isinstance(msg, m.BoundMax):
        body.value = float(msg.value)
    elif isinstance(msg, m.Ack):
        body.incarnation, body.node_id = msg.incarnation, msg.node_id
    elif isinstance(msg, m.ChannelAddress):
        body.host, body.port, body.cert, body.node_id = msg.host, int(msg.port), msg.cert, msg.node_id
    else:  # pragma: no cover - guarded by the type tables
        raise WireError(f"{type(msg).__name__} is not a message that may cross here")


def _read(cls, b, what: str):  # noqa: C901 - the inverse of _fill
    if cls is m.JobSetup:
        return m.JobSetup(
            job_id=b.job_id,
            sites=tuple(b.sites),
            index=b.index,
            predictor_sha256=tuple(b.predictor_sha256),
            task=b.task,
            loss=b.loss,
            classes=_opt_array(b, "classes", what),
            min_points=b.min_points,
        )
    if cls is m.DomainModelSpec:
        return m.DomainModelSpec(
            kind=b.kind,
            n_sources=b.n_sources,
            feature_map=_feature_map(b, what),
            theta=_opt_array(b, "theta", what),
            bandwidths=_opt_array(b, "bandwidths", what),
            samples=tuple(_array(a, f"{what}.samples") for a in b.samples),
            mu=b.mu,
        )
    if cls is m.ShardSetup:
        return m.ShardSetup(
            feature_map=_feature_map(b, what),
            custom_feature_map=None,
            n_sources=b.n_sources,
            dtype=b.dtype,
            device=b.device,
            seed=b.seed,
            workers_per_site=b.workers_per_site,
        )
    if cls is m.ThetaRequest:
        if not b.HasField("theta"):
            raise WireError(f"{what}: theta is missing")
        return m.ThetaRequest(
            theta=_array(b.theta, f"{what}.theta"), step=b.step if b.HasField("step") else None, batch_size=b.batch_size
        )
    if cls is m.RowRange:
        return m.RowRange(start=b.start, stop=b.stop)
    if cls is m.QhatBroadcast:
        if not b.HasField("qhat"):
            raise WireError(f"{what}: qhat is missing")
        return m.QhatBroadcast(qhat=_array(b.qhat, f"{what}.qhat"), eta=b.eta)
    if cls is m.DCRequest:
        if not b.HasField("z"):
            raise WireError(f"{what}: z is missing")
        return m.DCRequest(
            z=_array(b.z, f"{what}.z"),
            eta=b.eta,
            what=tuple(b.what),
            global_bound=b.global_bound if b.HasField("global_bound") else None,
        )
    if cls is m.ChannelOffer:
        return m.ChannelOffer(mode=b.mode, peer_cert=b.peer_cert)
    if cls is m.HarmRequest:
        if not b.HasField("z"):
            raise WireError(f"{what}: z is missing")
        return m.HarmRequest(z=_array(b.z, f"{what}.z"), eta=b.eta)
    if cls is m.HarmAnswer:
        if not b.HasField("combined"):
            raise WireError(f"{what}: combined is missing")
        return m.HarmAnswer(
            combined=_array(b.combined, f"{what}.combined"),
            own=b.own,
            n=b.n,
            epsilon=_epsilon(b.epsilon, what),
            noisy=bool(b.noisy),
            tolerance=b.tolerance,
            signs_off=bool(b.signs_off),
        )
    if cls is m.SiteInfo:
        return m.SiteInfo(
            name=b.name,
            n_features=b.n_features,
            n_labeled=b.n_labeled,
            n_unlabeled=b.n_unlabeled,
            task=b.task,
            classes=_opt_array(b, "classes", what),
            sample_in_model=not b.sample_kept_out,
        )
    if cls is m.UnlabeledSample:
        if not b.HasField("X"):
            raise WireError(f"{what}: X is missing")
        return m.UnlabeledSample(X=_array(b.X, f"{what}.X"))
    if cls is m.GradSum:
        if not b.HasField("grad"):
            raise WireError(f"{what}: grad is missing")
        return m.GradSum(loss=b.loss, grad=_array(b.grad, f"{what}.grad"), n=b.n)
    if cls is m.QhatPartial:
        if not b.HasField("sums"):
            raise WireError(f"{what}: sums is missing")
        return m.QhatPartial(
            sums=_array(b.sums, f"{what}.sums"), n=b.n, epsilon=_epsilon(b.epsilon, what), dp=bool(b.dp)
        )
    if cls is m.DCPartial:
        if not b.HasField("sums"):
            raise WireError("malformed DC sums: missing")
        s = b.sums
        return m.DCPartial(
            sums=DCSums(**{f.name: _numeric(s, f.name) for f in fields(DCSums) if f.name != "n"}, n=s.n),
            epsilon=_epsilon(b.epsilon, what),
        )
    if cls is m.BoundMax:
        return m.BoundMax(value=b.value)
    if cls is m.Ack:
        return m.Ack(incarnation=b.incarnation, node_id=b.node_id)
    if cls is m.ChannelAddress:
        return m.ChannelAddress(host=b.host, port=b.port, cert=b.cert, node_id=b.node_id)
    raise WireError(f"{cls.__name__} is not a message that may cross here")  # pragma: no cover


# ------------------------------------------------------------------ public API
def to_proto(method: str, msg: m.Message | None, allowed: dict[str, type]):
    """A ``SiteRequest`` (``allowed`` = :data:`REQUESTS`) or ``SiteResponse`` holding ``msg``."""
    envelope_cls, table = _direction(allowed)
    if not isinstance(method, str) or not _METHOD.match(method):
        raise WireError(f"method name {str(method)[:80]!r} is not an identifier")
    out = envelope_cls(method=method)
    if msg is None:
        out.empty.SetInParent()
        return out
    name = type(msg).__name__
    if allowed.get(name) is not type(msg) or type(msg) not in table:
        raise WireError(f"{name} is not a message that may cross here")
    body = getattr(out, table[type(msg)])
    _fill(body, msg)
    body.SetInParent()
    return out


def error_proto(kind: str, text: str) -> pb.SiteResponse:
    """A ``SiteResponse`` reporting an error: the error type's name and one line of text."""
    out = pb.SiteResponse(method="error")
    out.failure.kind = str(kind)[:128]
    out.failure.text = " ".join(str(text).split())[:4000]
    return out


def from_proto(envelope, allowed: dict[str, type]):
    """(method, message) of a ``SiteRequest``/``SiteResponse``; ("", RemoteError) for a failure."""
    envelope_cls, table = _direction(allowed)
    if not isinstance(envelope, envelope_cls):
        raise WireError(f"expected a {envelope_cls.__name__}, got {type(envelope).__name__}")
    body_name = envelope.WhichOneof("body")
    if body_name is None:
        raise WireError("message has no body")
    if body_name == "failure":
        f = envelope.failure
        return "", RemoteError(f.kind or "Error", f.text, rule=f.rule[:128], site=f.site[:128], detail=f.detail[:4000])
    method = envelope.method
    if not _METHOD.match(method):
        raise WireError(f"message names no method (or not an identifier: {method[:80]!r})")
    if body_name == "empty":
        return method, None
    by_field = {f: c for c, f in table.items() if c.__name__ in allowed and allowed[c.__name__] is c}
    cls = by_field.get(body_name)
    if cls is None:
        raise WireError(f"{body_name!r} is not a message that may cross here")
    try:
        return method, _read(cls, getattr(envelope, body_name), cls.__name__)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"{cls.__name__}: {exc}") from None


def encode(method: str, msg: m.Message | None, allowed: dict[str, type]) -> bytes:
    """The bytes of (method, msg); msg must be one of ``allowed`` (or None)."""
    return to_proto(method, msg, allowed).SerializeToString()


def encode_error(kind: str, text: str) -> bytes:
    """An error answer: the library error type's name and its message."""
    return error_proto(kind, text).SerializeToString()


def failure_proto(exc: BaseException):
    """The ``SiteResponse`` reporting ``exc``; a :class:`PrivacyError` keeps its rule, site and detail."""
    out = error_proto(type(exc).__name__, str(exc))
    if isinstance(exc, PeerFault):  # the party at fault, named by the one that noticed
        out.failure.rule = "peer_fault"
        out.failure.site = str(exc.site)[:128]
    if isinstance(exc, PrivacyError) and exc.rule:
        out.failure.rule = str(exc.rule)[:128]
        out.failure.site = str(exc.site)[:128]
        out.failure.detail = " ".join(str(exc.detail).split())[:4000]
    return out


def encode_failure(exc: BaseException) -> bytes:
    """An error answer for ``exc`` (:func:`failure_proto`), as bytes."""
    return failure_proto(exc).SerializeToString()


def decode(frame: bytes, allowed: dict[str, type]):
    """(method, message) of encoded bytes, or ("", RemoteError) for an error answer."""
    envelope_cls, _ = _direction(allowed)
    envelope = envelope_cls()
    try:
        envelope.ParseFromString(bytes(frame))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin: any parse failure
        raise WireError(f"not a {envelope_cls.__name__}: {type(exc).__name__}") from None
    if len(UnknownFieldSet(envelope)):
        raise WireError(
            f"not a message that may cross here: fields unknown to {envelope_cls.__name__} "
            "(a message of the other direction?)"
        )
    return from_proto(envelope, allowed)
