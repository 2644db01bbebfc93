"""Malformed and oversized requests (hypothesis) never crash the server; each gets a status code."""

from __future__ import annotations

import hashlib
import pickle

import grpc
import pytest
from control_helpers import ARTIFACT_REFUSED_DETAILS, linear_onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msa_fed.boundary.proto import SERVICE_NAME
from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Limits, Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Codes the domain layer may answer with; UNKNOWN or INTERNAL would mean an unhandled exception.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
}
VALID_ONNX = linear_onnx([1.0, 2.0, 3.0])

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
chunk = st.binary(max_size=4096)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    store = SqliteStore(tmp_path_factory.mktemp("fuzz") / "r.db")
    registry = Registry(
        store, Limits(max_predictor_bytes=1 << 16, max_sample_bytes=1 << 16, max_combined_bytes=1 << 16)
    )
    site_token = registry.issue_token("site", "fz")
    admin_token = registry.issue_token("admin", "admin")
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        with RegistryClient(server.address, site_token, insecure=True) as c:
            c.register("fz")
        channel = grpc.insecure_channel(server.address)
        yield {
            "server": server,
            "channel": channel,
            "stub": pb_grpc.RegistryStub(channel),
            "site": (("authorization", f"Bearer {site_token}"),),
            "admin": (("authorization", f"Bearer {admin_token}"),),
        }
        channel.close()
    store.close()


def status_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        assert "see the registry's log" not in (exc.details() or ""), exc.details()
        return exc.code()
    return grpc.StatusCode.OK


@SETTINGS
@given(
    method=st.sampled_from(
        [
            "RegisterSite",
            "Heartbeat",
            "GetSite",
            "ListSites",
            "DeregisterSite",
            "UploadPredictor",
            "UploadSample",
            "DownloadPredictor",
            "DownloadSample",
            "UploadCombinedModel",
            "DownloadCombinedModel",
        ]
    ),
    payloads=st.lists(st.binary(max_size=512), min_size=1, max_size=4),
    who=st.sampled_from(["site", "admin"]),
)
def test_raw_bytes_never_crash(env, method, payloads, who):
    path = f"/{SERVICE_NAME}/{method}"
    channel, md = env["channel"], env[who]
    if method.startswith("Upload"):
        call = channel.stream_unary(path)
        code = status_of(lambda: call(iter(payloads), metadata=md, timeout=60))
    elif method.startswith("Download"):
        call = channel.unary_stream(path)
        code = status_of(lambda: list(call(payloads[0], metadata=md, timeout=60)))
    else:
        call = channel.unary_unary(path)
        code = status_of(lambda: call(payloads[0], metadata=md, timeout=60))
    # undecodable bytes are refused by gRPC itself with INTERNAL before any handler runs
    assert code in EXPECTED | {grpc.StatusCode.INTERNAL}, code


predictor_part = st.one_of(
    st.builds(
        lambda u, s, n, k, w: pb.UploadPredictorRequest(
            header=pb.PredictorHeader(upload_id=u, sha256=s, size=n, output_kind=k, n_features=w)
        ),
        text,
        text,
        int64,
        text,
        int32,
    ),
    st.builds(lambda b: pb.UploadPredictorRequest(chunk=b), chunk),
)
sample_part = st.one_of(
    st.builds(
        lambda u, s, r, c, d: pb.UploadSampleRequest(
            header=pb.SampleHeader(upload_id=u, sha256=s, rows=r, cols=c, dtype=d)
        ),
        text,
        text,
        int64,
        int64,
        st.sampled_from(["float32", "float64", "", "<f4"]),
    ),
    st.builds(lambda b: pb.UploadSampleRequest(chunk=b), chunk),
)
combined_part = st.one_of(
    st.builds(
        lambda u, s, n, m: pb.UploadCombinedModelRequest(
            header=pb.CombinedModelHeader(upload_id=u, sha256=s, size=n, manifest_json=m)
        ),
        text,
        text,
        int64,
        text,
    ),
    st.builds(lambda b: pb.UploadCombinedModelRequest(chunk=b), chunk),
)


@SETTINGS
@given(
    kind=st.sampled_from(["predictor", "sample", "combined"]), data=st.data(), who=st.sampled_from(["site", "admin"])
)
def test_malformed_upload_streams(env, kind, data, who):
    stub, md = env["stub"], env[who]
    if kind == "predictor":
        messages = data.draw(st.lists(predictor_part, max_size=5))
        code = status_of(lambda: stub.UploadPredictor(iter(messages), metadata=md, timeout=60))
    elif kind == "sample":
        messages = data.draw(st.lists(sample_part, max_size=5))
        code = status_of(lambda: stub.UploadSample(iter(messages), metadata=md, timeout=60))
    else:
        messages = data.draw(st.lists(combined_part, max_size=5))
        code = status_of(lambda: stub.UploadCombinedModel(iter(messages), metadata=md, timeout=60))
    assert code in EXPECTED, code


@SETTINGS
@given(
    name=text,
    labels=st.dictionaries(text, text, max_size=40),
    version=int64,
    method=st.sampled_from(
        ["RegisterSite", "Heartbeat", "GetSite", "DownloadPredictor", "DownloadSample", "DownloadCombinedModel"]
    ),
    who=st.sampled_from(["site", "admin"]),
)
def test_malformed_unary_fields(env, name, labels, version, method, who):
    stub, md = env["stub"], env[who]
    calls = {
        "RegisterSite": lambda: stub.RegisterSite(
            pb.RegisterSiteRequest(name=name, labels=labels), metadata=md, timeout=60
        ),
        "Heartbeat": lambda: stub.Heartbeat(pb.HeartbeatRequest(name=name), metadata=md, timeout=60),
        "GetSite": lambda: stub.GetSite(pb.GetSiteRequest(name=name), metadata=md, timeout=60),
        "DownloadPredictor": lambda: list(
            stub.DownloadPredictor(pb.DownloadArtifactRequest(site=name), metadata=md, timeout=60)
        ),
        "DownloadSample": lambda: list(
            stub.DownloadSample(pb.DownloadArtifactRequest(site=name), metadata=md, timeout=60)
        ),
        "DownloadCombinedModel": lambda: list(
            stub.DownloadCombinedModel(pb.DownloadCombinedModelRequest(version=version), metadata=md, timeout=60)
        ),
    }
    assert status_of(calls[method]) in EXPECTED


@SETTINGS
@given(
    edits=st.lists(st.tuples(st.integers(0, len(VALID_ONNX) - 1), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.just(len(VALID_ONNX)), st.integers(1, len(VALID_ONNX))),
)
def test_corrupted_predictors_are_refused_or_still_valid(env, edits, cut):
    """Consistent header, corrupted ONNX bytes: the loader (not the transport) must decide."""
    blob = bytearray(VALID_ONNX[:cut])
    for pos, value in edits:
        if pos < len(blob):
            blob[pos] = value
    blob = bytes(blob)
    header = pb.PredictorHeader(
        upload_id="c" + hashlib.sha256(blob).hexdigest()[:20], sha256=hashlib.sha256(blob).hexdigest(), size=len(blob)
    )
    messages = [pb.UploadPredictorRequest(header=header), pb.UploadPredictorRequest(chunk=blob)]
    code = status_of(lambda: env["stub"].UploadPredictor(iter(messages), metadata=env["site"], timeout=60))
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    if cut < len(VALID_ONNX):  # every truncation loses part of the declaration at least
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_and_disguised_requests(env):
    stub, md = env["stub"], env["site"]
    # the site is registered (the raw-bytes fuzz above may have sent an empty DeregisterSite, which
    # deregisters the caller): the disguised upload must be refused by the loader, not for that
    stub.RegisterSite(pb.RegisterSiteRequest(name="fz"), metadata=md, timeout=60)
    huge = pb.RegisterSiteRequest(name="fz", labels={"k": "v" * (5 * 2**20)})
    assert status_of(lambda: stub.RegisterSite(huge, metadata=md, timeout=60)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    header = pb.PredictorHeader(upload_id="big", sha256="0" * 64, size=2**40)
    assert (
        status_of(
            lambda: stub.UploadPredictor(iter([pb.UploadPredictorRequest(header=header)]), metadata=md, timeout=60)
        )
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    disguised = pickle.dumps({"predict": "os.system"})
    header = pb.PredictorHeader(upload_id="pkl", sha256=hashlib.sha256(disguised).hexdigest(), size=len(disguised))
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadPredictor(
            iter([pb.UploadPredictorRequest(header=header), pb.UploadPredictorRequest(chunk=disguised)]),
            metadata=md,
            timeout=60,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ARTIFACT_REFUSED_DETAILS.fullmatch(err.value.details())  # the loader's reason stays in the server's log


def test_server_still_healthy_after_fuzzing(env):
    """Runs last in this module: after every malformed request, normal service continues."""
    with RegistryClient(env["server"].address, None, insecure=True) as anonymous:
        assert anonymous.health() == "SERVING"
    stub, md = env["stub"], env["site"]
    stub.RegisterSite(pb.RegisterSiteRequest(name="fz"), metadata=md, timeout=60)
    info = stub.UploadPredictor(
        iter(
            [
                pb.UploadPredictorRequest(
                    header=pb.PredictorHeader(
                        upload_id="final", sha256=hashlib.sha256(VALID_ONNX).hexdigest(), size=len(VALID_ONNX)
                    )
                ),
                pb.UploadPredictorRequest(chunk=VALID_ONNX),
            ]
        ),
        metadata=md,
        timeout=60,
    )
    assert info.sha256 == hashlib.sha256(VALID_ONNX).hexdigest()
