"""boundary.proto as the one codec of the boundary messages (no Ray, no network).

- every request and response type of msa_fed.boundary.messages round-trips through the protobuf
  schema bit for bit (arrays with their dtype and shape), including the federated JobSetup and
  the domain model with its feature map;
- the schema refuses what may not cross: in-process objects, strings or objects in arrays,
  a response type sent as a request, a malformed array from a peer;
- random bytes and random protobuf messages of either envelope decode to a boundary message or
  raise WireError, never anything else.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("epsilon", [-1.0, float("nan"), float("inf")])
def test_an_epsilon_that_is_no_budget_is_refused(epsilon):
    """A site's epsilon spent is a finite number >= 0; anything else from a peer is malformed."""
    bad = pb.SiteResponse(method="dc_evaluate", dc=pb.DCPartial(sums=pb.DCSums(n=41), epsilon=epsilon))
    with pytest.raises(wire.WireError, match="epsilon"):
        wire.from_proto(bad, wire.RESPONSES)


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
