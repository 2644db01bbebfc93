"""The federated job: registered sites -> combined model stored back in the registry.

    msa-fed run --registry HOST:PORT --admin-token-file F --job JOB.toml
    python cluster/jobs/run_msa.py ...            (the same, for `ray submit` / `ray job submit`)

Steps, each failing with one clear line before any training when something is wrong:
0. the job file is validated fully (:mod:`msa_fed.jobs.config`) before any network work, and an
   occupied ``--output`` directory stops the job;
1. list the registered sites (admin token), keep those named by the job (default: all);
2. download every site's ONNX predictor, pinned to the sha256 the registry recorded, and load
   it through the safe loader (a corrupted or mismatched artifact stops the job here);
3. check that the Ray cluster has a node carrying ``site:<name>`` for every site;
4. start one actor per site on its node; the actor reads the site's private data from that
   node's disk (``site_data`` path template), never from the driver;
5. train the domain classifier (data-parallel over the sites), solve for z with the sites
   computing the sums, save the combined model to the output directory and store it as a new
   registry version with its manifest (sites, artifact hashes, z, eta, Gamma, losses, code
   version, job id), retrying an unreachable registry; the run is recorded as a job.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.model import CombinedModel, load_model, predictor_kind
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.combination import class_union
from msa_fed.control.ops_models import pack_model, unpack_model
from msa_fed.errors import ArtifactError, ConfigError, PeerFault
from msa_fed.jobs.config import JobConfig, read_token_file  # noqa: F401 - read_token_file re-exported
from msa_fed.jobs.operations import (
    output_root,
    DEFAULT_UPLOAD_RETRY_S,
    JobTracker,
    channel_lines,
    check_output_dir,
    connection_flags,
    select_sites,
    site_lines,
    store_result,
    summary_lines,
    upload_command,
)
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.exclusions import ExclusionBook
from msa_fed.runtime.plausibility import ImplausibleAnswer
from msa_fed.runtime.site import SiteWorker


class JobSiteWorker(SiteWorker):
    """A site in a real deployment: reads its private data from its own node's disk
    (``data_path``; a relative path is under ``$MSA_FED_SITE_DATA`` on that node) and loads the
    published predictors from ONNX bytes through the safe loader (never unpickles)."""

    def __init__(
        self,
        name: str,
        index: int,
        data_path: str,
        predictor_artifacts: list,
        task: str,
        loss: str,
        classes=None,
        min_points: int = 20,
        predictor_owners=None,
        sites=None,
    ):
        predictors = [
            load_predictor(data, expected_sha256=sha, kind=predictor_kind(task)) for data, sha in predictor_artifacts
        ]
        if predictor_owners is not None:  # the peers' predictors: every call in a limited worker process
            predictors = [h if k == index else isolate(h, predictor_owners[k]) for k, h in enumerate(predictors)]
        super().__init__(
            name,
            index,
            predictors=predictors,
            task=task,
            loss=loss,
            classes=classes,
            min_points=min_points,
            data_path=data_path,
            sites=sites,
        )


#: where the party that runs jobs records sites excluded after an implausible answer
EXCLUDED_FILE = "excluded_sites.json"
CLEAR_HINT = "msa-fed excluded --clear"


def exclusion_book() -> ExclusionBook:
    """The sites excluded from jobs run here (``<output root>/excluded_sites.json``)."""
    return ExclusionBook(output_root() / EXCLUDED_FILE, "the party that runs jobs")


def check_influence(model: CombinedModel, margin: float | None) -> None:
    """Refuse (PeerFault naming the site) a model in which including a site raises another
    site's loss by more than ``margin`` (the job's ``influence_margin``; None: no refusal)."""
    from msa_fed.core.influence import flagged_at

    table = model.info.get("influence") if isinstance(model.info, dict) else None
    if margin is None or not isinstance(table, dict):
        return
    hits = flagged_at(table, margin)
    if hits:
        site, other, rel = max(hits, key=lambda h: h[2])
        raise PeerFault(
            site,
            f"including site {site!r} raises site {other!r}'s loss by {100 * rel:+.1f}% "
            f"(influence_margin {100 * margin:.0f}%): the model is not stored",
        )


def model_to_bytes(model: CombinedModel) -> bytes:
    """The saved model directory as the registry stores it (msa_fed.control.ops_models)."""
    with tempfile.TemporaryDirectory() as tmp:
        return pack_model(model.save(Path(tmp) / "model"))


def model_from_bytes(data: bytes) -> CombinedModel:
    """Inverse of :func:`model_to_bytes`, unpacked by the checked extractor (no links, fixed names, sizes)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_model(unpack_model(data, Path(tmp) / "model"))


def run_job(
    config: JobConfig,
    admin_token: str,
    *,
    log: Callable[[str], None] = print,
    verbose: bool = True,
    ray_init_kwargs: dict | None = None,
    output_dir=None,
    upload_retry_for: float = DEFAULT_UPLOAD_RETRY_S,
    job_id: str | None = None,
    pointers: bool = True,
) -> tuple[Any, CombinedModel]:
    """Run the federated job; returns (registry record of the stored model, the model).

    The run is recorded in the registry (``msa-fed job show JOB_ID``).  The model is saved to
    ``output_dir`` (default ``msa-fed-jobs/<job id>/model`` under the working directory) before
    it is uploaded; an unreachable registry is retried for ``upload_retry_for`` seconds.
    ``pointers`` False: the registry and the output folder go away with the caller (the demo), so
    the log names neither ``job show`` nor the folder."""
    from msa_fed.control.client import RegistryClient

    def connect():
        return RegistryClient(config.registry, admin_token, retries=0, **client_tls(config))

    config = config.validate()  # before any network work
    if config.fit.topology == "federated":
        from msa_fed.federation.job import check_job_name

        check_job_name(config.name)  # the job's id at the relay: before any work too
        config.check_sealed()
    check_output_dir(output_dir)  # before any work: a job never overwrites a result
    flags = connection_flags(
        config.registry, insecure=config.insecure, tls_ca=config.tls_ca, admin_token_file=config.admin_token_file
    )
    tracker = JobTracker(
        connect, job_id, name=config.name, topology=config.fit.topology, log=log, pointers=pointers, flags=flags
    )
    try:
        record, model = _run_job(
            config,
            admin_token,
            tracker,
            connect,
            log=log,
            verbose=verbose,
            ray_init_kwargs=ray_init_kwargs,
            output_dir=output_dir,
            upload_retry_for=upload_retry_for,
        )
    except BaseException as exc:
        tracker.failed(exc)
        raise
    tracker.succeeded(record.version)
    return record, model


def _run_job(
    config: JobConfig,
    admin_token: str,
    tracker: JobTracker,
    connect,
    *,
    log,
    verbose,
    ray_init_kwargs,
    output_dir,
    upload_retry_for,
) -> tuple[Any, CombinedModel]:
    from msa_fed.control.client import RegistryClient
    from msa_fed.runtime.ray_sites import RaySites, ensure_ray

    fit = config.fit
    with RegistryClient(config.registry, admin_token, **client_tls(config)) as client:
        records = {r.name: r for r in client.list_sites()}
        tracker.start(client, list(config.sites) or sorted(records))
        names = select_sites(client, list(config.sites), records, log)
        missing = [n for n in names if n not in records]
        if missing:
            raise ConfigError(f"site(s) {', '.join(missing)} named by the job are not registered")
        if len(names) < 2:
            raise ConfigError(
                f"the job needs at least two registered sites; found {len(names)}: {', '.join(names) or 'none'}"
            )
        unpublished = [n for n in names if records[n].predictor is None]
        if unpublished:
            raise ConfigError(f"site(s) {', '.join(unpublished)} have not published a predictor")
        exclusion_book().check(names, CLEAR_HINT)
        log(f"registered sites: {', '.join(names)}")
        artifacts: list[tuple[bytes, str]] = []
        predictors: list[Any] = []
        for n in names:
            rec = records[n].predictor
            assert rec is not None  # unpublished sites are refused above
            data, _ = client.download_predictor(n, expected_sha256=rec.sha256)
            try:
                loaded = load_predictor(data, expected_sha256=rec.sha256, kind=predictor_kind(fit.task))
                predictors.append(isolate(loaded, n))  # run here only in a limited worker process
            except ArtifactError as exc:
                raise ArtifactError(f"site {n!r}: predictor artifact rejected: {exc}") from None
            artifacts.append((data, rec.sha256))
            log(f"  {n}: predictor sha256 {rec.sha256[:12]}..., {predictors[-1].n_features_in_} features")

        ray = ensure_ray(fit.ray.address, **{**fit.ray.init_kwargs, **(ray_init_kwargs or {})})
        classes = class_union(p.classes_ for p in predictors) if fit.task == "classification" else None
        data_channel = fit.ray.data_channel
        backend: Any
        if fit.topology == "federated":  # the sites' own processes, through the registry's relay
            from msa_fed.federation.job import federated_backend

            backend = federated_backend(
                config, admin_token, client, names, records, [sha for _, sha in artifacts], classes, fit.loss, log=log
            )
        else:
            resources = ray.cluster_resources()
            absent = [n for n in names if f"site:{n}" not in resources]
            if absent:
                raise ConfigError(
                    f"site(s) {', '.join(absent)} are registered but no Ray node carries the resource "
                    + ", ".join(f"'site:{n}'" for n in absent)
                    + "; start each site's node with "
                    "ray start --resources='{\"site:<name>\": 1}'"
                )
            site_kwargs = [
                dict(
                    name=n,
                    index=k,
                    data_path=config.site_data.format(site=n),
                    predictor_artifacts=artifacts,
                    task=fit.task,
                    loss=fit.loss,
                    classes=classes,
                    min_points=fit.min_points,
                    predictor_owners=names,
                    sites=list(names),
                )
                for k, n in enumerate(names)
            ]
            backend = RaySites(site_kwargs, fit.ray, worker_cls=JobSiteWorker)
        with Coordinator(backend, predictors, replace(fit, verbose=verbose)) as coordinator:  # started here
            for line in site_lines(names, data_channel, topology=fit.topology):
                log(line)
            try:
                model = coordinator.fit()
            except ImplausibleAnswer as exc:  # seen here: the site is excluded until cleared
                exclusion_book().add(exc.site, str(exc))
                raise
            for line in channel_lines(backend, data_channel):
                log(line)

        check_influence(model, config.influence_margin)
        job = {
            "job": config.name,
            "job_id": tracker.job_id,
            "output_version": config.output_version,
            "predictor_sha256": [sha for _, sha in artifacts],
        }
        transcript = getattr(backend, "transcript", lambda: None)()
        if transcript is not None:  # the sites' signed answers (digests and signatures only)
            job["sealed_transcript"] = transcript
        output = Path(output_dir) if output_dir else output_root() / tracker.job_id / "model"
        command = partial(
            upload_command,
            registry=config.registry,
            insecure=config.insecure,
            tls_ca=config.tls_ca,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
            admin_token_file=config.admin_token_file,
        )
        record = store_result(
            model,
            job,
            connect,
            output_dir=output,
            retry_for=upload_retry_for,
            command=command,
            log=log,
            pointers=tracker.pointers,
        )
        log(f"stored combined model version {record.version} (sha256 {record.sha256[:12]}...)")
        return record, model


def client_tls(config: JobConfig) -> dict:
    """The channel options of the job's registry connections: plaintext or TLS, with the client
    certificate when the job file or the command line gives one (mutual TLS)."""
    return config.client_tls()


def report(model: CombinedModel, log: Callable[[str], None] = print):
    """The final summary: z, per-site L_k(z), the objective, epsilon spent when DP is on."""
    for line in summary_lines(model):
        log(line)
