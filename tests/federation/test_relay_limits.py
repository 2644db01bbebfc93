"""The relay in-process (a real gRPC server on port 0, raw site streams, no site processes):
it never lets site streams take every worker thread of the registry, heartbeats on the stream
are recorded as the site's heartbeat, and a site cannot answer calls it was not sent."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer
from msa_fed.federation.relay_client import RelayClient
from msa_fed.runtime.federated import TRANSIENT, SiteUnreachable


@pytest.fixture
def registry(tmp_path):
    store = SqliteStore(tmp_path / "r.db")
    reg = Registry(store)
    yield reg
    store.close()


class RawSite:
    """A site stream opened by hand; ``answer(forward)`` gives the response (None: stay silent)."""

    def __init__(self, address, token, name, answer=None):
        self.channel = grpc.insecure_channel(address)
        self.out: queue.Queue = queue.Queue()
        self.out.put(pb.SiteToRelay(hello=pb.Hello(site=name)))
        self.call = pb_grpc.RelayStub(self.channel).Connect(
            iter(self.out.get, None), metadata=(("authorization", f"Bearer {token}"),)
        )
        self.answer = answer
        self.error = None
        self.forwards = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            for msg in self.call:
                if msg.WhichOneof("part") == "forward":
                    self.forwards.append(msg.forward)
                    if self.answer is not None:
                        self.out.put(self.answer(msg.forward))
        except grpc.RpcError as exc:
            self.error = exc

    def close(self):
        self.out.put(None)
        self.channel.close()


def _wait(cond, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_site_streams_never_take_every_worker(registry):
    names = ["a", "b", "c"]
    tokens = {n: registry.issue_token("site", n) for n in names}
    for n in names:
        registry.store.register_site(n, {}, time.time())
    admin = registry.issue_token("admin", "operator")
    with RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=10) as server:
        assert server.relay.max_streams == 2
        server.relay.silence_timeout_s = 600
        sites = [RawSite(server.address, tokens[n], n) for n in names]
        try:
            _wait(lambda: any(s.error is not None for s in sites))
            (refused,) = [s for s in sites if s.error is not None]
            assert refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--workers" in refused.error.details()
            assert len(server.relay.connected()) == 2
            # the registry still answers the job
            with RelayClient(server.address, admin, insecure=True) as relay:
                assert len(relay.list_connected()) == 2
        finally:
            for s in sites:
                s.close()


def test_stream_heartbeats_are_recorded_and_answers_must_match_a_call(registry):
    tokens = {n: registry.issue_token("site", n) for n in ("a", "b")}
    for n in tokens:
        registry.store.register_site(n, {}, time.time())
    admin = registry.issue_token("admin", "operator")
    ack = wire.to_proto("ping", m.Ack("real"), wire.RESPONSES)
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        server.relay.heartbeat_interval_s = 0.2

        # b answers every forward it gets, and also tries to answer a's calls by guessing ids
        def b_answer(fwd):
            for guess in range(max(1, fwd.call_id - 3), fwd.call_id + 4):
                if guess == fwd.call_id:
                    continue
                b.out.put(
                    pb.SiteToRelay(
                        answer=pb.Answer(call_id=guess, response=wire.to_proto("ping", m.Ack("forged"), wire.RESPONSES))
                    )
                )
            return pb.SiteToRelay(answer=pb.Answer(call_id=fwd.call_id, response=ack))

        a = RawSite(server.address, tokens["a"], "a")  # a stays silent
        b = RawSite(server.address, tokens["b"], "b", b_answer)
        try:
            _wait(lambda: sorted(server.relay.connected()) == ["a", "b"])
            before = registry.store.get_site("a").last_heartbeat or 0.0
            time.sleep(0.3)
            a.out.put(pb.SiteToRelay(heartbeat=pb.Heartbeat(sent_at=time.time())))
            _wait(lambda: (registry.store.get_site("a").last_heartbeat or 0.0) > before)
            with RelayClient(server.address, admin, insecure=True) as relay:
                relay.open_job("j", ["a", "b"])
                res = relay.call("j", [("a", "ping", None), ("b", "ping", None)], 2.0)
            assert isinstance(res[0], SiteUnreachable) and res[0].status == "DEADLINE_EXCEEDED"
            assert isinstance(res[1], m.Ack) and res[1].incarnation == "real"
        finally:
            a.close()
            b.close()


def test_a_call_in_flight_when_the_registry_stops_is_an_unreachable_site(tmp_path):
    """An operator's restart (SIGTERM: the server stops with its grace) cancels the relay calls in
    flight; the job sees its sites as unreachable for that round and retries, never an error."""
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    admin = registry.issue_token("admin", "admin")
    token = registry.issue_token("site", "a")
    registry.store.register_site("a", {}, time.time())
    server = RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=16).start()
    site = RawSite(server.address, token, "a")  # connected, never answers: the call stays in flight
    try:
        _wait(lambda: sorted(server.relay.connected()) == ["a"])
        relay = RelayClient(server.address, admin, insecure=True)
        relay.open_job("j-1", ["a"])
        got: list = []
        caller = threading.Thread(target=lambda: got.append(relay.call("j-1", [("a", "ping", None)], 30.0)))
        caller.start()
        _wait(lambda: len(site.forwards) == 1)  # the call reached the site: it is in flight
        server.stop(0.2)
        caller.join(30)
        assert not caller.is_alive() and len(got) == 1, "the call raised instead of answering"
        assert isinstance(got[0][0], SiteUnreachable) and got[0][0].status in TRANSIENT, got
        relay.close()
    finally:
        site.close()
        server.stop(0)
        store.close()


def test_a_registry_that_cancels_the_call_is_an_unreachable_round():
    """A registry process shutting down can end a call in flight with CANCELLED (not only
    UNAVAILABLE): that is the registry going away, so the round's sites are unreachable and the
    job retries them; it never ends the job."""
    from concurrent import futures

    class Stopping(pb_grpc.RelayServicer):
        def OpenJob(self, request, context):
            return pb.OpenJobResponse(connected=list(request.sites))

        def Call(self, request, context):
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RelayServicer_to_server(Stopping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RelayClient(f"127.0.0.1:{port}", "t", insecure=True) as relay:
            relay.open_job("j", ["a", "b"])
            res = relay.call("j", [("a", "ping", None), ("b", "ping", None)], 1.0)
        assert [type(r) for r in res] == [SiteUnreachable, SiteUnreachable]
        assert all(r.status in TRANSIENT for r in res), res
    finally:
        server.stop(0)


def test_each_forward_is_refused_once_its_site_lost_its_right_and_the_others_are_answered(registry):
    """The relay checks all the sites of a Call at once; a site whose token was revoked, whose
    token was replaced, or that was deregistered is refused in that very Call (not at the next
    sweep), naming the reason, and the other sites of the Call are still answered."""
    names = ["a", "b", "c", "d"]
    tokens = {n: registry.issue_token("site", n) for n in names}
    for n in names:
        registry.store.register_site(n, {}, time.time())
    admin = registry.issue_token("admin", "operator")
    ack = wire.to_proto("ping", m.Ack("real"), wire.RESPONSES)
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        server.relay.sweep_interval_s = 3600  # the sweep must not be what refuses them
        sites = {
            n: RawSite(
                server.address,
                tokens[n],
                n,
                lambda f: pb.SiteToRelay(answer=pb.Answer(call_id=f.call_id, response=ack)),
            )
            for n in names
        }
        try:
            _wait(lambda: sorted(server.relay.connected()) == names)
            with RelayClient(server.address, admin, insecure=True) as relay:
                relay.open_job("j", names)
                calls = [(n, "ping", None) for n in names]
                assert all(isinstance(r, m.Ack) for r in relay.call("j", calls, 10.0))
                registry.revoke_token("site", "a")
                registry.issue_token("site", "b")  # b's token replaced: the stream's token is old
                registry.store.deregister_site("c")
                res = relay.call("j", calls, 10.0)
                assert [getattr(r, "status", "") for r in res[:3]] == ["PERMISSION_DENIED"] * 3
                assert "revoked or replaced" in res[0].detail and "'a'" in res[0].detail
                assert "revoked or replaced" in res[1].detail and "'b'" in res[1].detail
                assert "no longer registered" in res[2].detail
                assert isinstance(res[3], m.Ack) and res[3].incarnation == "real"
                assert [len(sites[n].forwards) for n in names] == [1, 1, 1, 2]  # nothing forwarded to a, b, c
                _wait(lambda: sorted(server.relay.connected()) == ["d"])  # and their streams are cut off
        finally:
            for s in sites.values():
                s.close()


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_the_stores_say_which_sites_may_still_be_served(tmp_path, kind):
    from msa_fed.control.registry.store import MemoryStore

    store = SqliteStore(tmp_path / "r.db") if kind == "sqlite" else MemoryStore()
    reg = Registry(store)
    tokens = {n: reg.issue_token("site", n) for n in ("a", "b", "c", "e")}
    for n in ("a", "b", "c", "d"):  # d registered without a token, e has a token but no registration
        store.register_site(n, {}, time.time())
    reg.revoke_token("site", "b")
    old_c = tokens["c"]
    tokens["c"] = reg.issue_token("site", "c")
    access = store.site_access(["a", "b", "c", "d", "e", "nobody"])
    assert sorted(access) == ["a", "b", "c", "d"]
    assert access["b"] is None and access["d"] is None
    assert access["a"].principal == "a" and access["c"] == store.get_token("site", "c")
    assert reg.sites_admitted(tokens) == {"a", "c"}
    assert reg.sites_admitted({"c": old_c, "a": tokens["c"], "d": tokens["a"]}) == set()  # old, another's
    assert reg.sites_admitted({"a": tokens["a"][:-2] + "xx"}) == set()  # a wrong secret
    assert reg.sites_admitted({"a": reg.issue_token("admin", "a")}) == set()  # an admin's token named a
    assert store.site_access([]) == {} and reg.sites_admitted({}) == set()
    many = [f"m{k:04d}" for k in range(1200)]  # more names than one query may carry
    for n in many:
        store.register_site(n, {}, time.time())
    got = store.site_access([*many, "a", "nobody"])
    assert len(got) == 1201 and got["a"].principal == "a" and all(got[n] is None for n in many)
    store.close()
