"""The job's side of operating a federation: its registry record, which sites it may use,
where each site ran, the result saved locally before the upload, and the final summary.

Used by :func:`msa_fed.jobs.run.run_job`:

- :class:`JobTracker` records the run in the registry (``msa-fed job list | show``): started
  with the sites the job asked for, finished as "succeeded" with the model version or as
  "failed" with the error line;
- :func:`select_sites` drops revoked and deregistered sites (a job that names one fails with the
  reason: "site 'b' was deregistered at ... by admin: ...");
- :func:`store_result` writes the model directory under ``output_dir`` first, then uploads it,
  retrying an unreachable registry with backoff; when that fails, the error names the saved
  directory and the ``msa-fed model upload`` command that stores it later.
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from msa_fed.control.ops import exclusion_reason
from msa_fed.control.ops_client import OpsClient
from msa_fed.control.ops_models import (
    pack_model,
    read_manifest,
    registry_manifest,
    upload_with_retry,
)
from msa_fed.control.ops_records import JOB_FAILED, JOB_SUCCEEDED
from msa_fed.errors import ConfigError, MsaFedError, RegistryError

DEFAULT_OUTPUT_ROOT = "msa-fed-jobs"  # relative to the driver's working directory
#: environment variable naming another root for job outputs (``ray job submit`` runs the driver
#: in a working directory that Ray may release, so cluster/jobs/run_msa.py points it elsewhere)
OUTPUT_ROOT_ENV = "MSA_FED_OUTPUT_ROOT"


def output_root() -> Path:
    """Where a job saves its model when ``--output`` is not given."""
    import os

    return Path(os.environ.get(OUTPUT_ROOT_ENV) or DEFAULT_OUTPUT_ROOT).expanduser()


DEFAULT_UPLOAD_RETRY_S = 300.0


class ResultNotStoredError(MsaFedError):
    """The job trained a model and saved it locally, but could not store it in the registry."""

    def __init__(self, message: str, saved_dir: Path):
        super().__init__(message)
        self.saved_dir = saved_dir


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


class JobTracker:
    """The job's record in the registry; ``connect()`` opens a fresh admin :class:`RegistryClient`."""

    def __init__(
        self,
        connect: Callable,
        job_id: str | None = None,
        name: str = "msa",
        topology: str = "ray",
        log: Callable[[str], None] = print,
    ):
        self.connect = connect
        self.job_id = job_id or new_job_id()
        self.name = name
        self.topology = topology
        self.log = log
        self.started = False

    def start(self, client, sites) -> None:
        OpsClient(client).start_job(self.job_id, self.name, list(sites), self.topology)
        self.started = True
        self.log(f"job {self.job_id} recorded in the registry (msa-fed job show {self.job_id})")

    def finish(self, status: str, model_version: int | None = None, error: str = "") -> None:
        if not self.started:
            return
        try:
            with self.connect() as client:
                OpsClient(client).finish_job(self.job_id, status, model_version or 0, error)
        except RegistryError as exc:  # the registry is down: the job's own error says more
            self.log(f"warning: could not record the end of job {self.job_id} in the registry ({exc})")

    def succeeded(self, model_version: int) -> None:
        self.finish(JOB_SUCCEEDED, model_version)

    def failed(self, error: BaseException) -> None:
        self.finish(
            JOB_FAILED, error=f"{type(error).__name__}: {error}" if not isinstance(error, MsaFedError) else str(error)
        )


def select_sites(client, requested, registered: dict, log: Callable[[str], None] = print) -> list[str]:
    """The sites the job uses: ``requested`` (or every registered site) minus revoked and deregistered
    ones.  A site the job names explicitly and may not use stops the job with the reason."""
    statuses = {s.name: s for s in OpsClient(client).site_statuses()}
    if requested:
        reasons = [exclusion_reason(statuses[n]) for n in requested if n in statuses]
        refused = [r for r in reasons if r is not None]
        if refused:
            raise ConfigError("the job names site(s) it may not use: " + "; ".join(refused))
        return list(requested)
    names = []
    for name in sorted(registered):
        why = exclusion_reason(statuses[name]) if name in statuses else None
        if why:
            log(f"excluding {why}")
        else:
            names.append(name)
    return names


def site_lines(names, data_channel: str, topology: str = "ray") -> list[str]:
    """One line per site: the Ray node that carries its ``site:<name>`` resource, topology, channel."""
    import ray

    nodes: dict[str, list[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for key in node.get("Resources", {}):
                if key.startswith("site:"):
                    where = f"{node.get('NodeManagerAddress')} ({node.get('NodeID', '')[:8]})"
                    nodes.setdefault(key[5:], []).append(where)
    channel = {
        "tls": "direct mutual-TLS data channel",
        "plain": "direct plaintext data channel (loopback)",
        "off": "Ray actor calls",
    }.get(data_channel, data_channel)
    if topology == "federated":  # labelled data stay in the site's process; its stand-in holds the published sample
        return [
            f"site {n}: own process through the registry's relay, topology federated; its stand-in actor's "
            f"classifier steps over {channel}"
            for n in names
        ]
    return [
        f"site {n}: node {', '.join(nodes.get(n, ['(any)']))}, topology {topology}, per-round calls over {channel}"
        for n in names
    ]


def channel_lines(backend, data_channel: str) -> list[str]:
    """After the run: which sites' per-round calls actually used the direct channel."""
    if data_channel == "off":
        return []
    out = []
    sites = getattr(getattr(backend, "stand_ins", backend), "sites", [])  # federated: the stand-in actors
    for e in sites:
        state = "open" if getattr(e, "channel", None) is not None else "not open (calls went through Ray)"
        out.append(f"site {e.name}: {data_channel} data channel {state}")
    return out


def summary_lines(model, epsilon: float | None = None) -> list[str]:
    """The final summary: z, per-site L_k(z), the objective, the DC rounds each site answered,
    and epsilon spent when DP is on."""
    names = model.site_names
    lines = ["z      = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(names, model.z))]
    if model.domain_losses is not None:
        lines.append("L_k(z) = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(names, model.domain_losses)))
        lines.append(
            f"eta    = {model.eta:g}   max_k L_k(z) = {np.max(model.domain_losses):.4f}   Gamma(z) = {model.gamma:.3g}"
        )
    solver = model.info.get("solver") if isinstance(model.info, dict) else None
    if isinstance(solver, dict) and "n_evaluations" in solver:
        lines.append(
            f"DC solver ({solver.get('method')}): {solver['n_evaluations']} rounds (queries each site "
            f"answered), {solver.get('n_iter')} iterations, converged = {solver.get('converged')}"
        )
    if epsilon is None:
        epsilon = (model.info.get("privacy") or {}).get("epsilon") if isinstance(model.info, dict) else None
    if epsilon is not None:
        lines.append(f"differential privacy: epsilon spent = {float(epsilon):.4g}")
    return lines


def upload_command(
    saved: Path, registry: str, *, insecure: bool, tls_ca: str | None, admin_token_file: str | None
) -> str:
    parts = ["msa-fed", "model", "upload", str(saved), "--registry", registry]
    if insecure:
        parts.append("--insecure")
    if tls_ca:
        parts += ["--tls-ca", str(tls_ca)]
    parts += ["--admin-token-file", str(admin_token_file) if admin_token_file else "ADMIN_TOKEN_FILE"]
    return shlex.join(parts)


def check_output_dir(output_dir) -> None:
    """Refuse an ``--output`` that already holds something (checked before the job does any work)."""
    if output_dir is None:
        return
    path = Path(output_dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            f"--output {str(path)!r} already exists and is not an empty directory; the job never overwrites a result"
        )


def store_result(
    model,
    job: dict,
    connect: Callable,
    *,
    output_dir,
    retry_for: float,
    command: Callable[[Path], str],
    log: Callable[[str], None] = print,
):
    """Save ``model`` (with ``job`` in its info) under ``output_dir``, then upload it with retries.

    Returns the registry record; raises :class:`ResultNotStoredError` naming the saved directory
    and the command that stores it later."""
    saved = Path(output_dir)
    check_output_dir(saved)
    model.info = {**model.info, "job": dict(job)}
    model.save(saved)
    log(f"combined model saved to {saved.resolve()}")
    manifest = registry_manifest(read_manifest(saved))
    try:
        return upload_with_retry(
            connect, pack_model(saved), manifest, retry_for=retry_for, upload_id=f"job-{job['job_id']}", log=log
        )
    except RegistryError as exc:
        attempts = getattr(exc, "attempts", 1)
        raise ResultNotStoredError(
            f"the combined model could not be stored in the registry ({exc.code}: {exc.message}; "
            f"{attempts} attempt(s) over up to {retry_for:g} s). It is saved in {saved.resolve()}; "
            f"store it later with: {command(saved.resolve())}",
            saved.resolve(),
        ) from None
