"""A sealed federated job with every `msa-fed site serve` unable to import the coordinator's
packages (tests/slim.py's import blocker, inherited by the sandboxed predictor workers they
start): the job runs to its end, finds the z of the in-process fit on the same data (which the
same sealed job with unrestricted sites finds too: tests/federation/test_sealed_relay.py), and no
site process (nor its children) tried to import torch, Ray, scikit-learn, scipy, skl2onnx or tqdm.
The site's other commands (audit, status, jobs) run under the same blocker on what the job left.
A site from a venv made by ``pip install .`` alone: tests/site/test_slim_install.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fedhelpers import NAMES, fit_config, job_config, local_kwargs, output_dir, site_files  # noqa: E402
from slim import blocked, slim_env  # noqa: E402

from msa_fed.artifacts.predictors import sha256_hex  # noqa: E402
from msa_fed.federation.local import LocalFederation  # noqa: E402
from msa_fed.jobs.run import run_job  # noqa: E402


def _job(fed, tmp):
    job = job_config("slimjob", fed.address, insecure=True, **fed.sealing())
    return run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(tmp))


def _local_z(files):
    """The job's fit (the defaults of job_config) in this process, on the same data and predictors."""
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.runtime.coordinator import Coordinator
    from msa_fed.runtime.local import LocalSites

    kw, preds, _ = local_kwargs(files, sorted(NAMES))
    config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver={"objective": "minmax"})
    with Coordinator(LocalSites(kw), preds, config) as c:
        return c.fit()


def _new_site_joins(fed, folder, like, env) -> None:
    folder.mkdir()
    token = fed.registry.issue_token("site", "south")
    rng = np.random.default_rng(7)
    np.save(folder / "sample.npy", rng.normal(size=(60, 2)).astype(np.float32).astype(np.float64))
    np.savez(folder / "data.npz", X_labeled=rng.normal(size=(50, 2)), y_labeled=np.zeros(50))
    (folder / "predictor.onnx").write_bytes(like.predictor)
    common = ["--registry", fed.address, "--token", token, "--insecure"]
    for args in (
        ["site", "keygen", "--out", "site.key"],
        ["site", "register", *common, "--name", "south", "--seal-key", "site.key.pub"],
        ["site", "publish", *common, "--predictor", "predictor.onnx", "--unlabeled", "sample.npy"]
        + ["--labeled", "data.npz"],
        ["site", "heartbeat", *common],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "msa_fed.cli", *args],
            env=env,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])
    record = fed.store.get_site("south")
    assert record is not None and record.predictor is not None and record.sample is not None
    assert record.last_heartbeat is not None and record.predictor.sha256 == sha256_hex(like.predictor)


def test_a_sealed_job_runs_with_every_site_serve_unable_to_import_the_coordinator(tmp_path):
    files = site_files()
    blocker = tmp_path / "blocker"
    with LocalFederation(tmp_path / "slim", files, env=slim_env(blocker)) as fed:
        fed.wait_connected(timeout=180)
        _, model = _job(fed, tmp_path)
        assert model.site_names == sorted(NAMES)
        assert not ray.is_initialized()  # samples this small: the coordinator trains, no stand-in actors
        for name in NAMES:
            assert "slimjob" in fed.log_text(name) and "Traceback" not in fed.log_text(name)
        workdir = fed.workdir
        # a new site registers, publishes and heartbeats from the same blocked environment
        _new_site_joins(fed, tmp_path / "south", files["north"], slim_env(blocker))
    assert blocked(blocker) == []
    # the z of sites that may import anything: the in-process fit on the same files and ONNX
    # predictors (a sealed job of unrestricted site processes finds it to 1e-9, test_sealed_relay.py)
    np.testing.assert_allclose(model.z, _local_z(files).z, rtol=0, atol=1e-9)
    # the site's commands, on what the job left, under the same blocker
    env = slim_env(blocker)
    config = str(workdir / "north" / "site.toml")
    outputs = {}
    for args in (
        ["site", "audit", "--config", config],
        ["site", "status", "--config", config, "--offline"],
        ["site", "jobs", "--config", config],
        ["site", "peers", "--config", config],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "msa_fed.cli", *args],
            env=env,
            cwd=workdir / "north",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])
        outputs[args[1]] = done.stdout
    assert "chain intact" in outputs["audit"] and "slimjob" in outputs["jobs"]
    assert blocked(blocker) == []
