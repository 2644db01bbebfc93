"""The federated job: registered sites -> combined model stored back in the registry.

    msa-fed run --registry HOST:PORT --admin-token-file F --job JOB.toml
    python cluster/jobs/run_msa.py ...            (the same, for `ray submit` / `ray job submit`)

Steps, each failing with one clear line before any training when something is wrong:
1. list the registered sites (admin token), keep those named by the job (default: all);
2. download every site's ONNX predictor, pinned to the sha256 the registry recorded, and load
   it through the safe loader (a corrupted or mismatched artifact stops the job here);
3. check that the Ray cluster has a node carrying ``site:<name>`` for every site;
4. start one actor per site on its node; the actor reads the site's private data from that
   node's disk (``site_data`` path template), never from the driver;
5. train the domain classifier (data-parallel over the sites), solve for z with the sites
   computing the sums, and store the combined model as a new registry version with its
   manifest (sites, artifact hashes, z, eta, Gamma, losses, code version).
"""
from __future__ import annotations

import tempfile
import tomllib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.domain_classifier import ClassifierConfig
from msa_fed.errors import ArtifactError, ConfigError
from msa_fed.artifacts.model import CombinedModel, load_model
from msa_fed.control.ops_models import pack_model, unpack_model
from msa_fed.jobs.operations import (DEFAULT_OUTPUT_ROOT, DEFAULT_UPLOAD_RETRY_S, JobTracker, channel_lines,
                                     check_output_dir, select_sites, site_lines, store_result, summary_lines,
                                     upload_command)
from msa_fed.runtime.channel import MODES as CHANNEL_MODES
from msa_fed.runtime.coordinator import Coordinator, RunConfig
from msa_fed.runtime.site import SiteWorker

@dataclass(frozen=True)
class JobConfig:
    """A job file, validated.  Every key is documented in cluster/README.md."""

    name: str = "msa"
    registry: str = ""
    tls_ca: str | None = None
    insecure: bool = False
    admin_token_file: str | None = None
    task: str = "classification"
    method: str = "dmsa"
    features: str = "standard"
    mu: float = 1e-3
    eta: float = 1e-2
    random_state: int = 0
    objective: str = "minmax"
    min_points: int = 20
    sites: tuple = ()
    site_data: str = "{site}.npz"   # path ON the site's node; relative: under $MSA_FED_SITE_DATA there
    checkpoint_dir: str | None = None
    output_version: str = ""
    ray_address: str | None = None
    data_channel: str = "tls"       # per-round calls: "tls" (direct mutual TLS), "plain" (loopback only), "off"

    @classmethod
    def from_toml(cls, path, **overrides) -> "JobConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"job file {str(path)!r} not found")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"job file {str(path)!r} is not valid TOML: {exc}") from None
        allowed = {"registry": {"address", "tls_ca", "insecure", "admin_token_file"},
                   "model": {"task", "method", "features", "mu", "eta", "random_state", "objective"},
                   "privacy": {"min_points"},
                   "run": {"sites", "site_data", "checkpoint_dir", "output_version", "ray_address", "data_channel"}}
        for table, keys in allowed.items():
            extra = sorted(set(doc.get(table, {})) - keys)
            if extra:
                raise ConfigError(f"job file {str(path)!r}: unknown key(s) {extra} in [{table}]; "
                                  f"expected some of {sorted(keys)}")
        flat: dict[str, Any] = {"name": doc.get("name", "msa")}
        reg = doc.get("registry", {})
        flat.update(registry=reg.get("address", ""), tls_ca=reg.get("tls_ca"), insecure=reg.get("insecure", False),
                    admin_token_file=reg.get("admin_token_file"))
        model = doc.get("model", {})
        for key in ("task", "method", "features", "mu", "eta", "random_state", "objective"):
            if key in model:
                flat[key] = model[key]
        flat["min_points"] = doc.get("privacy", {}).get("min_points", 20)
        run = doc.get("run", {})
        flat["sites"] = tuple(run.get("sites", ()))
        for key in ("site_data", "checkpoint_dir", "output_version", "ray_address", "data_channel"):
            if key in run:
                flat[key] = run[key]
        known = {"name", "registry", "model", "privacy", "run"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"job file {str(path)!r}: unknown table(s) {unknown}; expected {sorted(known)}")
        flat.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**flat).validate()

    def validate(self) -> "JobConfig":
        if not self.registry:
            raise ConfigError("no registry address: give --registry or [registry] address in the job file")
        if self.task not in ("classification", "regression"):
            raise ConfigError(f"[model] task must be 'classification' or 'regression'; got {self.task!r}")
        if self.method not in ("dmsa", "gmsa"):
            raise ConfigError(f"[model] method must be 'dmsa' or 'gmsa'; got {self.method!r}")
        if self.data_channel not in CHANNEL_MODES:
            raise ConfigError(f"[run] data_channel must be one of {list(CHANNEL_MODES)}; got {self.data_channel!r}")
        if "{site}" not in self.site_data:
            raise ConfigError(f"[run] site_data must contain '{{site}}'; got {self.site_data!r}")
        return self


class JobSiteWorker(SiteWorker):
    """A site in a real deployment: reads its private data from its own node's disk
    (``data_path``; a relative path is under ``$MSA_FED_SITE_DATA`` on that node) and loads the
    published predictors from ONNX bytes through the safe loader (never unpickles)."""

    def __init__(self, name: str, index: int, data_path: str, predictor_artifacts: list, task: str,
                 loss: str, classes=None, min_points: int = 20):
        kind = "regression" if task == "regression" else "probabilities"
        predictors = [load_predictor(data, expected_sha256=sha, kind=kind) for data, sha in predictor_artifacts]
        super().__init__(name, index, predictors=predictors, task=task, loss=loss, classes=classes,
                         min_points=min_points, data_path=data_path)


def model_to_bytes(model: CombinedModel) -> bytes:
    """The saved model directory as the registry stores it (msa_fed.control.ops_models)."""
    with tempfile.TemporaryDirectory() as tmp:
        return pack_model(model.save(Path(tmp) / "model"))


def model_from_bytes(data: bytes) -> CombinedModel:
    """Inverse of :func:`model_to_bytes`, unpacked by the checked extractor (no links, fixed names, sizes)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_model(unpack_model(data, Path(tmp) / "model"))


def run_job(config: JobConfig, admin_token: str, *, log: Callable[[str], None] = print,
            verbose: bool = True, ray_init_kwargs: dict | None = None, output_dir=None,
            upload_retry_for: float = DEFAULT_UPLOAD_RETRY_S, job_id: str | None = None) -> tuple[Any, CombinedModel]:
    """Run the federated job; returns (registry record of the stored model, the model).

    The run is recorded in the registry (``msa-fed job show JOB_ID``).  The model is saved to
    ``output_dir`` (default ``msa-fed-jobs/<job id>/model`` under the working directory) before
    it is uploaded; an unreachable registry is retried for ``upload_retry_for`` seconds."""
    from msa_fed.control.client import RegistryClient

    def connect():
        return RegistryClient(config.registry, admin_token, insecure=config.insecure, tls_ca=config.tls_ca, retries=0)

    check_output_dir(output_dir)  # before any work: a job never overwrites a result
    tracker = JobTracker(connect, job_id, name=config.name, topology="ray", log=log)
    try:
        record, model = _run_job(config, admin_token, tracker, connect, log=log, verbose=verbose,
                                 ray_init_kwargs=ray_init_kwargs, output_dir=output_dir,
                                 upload_retry_for=upload_retry_for)
    except BaseException as exc:
        tracker.failed(exc)
        raise
    tracker.succeeded(record.version)
    return record, model


def _run_job(config: JobConfig, admin_token: str, tracker: JobTracker, connect, *, log, verbose, ray_init_kwargs,
             output_dir, upload_retry_for) -> tuple[Any, CombinedModel]:
    from msa_fed.control.client import RegistryClient
    from msa_fed.runtime.ray_sites import RaySites, ensure_ray

    with RegistryClient(config.registry, admin_token, insecure=config.insecure, tls_ca=config.tls_ca) as client:
        records = {r.name: r for r in client.list_sites()}
        tracker.start(client, list(config.sites) or sorted(records))
        names = select_sites(client, list(config.sites), records, log)
        missing = [n for n in names if n not in records]
        if missing:
            raise ConfigError(f"site(s) {missing} named by the job are not registered")
        if len(names) < 2:
            raise ConfigError(f"the job needs at least two registered sites; found {len(names)}: {names}")
        unpublished = [n for n in names if records[n].predictor is None]
        if unpublished:
            raise ConfigError(f"site(s) {unpublished} have not published a predictor")
        log(f"registered sites: {', '.join(names)}")
        artifacts, predictors = [], []
        kind = "regression" if config.task == "regression" else "probabilities"
        for n in names:
            rec = records[n].predictor
            data, _ = client.download_predictor(n, expected_sha256=rec.sha256)
            try:
                predictors.append(load_predictor(data, expected_sha256=rec.sha256, kind=kind))
            except ArtifactError as exc:
                raise ArtifactError(f"site {n!r}: predictor artifact rejected: {exc}") from None
            artifacts.append((data, rec.sha256))
            log(f"  {n}: predictor sha256 {rec.sha256[:12]}..., {predictors[-1].n_features_in_} features")

        ray = ensure_ray(config.ray_address, **(ray_init_kwargs or {}))
        resources = ray.cluster_resources()
        absent = [n for n in names if f"site:{n}" not in resources]
        if absent:
            raise ConfigError(
                f"site(s) {absent} are registered but no Ray node carries the resource "
                + ", ".join(f"'site:{n}'" for n in absent) + "; start each site's node with "
                "ray start --resources='{\"site:<name>\": 1}'")

        classes = None
        if config.task == "classification":
            classes = np.unique(np.concatenate([np.asarray(p.classes_) for p in predictors]))
        loss = "cross_entropy" if config.task == "classification" else "squared"
        site_kwargs = [dict(name=n, index=k, data_path=config.site_data.format(site=n),
                            predictor_artifacts=artifacts, task=config.task, loss=loss, classes=classes,
                            min_points=config.min_points) for k, n in enumerate(names)]
        run_config = RunConfig(task=config.task, method=config.method, features=config.features, eta=config.eta,
                               random_state=config.random_state, min_points=config.min_points,
                               classifier=ClassifierConfig(mu=config.mu),
                               solver={"objective": config.objective}, checkpoint_dir=config.checkpoint_dir,
                               verbose=verbose)
        backend = RaySites(site_kwargs, worker_cls=JobSiteWorker, data_channel=config.data_channel)
        with Coordinator(backend, predictors, run_config) as coordinator:
            coordinator.start()
            for line in site_lines(names, config.data_channel):
                log(line)
            model = coordinator.fit()
            for line in channel_lines(backend, config.data_channel):
                log(line)

        job = {"job": config.name, "job_id": tracker.job_id, "output_version": config.output_version}
        output = Path(output_dir) if output_dir else Path(DEFAULT_OUTPUT_ROOT) / tracker.job_id / "model"
        command = partial(upload_command, registry=config.registry, insecure=config.insecure, tls_ca=config.tls_ca,
                          admin_token_file=config.admin_token_file)
        record = store_result(model, job, connect, output_dir=output, retry_for=upload_retry_for, command=command,
                              log=log)
        log(f"stored combined model version {record.version} (sha256 {record.sha256[:12]}...)")
        return record, model


def read_token_file(path: str | None, what: str = "--admin-token-file") -> str:
    if not path:
        raise ConfigError(f"{what} is required")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: {path!r} not found")
    token = p.read_text().strip()
    if not token:
        raise ConfigError(f"{what}: {path!r} is empty")
    return token


def report(model: CombinedModel, log: Callable[[str], None] = print):
    """The final summary: z, per-site L_k(z), the objective, epsilon spent when DP is on."""
    for line in summary_lines(model):
        log(line)

