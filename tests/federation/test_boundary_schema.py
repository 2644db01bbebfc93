"""boundary.proto as the one codec of the boundary messages (no Ray, no network).

- every request and response type of msa_fed.boundary.messages round-trips through the protobuf
  schema bit for bit (arrays with their dtype and shape), including the federated JobSetup and
  the domain model with its feature map, for samples written here and for messages of every type
  generated from the codec's table (wire.SCHEMA);
- every generated message also pickles back equal (how it travels inside one party, on Ray);
- the table covers every dataclass field and every proto field, and refuses to build where they
  disagree; the encoding of each sample is pinned byte for byte;
- the schema refuses what may not cross: in-process objects, strings or objects in arrays,
  a response type sent as a request, a malformed array from a peer;
- a peer's array that does not fill its shape, a required array left out, an epsilon that is no
  budget are refused in every field of every message where they may stand;
- random bytes and random protobuf messages of either envelope decode to a boundary message or
  raise WireError, never anything else.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, fields

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as pb
from msa_fed.core.dc_terms import DCSums
from msa_fed.core.features import RandomFourierFeatures, feature_map_state

RNG = np.random.default_rng(0)
FMAP = feature_map_state(RandomFourierFeatures(n_components=6).fit(RNG.normal(size=(30, 3))))


def _equal(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, DCSums) or isinstance(a, m.Message):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, float) and np.isnan(a):
        return isinstance(b, float) and np.isnan(b)
    return a == b and type(a) is type(b)


REQUESTS = [
    m.JobSetup(
        job_id="job-1",
        sites=("a", "b", "c"),
        index=1,
        predictor_sha256=("0" * 64, "1" * 64, "2" * 64),
        task="classification",
        loss="cross_entropy",
        classes=np.array([0, 1, 2]),
        min_points=25,
    ),
    m.JobSetup(job_id="r", sites=("a", "b"), index=0, predictor_sha256=("x", "y"), task="regression", loss="squared"),
    m.DomainModelSpec(kind="maxent", n_sources=3, feature_map=FMAP, theta=RNG.normal(size=21)),
    m.DomainModelSpec(
        kind="kde",
        n_sources=2,
        bandwidths=np.array([0.5, 0.7]),
        samples=(RNG.normal(size=(4, 3)), RNG.normal(size=(5, 3)).astype(np.float32)),
    ),
    m.ShardSetup(
        feature_map=FMAP,
        custom_feature_map=None,
        n_sources=3,
        dtype="float32",
        device="cuda:1",
        seed=7,
        workers_per_site=4,
    ),
    m.ThetaRequest(theta=RNG.normal(size=(21,)), step=None, batch_size=0),
    m.RowRange(start=10, stop=20),
    m.QhatBroadcast(qhat=np.array([0.2, 0.3, 0.5]), eta=0.01),
    m.DCRequest(z=np.array([0.5, 0.5]), eta=0.0, what=("u", "du", "v", "dv"), global_bound=3.5),
    m.ChannelOffer(mode="tls", peer_cert="-----BEGIN CERTIFICATE-----\nabc\n"),
    m.HarmRequest(z=np.array([[0.2, 0.3, 0.5], [0.0, 0.4, 0.6]]), eta=0.01),
]
RESPONSES = [
    m.SiteInfo(name="a", n_features=3, n_labeled=41, n_unlabeled=60, task="classification", classes=np.array([0, 1])),
    m.SiteInfo(name="b", n_features=3, n_labeled=41, n_unlabeled=60, task="regression", sample_in_model=False),
    m.UnlabeledSample(X=RNG.normal(size=(7, 3))),
    m.GradSum(loss=1.25, grad=RNG.normal(size=21), n=60),
    m.QhatPartial(sums=np.array([0.1, 0.2, 0.05]), n=41),
    m.QhatPartial(sums=np.array([0.1, 0.2, 0.05]), n=41, epsilon=0.125),  # DP: the epsilon the site has spent
    m.DCPartial(sums=DCSums(L=RNG.normal(size=3), dL=RNG.normal(size=(3, 3)), n=41)),
    m.DCPartial(sums=DCSums(L=RNG.normal(size=3), n=41), epsilon=0.75),
    m.BoundMax(value=float("inf")),
    m.Ack(incarnation="i", node_id="n"),
    m.ChannelAddress(host="::1", port=4242, cert="c", node_id="n"),
    m.HarmAnswer(
        combined=np.array([0.21, 0.19]), own=0.19, n=41, epsilon=0.5, noisy=True, tolerance=4.0, signs_off=False
    ),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda x: type(x).__name__)
def test_every_request_round_trips(msg):
    method, got = wire.decode(wire.encode("some_method", msg, wire.REQUESTS), wire.REQUESTS)
    assert method == "some_method" and _equal(msg, got), (msg, got)


@pytest.mark.parametrize("msg", RESPONSES, ids=lambda x: type(x).__name__)
def test_every_response_round_trips(msg):
    method, got = wire.decode(wire.encode("some_method", msg, wire.RESPONSES), wire.RESPONSES)
    assert method == "some_method" and _equal(msg, got), (msg, got)


def test_every_boundary_type_is_covered_here():
    assert {type(x) for x in REQUESTS} == set(m.REQUEST_TYPES)
    assert {type(x) for x in RESPONSES} == set(m.RESPONSE_TYPES)


# sha256 of each sample's envelope (REQUESTS, then RESPONSES) serialised with sorted map keys:
# the encoding as it was when the codec was a hand-written pair of functions; a change to the codec
# or to the schema that changes one byte of a message fails here
PINNED = [
    "62e1d2c050ec0154f01271b1ece3792f965504b322d15e1a377b621d642c275e",  # JobSetup
    "cbb6dd163ac0a15370204361c225bb1d834eaedb7426c5346a419c14746935a7",  # JobSetup
    "4cd1b1ab3adbf7c1b55f6df564b9bd6836f714c7e124cb61e1a8feea4086148d",  # DomainModelSpec
    "83e6e6e38dfcee211df613105d52c9a1fb59bf9dbd4648467650486e8b53d815",  # DomainModelSpec
    "31bb0aa8a898d8b7d83d7308cb33a3e68431fa8c33317a826860fda37fa6173f",  # ShardSetup
    "a28f7443c052d4bae7aeb832d6d35dda23fc3c8fe26ed4df34ab4f06e6754e17",  # ThetaRequest
    "5109be6dafdded213ed9407f316d7f5d4c2bf5b2ce3dcf516437bff4e2ee7395",  # RowRange
    "bd9ece6a61ff39c5a5677af7fcc95ddba4954e7ab5e48c501537077a1cccce72",  # QhatBroadcast
    "018a2de946a2531cc8fd3d7ef7af98ed3aca218b7104afc198cc4a768706aee1",  # DCRequest
    "b487d4d7f75acc9af4b7688915b616be2def6ffa3fbff1d6c01bd9f346c44b51",  # ChannelOffer
    "b0211f382397b13c1ffdbfeef48d921e29ed87560976e9ce7fccb276cca85e85",  # HarmRequest
    "b4e246926145fdd880832de7ea6279af05f7c29ced52a75da6323f1e1c7b0d3b",  # SiteInfo
    "d2b54c6cad671e8781979b6f37a3a2c32552b8077a907f45c63644627d80554e",  # SiteInfo
    "28050b750c97f9dde298bf9233b3a27d7d797b6702c9a8624a38ec88f0323235",  # UnlabeledSample
    "5bce3ddb05a88ca83537ac38241a740f12066c4fa1cdc343c2b1409103ed24ff",  # GradSum
    "02c0a9c062fbb95a4e54a1a8d1c0370b9bf3232bd8875ffba310170fdf12c419",  # QhatPartial
    "84a316b10d93a77b576a324e15eb27b7385464ad2ef073eed75d4a65b0b8cd00",  # QhatPartial
    "2dc9b333d4cc7073d490377ddbd952ba842901b6a0c47bba27a1c0e1d0e484ea",  # DCPartial
    "252b5887fe15890517ec3f54bcf22b911ee05f5c5f4f776c5ee056d951fcdb84",  # DCPartial
    "bca296e1e7931b2cae3c3d1b3b74633fe8c4479b15daccf94292a6015c7b90fb",  # BoundMax
    "e4e92977706f257c94aeddd34448b6f740a95f174f30cc22e61380e52b934078",  # Ack
    "007f2670b4932bcb00dbe130fc05c066db73855afe4246a453e2ab3bf1d6dc5f",  # ChannelAddress
    "ec6234d85e0432a7e99e4d837a0451b087a65eb3fd5acf9cf2dd72aedd29c7fa",  # HarmAnswer
]


def test_the_encoding_of_every_sample_is_pinned():
    got = [
        hashlib.sha256(wire.to_proto("some_method", msg, allowed).SerializeToString(deterministic=True)).hexdigest()
        for allowed, msgs in ((wire.REQUESTS, REQUESTS), (wire.RESPONSES, RESPONSES))
        for msg in msgs
    ]
    assert got == PINNED
    # the bytes sent are those bytes but for the order of map entries (a feature map's)
    for allowed, msgs in ((wire.REQUESTS, REQUESTS), (wire.RESPONSES, RESPONSES)):
        for msg in msgs:
            frame = wire.encode("some_method", msg, allowed)
            assert wire.to_proto("some_method", msg, allowed) == type(wire.to_proto("x", None, allowed)).FromString(
                frame
            )


# ------------------------------------------------------------------ messages generated from the table
def _body(cls) -> tuple[type, object]:
    """(envelope, proto descriptor of the body) of a message type."""
    envelope = pb.SiteRequest if cls in m.REQUEST_TYPES else pb.SiteResponse
    return envelope, envelope.DESCRIPTOR.fields_by_name[wire.SCHEMA[cls][0]].message_type


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
ARRAYS = hnp.arrays(
    st.sampled_from(sorted(wire.DTYPES)), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
)
INT64 = st.integers(-(2**63), 2**63 - 1)
PARAMS = st.none() | st.booleans() | INT64 | st.floats() | TEXT
FEATURE_MAPS = st.tuples(TEXT, st.dictionaries(TEXT, PARAMS, max_size=3), st.dictionaries(TEXT, ARRAYS, max_size=3))
NUMERIC = st.none() | ARRAYS | st.floats()
KIND_VALUES = {
    wire.STR: TEXT,
    wire.FLOAT: st.floats(),
    wire.BOOL: st.booleans(),
    wire.NEGATED: st.booleans(),
    wire.OPT_FLOAT: st.none() | st.floats(),
    wire.STRS: st.lists(TEXT, max_size=4).map(tuple),
    wire.ARRAY: ARRAYS,
    wire.OPT_ARRAY: st.none() | ARRAYS,
    wire.ARRAYS: st.lists(ARRAYS, max_size=3).map(tuple),
    wire.FEATURE_MAP: st.none() | FEATURE_MAPS,
    wire.DC_SUMS: st.builds(DCSums, L=NUMERIC, dL=NUMERIC, u=NUMERIC, du=NUMERIC, v=NUMERIC, dv=NUMERIC, n=INT64),
    wire.EPSILON: st.floats(min_value=0, allow_infinity=False),
    wire.IN_PROCESS: st.none(),
}


def _values(cls, f: wire.Field):
    if f.kind in (wire.INT, wire.OPT_INT):  # the proto field's width
        bits = 31 if _body(cls)[1].fields_by_name[f.name].type == FieldDescriptor.TYPE_INT32 else 63
        ints = st.integers(-(2**bits), 2**bits - 1)
        return ints if f.kind is wire.INT else st.none() | ints
    return KIND_VALUES[f.kind]


def messages(cls):
    """Messages of type ``cls``, each field's values from its kind in the table and, where the
    dataclass says the field may be None (its default), None as well: a wrong kind fails."""
    may_be_none = {f.name for f in fields(cls) if f.default is None}
    return st.builds(
        cls,
        **{
            f.name: st.none() | _values(cls, f) if f.name in may_be_none else _values(cls, f)
            for f in wire.SCHEMA[cls][1]
        },
    )


@pytest.mark.parametrize("cls", list(wire.SCHEMA), ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_generated_from_the_table_round_trips(cls, data):
    """Through the codec, and pickled (how a message travels inside one party, on Ray)."""
    msg = data.draw(messages(cls))
    allowed = wire.REQUESTS if cls in m.REQUEST_TYPES else wire.RESPONSES
    method, got = wire.decode(wire.encode("some_method", msg, allowed), allowed)
    assert method == "some_method" and _equal(msg, got), (msg, got)
    assert _equal(msg, pickle.loads(pickle.dumps(msg)))


def test_the_table_holds_every_field_of_every_message_and_of_its_proto():
    assert set(wire.SCHEMA) == set(m.REQUEST_TYPES) | set(m.RESPONSE_TYPES)
    for cls, (_, row) in wire.SCHEMA.items():
        assert [f.name for f in row] == [f.name for f in fields(cls)], cls
        proto = set(_body(cls)[1].fields_by_name)
        assert proto == {f.proto for f in row if f.kind is not wire.IN_PROCESS}, cls
    assert set(KIND_VALUES) | {wire.INT, wire.OPT_INT} >= {f.kind for _, row in wire.SCHEMA.values() for f in row}


def test_a_field_missing_from_the_proto_or_the_dataclass_is_refused():
    body = pb.RowRange.DESCRIPTOR

    @dataclass(frozen=True)
    class WithExtra(m.Message):
        start: int
        stop: int
        step: int = 1

    @dataclass(frozen=True)
    class WithoutStop(m.Message):
        start: int

    @dataclass(frozen=True)
    class Renamed(m.Message):
        start: int
        end: int

    for cls in (WithExtra, Renamed):
        with pytest.raises(TypeError, match="no field in the proto message RowRange"):
            wire.fields_of(cls, body)
    with pytest.raises(TypeError, match="RowRange has fields that WithoutStop lacks: \\['stop'\\]"):
        wire.fields_of(WithoutStop, body)
    assert wire.fields_of(m.RowRange, body) == (("start", wire.INT, "start"), ("stop", wire.INT, "stop"))


# every field of every message that holds a peer's array (cls, name, kind)
ARRAY_FIELDS = [
    (cls, f.name, f.kind)
    for cls, (_, row) in wire.SCHEMA.items()
    for f in row
    if f.kind in (wire.ARRAY, wire.OPT_ARRAY, wire.ARRAYS)
]


def _empty(cls):
    """An envelope holding an empty body of type ``cls``, and the direction it belongs to."""
    envelope, _ = _body(cls)
    out = envelope(method="x")
    getattr(out, wire.SCHEMA[cls][0]).SetInParent()
    return out, (wire.REQUESTS if cls in m.REQUEST_TYPES else wire.RESPONSES)


@pytest.mark.parametrize("cls,name,kind", ARRAY_FIELDS, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize(
    "array,match",
    [
        (pb.NdArray(dtype="<f8", shape=[3], data=bytes(23)), "does not fill"),
        (pb.NdArray(dtype="<f8", shape=[2**40, 2**40], data=bytes(16)), "does not fill"),
        (pb.NdArray(dtype="<f8", shape=[-1], data=b""), "not allowed"),
        (pb.NdArray(dtype="<f8", shape=[1] * 9, data=bytes(8)), "not allowed"),
        (pb.NdArray(dtype="|O8", shape=[1], data=bytes(8)), "not allowed"),
        (pb.NdArray(dtype="<U2", shape=[1], data=bytes(8)), "not allowed"),
    ],
)
def test_a_malformed_array_is_refused_in_every_array_field(cls, name, kind, array, match):
    envelope, allowed = _empty(cls)
    target = getattr(getattr(envelope, wire.SCHEMA[cls][0]), name)
    (target.add() if kind is wire.ARRAYS else target).CopyFrom(array)
    with pytest.raises(wire.WireError, match=match):
        wire.decode(envelope.SerializeToString(), allowed)


@pytest.mark.parametrize(
    "cls,name", [(c, n) for c, n, k in ARRAY_FIELDS if k is wire.ARRAY], ids=lambda x: getattr(x, "__name__", x)
)
def test_a_required_array_left_out_is_refused(cls, name):
    envelope, allowed = _empty(cls)
    with pytest.raises(wire.WireError, match=f"{name} is missing"):
        wire.decode(envelope.SerializeToString(), allowed)


def test_what_may_not_cross_is_refused():
    with pytest.raises(wire.WireError, match="only in-process"):
        wire.encode("x", m.DomainModelSpec(kind="maxent", n_sources=2, custom_feature_map=object()), wire.REQUESTS)
    with pytest.raises(wire.WireError, match="dtype"):
        wire.encode(
            "x",
            m.SiteInfo(name="a", n_features=1, n_labeled=1, n_unlabeled=1, task="c", classes=np.array(["yes", "no"])),
            wire.RESPONSES,
        )
    with pytest.raises(wire.WireError, match="parameter"):
        wire.encode(
            "x",
            m.ShardSetup(feature_map=("standard", {"f": object()}, {}), custom_feature_map=None, n_sources=2),
            wire.REQUESTS,
        )
    with pytest.raises(wire.WireError, match="not a message that may cross"):
        wire.to_proto("x", m.BoundMax(1.0), wire.REQUESTS)
    with pytest.raises(wire.WireError, match="not an identifier"):
        wire.to_proto("../etc", None, wire.REQUESTS)
    # a request decoded as a response (and the reverse) is refused
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode("x", REQUESTS[0], wire.REQUESTS), wire.RESPONSES)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode("x", RESPONSES[0], wire.RESPONSES), wire.REQUESTS)
    # a peer's malformed feature-map array
    bad = pb.SiteRequest(
        method="x",
        shard_setup=pb.ShardSetup(
            feature_map=pb.FeatureMap(
                name="standard", arrays={"mean": pb.NdArray(dtype="<f8", shape=[3], data=b"\x00" * 7)}
            )
        ),
    )
    with pytest.raises(wire.WireError, match="does not fill"):
        wire.from_proto(bad, wire.REQUESTS)


def test_a_site_failure_decodes_as_a_remote_error():
    method, err = wire.decode(wire.encode_error("PrivacyError", "too few\npoints"), wire.RESPONSES)
    assert method == "" and isinstance(err, wire.RemoteError) and err.kind == "PrivacyError"
    assert err.text == "too few points"


EPSILONS = [cls for cls, (_, row) in wire.SCHEMA.items() if any(f.kind is wire.EPSILON for f in row)]


@pytest.mark.parametrize("cls", EPSILONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("epsilon", [-1.0, -1e-300, float("nan"), float("inf")])
def test_an_epsilon_that_is_no_budget_is_refused(cls, epsilon):
    """A site's epsilon spent is a finite number >= 0; anything else from a peer is malformed,
    in every message that reports one."""
    good = next(x for x in RESPONSES if type(x) is cls)
    out = wire.to_proto("dc_evaluate", good, wire.RESPONSES)
    getattr(out, wire.SCHEMA[cls][0]).epsilon = epsilon
    with pytest.raises(wire.WireError, match="epsilon"):
        wire.from_proto(out, wire.RESPONSES)
    assert {QhatPartial_or_more.__name__ for QhatPartial_or_more in EPSILONS} >= {
        "DCPartial",
        "QhatPartial",
        "HarmAnswer",
    }


def test_a_policy_refusal_crosses_typed():
    """A PrivacyError keeps its rule and site through the boundary codec (the relay and the data
    channel): the job reports it as the site's refusal under that rule."""
    from msa_fed.errors import PrivacyError

    refusal = PrivacyError("concentration", "east", "the domain model: 0.4 of the weight on one point")
    method, err = wire.decode(wire.encode_failure(refusal), wire.RESPONSES)
    assert method == "" and isinstance(err, wire.RemoteError) and err.kind == "PrivacyError"
    typed = err.exception()
    assert isinstance(typed, PrivacyError) and (typed.rule, typed.site) == ("concentration", "east")
    assert str(typed) == str(refusal) and "\n" not in str(typed)
    # any other failure stays a RemoteError with the type's name only
    _, other = wire.decode(wire.encode_failure(ValueError("x")), wire.RESPONSES)
    assert other.kind == "ValueError" and other.rule == "" and other.exception() is other


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_raise_only_wire_error(data, request_direction):
    allowed = wire.REQUESTS if request_direction else wire.RESPONSES
    try:
        wire.decode(data, allowed)
    except wire.WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), st.binary(min_size=1, max_size=6), st.sampled_from(range(len(REQUESTS))))
def test_corrupted_requests_raise_only_wire_error(pos, junk, k):
    frame = bytearray(wire.encode("dc_evaluate", REQUESTS[k], wire.REQUESTS))
    pos = min(pos, len(frame) - 1)
    frame[pos : pos + len(junk)] = junk
    try:
        wire.decode(bytes(frame), wire.REQUESTS)
    except wire.WireError:
        pass
