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

import io
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from msa_fed import __version__
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.domain_classifier import ClassifierConfig
from msa_fed.errors import ArtifactError, ConfigError
from msa_fed.artifacts.model import CombinedModel, load_model
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
    topology: str = "federated"     # "federated" (site processes dial out) or "cluster" (sites are Ray nodes)
    site_timeout_s: float = 60.0    # a site unreachable (or an actor unplaceable) this long ends the job

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
                   "run": {"sites", "site_data", "checkpoint_dir", "output_version", "ray_address", "data_channel",
                           "topology", "site_timeout_s"}}
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
        for key in ("site_data", "checkpoint_dir", "output_version", "ray_address", "data_channel", "topology",
                    "site_timeout_s"):
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
        if self.topology not in ("federated", "cluster"):
            raise ConfigError(f"[run] topology must be 'federated' or 'cluster'; got {self.topology!r}")
        if isinstance(self.site_timeout_s, bool) or not isinstance(self.site_timeout_s, (int, float)) \
                or not self.site_timeout_s > 0:
            raise ConfigError(f"[run] site_timeout_s must be a number of seconds > 0; got {self.site_timeout_s!r}")
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
    """The saved model directory as an uncompressed tar (what the registry stores)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save(Path(tmp) / "model")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(Path(tmp) / "model", arcname="model")
        return buf.getvalue()


def model_from_bytes(data: bytes) -> CombinedModel:
    """Inverse of :func:`model_to_bytes`; extraction refuses links, absolute paths and '..'."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise ArtifactError(f"combined model archive is unreadable: {exc}") from None
        return load_model(Path(tmp) / "model")


def run_job(config: JobConfig, admin_token: str, *, log: Callable[[str], None] = print,
            verbose: bool = True, ray_init_kwargs: dict | None = None) -> tuple[Any, CombinedModel]:
    """Run the federated job; returns (registry record of the stored model, the model)."""
    from msa_fed.control.client import RegistryClient
    from msa_fed.runtime.ray_sites import RaySites, ensure_ray

    with RegistryClient(config.registry, admin_token, insecure=config.insecure, tls_ca=config.tls_ca) as client:
        records = {r.name: r for r in client.list_sites()}
        names = list(config.sites) or sorted(records)
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

        classes = None
        if config.task == "classification":
            classes = np.unique(np.concatenate([np.asarray(p.classes_) for p in predictors]))
        loss = "cross_entropy" if config.task == "classification" else "squared"
        ray = ensure_ray(config.ray_address, **(ray_init_kwargs or {}))
        if config.topology == "federated":  # the sites' own processes, through the registry's relay
            from msa_fed.federation.job import federated_backend

            backend = federated_backend(config, admin_token, client, names, records,
                                        [sha for _, sha in artifacts], classes, loss, log=log)
        else:
            resources = ray.cluster_resources()
            absent = [n for n in names if f"site:{n}" not in resources]
            if absent:
                raise ConfigError(
                    f"site(s) {absent} are registered but no Ray node carries the resource "
                    + ", ".join(f"'site:{n}'" for n in absent) + "; start each site's node with "
                    "ray start --resources='{\"site:<name>\": 1}'")
            site_kwargs = [dict(name=n, index=k, data_path=config.site_data.format(site=n),
                                predictor_artifacts=artifacts, task=config.task, loss=loss, classes=classes,
                                min_points=config.min_points) for k, n in enumerate(names)]
            backend = RaySites(site_kwargs, worker_cls=JobSiteWorker, data_channel=config.data_channel,
                               start_timeout_s=config.site_timeout_s, retry_timeout_s=config.site_timeout_s)
        run_config = RunConfig(task=config.task, method=config.method, features=config.features, eta=config.eta,
                               random_state=config.random_state, min_points=config.min_points,
                               classifier=ClassifierConfig(mu=config.mu),
                               solver={"objective": config.objective}, checkpoint_dir=config.checkpoint_dir,
                               verbose=verbose)
        with Coordinator(backend, predictors, run_config) as coordinator:
            model = coordinator.fit()

        manifest = model.manifest()
        manifest.update(job=config.name, output_version=config.output_version,
                        predictor_sha256=[sha for _, sha in artifacts], code_version=__version__)
        record = client.upload_combined_model(model_to_bytes(model), manifest)
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
    log("z      = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(model.site_names, model.z)))
    log(f"eta    = {model.eta:g}   Gamma = {model.gamma:.3g}   max_k L_k = {np.max(model.domain_losses):.4f}")
    log("L_k(z) = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(model.site_names, model.domain_losses)))

