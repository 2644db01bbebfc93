"""The federated job: registered sites -> combined model stored back in the registry.

    msa-fed run --registry HOST:PORT --admin-token-file F --job JOB.toml
    python cluster/jobs/run_msa.py ...            (the same, for `ray submit` / `ray job submit`)

Steps, each failing with one clear line before any training when something is wrong:
0. the job file is validated fully (:mod:`msa_fed.jobs.config`) before any network work;
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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from msa_fed import __version__
from msa_fed.artifacts.model import CombinedModel, load_model, predictor_kind
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.combination import class_union
from msa_fed.errors import ArtifactError, ConfigError
from msa_fed.jobs.config import JobConfig, read_token_file  # noqa: F401 - read_token_file re-exported
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.site import SiteWorker


class JobSiteWorker(SiteWorker):
    """A site in a real deployment: reads its private data from its own node's disk
    (``data_path``; a relative path is under ``$MSA_FED_SITE_DATA`` on that node) and loads the
    published predictors from ONNX bytes through the safe loader (never unpickles)."""

    def __init__(self, name: str, index: int, data_path: str, predictor_artifacts: list, task: str,
                 loss: str, classes=None, min_points: int = 20):
        predictors = [load_predictor(data, expected_sha256=sha, kind=predictor_kind(task))
                      for data, sha in predictor_artifacts]
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
    """Run the federated job; returns (registry record of the stored model, the model).

    ``config`` is validated again here, before any network work."""
    from msa_fed.control.client import RegistryClient
    from msa_fed.runtime.ray_sites import RaySites, ensure_ray

    config = config.validate()
    fit = config.fit
    if fit.topology != "cluster":
        raise ConfigError(f"[run] topology = {fit.topology!r} needs the federated backend, which this installation "
                          "lacks; run the job on a Ray cluster with [run] topology = \"cluster\"")
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
        for n in names:
            rec = records[n].predictor
            data, _ = client.download_predictor(n, expected_sha256=rec.sha256)
            try:
                predictors.append(load_predictor(data, expected_sha256=rec.sha256, kind=predictor_kind(fit.task)))
            except ArtifactError as exc:
                raise ArtifactError(f"site {n!r}: predictor artifact rejected: {exc}") from None
            artifacts.append((data, rec.sha256))
            log(f"  {n}: predictor sha256 {rec.sha256[:12]}..., {predictors[-1].n_features_in_} features")

        ray = ensure_ray(fit.ray.address, **{**fit.ray.init_kwargs, **(ray_init_kwargs or {})})
        resources = ray.cluster_resources()
        absent = [n for n in names if f"site:{n}" not in resources]
        if absent:
            raise ConfigError(
                f"site(s) {absent} are registered but no Ray node carries the resource "
                + ", ".join(f"'site:{n}'" for n in absent) + "; start each site's node with "
                "ray start --resources='{\"site:<name>\": 1}'")

        classes = class_union(p.classes_ for p in predictors) if fit.task == "classification" else None
        site_kwargs = [dict(name=n, index=k, data_path=config.site_data.format(site=n),
                            predictor_artifacts=artifacts, task=fit.task, loss=fit.loss, classes=classes,
                            min_points=fit.min_points) for k, n in enumerate(names)]
        backend = RaySites(site_kwargs, fit.ray, worker_cls=JobSiteWorker)
        with Coordinator(backend, predictors, replace(fit, verbose=verbose)) as coordinator:
            model = coordinator.fit()

        manifest = model.manifest()
        manifest.update(job=config.name, output_version=config.output_version,
                        predictor_sha256=[sha for _, sha in artifacts], code_version=__version__)
        record = client.upload_combined_model(model_to_bytes(model), manifest)
        log(f"stored combined model version {record.version} (sha256 {record.sha256[:12]}...)")
        return record, model


def report(model: CombinedModel, log: Callable[[str], None] = print):
    log("z      = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(model.site_names, model.z)))
    log(f"eta    = {model.eta:g}   Gamma = {model.gamma:.3g}   max_k L_k = {np.max(model.domain_losses):.4f}")
    log("L_k(z) = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(model.site_names, model.domain_losses)))

