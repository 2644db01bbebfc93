"""``msa-fed model | job | admin`` commands through real processes: a registry subprocess on
loopback with its SQLite file, and each command as its own process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ops_helpers import RegistryProcess, cli, issue_tokens

import msa_fed
from msa_fed.control.ops.client import OpsClient
from msa_fed.control.registry.client import RegistryClient


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two saved models (different random states) as a job would leave them."""
    from demo_sites import demo_sites

    out = []
    for seed in (1, 2):
        sites, fed = demo_sites(seed)
        model = msa_fed.fit_dmsa(sites, task="classification", random_state=seed)
        out.append(model.save(tmp_path_factory.mktemp(f"model{seed}") / "model"))
    return out, fed["north"]["X_test"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    db = tmp / "registry.db"
    tokens = issue_tokens(db, ["a", "b", "c"])
    (tmp / "admin_token").write_text(tokens["admin"] + "\n")
    with RegistryProcess(db, audit_log=tmp / "audit.jsonl") as reg:
        yield reg, tokens, tmp


def ops(served, *args):
    reg, _, tmp = served
    return cli(*args, "--registry", reg.address, "--insecure", "--admin-token-file", tmp / "admin_token")


def test_model_upload_list_show_download_promote(served, model_dirs, tmp_path):
    (first, second), X = model_dirs
    rc, out, err = ops(served, "model", "list")
    assert rc == 0 and "no combined model" in out, err
    for path in (first, second):
        rc, out, err = ops(served, "model", "upload", path)
        assert rc == 0 and "stored combined model version" in out, err
    rc, out, _ = ops(served, "model", "list")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["VERSION", "CURRENT", "CREATED"]
    assert lines[1].split()[0] == "1" and lines[1].split()[1] != "*"
    assert lines[2].split()[1] == "*"  # version 2 is current
    rc, out, _ = ops(served, "model", "list", "--json")
    listing = json.loads(out)
    assert listing["current_version"] == 2 and listing["models"][0]["manifest"]["sites"] == ["north", "east", "west"]

    rc, out, err = ops(served, "model", "download", "1", "--out", tmp_path / "v1")
    assert rc == 0 and "load_model" in out, err
    np.testing.assert_allclose(
        msa_fed.load_model(tmp_path / "v1").predict_proba(X), msa_fed.load_model(first).predict_proba(X)
    )
    rc, _, err = ops(served, "model", "download", "1", "--out", tmp_path / "v1")
    assert rc == 1 and err.startswith("error: ") and "not an empty directory" in err and len(err.splitlines()) == 1

    rc, out, err = ops(served, "model", "promote", "1", "--reason", "version 2 was trained on poisoned data")
    assert rc == 0 and "version 1 is now current" in out, err
    rc, out, _ = ops(served, "model", "show", "latest")
    assert out.startswith("version         1  (current") and "poisoned data" in out and "z " in out
    assert "predictor       north: sha256 " in out
    rc, out, err = ops(served, "model", "download", "latest", "--out", tmp_path / "latest")
    assert rc == 0 and "version 1 " in out, err
    reg, tokens, _ = served
    with RegistryClient(reg.address, tokens["a"], insecure=True) as site:  # sites see the rollback too
        site.register("a")
        assert site.heartbeat().latest_combined_version == 1

    rc, _, err = ops(served, "model", "promote", "7")
    assert rc == 1 and err.strip() == "error: NOT_FOUND: no combined model version 7 is stored"
    rc, _, err = ops(served, "model", "show", "zero")
    assert rc == 2 and "VERSION must be a positive integer" in err


def test_model_upload_refuses_a_directory_that_is_not_a_model(served, tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "msa_fed.combined_model", "format_version": 1}')
    rc, _, err = ops(served, "model", "upload", tmp_path)
    assert rc == 1 and err.startswith("error: ") and len(err.splitlines()) == 1


def test_admin_deregister_and_list_sites(served):
    reg, tokens, tmp = served
    for name in ("b", "c"):
        with RegistryClient(reg.address, tokens[name], insecure=True) as site:
            site.register(name)
            site.heartbeat()
    rc, out, err = ops(served, "admin", "deregister", "--site", "b", "--reason", "left the consortium")
    assert rc == 0 and "site 'b' deregistered" in out, err
    rc, out, err = cli("admin", "revoke-token", "--db", tmp / "registry.db", "--site", "c")
    assert rc == 0, err
    rc, out, err = cli("admin", "list-sites", "--db", tmp / "registry.db")
    assert rc == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:5] == ["NAME", "TOKEN", "REGISTERED", "REVOKED", "DEREGISTERED"] and "CONNECTED" in header
    row = {r.split()[0]: r for r in rows}
    assert "left the consortium" in row["b"] and row["b"].split()[1:3] == ["revoked", "no"]
    assert row["c"].split()[1] == "revoked" and row["c"].split()[3].startswith("20")  # revocation time shown
    rc, out, _ = cli("admin", "list-sites", "--db", tmp / "registry.db", "--json")
    listing = {r["name"]: r for r in json.loads(out)}
    assert listing["b"]["deregistration"]["reason"] == "left the consortium" and listing["b"]["site"] is None
    assert listing["c"]["token_revoked_at"] > 0 and listing["c"]["connected"] is None
    rc, out, _ = ops(served, "admin", "site-status", "--json")
    assert {r["name"]: r["token"] for r in json.loads(out)}["b"] == "revoked"


def test_job_list_and_show(served):
    reg, tokens, _ = served
    with RegistryClient(reg.address, tokens["admin"], insecure=True) as admin:
        ops_client = OpsClient(admin)
        ops_client.start_job("20260101-000000-abcd", "nightly", ["a", "b"], "ray")
        ops_client.finish_job("20260101-000000-abcd", "failed", error="site 'b' was deregistered at X")
    rc, out, err = ops(served, "job", "list")
    assert rc == 0, err
    assert out.splitlines()[0].split()[:3] == ["JOB", "ID", "NAME"]
    assert "20260101-000000-abcd  nightly  failed" in out
    rc, out, _ = ops(served, "job", "show", "20260101-000000-abcd")
    assert "status          failed" in out and "site 'b' was deregistered" in out and "sites           a, b" in out
    rc, out, _ = ops(served, "job", "show", "20260101-000000-abcd", "--json")
    assert json.loads(out)["sites"] == ["a", "b"]
    rc, _, err = ops(served, "job", "show", "nope")
    assert rc == 1 and err.strip() == "error: NOT_FOUND: no job 'nope' was recorded"


def test_admin_commands_need_the_admin_token(served, tmp_path):
    reg, tokens, _ = served
    (tmp_path / "site_token").write_text(tokens["a"])
    rc, _, err = cli(
        "model", "list", "--registry", reg.address, "--insecure", "--admin-token-file", tmp_path / "site_token"
    )
    assert rc == 1 and err.startswith("error: PERMISSION_DENIED")
    rc, _, err = cli("model", "list", "--registry", reg.address, "--insecure", "--admin-token-file", tmp_path / "none")
    assert rc == 1 and err.strip() == f"error: --admin-token-file {str(tmp_path / 'none')!r} not found"


def test_audit_log_of_the_served_registry(served):
    _, _, tmp = served
    lines = [json.loads(x) for x in (tmp / "audit.jsonl").read_text().splitlines()]
    assert any(e["method"].endswith("/UploadCombinedModel") and e["outcome"] == "OK" for e in lines)
    assert any(e["outcome"] == "PERMISSION_DENIED" for e in lines)
