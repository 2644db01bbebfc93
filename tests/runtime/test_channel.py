"""The direct data channel and its wire format, without Ray: real sockets on loopback, real TLS.

- the wire codec round-trips every message the channel carries bit for bit, and rejects anything
  else (other types, object arrays, bytes outside the frame, pickle, garbage) with WireError;
- a site served over the channel answers exactly what the worker's own method returns;
- only the pinned coordinator certificate gets answers; a client pinned to the wrong site
  certificate refuses the site; plaintext is refused off loopback; methods other than the
  per-round ones are refused; a site's own error comes back as its error type.
"""

from __future__ import annotations

import pickle
import socket
import ssl

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_fed.core.dc_terms import DCSums
from msa_fed.core.features import StandardFeatures, feature_map_state
from msa_fed.errors import ConfigError
from msa_fed.boundary import channel as ch
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.site.worker import SiteWorker
from problems import make_sites, site_kwargs


def _same(a, b):
    """Bitwise equality of two decoded messages (arrays compared with their dtype and shape)."""
    assert type(a) is type(b)
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, DCSums):
            for g in x.__dataclass_fields__:
                _same_value(getattr(x, g), getattr(y, g))
        else:
            _same_value(x, y)


def _same_value(x, y):
    if isinstance(x, np.ndarray):
        assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
    elif isinstance(x, float) and np.isnan(x):
        assert isinstance(y, float) and np.isnan(y)
    else:
        assert x == y and type(x) is type(y)


RNG = np.random.default_rng(0)
SUMS = DCSums(L=RNG.normal(size=3), dL=RNG.normal(size=(3, 3)), u=None, du=None, v=1.5, dv=RNG.normal(size=3))
MESSAGES = [
    ("dc_evaluate", m.DCRequest(z=np.array([0.2, 0.3, 0.5]), eta=0.01, what=("L", "dL"), global_bound=None), True),
    ("dc_evaluate", m.DCRequest(z=np.array([1.0, 0.0]), eta=0.0, what=(), global_bound=float("inf")), True),
    ("classifier_loss_grad", m.ThetaRequest(theta=RNG.normal(size=15).astype(np.float32), step=7, batch_size=16), True),
    ("classifier_loss_grad", m.ThetaRequest(theta=RNG.normal(size=(0,))), True),
    ("dc_evaluate", m.DCPartial(sums=SUMS), False),
    ("classifier_loss_grad", m.GradSum(loss=float("nan"), grad=RNG.normal(size=15), n=41), False),
    ("max_bound", m.BoundMax(value=-0.0), False),
    ("ping", m.Ack(incarnation="abc", node_id=""), False),
]


@pytest.mark.parametrize("method,msg,request_", MESSAGES, ids=[type(x[1]).__name__ for x in MESSAGES])
def test_wire_round_trips_bit_for_bit(method, msg, request_):
    allowed = wire.REQUESTS if request_ else wire.RESPONSES
    got_method, got = wire.decode(wire.encode(method, msg, allowed), allowed)
    assert got_method == method
    _same(msg, got)
    assert wire.decode(wire.encode("ping", None, allowed), allowed) == ("ping", None)


def test_wire_refuses_what_may_not_cross():
    # a response type in the request direction, and the reverse
    with pytest.raises(wire.WireError, match="not a message that may cross"):
        wire.encode("dc_evaluate", m.DCPartial(sums=SUMS), wire.REQUESTS)
    frame = wire.encode("dc_evaluate", m.DCPartial(sums=SUMS), wire.RESPONSES)
    with pytest.raises(wire.WireError, match="not a message that may cross"):
        wire.decode(frame, wire.REQUESTS)
    # an object array cannot be sent
    with pytest.raises(wire.WireError, match="dtype object"):
        wire.encode("dc_evaluate", m.DCRequest(z=np.array([object()]), eta=0.0, what=()), wire.REQUESTS)
    # a pickled message is not a frame
    with pytest.raises(wire.WireError):
        wire.decode(pickle.dumps(m.BoundMax(1.0)), wire.RESPONSES)


def _response(**kw) -> bytes:
    """A hand-built SiteResponse, as a hostile peer could send it."""
    from msa_fed.boundary.proto import boundary_pb2 as pb

    return pb.SiteResponse(**kw).SerializeToString()


def _grad(dtype="<f8", shape=(2,), data=bytes(16)) -> dict:
    from msa_fed.boundary.proto import boundary_pb2 as pb

    return dict(method="x", grad=pb.GradSum(loss=1.0, n=1, grad=pb.NdArray(dtype=dtype, shape=shape, data=data)))


@pytest.mark.parametrize(
    "frame,match",
    [
        (b"", "no body"),
        (b"\xff\xff\xff", "not a SiteResponse"),
        (b"\x0a\x05ab", "not a SiteResponse"),  # a length running past the end
        (_response(method="max_bound"), "no body"),
        (_response(bound={"value": 1.0}), "names no method"),
        (_response(method="Max Bound!", bound={"value": 1.0}), "names no method"),
        (_response(**_grad(dtype="|O8")), "not allowed"),
        (_response(**_grad(dtype="<U4")), "not allowed"),
        (_response(**_grad(dtype="f8,i4")), "not allowed"),
        (_response(**_grad(shape=(3,))), "fill"),
        (_response(**_grad(shape=(-2, -1))), "not allowed"),
        (_response(**_grad(shape=(1,) * 9, data=bytes(8))), "not allowed"),
        (_response(**_grad(shape=(2**40, 2**40), data=bytes(16))), "fill"),
        (_response(method="x", grad={"loss": 1.0}), "grad is missing"),
        (_response(method="dc_evaluate", dc={}), "malformed DC sums"),
        (_response(method="dc_evaluate", dc={"sums": {"L": {}}}), "empty"),
    ],
)
def test_wire_rejects_malformed_frames(frame, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frame, wire.RESPONSES)


def test_wire_refuses_a_custom_feature_map_object():
    with pytest.raises(wire.WireError, match="only in-process"):
        wire.encode(
            "setup_shard",
            m.ShardSetup(feature_map=None, custom_feature_map=StandardFeatures(), n_sources=2),
            wire.REQUESTS,
        )


def test_every_boundary_type_is_in_the_schema():
    """Each request and response type of msa_fed.boundary.messages has its place in boundary.proto."""
    for cls in m.REQUEST_TYPES:
        assert cls in wire._REQUEST_FIELDS, cls
    for cls in m.RESPONSE_TYPES:
        assert cls in wire._RESPONSE_FIELDS, cls


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_wire_decode_of_garbage_raises_only_wire_error(data):
    try:
        wire.decode(data, wire.RESPONSES)
    except wire.WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 120), st.binary(min_size=1, max_size=8))
def test_wire_decode_of_a_corrupted_frame_raises_only_wire_error(pos, junk):
    frame = bytearray(wire.encode("dc_evaluate", m.DCPartial(sums=SUMS), wire.RESPONSES))
    pos = min(pos, len(frame) - 1)
    frame[pos : pos + len(junk)] = junk
    try:
        wire.decode(bytes(frame), wire.RESPONSES)
    except wire.WireError:
        pass


# ------------------------------------------------------------------ a served site
@pytest.fixture(scope="module")
def worker():
    """A site worker ready for DC evaluations and classifier steps (no Ray)."""
    from msa_fed.privacy.policy import SitePolicy

    sites = make_sites()
    kw = site_kwargs(sites)[1]
    kw["policy"] = SitePolicy(verify_domain_models=False)  # a random theta: the channel is tested here
    w = SiteWorker(**kw)
    fmap = StandardFeatures().fit(np.vstack([s.X_unlabeled for s in sites]))
    state = feature_map_state(fmap)
    w.setup_shard(m.ShardSetup(feature_map=state, custom_feature_map=None, n_sources=3))
    theta = np.random.default_rng(1).normal(size=15) * 0.1
    w.set_domain_model(m.DomainModelSpec(kind="maxent", n_sources=3, feature_map=state, theta=theta))
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.3, 0.3, 0.4]), eta=0.01))
    return w


@pytest.fixture(scope="module")
def coordinator_identity():
    return ch.make_identity("test coordinator")


@pytest.fixture
def served(worker, coordinator_identity):
    address = worker.open_channel(m.ChannelOffer(mode="tls", peer_cert=coordinator_identity[0]))
    yield address
    worker._channel_server.close()


def test_channel_answers_exactly_what_the_worker_returns(worker, served, coordinator_identity):
    client = ch.ChannelClient(served, "tls", coordinator_identity, timeout_s=10)
    try:
        for z in (np.array([0.2, 0.3, 0.5]), np.array([1.0, 0.0, 0.0])):
            req = m.DCRequest(z=z, eta=0.01, what=("L", "dL", "u", "du", "v", "dv"))
            client.send("dc_evaluate", req)
            _same(client.receive("dc_evaluate"), worker.dc_evaluate(req))
        for step in (None, 3):
            req = m.ThetaRequest(theta=np.linspace(-1, 1, 15), step=step, batch_size=8)
            client.send("classifier_loss_grad", req)
            _same(client.receive("classifier_loss_grad"), worker.classifier_loss_grad(req))
        client.send("max_bound", None)
        _same(client.receive("max_bound"), worker.max_bound())
        client.send("ping", None)
        assert client.receive("ping").incarnation == worker.incarnation
    finally:
        client.close()
    assert isinstance(client.sock, ssl.SSLSocket) and client.sock.version() in (None, "TLSv1.3")


def test_only_the_pinned_coordinator_gets_answers(served):
    intruder = ch.make_identity("intruder")
    with pytest.raises((ssl.SSLError, ch.ChannelError, OSError)):
        client = ch.ChannelClient(served, "tls", intruder, timeout_s=5)
        client.send("ping", None)  # TLS 1.3: a refused client certificate shows at the first read
        client.receive("ping")
    # plaintext to the TLS listener: the site never answers with a message
    raw = socket.create_connection((served.host, served.port), timeout=5)
    try:
        raw.sendall(len(b"x").to_bytes(8, "big") + b"x")
        data = raw.recv(64)
        assert not data or data[0] in (0x15, 0x16)  # TLS alert / handshake bytes, never a frame
    except OSError:
        pass
    finally:
        raw.close()


def test_the_client_refuses_a_site_with_another_certificate(served, coordinator_identity):
    impostor_cert, _ = ch.make_identity("impostor")
    wrong = m.ChannelAddress(host=served.host, port=served.port, cert=impostor_cert)
    with pytest.raises(ssl.SSLError):
        ch.ChannelClient(wrong, "tls", coordinator_identity, timeout_s=5)


def test_plaintext_only_on_loopback(worker):
    address = worker.open_channel(m.ChannelOffer(mode="plain"))
    try:
        assert address.host == "127.0.0.1" and address.cert == ""
        client = ch.ChannelClient(address, "plain", None, timeout_s=5)
        client.send("ping", None)
        assert client.receive("ping").incarnation == worker.incarnation
        client.close()
        remote = m.ChannelAddress(host="10.1.2.3", port=address.port)
        with pytest.raises(ConfigError, match="only on loopback"):
            ch.ChannelClient(remote, "plain", None, timeout_s=5)
    finally:
        worker._channel_server.close()
    with pytest.raises(ConfigError, match="data_channel must be one of"):
        ch.check_mode("udp")


def test_only_per_round_methods_and_site_errors_come_back_typed(served, coordinator_identity):
    client = ch.ChannelClient(served, "tls", coordinator_identity, timeout_s=10)
    try:
        with pytest.raises(ValueError, match="does not go over the data channel"):
            client.send("set_qhat", m.QhatBroadcast(qhat=np.ones(3) / 3, eta=0.0))
        # a forged frame asking for another method is refused by the site
        frame = wire.encode("set_qhat", m.QhatBroadcast(qhat=np.ones(3) / 3, eta=0.0), wire.REQUESTS)
        client.sock.sendall(len(frame).to_bytes(8, "big") + frame)
        with pytest.raises(wire.RemoteError, match="not served over the data channel"):
            client.receive("set_qhat")
        # the worker's own error keeps its type name
        client.send("classifier_loss_grad", m.ThetaRequest(theta=np.zeros(4)))
        with pytest.raises(wire.RemoteError) as info:
            client.receive("classifier_loss_grad")
        assert info.value.kind != "WireError"
        # the connection still works after errors
        client.send("ping", None)
        assert isinstance(client.receive("ping"), m.Ack)
    finally:
        client.close()


def test_a_fresh_worker_reports_lost_state_over_the_channel(coordinator_identity):
    w = SiteWorker(**site_kwargs(make_sites())[0])
    address = w.open_channel(m.ChannelOffer(mode="tls", peer_cert=coordinator_identity[0]))
    client = ch.ChannelClient(address, "tls", coordinator_identity, timeout_s=10)
    try:
        client.send("dc_evaluate", m.DCRequest(z=np.ones(3) / 3, eta=0.01, what=("L",)))
        with pytest.raises(wire.RemoteError) as info:
            client.receive("dc_evaluate")
        assert info.value.kind == "SiteStateLost"
    finally:
        client.close()
        w._channel_server.close()


def test_oversized_frames_are_refused(served, coordinator_identity):
    client = ch.ChannelClient(served, "tls", coordinator_identity, timeout_s=5)
    try:
        client.sock.sendall((ch.MAX_FRAME_BYTES + 1).to_bytes(8, "big"))
        with pytest.raises(ch.ChannelError):
            client.receive("ping")  # the site drops the connection
    finally:
        client.close()


def test_stray_connections_do_not_use_up_the_server(served, coordinator_identity):
    """Connections that never finish a handshake take at most MAX_CONNECTIONS slots, given back
    when they close; the pinned coordinator is served afterwards."""
    strays = [socket.create_connection((served.host, served.port), timeout=5) for _ in range(2 * ch.MAX_CONNECTIONS)]
    for s in strays:
        s.close()
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            client = ch.ChannelClient(served, "tls", coordinator_identity, timeout_s=5)
            client.send("ping", None)
            assert isinstance(client.receive("ping"), m.Ack)
            client.close()
            break
        except (OSError, ssl.SSLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_node_can_confine_the_channel_to_a_port_range(worker, coordinator_identity, monkeypatch):
    """MSA_FED_CHANNEL_PORTS on a site's node: the channel listens in that range (for firewalls);
    a full range is an OSError (the coordinator then goes through Ray); a bad value is a clear
    ConfigError."""
    with socket.socket() as probe:  # a free port to start the range at
        probe.bind(("127.0.0.1", 0))
        low = probe.getsockname()[1]
    monkeypatch.setenv(ch.PORTS_ENV, f"{low}-{low + 3}")
    offer = m.ChannelOffer(mode="tls", peer_cert=coordinator_identity[0])
    servers = []
    try:
        address = worker.open_channel(offer)
        assert low <= address.port <= low + 3
        client = ch.ChannelClient(address, "tls", coordinator_identity, timeout_s=5)
        client.send("ping", None)
        assert isinstance(client.receive("ping"), m.Ack)
        client.close()
        taken = [ch.ChannelServer(worker, "x", offer, "127.0.0.1") for _ in range(3)]  # the rest of the range
        servers.extend(taken)
        assert sorted(s.port for s in taken + [worker._channel_server]) == list(range(low, low + 4))
        with pytest.raises(OSError, match="no free port"):
            ch.ChannelServer(worker, "x", offer, "127.0.0.1")
        for bad in ("20000-10", "abc", "0-5", "70000"):
            monkeypatch.setenv(ch.PORTS_ENV, bad)
            with pytest.raises(ConfigError, match=ch.PORTS_ENV):
                ch.ChannelServer(worker, "x", offer, "127.0.0.1")
    finally:
        for s in servers:
            s.close()
        worker._channel_server.close()


def test_a_site_on_an_ipv6_address_is_served(worker, coordinator_identity):
    if not socket.has_ipv6:
        pytest.skip("this machine has no IPv6 stack")
    try:
        server = ch.ChannelServer(worker, "v6", m.ChannelOffer(mode="tls", peer_cert=coordinator_identity[0]), "::1")
    except OSError as exc:  # IPv6 compiled in but no ::1 configured (some containers)
        pytest.skip(f"::1 is not usable here: {exc}")
    try:
        client = ch.ChannelClient(server.address(), "tls", coordinator_identity, timeout_s=5)
        client.send("ping", None)
        assert client.receive("ping").incarnation == worker.incarnation
        client.close()
    finally:
        server.close()
