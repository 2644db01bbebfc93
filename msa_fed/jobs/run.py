"""The federated job: registered sites -> combined model stored back in the registry.

    msa-fed run --registry HOST:PORT --admin-token-file F --job JOB.toml
    python cluster/jobs/run_msa.py ...            (the same, for `ray submit` / `ray job submit`)

Five steps, each failing with one clear line before any training when something is wrong:

1. config: the job file is parsed and validated once (:mod:`msa_fed.jobs.config`, before any
   network work and any heavy import), and an occupied ``--output`` directory stops the job;
2. plan (:func:`plan_job`): list the registered sites (admin token), keep those named by the job
   (default: all), download every site's ONNX predictor, pinned to the sha256 the registry
   recorded, and load it through the safe loader (a corrupted or mismatched artifact stops the
   job here);
3. backend (:func:`job_backend`, through :func:`msa_fed.runtime.topology.make_backend`): the
   sites' own processes through the registry's relay (federated), or one actor per site on the
   node carrying ``site:<name>``, reading the site's private data from that node's disk
   (``site_data`` path template), never from the driver (cluster);
4. fit (:func:`fit_job`): train the domain classifier (data-parallel over the sites), solve for
   z with the sites computing the sums;
5. store (:func:`store_job`): save the combined model to the output directory and store it as a
   new registry version with its manifest (sites, artifact hashes, z, eta, Gamma, losses, code
   version, job id), retrying an unreachable registry; the run is recorded as a job.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.model import CombinedModel, load_model, predictor_kind
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.combination import class_union
from msa_fed.control.ops.models import unpack_model
from msa_fed.errors import ArtifactError, ConfigError, JobInterrupted, PeerFault
from msa_fed.jobs.config import JobConfig, read_token_file  # noqa: F401 - read_token_file re-exported
from msa_fed.jobs.operations import (
    output_root,
    DEFAULT_UPLOAD_RETRY_S,
    FINISH_RETRY_S,
    JobLogSender,
    JobTracker,
    channel_lines,
    check_output_dir,
    connection_flags,
    interrupt_cause,
    interrupt_on_sigterm,
    select_sites,
    site_lines,
    store_result,
    summary_lines,
    upload_command,
)
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.exclusions import ExclusionBook
from msa_fed.runtime.plausibility import ImplausibleAnswer


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


def model_from_bytes(data: bytes) -> CombinedModel:
    """A stored model (the bytes of its saved directory, as the registry keeps them), unpacked by the
    checked extractor (no links, fixed names, sizes)."""
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
    from msa_fed.control.registry.client import RegistryClient, SharedClient

    config = config.validate()  # at once for a config read from its file (msa-fed run), checked there
    config.check_sealed()
    check_output_dir(output_dir)  # before any work: a job never overwrites a result
    interrupt_on_sigterm()

    labels = config.connection_labels()  # a TLS mistake names the job file's key or the flag
    # one connection for the whole job (plan, log, store, record); reopened only if it broke
    connect = SharedClient(
        lambda: RegistryClient(config.registry, admin_token, retries=0, labels=labels, **config.client_tls())
    )
    flags = connection_flags(config.registry, admin_token_file=config.admin_token_file, **config.client_tls())
    tracker = JobTracker(
        connect,
        job_id,
        name=config.name,
        topology=config.fit.topology,
        log=log,
        pointers=pointers,
        flags=flags,
        finish_retry_s=min(FINISH_RETRY_S, upload_retry_for),  # a registry down that long is down for now
    )
    try:
        with JobLogSender(connect, tracker), connect() as shared:  # the log: msa-fed job log JOB_ID
            client = shared.with_retries(2)  # the plan's calls retry a registry that blinked
            plan = plan_job(config, client, tracker, log)
            backend = job_backend(config, plan, client, admin_token, ray_init_kwargs, log)
            model = fit_job(config, plan, backend, verbose, log)
            record = store_job(config, plan, backend, model, tracker, connect, output_dir, upload_retry_for, log)
    except KeyboardInterrupt as exc:  # SIGTERM or Ctrl-C: recorded as interrupted, one line
        tracker.failed(exc)
        recorded = "; recorded in the registry as interrupted" if tracker.started else ""
        raise JobInterrupted(f"job {tracker.job_id} interrupted ({interrupt_cause(exc)}){recorded}") from None
    except BaseException as exc:
        tracker.failed(exc)
        raise
    else:
        tracker.succeeded(record.version)
    finally:
        connect.close()
    return record, model


@dataclass(frozen=True)
class JobPlan:
    """What the job runs on: its sites, in order, and their published predictors."""

    names: list[str]
    records: dict  # {site: SiteRecord} as the registry lists them
    artifacts: list[tuple[bytes, str]]  # each site's ONNX predictor and its sha256
    predictors: list[Any]  # the same, loaded (each in a limited worker process)
    classes: Any  # the union of the predictors' classes (classification), else None

    @property
    def predictor_sha256(self) -> list[str]:
        return [sha for _, sha in self.artifacts]


def plan_job(config: JobConfig, client, tracker: JobTracker, log) -> JobPlan:
    """The job's sites (registered, published, not excluded) and their predictors, each pinned to
    the sha256 the registry recorded and loaded through the safe loader."""
    task = config.fit.task
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
            loaded = load_predictor(data, expected_sha256=rec.sha256, kind=predictor_kind(task))
            predictors.append(isolate(loaded, n))  # run here only in a limited worker process
        except ArtifactError as exc:
            raise ArtifactError(f"site {n!r}: predictor artifact rejected: {exc}") from None
        artifacts.append((data, rec.sha256))
        log(f"  {n}: predictor sha256 {rec.sha256[:12]}..., {predictors[-1].n_features_in_} features")
    classes = class_union(p.classes_ for p in predictors) if task == "classification" else None
    return JobPlan(names, records, artifacts, predictors, classes)


def job_backend(config: JobConfig, plan: JobPlan, client, admin_token: str, ray_init_kwargs, log):
    """The job's backend (:func:`msa_fed.runtime.topology.make_backend`): the sites' own processes
    through the registry's relay (federated), or one actor per site on its own node (cluster).
    Ray starts here for the cluster topology; a federated job starts it only if it needs stand-in
    actors for the classifier's training (large published samples), and not at all otherwise."""
    from msa_fed.runtime.ray_actors import ensure_ray
    from msa_fed.runtime.topology import make_backend

    fit = config.fit
    if ray_init_kwargs:
        fit = replace(fit, ray=replace(fit.ray, init_kwargs={**fit.ray.init_kwargs, **ray_init_kwargs}))
    if fit.topology != "federated":
        ensure_ray(fit.ray.address, **fit.ray.init_kwargs)  # keeps run_job's SIGTERM handler
    sites: Any
    if fit.topology == "federated":
        from msa_fed.federation.job import relayed_sites

        sites = relayed_sites(
            config, admin_token, client, plan.names, plan.records, plan.predictor_sha256, plan.classes, log=log
        )
    else:
        from msa_fed.site.admission import host_content

        unpublished = [n for n in plan.names if plan.records[n].sample is None]
        if unpublished:
            raise ConfigError(
                f"site(s) {', '.join(unpublished)} have not published an unlabelled sample (msa-fed site "
                "publish --unlabeled ...); every site checks its peers' samples against the published sha256"
            )
        # the job's content: each site actor checks the samples it is handed against these pins
        content = host_content(
            config.name,
            plan.names,
            [plan.records[n].sample.sha256 for n in plan.names],
            plan.predictor_sha256,
            task=fit.task,
            loss=fit.loss,
            min_points=fit.min_points,
        )
        sites = [
            dict(
                name=n,
                index=k,
                data_path=config.site_data.format(site=n),
                predictor_artifacts=plan.artifacts,
                task=fit.task,
                loss=fit.loss,
                classes=plan.classes,
                min_points=fit.min_points,
                predictor_owners=plan.names,
                sites=list(plan.names),
                content=content,
            )
            for k, n in enumerate(plan.names)
        ]
    return make_backend(fit.topology, fit, sites)


def fit_job(config: JobConfig, plan: JobPlan, backend, verbose: bool, log) -> CombinedModel:
    """Train and solve with the sites; a site whose answer was implausible is excluded from later
    jobs until cleared; a model that fails the job's influence margin is refused."""
    fit = config.fit  # checked with the job's config (influence on with the job's influence report)
    data_channel = fit.ray.data_channel
    with Coordinator(backend, plan.predictors, fit, verbose=verbose) as coordinator:  # started here
        in_process = bool(getattr(backend, "trains_in_process", False))
        for line in site_lines(plan.names, data_channel, topology=fit.topology, classifier_in_process=in_process):
            log(line)
        try:
            model = coordinator.fit()
        except ImplausibleAnswer as exc:  # seen here: the site is excluded until cleared
            exclusion_book().add(exc.site, str(exc))
            raise
        for line in channel_lines(backend, data_channel):
            log(line)
    check_influence(model, config.influence_margin)
    return model


def store_job(config, plan: JobPlan, backend, model, tracker: JobTracker, connect, output_dir, retry_for, log):
    """Save the model to the output folder and store it in the registry as a new version with its
    manifest (the job, its sites' artifacts, a sealed job's transcript); returns the record."""
    job = {
        "job": config.name,
        "job_id": tracker.job_id,
        "output_version": config.output_version,
        "predictor_sha256": plan.predictor_sha256,
    }
    transcript = getattr(backend, "transcript", lambda: None)()
    if transcript is not None:  # the sites' signed answers (digests and signatures only)
        job["sealed_transcript"] = transcript
    output = Path(output_dir) if output_dir else output_root() / tracker.job_id / "model"
    command = partial(upload_command, flags=tracker.flags)
    record = store_result(
        model,
        job,
        connect,
        output_dir=output,
        retry_for=retry_for,
        command=command,
        log=log,
        pointers=tracker.pointers,
    )
    log(f"stored combined model version {record.version} (sha256 {record.sha256[:12]}...)")
    return record


def report(model: CombinedModel, log: Callable[[str], None] = print):
    """The final summary: z, per-site L_k(z), the objective, epsilon spent when DP is on."""
    for line in summary_lines(model):
        log(line)
