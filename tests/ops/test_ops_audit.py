"""The registry audit log: a JSON line for every RPC, refusals included, with sha256 of what moved."""

from __future__ import annotations

import hashlib
import json

import grpc
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn
from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.audit import AuditLog
from msa_fed.control.ops.client import OpsClient
from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer
from msa_fed.errors import RegistryError


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def audited(tmp_path):
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    log_path = tmp_path / "audit.jsonl"
    audit = AuditLog(log_path)
    with RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=16, audit_log=audit) as server:
        yield registry, server, log_path
    audit.close()
    store.close()


def test_every_rpc_is_logged_with_principal_outcome_and_sha256(audited):
    registry, server, log_path = audited
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    onnx = export_sklearn(LogisticRegression().fit(X, (X[:, 0] > 0).astype(int)), n_features=3)
    site_token, admin_token = registry.issue_token("site", "a"), registry.issue_token("admin", "admin")
    other_token = registry.issue_token("site", "b")
    with RegistryClient(server.address, site_token, insecure=True, retries=0) as site:
        site.register("a")
        site.upload_predictor(onnx)
        site.upload_sample(X)
        with pytest.raises(RegistryError):
            site.upload_combined_model(b"x", {})  # PERMISSION_DENIED (role)
    with RegistryClient(server.address, other_token, insecure=True, retries=0) as other, pytest.raises(RegistryError):
        other.get_site("a")  # PERMISSION_DENIED (domain rule)
    forged = site_token[:-3] + ("aaa" if not site_token.endswith("aaa") else "bbb")
    with RegistryClient(server.address, forged, insecure=True, retries=0) as bad, pytest.raises(RegistryError):
        bad.list_sites()  # UNAUTHENTICATED
    model = b"combined model bytes" * 1000
    with RegistryClient(server.address, admin_token, insecure=True, retries=0) as admin:
        admin.download_predictor("a")
        stored = admin.upload_combined_model(model, {"job": "t"})
        admin.download_combined_model(stored.version)
        OpsClient(admin).list_jobs()
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):  # no token at all
        pb_grpc.RegistryStub(channel).ListSites(pb.ListSitesRequest(), timeout=30)

    entries = read_log(log_path)
    by = [(e["method"].rsplit("/", 1)[1], e["outcome"]) for e in entries]
    assert by == [
        ("RegisterSite", "OK"),
        ("UploadPredictor", "OK"),
        ("UploadSample", "OK"),
        ("UploadCombinedModel", "PERMISSION_DENIED"),
        ("GetSite", "PERMISSION_DENIED"),
        ("ListSites", "UNAUTHENTICATED"),
        ("DownloadPredictor", "OK"),
        ("UploadCombinedModel", "OK"),
        ("DownloadCombinedModel", "OK"),
        ("ListJobs", "OK"),
        ("ListSites", "UNAUTHENTICATED"),
    ]
    up_pred, up_sample, refused_role, refused_rule, forged_e, down_pred, up_model, down_model, ops_e, anon = entries[1:]
    sha = hashlib.sha256(onnx).hexdigest()
    assert up_pred["principal"] == {"role": "site", "name": "a", "verified": True}
    assert up_pred["request"]["content_sha256"] == sha and up_pred["request"]["content_bytes"] == len(onnx)
    assert up_sample["request"]["content_sha256"] == hashlib.sha256(X.astype("<f4").tobytes()).hexdigest()
    assert down_pred["response"]["content_sha256"] == sha and down_pred["principal"]["name"] == "admin"
    assert up_model["request"]["content_sha256"] == hashlib.sha256(model).hexdigest() == stored.sha256
    assert down_model["response"]["content_sha256"] == stored.sha256
    assert down_model["response"]["content_bytes"] == len(model)
    assert refused_role["principal"]["name"] == "a" and "admin" in refused_role["details"]
    assert refused_rule["principal"] == {"role": "site", "name": "b", "verified": True}
    assert forged_e["principal"] == {"role": "site", "name": "a", "verified": False}
    assert anon["principal"] is None
    assert ops_e["method"] == "/msa_fed.v1.Operations/ListJobs"
    for e in entries:
        assert e["peer"].startswith("ipv4:127.0.0.1") and e["duration_ms"] >= 0 and e["time"].endswith("Z")
    text = log_path.read_text()
    for token in (site_token, admin_token, other_token, forged):
        assert token.rsplit(".", 1)[1] not in text  # no secret in the log
    assert oct(log_path.stat().st_mode & 0o777) == "0o600"
