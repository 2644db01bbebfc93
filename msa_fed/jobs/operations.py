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
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from msa_fed.artifacts.privacy_view import (
    ESTIMATE_NOTE,
    MEASURED_NOTE,
    dp_on,
    epsilon_line,
    reported_losses,
    site_check_of,
    worst_text,
)
from msa_fed.control.ops.client import OpsClient
from msa_fed.control.ops.models import (
    pack_model,
    read_manifest,
    registry_manifest,
    upload_with_retry,
)
from msa_fed.control.ops.service import exclusion_reason
from msa_fed.control.registry.client import REGISTRY_AWAY
from msa_fed.control.registry.ops_records import JOB_FAILED, JOB_INTERRUPTED, JOB_SUCCEEDED
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
#: how long a job retries recording its end in an unreachable registry (seconds)
FINISH_RETRY_S = 60.0


class ResultNotStoredError(MsaFedError):
    """The job trained a model and saved it locally, but could not store it in the registry."""

    def __init__(self, message: str, saved_dir: Path):
        super().__init__(message)
        self.saved_dir = saved_dir


def interrupt_cause(error: KeyboardInterrupt) -> str:
    """What stopped the driver: the signal a JobInterrupted names, else Ctrl-C."""
    from msa_fed.errors import JobInterrupted

    return str(error.args[0]) if isinstance(error, JobInterrupted) and error.args else "Ctrl-C"


def interrupt_on_sigterm() -> None:
    """SIGTERM raises :class:`msa_fed.errors.JobInterrupted` in the main thread, so that the job
    ends as Ctrl-C does: recorded as interrupted, one line.  Ray's driver installs its own on
    ``ray.init`` (it exits with status 15 and no record); :func:`msa_fed.runtime.ray_actors.ensure_ray`
    puts this one back."""
    import signal
    import threading

    from msa_fed.errors import JobInterrupted

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, _frame):
        raise JobInterrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


class JobTracker:
    """The job's record in the registry; ``with connect() as client`` lends an admin
    :class:`RegistryClient` (the job's :class:`~msa_fed.control.registry.client.SharedClient`)."""

    def __init__(
        self,
        connect: Callable,
        job_id: str | None = None,
        name: str = "msa",
        topology: str = "ray",
        log: Callable[[str], None] = print,
        pointers: bool = True,
        flags: list[str] | None = None,
        finish_retry_s: float = FINISH_RETRY_S,
    ):
        self.connect = connect
        self.flags = list(flags or ["--registry", "HOST:PORT", "--admin-token-file", "ADMIN_TOKEN_FILE"])
        self.finish_retry_s = float(finish_retry_s)
        self.pointers = pointers  # False: the registry goes away with the caller (the demo)
        self.job_id = job_id or new_job_id()
        self.name = name
        self.topology = topology
        self.log = log
        self.started = False

    def start(self, client, sites) -> None:
        OpsClient(client).start_job(self.job_id, self.name, list(sites), self.topology)
        self.started = True
        hint = f" (msa-fed job show {self.job_id})" if self.pointers else ""
        self.log(f"job {self.job_id} recorded in the registry{hint}")

    def finish(self, status: str, model_version: int | None = None, error: str = "") -> None:
        if not self.started:
            return
        deadline, pause = time.monotonic() + self.finish_retry_s, 1.0
        while True:
            try:
                with self.connect() as client:
                    OpsClient(client).finish_job(self.job_id, status, model_version or 0, error)
                return
            except RegistryError as exc:
                if exc.code not in REGISTRY_AWAY or time.monotonic() + pause > deadline:
                    why = f"{exc.code}: {exc.message}"
                    break
                if pause == 1.0:
                    self.log(f"recording the end of job {self.job_id}: the registry is unreachable; retrying")
            time.sleep(pause)
            pause = min(10.0, pause * 2)
        command = ["msa-fed", "job", "finish", self.job_id, "--status", status]
        if model_version:
            command += ["--model-version", str(model_version)]
        if error:
            command += ["--error", error[:200]]
        self.log(
            f"warning: the end of job {self.job_id} could not be recorded in the registry ({why}); "
            f"'msa-fed job list' shows it as running until it is. Record it with: {shlex.join(command + self.flags)}"
        )

    def succeeded(self, model_version: int) -> None:
        self.finish(JOB_SUCCEEDED, model_version)

    def failed(self, error: BaseException) -> None:
        if isinstance(error, KeyboardInterrupt):  # SIGTERM (JobInterrupted) or Ctrl-C
            self.finish(JOB_INTERRUPTED, error=f"interrupted ({interrupt_cause(error)})")
            return
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


def site_lines(names, data_channel: str, topology: str = "ray", classifier_in_process: bool = False) -> list[str]:
    """One line per site: the Ray node that carries its ``site:<name>`` resource, topology, channel
    (federated: where the domain classifier is trained, ``classifier_in_process``: by the
    coordinator itself, on the published samples)."""
    channel = {
        "tls": "direct mutual-TLS data channel",
        "plain": "direct plaintext data channel (loopback)",
        "off": "Ray actor calls",
    }.get(data_channel, data_channel)
    if topology == "federated":  # labelled data stay in the site's process
        where = (
            "the domain classifier is trained here, on the published samples"
            if classifier_in_process  # small published samples: no stand-in actor
            else f"the domain classifier's steps on its published sample run in a Ray actor over {channel}"
        )
        return [
            f"site {n}: answers from its own process through the registry's relay (topology federated); "
            f"{where} (docs/OPERATIONS.md, 'Job output')"
            for n in names
        ]
    import ray

    nodes: dict[str, list[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for key in node.get("Resources", {}):
                if key.startswith("site:"):
                    where = f"{node.get('NodeManagerAddress')} ({node.get('NodeID', '')[:8]})"
                    nodes.setdefault(key[5:], []).append(where)
    return [
        f"site {n}: node {', '.join(nodes.get(n, ['(any)']))}, topology {topology}, per-round calls over {channel}"
        for n in names
    ]


def channel_lines(backend, data_channel: str) -> list[str]:
    """After the run: what each site's per-round calls (the classifier's steps, and the DC
    rounds of the cluster topology) went over, in words.  A call the data channel did not carry
    went over Ray's own connections, as with ``data_channel = "off"``: the same messages, checked
    the same way; nothing else is used in its place."""
    if data_channel == "off":
        return []
    out = []
    sites = getattr(getattr(backend, "stand_ins", backend), "sites", [])  # federated: the stand-in actors
    for e in sites:
        direct, via_ray = int(getattr(e, "channel_calls", 0)), int(getattr(e, "ray_calls", 0))
        if direct + via_ray == 0:
            state = (
                "not needed: this run sent it no per-round calls (e.g. the domain classifier resumed "
                "from its checkpoint)"
            )
        elif via_ray == 0:
            state = f"open: it carried all {direct} per-round calls"
        else:
            state = (
                f"not open for {via_ray} of {direct + via_ray} per-round calls: those went over Ray's "
                "own connections, as with data_channel 'off' (the same messages, checked the same way; "
                "nothing less safe is used in its place; the coordinator's log says why the channel did not open)"
            )
        out.append(f"site {e.name}: {data_channel} data channel {state}")
    return out


def solver_objective(info) -> str | None:
    """What a model's z solve minimised ("minmax" or "gamma"), from its info; None when unknown."""
    solver = info.get("solver") if isinstance(info, dict) else None
    if not isinstance(solver, dict):
        return None
    if solver.get("objective") in ("minmax", "gamma"):
        return str(solver["objective"])
    # models stored before the objective was recorded: the method says it
    return {"slsqp-minmax": "minmax", "dp-surrogate": "minmax"}.get(str(solver.get("method")), "gamma")


def summary_lines(model, epsilon: float | None = None) -> list[str]:
    """The final summary: z, per-site L_k(z), the objective, the DC rounds each site answered,
    and epsilon spent when DP is on."""
    names = model.site_names
    lines = [
        "z      = " + "  ".join(f"{n}={v:.4f}" for n, v in zip(names, model.z)),
        "         (z: each site's weight in the combined model, which predicts a point by mixing the sites' "
        "predictors in proportion to z_k times how likely the point comes from site k)",
    ]
    eps = getattr(model, "epsilon_by_site", None) or {}
    values, texts, measured = reported_losses(model.info, model.domain_losses, eps)
    if texts:
        lines.append("L_k(z) = " + "  ".join(f"{n}={v}" for n, v in zip(names, texts)))
        lines.append(f"eta    = {model.eta:g}")
        objective = solver_objective(model.info)
        mark = {o: " (what the solver minimised)" if o == objective else "" for o in ("minmax", "gamma")}
        lines.append(f"max_k L_k(z) = {worst_text(values, texts)}: the worst site's loss{mark['minmax']}")
        if not dp_on(eps):  # with DP noise at a site, Gamma is the solver's estimate: not shown as a fact
            lines.append(
                f"Gamma(z)     = {model.gamma:.3g}: how far the worst site's loss lies above the z-weighted "
                f"average of the sites' losses, 0 when no site is worse off{mark['gamma']}"
            )
        if objective == "regret":
            lines.append("z minimised the worst site's loss above that site's best achievable loss (objective regret)")
        if measured:
            lines.append(MEASURED_NOTE)
        elif dp_on(eps):
            lines.append(ESTIMATE_NOTE)
    solver = model.info.get("solver") if isinstance(model.info, dict) else None
    if isinstance(solver, dict) and "n_evaluations" in solver:
        influence = model.info.get("influence") if isinstance(model.info, dict) else None
        # the report's requests to each site: its lockstep rounds (older models: one per evaluation)
        extra = 0
        if isinstance(influence, dict):
            extra = int(influence.get("rounds") or influence.get("evaluations") or 0)
        total = int(solver["n_evaluations"]) + extra
        also = f"; the influence report {extra} more, {total} in all" if extra else ""
        lines.append(
            f"DC solver ({solver.get('method')}): {solver['n_evaluations']} rounds for z (queries each site "
            f"answered{also}), {solver.get('n_iter')} iterations, converged = {solver.get('converged')}"
        )
    guarantee = model.info.get("guarantee") if isinstance(model.info, dict) else None
    if isinstance(guarantee, dict) and guarantee.get("line"):
        lines.append(str(guarantee["line"]))
    shown = epsilon_line(names, eps)
    if epsilon is None and shown is None:
        epsilon = (model.info.get("privacy") or {}).get("epsilon") if isinstance(model.info, dict) else None
    if shown is not None:
        lines.append(f"differential privacy: epsilon spent by site: {shown}")
    elif epsilon is not None:
        lines.append(f"differential privacy: epsilon spent = {float(epsilon):.4g}")
    influence = model.info.get("influence") if isinstance(model.info, dict) else None
    if isinstance(influence, dict) and influence.get("sites"):
        from msa_fed.core.influence import influence_lines

        lines += influence_lines(influence)
    check = site_check_of(model.info)
    if check is not None:
        from msa_fed.core.harm import harm_lines

        lines += harm_lines(check)
    return lines


def connection_flags(
    registry: str,
    *,
    insecure: bool,
    tls_ca: str | None,
    admin_token_file: str | None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    server_name: str | None = None,
    timeout: float | None = None,
) -> list[str]:
    """The admin command-line options that reach ``registry`` (for the commands a job prints)."""
    parts = ["--registry", registry]
    if insecure:
        parts.append("--insecure")
    if tls_ca:
        parts += ["--tls-ca", str(tls_ca)]
    if tls_cert and tls_key:
        parts += ["--tls-cert", str(tls_cert), "--tls-key", str(tls_key)]
    if server_name:
        parts += ["--server-name", server_name]
    if timeout is not None and timeout != 30.0:
        parts += ["--timeout", f"{timeout:g}"]
    return parts + ["--admin-token-file", str(admin_token_file) if admin_token_file else "ADMIN_TOKEN_FILE"]


def upload_command(saved: Path, flags: list[str]) -> str:
    """The command that stores a saved model later, with the job's :func:`connection_flags`."""
    return shlex.join(["msa-fed", "model", "upload", str(saved), *flags])


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
    pointers: bool = True,
):
    """Save ``model`` (with ``job`` in its info) under ``output_dir``, then upload it with retries
    (``pointers`` False: the folder goes away with the caller, so it is not named).

    Returns the registry record; raises :class:`ResultNotStoredError` naming the saved directory
    and the command that stores it later."""
    saved = Path(output_dir)
    check_output_dir(saved)
    model.info = {**model.info, "job": dict(job)}
    model.save(saved)
    if pointers:
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


class _Tee:
    """A text stream that writes to ``stream`` and hands every complete line to ``line``."""

    def __init__(self, stream, line: Callable[[str], None]):
        self._stream, self._line, self._part = stream, line, ""

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._part += text
        *lines, self._part = self._part.split("\n")
        for item in lines:
            item = item.rsplit("\r", 1)[-1].strip()  # a progress bar's last state
            if item:
                self._line(item)
        if len(self._part) > 4000:  # no newline for long: a bar redrawn in place
            self._part = self._part.rsplit("\r", 1)[-1][-4000:]
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


class JobLogSender:
    """The driver's output as the job's log in the registry (``msa-fed job log JOB_ID``): every
    line printed on stdout or stderr while the job runs is sent, in batches every ``interval``
    seconds once the job is recorded, best effort (a registry away keeps them for the next try,
    up to ``MAX_PENDING``; the job never waits for its log).  Each batch goes over
    ``with connect() as client``: the job's :class:`~msa_fed.control.registry.client.SharedClient`,
    whose one connection is reopened only after it broke (a restarted registry is reached)."""

    MAX_PENDING = 5000
    BATCH = 500

    def __init__(self, connect, tracker: JobTracker, interval: float = 2.0):
        self.connect, self.tracker, self.interval = connect, tracker, float(interval)
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: tuple = ()

    def _add(self, line: str) -> None:
        with self._lock:
            if len(self._pending) < self.MAX_PENDING:
                self._pending.append(line)

    def flush(self) -> None:
        if not self.tracker.started:
            return
        with self._lock:
            batch = self._pending[: self.BATCH]
        if not batch:
            return
        try:
            with self.connect() as client:
                OpsClient(client).append_job_log(self.tracker.job_id, batch)
        except (MsaFedError, OSError):
            return  # kept for the next try
        with self._lock:
            del self._pending[: len(batch)]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def __enter__(self) -> JobLogSender:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._add), _Tee(sys.stderr, self._add)
        self._thread = threading.Thread(target=self._run, name="job-log", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout, sys.stderr = self._saved
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for _ in range(self.MAX_PENDING // self.BATCH):  # what is left, while the registry takes it
            before = len(self._pending)
            self.flush()
            if not self._pending or len(self._pending) == before:
                break
