"""The federated job as an operator runs it: registry and job driver as processes, a local Ray.

The two failure paths: the registry goes down while the job stores its result (back after a
few seconds: the retried upload succeeds; down for good: the error names the saved model and
the command that stores it later), and a job that names a deregistered or revoked site.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from ops_helpers import (
    RegistryProcess,
    cli,
    issue_tokens,
    publish_sites,
    start_job,
    write_job,
)

import msa_fed

SITES = ("north", "east", "west")


@pytest.fixture
def federation(tmp_path):
    db = tmp_path / "registry.db"
    tokens = issue_tokens(db, SITES)
    token_file = tmp_path / "admin_token"
    token_file.write_text(tokens["admin"])
    data_dir = tmp_path / "site-data"
    data_dir.mkdir()
    reg = RegistryProcess(db).start()
    publish_sites(reg.address, tokens, data_dir)
    yield reg, token_file, data_dir, tmp_path
    reg.stop()


def admin(reg, token_file, *args):
    return cli(*args, "--registry", reg.address, "--insecure", "--admin-token-file", token_file)


@pytest.mark.slow
def test_registry_down_during_upload_then_back(federation):
    reg, token_file, data_dir, tmp = federation
    job = write_job(tmp / "job.toml", reg.address, token_file, data_dir)
    proc, out = start_job("--job", job, "--output", tmp / "result", "--upload-retry-for", "240", cwd=tmp)
    try:
        out.wait_for("site west: node", timeout=600)  # every registry read is done; training starts
        reg.stop()
        out.wait_for("storing the model failed (UNAVAILABLE)", timeout=600)
        reg.start()  # same port, same database
        assert proc.wait(timeout=600) == 0, out.text()
    finally:
        proc.kill()
    text = out.text()
    assert "stored combined model version 1" in text and "\r" not in text
    assert f"combined model saved to {tmp / 'result'}" in text
    # a line per site: node, topology and channel; progress as one line per iteration
    for site in SITES:
        assert any(
            line.startswith(f"site {site}: node ") and "topology cluster" in line and "plaintext data channel" in line
            for line in out.lines
        ), out.text()
    assert any(line.startswith("DC solver: iteration 1") for line in out.lines), text
    assert any(line.startswith("DC solver: done after") for line in out.lines), text
    assert any(line.startswith("L_k(z) = east=") for line in out.lines), text  # the final summary
    job_id = next(line.split()[1] for line in out.lines if line.startswith("job ") and "recorded" in line)
    rc, listing, err = admin(reg, token_file, "job", "show", job_id, "--json")
    record = json.loads(listing)
    assert rc == 0 and record["status"] == "succeeded" and record["model_version"] == 1, err
    assert record["sites"] == sorted(SITES) and record["topology"] == "cluster"
    rc, listing, _ = admin(reg, token_file, "model", "show", "1", "--json")
    assert json.loads(listing)["manifest"]["job_id"] == job_id
    assert msa_fed.load_model(tmp / "result").site_names == sorted(SITES)


@pytest.mark.slow
def test_registry_down_for_good_names_the_saved_model_and_the_command(federation):
    reg, token_file, data_dir, tmp = federation
    job = write_job(tmp / "job.toml", reg.address, token_file, data_dir, sites=SITES)
    proc, out = start_job("--job", job, "--upload-retry-for", "1", cwd=tmp)
    try:
        out.wait_for("site west: node", timeout=600)
        reg.stop()
        assert proc.wait(timeout=600) == 1, out.text()
    finally:
        proc.kill()
    error = [line for line in out.lines if line.startswith("error: ")]
    assert len(error) == 1, out.text()
    job_id = next(line.split()[1] for line in out.lines if line.startswith("job ") and "recorded" in line)
    saved = tmp / "msa-fed-jobs" / job_id / "model"
    assert f"It is saved in {saved}" in error[0] and "UNAVAILABLE" in error[0]
    command = error[0].split("store it later with: ", 1)[1]
    assert command == (
        f"msa-fed model upload {saved} --registry {reg.address} --insecure --admin-token-file {token_file}"
    )
    assert msa_fed.load_model(saved).site_names == list(SITES)
    # later: the registry is back, the operator runs exactly the printed command
    reg.start()
    argv = shlex.split(command)
    assert argv[0] == "msa-fed"
    rc, stdout, err = cli(*argv[1:])
    assert rc == 0 and "stored combined model version 1" in stdout, err
    rc, listing, _ = admin(reg, token_file, "job", "show", job_id, "--json")
    assert json.loads(listing)["status"] == "succeeded" and json.loads(listing)["model_version"] == 1


def test_a_job_naming_a_deregistered_or_revoked_site_fails_with_the_reason(federation):
    reg, token_file, data_dir, tmp = federation
    rc, _, err = admin(reg, token_file, "admin", "deregister", "--site", "east", "--reason", "left the consortium")
    assert rc == 0, err
    rc, _, err = cli("admin", "revoke-token", "--db", tmp / "registry.db", "--site", "west")
    assert rc == 0, err

    # refused before any Ray work, so the job runs in this process (no driver with its own Ray)
    job = write_job(tmp / "job.toml", reg.address, token_file, data_dir, sites=("north", "east"))
    rc, out, err = cli("run", "--job", job, cwd=tmp)
    assert rc == 1
    error = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "site 'east' was deregistered at 20" in error[0], out + err
    assert "by admin: left the consortium" in error[0]
    assert ": node " not in out + err  # refused before any site actor started
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()

    job = write_job(tmp / "job2.toml", reg.address, token_file, data_dir, sites=("north", "west"))
    rc, out, err = cli("run", "--job", job, cwd=tmp)
    assert rc == 1 and "site 'west': its token was revoked at 20" in out + err, out + err

    # without a site list the job leaves both out (and then has too few sites)
    job = write_job(tmp / "job3.toml", reg.address, token_file, data_dir)
    rc, out, err = cli("run", "--job", job, cwd=tmp)
    assert rc == 1 and "excluding site 'west': its token was revoked" in out + err, out + err
    assert ": node " not in out + err  # refused before any site actor started, as the first
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()

    rc, listing, _ = admin(reg, token_file, "job", "list", "--json")
    jobs = json.loads(listing)
    assert [j["status"] for j in jobs] == ["failed"] * 3
    assert "site 'east' was deregistered" in jobs[2]["error"] and jobs[2]["sites"] == ["north", "east"]
    assert "token was revoked" in jobs[1]["error"]


def test_an_occupied_output_folder_stops_the_job_before_any_work(tmp_path):
    (tmp_path / "result").mkdir()
    (tmp_path / "result" / "manifest.json").write_text("{}")  # a previous result
    (tmp_path / "token").write_text("mft1.admin.admin.x")
    job = write_job(tmp_path / "job.toml", "127.0.0.1:1", tmp_path / "token", tmp_path)  # no registry there
    rc, _, err = cli("run", "--job", job, "--output", tmp_path / "result")
    assert rc == 1 and err.strip() == (
        f"error: --output {str(tmp_path / 'result')!r} already exists and is not an "
        "empty directory; the job never overwrites a result"
    )
    assert (tmp_path / "result" / "manifest.json").read_text() == "{}"
