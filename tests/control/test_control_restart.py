"""Restart persistence: SIGKILL the registry process, restart it on the same database."""

from __future__ import annotations

import hashlib
import os
import re
import select
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from cli_runner import registry_serve_argv
from control_helpers import linear_onnx, softmax_onnx

from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore

LISTENING = re.compile(r"registry listening on (\S+)")


def start_registry(db) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(registry_serve_argv(db), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            match = LISTENING.search(line)
            if match:
                return proc, match.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"registry exited with {proc.returncode}: {proc.stderr.read()}")
    proc.kill()
    raise AssertionError("registry did not report its address in time")


@pytest.mark.timeout(300)
def test_sigkill_and_restart_keeps_everything(tmp_path):
    db = tmp_path / "registry.db"
    with SqliteStore(db) as store:
        reg = Registry(store)
        tokens = {name: reg.issue_token("site", name) for name in ("a", "b", "c")}
        admin_token = reg.issue_token("admin", "admin")

    rng = np.random.default_rng(1)
    published = {}
    proc, address = start_registry(db)
    try:
        for i, name in enumerate(("a", "b", "c")):
            with RegistryClient(address, tokens[name], insecure=True) as client:
                client.register(name, {"index": str(i)})
                client.heartbeat()
                onnx_bytes = linear_onnx(rng.normal(size=4)) if name != "b" else softmax_onnx(rng.normal(size=(4, 3)))
                X = rng.normal(size=(200 + i, 4)).astype(np.float32)
                p = client.upload_predictor(onnx_bytes)
                s = client.upload_sample(X)
                published[name] = (onnx_bytes, X, p.sha256, s.sha256)
        with RegistryClient(address, admin_token, insecure=True) as admin:
            model = admin.upload_combined_model(b"combined" * 1000, {"z": [0.2, 0.3, 0.5]})

        # An upload in flight when the process dies must not become visible.
        big = rng.normal(size=(300_000, 4)).astype("<f4").tobytes()  # 4.8 MB, 5 chunks
        half_sent = threading.Event()

        def stalled():
            header = pb.SampleHeader(
                upload_id="in-flight", sha256=hashlib.sha256(big).hexdigest(), rows=300_000, cols=4, dtype="float32"
            )
            yield pb.UploadSampleRequest(header=header)
            yield pb.UploadSampleRequest(chunk=big[: 2**20])
            yield pb.UploadSampleRequest(chunk=big[2**20 : 2 * 2**20])
            half_sent.set()
            time.sleep(30)  # never finishes: the server is killed meanwhile

        channel = grpc.insecure_channel(address)
        stub = pb_grpc.RegistryStub(channel)
        errors = []

        def upload():
            try:
                stub.UploadSample(stalled(), metadata=(("authorization", f"Bearer {tokens['a']}"),), timeout=60)
            except grpc.RpcError as exc:
                errors.append(exc.code())

        uploader = threading.Thread(target=upload, daemon=True)
        uploader.start()
        assert half_sent.wait(30)
        time.sleep(0.3)  # let the server receive the chunks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        uploader.join(60)
        channel.close()
        assert errors and errors[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    proc, address = start_registry(db)
    try:
        with RegistryClient(address, admin_token, insecure=True) as admin:
            sites = {s.name: s for s in admin.list_sites()}
            assert sorted(sites) == ["a", "b", "c"]
            for i, (name, (onnx_bytes, X, p_sha, s_sha)) in enumerate(sorted(published.items())):
                site = sites[name]
                assert site.labels == {"index": str(i)}
                assert site.last_heartbeat is not None
                assert site.predictor.sha256 == p_sha and site.sample.sha256 == s_sha
                data, _ = admin.download_predictor(name)
                assert data == onnx_bytes and hashlib.sha256(data).hexdigest() == p_sha
                got, _ = admin.download_sample(name)
                np.testing.assert_array_equal(got, X)
            data, info = admin.download_combined_model()
            assert data == b"combined" * 1000 and info == model
        with RegistryClient(address, tokens["a"], insecure=True) as a:
            assert a.get_site().sample.sha256 == published["a"][3]  # the killed upload is not there
            X_big = np.frombuffer(big, dtype="<f4").reshape(300_000, 4)
            assert a.upload_sample(X_big, upload_id="in-flight").sha256 == hashlib.sha256(big).hexdigest()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "registry stopping" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
