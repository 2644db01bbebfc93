"""Artifact and sample uploads, downloads and combined models over a real server (both stores)."""

from __future__ import annotations

import hashlib
import pickle
import threading
import time

import grpc
import numpy as np
import pytest
from control_helpers import ARTIFACT_REFUSED_DETAILS, linear_onnx, softmax_onnx
from sklearn.linear_model import LinearRegression

from msa_fed.artifacts.predictors import load_predictor
from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Limits, Registry
from msa_fed.control.registry.store import MemoryStore
from msa_fed.control.server import RegistryServer
from msa_fed.errors import RegistryError

RNG = np.random.default_rng(0)
X3 = RNG.normal(size=(50, 3)).astype(np.float32)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_of(fn) -> str:
    try:
        fn()
    except RegistryError as exc:
        return exc.code
    return "OK"


@pytest.fixture
def site_a(tokens, connect):
    client = connect(tokens["a"])
    client.register("a")
    return client


@pytest.fixture
def admin(tokens, connect):
    return connect(tokens["admin"])


def raw_stub(server):
    channel = grpc.insecure_channel(server.address)
    return channel, pb_grpc.RegistryStub(channel)


def test_multichunk_predictor_round_trip(site_a, admin, store):
    data = linear_onnx([1.0, -2.0, 0.5], 0.25, padding=700_000)  # ~2.8 MB: three upload chunks
    assert len(data) > 2 * 2**20
    rec = site_a.upload_predictor(data)
    assert rec.sha256 == sha(data) and rec.size == len(data)
    assert rec.meta == {"output_kind": "regression", "n_features": 3, "classes": None}
    downloaded, info = admin.download_predictor("a")
    assert downloaded == data and info == rec
    predictor = admin.fetch_predictor("a", expected_sha256=rec.sha256)
    np.testing.assert_allclose(predictor.predict(X3), X3 @ np.array([1.0, -2.0, 0.5]) + 0.25, rtol=1e-5, atol=1e-5)
    assert store.get_blob(rec.sha256) == data


def test_multichunk_sample_round_trip(site_a, admin):
    X = RNG.normal(size=(70_000, 5))  # float64 in, float32 stored: 1.4 MB
    rec = site_a.upload_sample(X)
    assert rec.meta == {"rows": 70_000, "cols": 5, "dtype": "float32"}
    got, info = admin.download_sample("a")
    assert got.dtype == np.float32 and got.shape == (70_000, 5)
    np.testing.assert_array_equal(got, X.astype(np.float32))
    assert info.sha256 == sha(X.astype("<f4").tobytes())


def test_classifier_metadata_reaches_the_admin(site_a, admin):
    data = softmax_onnx(RNG.normal(size=(3, 4)), classes=["w", "x", "y", "z"])
    site_a.upload_predictor(data, kind="probabilities", n_features=3)
    (site,) = [s for s in admin.list_sites() if s.name == "a"]
    assert site.predictor.meta == {"output_kind": "probabilities", "n_features": 3, "classes": ["w", "x", "y", "z"]}
    assert list(admin.fetch_predictor("a").classes_) == ["w", "x", "y", "z"]


def test_retry_is_idempotent_and_reuse_with_other_content_conflicts(site_a, store):
    data = linear_onnx([1.0, 2.0, 3.0])
    first = site_a.upload_predictor(data, upload_id="job-1")
    again = site_a.upload_predictor(data, upload_id="job-1")
    assert again == first
    assert len(store.artifact_history("a", "predictor")) == 1
    other = linear_onnx([3.0, 2.0, 1.0])
    assert code_of(lambda: site_a.upload_predictor(other, upload_id="job-1")) == "ALREADY_EXISTS"
    assert store.get_blob(sha(other)) is None


def test_interrupted_upload_leaves_nothing_and_retry_succeeds(server, tokens, site_a, store, caplog):
    data = linear_onnx([1.0, 2.0, 3.0], padding=400_000)
    header = pb.PredictorHeader(upload_id="u-int", sha256=sha(data), size=len(data))

    def broken_stream():
        yield pb.UploadPredictorRequest(header=header)
        yield pb.UploadPredictorRequest(chunk=data[: 2**20])
        raise ConnectionError("network dropped")  # the client dies mid-upload

    channel, stub = raw_stub(server)
    with pytest.raises(grpc.RpcError):
        stub.UploadPredictor(broken_stream(), metadata=(("authorization", f"Bearer {tokens['a']}"),), timeout=10)
    channel.close()
    assert store.get_site("a").predictor is None
    assert store.get_blob(sha(data)) is None
    assert store.artifact_history("a", "predictor") == []
    rec = site_a.upload_predictor(data, upload_id="u-int")
    assert rec.sha256 == sha(data) and len(store.artifact_history("a", "predictor")) == 1
    # the aborted stream was a client error, not a server failure
    assert not [r for r in caplog.records if r.name.startswith("msa_fed") and r.levelname == "ERROR"]


def test_stream_framing_errors(server, tokens, site_a, store):
    data = linear_onnx([1.0, 2.0, 3.0])
    md = (("authorization", f"Bearer {tokens['a']}"),)
    channel, stub = raw_stub(server)
    good = pb.PredictorHeader(upload_id="f", sha256=sha(data), size=len(data))
    cases = {
        "no header": [pb.UploadPredictorRequest(chunk=data)],
        "empty stream": [],
        "two headers": [pb.UploadPredictorRequest(header=good), pb.UploadPredictorRequest(header=good)],
        "short": [pb.UploadPredictorRequest(header=good), pb.UploadPredictorRequest(chunk=data[:-1])],
        "long": [pb.UploadPredictorRequest(header=good), pb.UploadPredictorRequest(chunk=data + b"x")],
        "bad sha": [
            pb.UploadPredictorRequest(header=pb.PredictorHeader(upload_id="f", sha256="0" * 64, size=len(data))),
            pb.UploadPredictorRequest(chunk=data),
        ],
        "bad upload id": [
            pb.UploadPredictorRequest(header=pb.PredictorHeader(upload_id="../x", sha256=sha(data), size=len(data))),
            pb.UploadPredictorRequest(chunk=data),
        ],
        "zero size": [pb.UploadPredictorRequest(header=pb.PredictorHeader(upload_id="f", sha256=sha(data), size=0))],
    }
    for name, messages in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.UploadPredictor(iter(messages), metadata=md, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    channel.close()
    assert store.get_site("a").predictor is None


def test_size_limits():
    registry = Registry(MemoryStore(), Limits(max_predictor_bytes=10_000, max_sample_bytes=4_000))
    token = registry.issue_token("site", "a")
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        with RegistryClient(server.address, token, insecure=True, retries=0) as client:
            client.register("a")
            assert code_of(lambda: client.upload_predictor(linear_onnx([1.0], padding=5_000))) == "RESOURCE_EXHAUSTED"
            assert code_of(lambda: client.upload_sample(np.zeros((1001, 1)))) == "RESOURCE_EXHAUSTED"
            assert code_of(lambda: client.upload_sample(np.zeros((1000, 1)))) == "OK"
            # one gRPC message above the server's 4 MiB limit is refused by gRPC itself
            channel, stub = raw_stub(server)
            big = pb.UploadSampleRequest(chunk=b"\x00" * (5 * 2**20))
            header = pb.UploadSampleRequest(
                header=pb.SampleHeader(upload_id="x", sha256="0" * 64, rows=1, cols=1, dtype="float32")
            )
            with pytest.raises(grpc.RpcError) as err:
                stub.UploadSample(iter([header, big]), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            channel.close()


def test_disguised_and_bad_predictors_are_invalid_argument(site_a, store, caplog):
    fitted = LinearRegression().fit(X3, X3[:, 0])
    valid = linear_onnx([1.0, 2.0, 3.0])
    bad = {
        "pickle": pickle.dumps(fitted),
        "truncated": valid[: len(valid) // 2],
        "width": linear_onnx([1.0, 2.0, 3.0], metadata={"msa_fed.kind": "regression", "msa_fed.n_features": "4"}),
        "not normalised": softmax_onnx(RNG.normal(size=(3, 2)), softmax=False),
        "text": b"def predict(x): import os; os.system('id')",
    }
    for name, data in bad.items():
        with pytest.raises(RegistryError) as err:
            site_a.upload_predictor(data)
        assert err.value.code == "INVALID_ARGUMENT", name
        assert ARTIFACT_REFUSED_DETAILS.fullmatch(err.value.message), name  # the fixed reason and an incident id
        incident = err.value.message.rsplit(" ", 1)[-1].rstrip(")")
        logged = [r.getMessage() for r in caplog.records if incident in r.getMessage()]
        assert len(logged) == 1, name  # the registry logs the loader's reason under that id
        if name == "pickle":
            assert "pickle" in logged[0]
    # a valid model whose declaration contradicts the header's expectations
    assert code_of(lambda: site_a.upload_predictor(valid, kind="probabilities")) == "INVALID_ARGUMENT"
    assert code_of(lambda: site_a.upload_predictor(valid, n_features=5)) == "INVALID_ARGUMENT"
    assert store.get_site("a").predictor is None


def test_sample_validation(site_a, tokens, connect):
    bad = X3.copy()
    bad[3, 1] = np.nan
    assert code_of(lambda: site_a.upload_sample(bad)) == "INVALID_ARGUMENT"
    site_a.upload_predictor(linear_onnx([1.0, 2.0, 3.0]))
    assert code_of(lambda: site_a.upload_sample(np.zeros((5, 4)))) == "INVALID_ARGUMENT"  # width != predictor's
    assert code_of(lambda: site_a.upload_sample(X3)) == "OK"
    assert code_of(lambda: site_a.upload_predictor(linear_onnx([1.0, 2.0]))) == "INVALID_ARGUMENT"  # width != sample's
    b = connect(tokens["b"])  # b has a token but never registered
    assert code_of(lambda: b.upload_sample(X3)) == "FAILED_PRECONDITION"
    assert code_of(lambda: b.heartbeat()) == "FAILED_PRECONDITION"


def test_downloads_and_republish(site_a, admin):
    assert code_of(lambda: admin.download_predictor("a")) == "NOT_FOUND"
    assert code_of(lambda: admin.download_sample("nobody")) == "NOT_FOUND"
    assert code_of(lambda: admin.download_predictor("")) == "INVALID_ARGUMENT"  # an admin must name the site
    first = site_a.upload_predictor(linear_onnx([1.0, 2.0, 3.0]))
    second = site_a.upload_predictor(linear_onnx([0.0, 2.0, 3.0]))
    assert admin.get_site("a").predictor == second
    assert site_a.download_predictor()[1] == second  # a site may read its own artifact
    with pytest.raises(RegistryError) as err:
        admin.download_predictor("a", expected_sha256=first.sha256)
    assert err.value.code == "FAILED_PRECONDITION"


def test_deregister_and_register_again(site_a, admin):
    site_a.upload_sample(X3)
    assert admin.deregister("a") is True
    assert code_of(lambda: admin.get_site("a")) == "NOT_FOUND"
    assert code_of(lambda: admin.download_sample("a")) == "NOT_FOUND"
    assert site_a.register("a").sample is None
    assert site_a.deregister() is True and site_a.deregister() is False


def test_combined_models(site_a, admin):
    assert code_of(lambda: admin.download_combined_model()) == "NOT_FOUND"
    m1 = admin.upload_combined_model(b"model-one" * 100_000, {"z": [0.5, 0.5], "sites": ["a", "b"]})
    m2 = admin.upload_combined_model(b"model-two", '{"z": [1.0, 0.0]}', upload_id="run-2")
    assert (m1.version, m2.version) == (1, 2)
    assert admin.upload_combined_model(b"model-two", '{"z": [1.0, 0.0]}', upload_id="run-2") == m2
    data, info = site_a.download_combined_model()  # sites may fetch the result
    assert data == b"model-two" and info == m2
    data, info = admin.download_combined_model(1)
    assert data == b"model-one" * 100_000 and info.manifest_json == m1.manifest_json
    assert site_a.heartbeat().latest_combined_version == 2
    assert code_of(lambda: admin.download_combined_model(9)) == "NOT_FOUND"
    assert code_of(lambda: admin.upload_combined_model(b"x", "[1, 2]")) == "INVALID_ARGUMENT"
    assert code_of(lambda: admin.upload_combined_model(b"x", "{not json")) == "INVALID_ARGUMENT"


def test_load_predictor_agrees_with_stored_meta(site_a, admin):
    """The record the registry returns is the declaration the loader sees."""
    data = softmax_onnx(RNG.normal(size=(3, 2)), classes=[-1, 1])
    rec = site_a.upload_predictor(data)
    p = load_predictor(admin.download_predictor("a")[0], expected_sha256=rec.sha256)
    assert (p.kind, p.n_features_in_, p.classes_.tolist()) == ("probabilities", 3, [-1, 1])


def test_bytes_in_flight_are_bounded_and_released():
    registry = Registry(MemoryStore(), Limits(max_upload_bytes_in_flight=3_000_000))
    token = registry.issue_token("site", "a")
    md = (("authorization", f"Bearer {token}"),)
    rows = 500_000 // 3 * 3  # (rows, 1) float32: 2 MB
    X = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    data = X.tobytes()
    header = pb.SampleHeader(upload_id="slow", sha256=sha(data), rows=rows, cols=1, dtype="float32")
    release = threading.Event()

    def stalled():
        yield pb.UploadSampleRequest(header=header)
        yield pb.UploadSampleRequest(chunk=data[:1000])
        release.wait(30)
        raise ConnectionError("the slow client gives up")

    def empty_probe(stub):
        """A 2 MB header with no body: RESOURCE_EXHAUSTED while reserved, else INVALID_ARGUMENT."""
        probe = pb.SampleHeader(upload_id="probe", sha256=sha(data), rows=rows, cols=1, dtype="float32")
        try:
            stub.UploadSample(iter([pb.UploadSampleRequest(header=probe)]), metadata=md, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()

    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        with RegistryClient(server.address, token, insecure=True, retries=0, busy_wait=0) as client:
            client.register("a")
            channel, stub = raw_stub(server)
            slow = threading.Thread(
                target=lambda: pytest.raises(grpc.RpcError, stub.UploadSample, stalled(), metadata=md, timeout=30)
            )
            slow.start()
            # wait for the slow upload's reservation itself: a probe racing it for the budget
            # could win and make the slow upload the one refused
            deadline = time.monotonic() + 20
            while server.servicer.upload_bytes_in_flight < len(data):
                assert time.monotonic() < deadline, "the slow upload never reserved its bytes"
                time.sleep(0.05)
            assert empty_probe(stub) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert code_of(lambda: client.upload_sample(X)) == "RESOURCE_EXHAUSTED"
            assert code_of(lambda: client.upload_sample(X[:1000])) == "OK"  # small uploads still fit
            release.set()
            slow.join(30)
            deadline = time.monotonic() + 20
            while server.servicer.upload_bytes_in_flight != 0:  # the reservation is returned
                assert time.monotonic() < deadline, "the aborted upload kept its reservation"
                time.sleep(0.05)
            assert empty_probe(stub) == grpc.StatusCode.INVALID_ARGUMENT
            assert client.upload_sample(X).sha256 == sha(data)
            channel.close()
