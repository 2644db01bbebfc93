"""cluster/jobs/run_msa.py reads every input from the working directory before ray.init."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from ops_helpers import REPO


@pytest.fixture
def run_msa():
    spec = importlib.util.spec_from_file_location("run_msa_under_test", REPO / "cluster" / "jobs" / "run_msa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    environ = dict(os.environ)
    yield module
    # main() sets the job's defaults (GRPC_VERBOSITY, MSA_FED_OUTPUT_ROOT) in its process, which here is
    # the suite's: the modules after this one would run their jobs with them
    os.environ.clear()
    os.environ.update(environ)


def test_inputs_are_read_before_ray_init_and_survive_the_working_dir(run_msa, tmp_path, monkeypatch):
    """Ray releases the working directory (we delete it in ray.init); the job still reads its files."""
    import ray

    import msa_fed.cli

    work = tmp_path / "working-dir"
    (work / "jobs").mkdir(parents=True)
    (work / "jobs" / "job.toml").write_text('name = "x"\n[registry]\ntls_ca = "secrets/ca.pem"\n')
    (work / "secrets").mkdir()
    (work / "secrets" / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (work / "secrets" / "admin_token").write_text("mft1.admin.admin.secret\n")
    monkeypatch.chdir(work)
    seen = {}

    def released_init(*args, **kwargs):  # what Ray's agent may do to the working dir meanwhile
        import shutil

        shutil.rmtree(work)
        seen["init"] = True

    def fake_cli(argv):
        seen["argv"] = argv
        split = [part for arg in argv[1:] for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
        flags = dict(zip(split[0::2], split[1::2]))
        seen["job"] = Path(flags["--job"]).read_text()
        seen["token"] = Path(flags["--admin-token-file"]).read_text()
        seen["ca"] = Path(flags["--tls-ca"]).read_text()
        return 0

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", released_init)
    monkeypatch.setattr(msa_fed.cli, "main", fake_cli)
    assert run_msa.main(["--job", "jobs/job.toml", "--admin-token-file=secrets/admin_token", "--registry", "h:1"]) == 0
    assert seen["init"] and not work.exists()
    assert seen["job"].startswith('name = "x"') and seen["token"] == "mft1.admin.admin.secret\n"
    assert seen["ca"].startswith("-----BEGIN")
    assert seen["argv"][0] == "run" and "--registry" in seen["argv"]
    assert "--admin-token-file=" + str(tmp_path) not in " ".join(seen["argv"])  # the copy, not the original
    copy = seen["argv"][seen["argv"].index("--job") + 1]
    assert os.path.isabs(copy) and oct(os.stat(copy).st_mode & 0o777) == "0o600"


def test_missing_files_are_left_for_the_cli_to_report(run_msa, tmp_path):
    argv = ["--job", str(tmp_path / "nope.toml"), "--registry", "h:1"]
    assert run_msa.snapshot_inputs(argv, str(tmp_path)) == argv


def test_ray_address_comes_from_the_job_file_unless_ray_address_is_set(run_msa, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[run]\nray_address = "127.0.0.1:27001"\n')
    assert run_msa.job_ray_address(["--job", str(job)]) == "127.0.0.1:27001"
    job.write_text("[run]\nsites = []\n")
    assert run_msa.job_ray_address(["--job", str(job)]) is None
    assert run_msa.job_ray_address(["--registry", "h:1"]) is None


def test_client_certificate_and_job_key_are_snapshotted_too(run_msa, tmp_path):
    """The client certificate and key (mutual TLS) and the sealing job key, named on the command line
    or in the job file, are copied like every other input and passed on as flags."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("cert.pem", "key.pem", "job.key", "other-cert.pem"):
        (secrets / name).write_text(name)
    job = tmp_path / "job.toml"
    job.write_text(
        f'[registry]\ntls_cert = "{secrets / "cert.pem"}"\ntls_key = "{secrets / "key.pem"}"\n'
        f'[sealing]\njob_key = "{secrets / "job.key"}"\n'
    )
    folder = tmp_path / "copies"
    folder.mkdir()
    out = run_msa.snapshot_inputs(["--job", str(job)], str(folder))
    flags = dict(zip(out[0::2], out[1::2]))
    assert {k: Path(v).read_text() for k, v in flags.items() if k != "--job"} == {
        "--tls-cert": "cert.pem",
        "--tls-key": "key.pem",
        "--job-key": "job.key",
    }
    assert all(Path(v).parent == folder for v in flags.values())
    # a flag overrides the job file's key
    folder2 = tmp_path / "copies2"
    folder2.mkdir()
    out = run_msa.snapshot_inputs(["--job", str(job), "--tls-cert", str(secrets / "other-cert.pem")], str(folder2))
    assert out.count("--tls-cert") == 1 and Path(out[out.index("--tls-cert") + 1]).read_text() == "other-cert.pem"
