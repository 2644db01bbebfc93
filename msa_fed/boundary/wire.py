"""The one codec of the boundary messages: :mod:`msa_fed.boundary.messages` <-> protobuf.

The schema is ``protos/msa_fed/v1/boundary.proto`` (generated code in
:mod:`msa_fed.boundary.proto`): ``SiteRequest`` is everything a coordinator may send a site,
``SiteResponse`` everything a site may return.  Both topologies use it: the cluster topology's
direct data channel (:mod:`msa_fed.boundary.channel`, one serialised message per frame) and the
federated relay (``relay.proto`` embeds the same two messages).

- :func:`to_proto` / :func:`from_proto`: a message object <-> a ``SiteRequest`` /
  ``SiteResponse``; :func:`encode` / :func:`decode`: the same as bytes.
- :data:`SCHEMA`: the one description of how each message crosses, field by field, derived from
  the message dataclasses and the proto messages (see "the schema" below).
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
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
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


# the body field of SiteRequest / SiteResponse for each message type: the first column of SCHEMA
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
    v = np.asarray(v)
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


def _put_feature_map(parent, name: str, state) -> None:
    if state is None:
        return
    try:
        fname, params, arrays = state
    except (TypeError, ValueError):
        raise WireError("a feature map is sent as (name, params, arrays)") from None
    out = getattr(parent, name)
    out.name = str(fname)
    for k, v in dict(params).items():
        _put_scalar(out.params[str(k)], v)
    for k, v in dict(arrays).items():
        _put_array(out.arrays[str(k)], v)


def _feature_map(parent, name: str, what: str):
    if not parent.HasField(name):
        return None
    f = getattr(parent, name)
    return (
        f.name,
        {k: _scalar(v) for k, v in f.params.items()},
        {k: _array(v, f"{what}.{name}.{k}") for k, v in f.arrays.items()},
    )


def _put_dc_sums(out: pb.DCSums, s) -> None:
    if not isinstance(s, DCSums):
        raise WireError("DCPartial.sums must be DCSums")
    for f in fields(DCSums):
        v = getattr(s, f.name)
        if f.name == "n":
            out.n = int(v)
        elif isinstance(v, np.ndarray):
            _put_array(getattr(out, f.name).array, v)
        elif isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
            getattr(out, f.name).scalar = float(v)
        elif v is not None:
            raise WireError(f"cannot send a DC sum of type {type(v).__name__}")
    out.SetInParent()


def _numeric(parent, name: str):
    if not parent.HasField(name):
        return None
    n = getattr(parent, name)
    kind = n.WhichOneof("value")
    if kind is None:
        raise WireError(f"DC sum {name} is empty")
    return _array(n.array, f"DC sum {name}") if kind == "array" else n.scalar


def _dc_sums(parent, name: str) -> DCSums:
    if not parent.HasField(name):
        raise WireError("malformed DC sums: missing")
    s = getattr(parent, name)
    return DCSums(**{f.name: _numeric(s, f.name) for f in fields(DCSums) if f.name != "n"}, n=s.n)


# ------------------------------------------------------------------ the schema: one table
# A message crosses field by field.  A dataclass field is the proto field of the same name in its
# body message, and how it crosses (its kind) follows from the proto field's type and the
# dataclass field's default, but for the few fields named in _EXCEPTIONS.  Adding a field is the
# dataclass field plus the .proto field; adding a message, its row in _REQUEST_FIELDS /
# _RESPONSE_FIELDS as well.  SCHEMA is the table that results; it refuses to build (TypeError, at
# import) where a dataclass and its proto message disagree.


class Kind(NamedTuple):
    """How a value crosses: ``put(body, proto_name, value)``, ``get(body, proto_name, what)``."""

    name: str
    put: Callable[[Any, Any, Any], None]
    get: Callable[[Any, Any, str], Any]


class Field(NamedTuple):
    name: str  # of the dataclass field
    kind: Kind
    proto: str | None  # the proto field's name; None: the field does not cross


def _scalar_kind(name: str, cast) -> Kind:
    def put(b, k, v):
        setattr(b, k, cast(v))

    return Kind(name, put, lambda b, k, what: getattr(b, k))


def _optional_kind(name: str, cast) -> Kind:  # proto3 ``optional``: None <-> unset
    def put(b, k, v):
        if v is not None:
            setattr(b, k, cast(v))

    return Kind(name, put, lambda b, k, what: getattr(b, k) if b.HasField(k) else None)


def _put_opt_array(b, k, v):
    if v is not None:
        _put_array(getattr(b, k), v)


def _required_array(b, k, what):
    if not b.HasField(k):
        raise WireError(f"{what}: {k} is missing")
    return _array(getattr(b, k), f"{what}.{k}")


def _put_arrays(b, k, v):
    for x in v:
        _put_array(getattr(b, k).add(), x)


def _put_in_process(b, k, v):
    if v is not None:
        raise WireError("a custom feature map object exists only in-process; it cannot cross a boundary")


STR, INT, FLOAT, BOOL = (
    _scalar_kind("str", str),
    _scalar_kind("int", int),
    _scalar_kind("float", float),
    _scalar_kind("bool", bool),
)
OPT_INT, OPT_FLOAT = _optional_kind("int | None", int), _optional_kind("float | None", float)
STRS = Kind(
    "tuple[str]", lambda b, k, v: getattr(b, k).extend(str(x) for x in v), lambda b, k, what: tuple(getattr(b, k))
)
ARRAY = Kind("array", lambda b, k, v: _put_array(getattr(b, k), v), _required_array)
OPT_ARRAY = Kind("array | None", _put_opt_array, lambda b, k, what: _opt_array(b, k, what))
ARRAYS = Kind("tuple[array]", _put_arrays, lambda b, k, what: tuple(_array(a, f"{what}.{k}") for a in getattr(b, k)))
FEATURE_MAP = Kind("feature map | None", _put_feature_map, _feature_map)
DC_SUMS = Kind("DCSums", lambda b, k, v: _put_dc_sums(getattr(b, k), v), lambda b, k, what: _dc_sums(b, k))
#: a site's epsilon spent: a finite number >= 0
EPSILON = Kind("epsilon", FLOAT.put, lambda b, k, what: _epsilon(getattr(b, k), what))
#: a flag that crosses as its negation (so that its default crosses as an absent field)
NEGATED = Kind("not bool", lambda b, k, v: setattr(b, k, not v), lambda b, k, what: not getattr(b, k))
#: an in-process object without a proto field: None to cross, None when read
IN_PROCESS = Kind("in-process only", _put_in_process, lambda b, k, what: None)

_F = FieldDescriptor
_KINDS = {
    (_F.TYPE_STRING, False): STR,
    (_F.TYPE_INT32, False): INT,
    (_F.TYPE_INT64, False): INT,
    (_F.TYPE_INT32, True): OPT_INT,
    (_F.TYPE_INT64, True): OPT_INT,
    (_F.TYPE_DOUBLE, False): FLOAT,
    (_F.TYPE_DOUBLE, True): OPT_FLOAT,
    (_F.TYPE_BOOL, False): BOOL,
    ("repeated", _F.TYPE_STRING): STRS,
    ("repeated", "NdArray"): ARRAYS,
    ("NdArray", False): ARRAY,  # a dataclass field without default None: required
    ("NdArray", True): OPT_ARRAY,
    ("FeatureMap", True): FEATURE_MAP,
    ("DCSums", True): DC_SUMS,
}
#: the fields, in any message, that do not follow from their proto field: (proto field, kind)
_EXCEPTIONS = {
    "custom_feature_map": (None, IN_PROCESS),
    "epsilon": ("epsilon", EPSILON),
    "sample_in_model": ("sample_kept_out", NEGATED),
}


def fields_of(cls: type, body: Descriptor) -> tuple[Field, ...]:
    """The row of ``cls`` in :data:`SCHEMA`: each dataclass field with its kind and proto field;
    TypeError where the dataclass and the proto message ``body`` disagree (a field missing from
    either, a proto type with no kind)."""
    proto = body.fields_by_name
    out = []
    for f in fields(cls):
        name, kind = _EXCEPTIONS.get(f.name, (f.name, None))
        d = proto.get(name) if name is not None else None
        if kind is None and d is not None:
            t = d.message_type.name if d.message_type is not None else d.type
            key = ("repeated", t) if d.is_repeated else (t, f.default is None if t == "NdArray" else d.has_presence)
            kind = _KINDS.get(key)
        if (d is None) != (name is None) or kind is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no field in the proto message {body.name} it can cross as")
        out.append(Field(f.name, kind, name))
    extra = set(proto) - {f.proto for f in out}
    if extra:
        raise TypeError(f"{body.name} has fields that {cls.__name__} lacks: {sorted(extra)}")
    return tuple(out)


def _schema(envelope, table: dict[type, str]) -> dict[type, tuple[str, tuple[Field, ...]]]:
    by_name = envelope.DESCRIPTOR.fields_by_name
    return {cls: (name, fields_of(cls, by_name[name].message_type)) for cls, name in table.items()}


#: message type -> (its body field in the envelope, its fields with their kinds)
SCHEMA = {**_schema(pb.SiteRequest, _REQUEST_FIELDS), **_schema(pb.SiteResponse, _RESPONSE_FIELDS)}


def _fill(body, msg) -> None:
    for f in SCHEMA[type(msg)][1]:
        f.kind.put(body, f.proto, getattr(msg, f.name))


def _read(cls, b, what: str):
    return cls(**{f.name: f.kind.get(b, f.proto, what) for f in SCHEMA[cls][1]})


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
