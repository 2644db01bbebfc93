"""A site's fetches of its peers' predictors and published samples through the registry's relay
(msa_fed/federation/agent.py), against a relay that answers what it likes: a stream must open
with one header and carry at most the bound in chunks after it; anything else is one
ConfigError naming the site, never part of an artifact."""

from __future__ import annotations

from concurrent import futures
from functools import partial
from types import SimpleNamespace

import grpc
import pytest

from msa_fed.boundary.proto import registry_pb2 as reg_pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.errors import ConfigError
from msa_fed.federation.agent import SiteAgent
from msa_fed.site import admission


class ScriptedRelay(pb_grpc.RelayServicer):
    """Streams ``self.script`` for either fetch (or aborts with ``self.abort``); notes each call's metadata."""

    def __init__(self):
        self.script: list = []
        self.abort: grpc.StatusCode | None = None
        self.calls: list[tuple[str, str, dict]] = []

    def _stream(self, request, context):
        self.calls.append((request.job_id, request.site, dict(context.invocation_metadata())))
        if self.abort is not None:
            context.abort(self.abort, "not for you")
        yield from self.script

    FetchPredictor = FetchSample = _stream


@pytest.fixture(scope="module")
def served():
    relay = ScriptedRelay()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RelayServicer_to_server(relay, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    agent = SimpleNamespace(token="site-token", _stub=pb_grpc.RelayStub(channel))
    agent._fetch = partial(SiteAgent._fetch, agent)  # the agent's own code, on this channel
    yield relay, agent
    channel.close()
    server.stop(None)


@pytest.fixture
def relay(served):
    relay, _ = served
    relay.script, relay.abort = [], None
    relay.calls.clear()
    return relay


def sample_header(rows: int = 2, cols: int = 3) -> reg_pb.DownloadChunk:
    info = reg_pb.ArtifactInfo(site="west", kind="sample", sha256="ab" * 32, size=24)
    info.sample.CopyFrom(reg_pb.SampleMeta(rows=rows, cols=cols, dtype="float32"))
    return reg_pb.DownloadChunk(artifact=info)


def chunk(data: bytes) -> reg_pb.DownloadChunk:
    return reg_pb.DownloadChunk(chunk=data)


def fetch(served, what: str):
    _, agent = served
    method = SiteAgent.fetch_sample if what == "sample" else SiteAgent.fetch_predictor
    return method(agent, "job-1", "west")


def test_an_honest_stream_is_the_header_then_the_bytes(served, relay):
    relay.script = [sample_header(2, 3), chunk(b"x" * 10), chunk(b"y" * 14)]
    assert fetch(served, "sample") == (b"x" * 10 + b"y" * 14, "ab" * 32, 2, 3)
    assert fetch(served, "predictor") == b"x" * 10 + b"y" * 14
    assert [c[:2] for c in relay.calls] == [("job-1", "west")] * 2
    assert all(c[2]["authorization"] == "Bearer site-token" for c in relay.calls)


@pytest.mark.parametrize("what", ["sample", "predictor"])
@pytest.mark.parametrize(
    "script, words",
    [
        ([chunk(b"early"), sample_header()], "unexpected message"),  # bytes before the header
        ([sample_header(), chunk(b"a"), sample_header()], "unexpected message"),  # a second header
        ([reg_pb.DownloadChunk(combined_model=reg_pb.CombinedModelInfo())], "unexpected message"),
        ([], "no header"),
    ],
    ids=["chunk-first", "two-headers", "other-part", "empty"],
)
def test_a_malformed_stream_is_refused_naming_the_site(served, relay, what, script, words):
    relay.script = script
    with pytest.raises(ConfigError, match=f"of site 'west'.*{words}|{words}.*of site 'west'") as info:
        fetch(served, what)
    assert what in str(info.value)


@pytest.mark.parametrize("what", ["sample", "predictor"])
def test_a_stream_past_the_bound_is_cut_off(served, relay, monkeypatch, what):
    monkeypatch.setattr(admission, "MAX_SAMPLE_BYTES", 20)
    relay.script = [sample_header(), chunk(b"a" * 15), chunk(b"b" * 6), chunk(b"c" * 100)]
    with pytest.raises(ConfigError, match=f"the {what} of site 'west' is larger than"):
        fetch(served, what)
    relay.script = [sample_header(), chunk(b"a" * 15), chunk(b"b" * 5)]  # at the bound: taken
    assert len(fetch(served, "predictor")) == 20


def test_a_sample_whose_header_has_no_shape_is_refused(served, relay):
    info = reg_pb.ArtifactInfo(site="west", kind="sample", sha256="ab" * 32)
    info.predictor.CopyFrom(reg_pb.PredictorMeta(output_kind="probabilities", classes_json="{not json"))
    relay.script = [reg_pb.DownloadChunk(artifact=info), chunk(b"x")]
    with pytest.raises(ConfigError, match="the sample of site 'west' has no readable shape"):
        fetch(served, "sample")


def test_a_refusal_of_the_relay_is_one_line(served, relay):
    relay.abort = grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ConfigError, match=r"^cannot fetch the sample of site 'west': PERMISSION_DENIED: not for you$"):
        fetch(served, "sample")
