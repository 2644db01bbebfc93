"""The site agent: ``msa-fed site serve --config site.toml``.

The site's process, on the site's own machine.  It holds the labelled data, the site's policy and
its request log; it opens **no listening socket**.  It

1. reads ``site.toml`` (:mod:`msa_fed.federation.config`), the data file and the predictor file,
   and checks with the registry that the predictor and ``X_unlabeled`` are exactly what the site
   published (sha256 of the ONNX bytes, and of the sample as little-endian float32, the form in
   which it was published); it refuses to start otherwise;
2. dials out to the registry (TLS; mutual TLS with ``tls_cert``/``tls_key``; plaintext only with
   ``insecure = true`` towards loopback), authenticates with its site token and keeps the relay's
   ``Connect`` stream open, with heartbeats; it reconnects after a network failure and stops for
   good when the registry refuses the site (revoked token, deregistered, another process
   connected as the site);
3. answers the requests relayed on that stream by calling a
   :class:`msa_fed.runtime.site.SiteWorker` per job, only for the methods of
   :data:`msa_fed.runtime.federated.RELAY_METHODS` (aggregates over its points, counts), with
   requests and answers decoded and encoded by :mod:`msa_fed.runtime.wire` (the boundary schema);
4. applies its own privacy policy (``policy`` in site.toml, :mod:`msa_fed.privacy`) inside each
   job's worker, decides which jobs it serves (``accept_jobs``: every job the registry's admin
   opens, or only those approved with ``msa-fed site approve``), and writes every answer and
   refusal to its one hash-chained audit log (:func:`load_site_policy`).

Errors sent back carry the library's own message for the library's own errors (a refusal, a
configuration mismatch) and only the error's type name for anything else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from msa_fed import __version__
from msa_fed.artifacts.predictors import load_predictor, sha256_hex
from msa_fed.control.proto import relay_pb2 as pb
from msa_fed.control.proto import relay_pb2_grpc as pb_grpc
from msa_fed.errors import ConfigError, MsaFedError, PrivacyError
from msa_fed.federation.config import SiteConfig
from msa_fed.federation.relay_client import open_channel
from msa_fed.federation.state import JobBook
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy, load_policy
from msa_fed.runtime import messages as m
from msa_fed.runtime import wire
from msa_fed.runtime.federated import RELAY_METHODS
from msa_fed.runtime.site import SiteStateLost, SiteWorker, load_site_data

log = logging.getLogger(__name__)

#: the agent gives up on a silent stream after this many heartbeat intervals
SILENCE_INTERVALS = 4
RECONNECT_MAX_S = 30.0
#: statuses after which reconnecting cannot help
FATAL = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNIMPLEMENTED,
}


class SiteRefused(MsaFedError):
    """The registry refused this site (or the site refused to start); reconnecting cannot help."""


def sample_sha256(X: np.ndarray) -> str:
    """The sha256 of an unlabelled sample as the registry stores it (little-endian float32, C order)."""
    return hashlib.sha256(np.ascontiguousarray(X, dtype="<f4").tobytes()).hexdigest()


# ---------------------------------------------------------------------- the site's policy
def load_site_policy(config: SiteConfig) -> SitePolicy:
    """The site's privacy policy, read by the site's own process: ``config.policy``
    (:func:`msa_fed.privacy.policy.load_policy`), the defaults when absent.

    The site keeps one audit log, ``config.audit_log``: the policy's hash-chained log
    (:class:`msa_fed.privacy.audit.AuditLog`; ``msa-fed site audit --log F --ledger L`` verifies
    it), written by the policy's checks inside each job's :class:`SiteWorker` and by the agent
    (jobs joined and ended, refusals before the policy's checks).  Its ledger (budgets, epsilon
    spent, the log's length) is a file too, ``config.ledger_path`` (next to the audit log unless
    site.toml or the policy names one), so that budgets survive a restart.  A policy file that
    names another audit log than site.toml is refused: one site, one log.
    """
    policy = load_policy(config.policy) if config.policy is not None else SitePolicy()
    audit = os.path.abspath(config.audit_log)
    if policy.audit_log and os.path.abspath(policy.audit_log) != audit:
        raise ConfigError(
            f"site config: the policy's [budget] audit_log {policy.audit_log!r} is not site.toml's "
            f"audit_log {config.audit_log!r}; a site keeps one audit log (remove one of the two)"
        )
    ledger = os.path.abspath(config.ledger_path)
    if policy.ledger and config.ledger and os.path.abspath(policy.ledger) != ledger:
        raise ConfigError(
            f"site config: the policy's [budget] ledger {policy.ledger!r} is not site.toml's "
            f"ledger {config.ledger!r} (remove one of the two)"
        )
    if policy.ledger and not config.ledger:
        ledger = os.path.abspath(policy.ledger)
    Path(audit).parent.mkdir(parents=True, exist_ok=True)
    Path(ledger).parent.mkdir(parents=True, exist_ok=True)
    return replace(policy, audit_log=audit, ledger=ledger)


def job_key(job: str, msg: m.JobSetup) -> str:
    """``job@digest``: the job's id and a digest of what it asks of the site (its sites, their
    predictors, task, loss, classes, min_points).  A site approves this key, so a job that reuses
    an approved name with other content is a new job, pending again."""
    h = hashlib.sha256()
    classes = None if msg.classes is None else np.asarray(msg.classes).tolist()
    content = [job, list(msg.sites), list(msg.predictor_sha256), msg.task, msg.loss, classes, int(msg.min_points)]
    h.update(repr(content).encode())
    return f"{job}@{h.hexdigest()[:16]}"


def run_key(key: str) -> str:
    """The ledger's name for one run of a job (one join): per-job budgets count per run, so a
    monthly job starts each month with its per-job budgets, and the rolling-day budgets and the
    lifetime epsilon, counted over all runs, bound what repeated runs take."""
    return f"{key}#{os.urandom(4).hex()}"


def worker_policy_kwargs(policy: SitePolicy, job: m.JobSetup, job_id: str) -> dict:
    """Keyword arguments of :class:`SiteWorker` that carry the site's policy for one job: the
    job's min_points can only tighten the policy's (the worker applies the stricter)."""
    return {"min_points": int(job.min_points), "policy": policy, "job_id": job_id, "sites": list(job.sites)}


# ---------------------------------------------------------------------- the agent
class SiteAgent:
    """One site's process (see the module docstring).  ``serve()`` blocks until ``stop()``."""

    def __init__(self, config: SiteConfig, *, echo=print):
        self.config = config
        self.name = config.name
        self.echo = echo
        self.token = config.read_token()
        self.data = load_site_data(config.name, config.data)
        p = Path(config.predictor)
        if not p.is_file():
            raise ConfigError(f"site config: predictor {config.predictor!r} not found")
        self.predictor_bytes = p.read_bytes()
        self.predictor_sha256 = sha256_hex(self.predictor_bytes)
        self.sample_sha256 = sample_sha256(self.data["X_unlabeled"])
        self.policy = load_site_policy(config)
        # load the domain models' libraries (torch, scikit-learn) now, not in the first request:
        # a request's time counts against the job's site_timeout_s
        import msa_fed.core.density  # noqa: F401
        import msa_fed.core.domain_classifier  # noqa: F401

        self.book = JobBook(config.jobs_path)
        self.ledger = Ledger(self.policy.ledger)
        self.audit = AuditLog(self.policy.audit_log, ledger=self.ledger)
        self.jobs: dict[str, SiteWorker] = {}
        self._predictors: dict[str, object] = {}  # sha256 -> loaded predictor
        self._stop = threading.Event()
        self._call: Any = None
        self._stub: Any = None

    # ------------------------------------------------------------------ start-up checks
    def check_published(self) -> None:
        """Refuse to start unless the predictor and X_unlabeled are what the site published."""
        from msa_fed.control.client import RegistryClient

        with RegistryClient(self.config.registry, self.token, **self.config.channel_kwargs()) as client:
            record = client.get_site("")
        if record.name != self.name:
            raise SiteRefused(f"the token belongs to site {record.name!r}, not {self.name!r}")
        if record.predictor is None or record.sample is None:
            raise SiteRefused(
                f"site {self.name!r} has not published both a predictor and an unlabelled sample; "
                "run 'msa-fed site publish' first"
            )
        if record.predictor.sha256 != self.predictor_sha256:
            raise SiteRefused(
                f"predictor {self.config.predictor!r} (sha256 {self.predictor_sha256[:16]}...) is not "
                f"the predictor site {self.name!r} published ({record.predictor.sha256[:16]}...)"
            )
        X = self.data["X_unlabeled"]
        if record.sample.sha256 != self.sample_sha256:
            raise SiteRefused(
                f"X_unlabeled of {self.config.data!r} ({X.shape[0]} x {X.shape[1]}, sha256 "
                f"{self.sample_sha256[:16]}... as float32) is not the sample site {self.name!r} "
                f"published ({record.sample.meta.get('rows')} x {record.sample.meta.get('cols')}, "
                f"{record.sample.sha256[:16]}...)"
            )

    # ------------------------------------------------------------------ serving
    def stop(self):
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def serve(self, check: bool = True) -> None:
        """Check the published artifacts, then connect and answer until stopped or refused."""
        if check:
            self.check_published()
        pause = 0.5
        while not self._stop.is_set():
            connected = self._session()
            if self._stop.is_set():
                break
            pause = 0.5 if connected else min(RECONNECT_MAX_S, pause * 2)
            self.echo(f"site {self.name}: reconnecting in {pause:.1f} s")
            self._stop.wait(pause)

    def _session(self) -> bool:
        """One connection; True if it got as far as the registry's welcome."""
        channel = open_channel(self.config.registry, **self.config.channel_kwargs())
        out: queue.Queue = queue.Queue()
        done = threading.Event()
        state: dict[str, Any] = {"last": time.monotonic(), "interval": 5.0, "welcomed": False}
        out.put(
            pb.SiteToRelay(
                hello=pb.Hello(
                    site=self.name,
                    agent_version=__version__,
                    predictor_sha256=self.predictor_sha256,
                    sample_sha256=self.sample_sha256,
                )
            )
        )

        def outgoing():
            while True:
                item = out.get()
                if item is None:
                    return
                yield item

        stub = pb_grpc.RelayStub(channel)
        call = stub.Connect(outgoing(), metadata=(("authorization", f"Bearer {self.token}"),))
        self._call, self._stub = call, stub

        def heartbeat():
            while not done.wait(state["interval"]):
                out.put(pb.SiteToRelay(heartbeat=pb.Heartbeat(sent_at=time.time())))
                if time.monotonic() - state["last"] > SILENCE_INTERVALS * state["interval"] + 5:
                    log.warning("site %s: the registry has been silent; reconnecting", self.name)
                    call.cancel()
                    return

        threading.Thread(target=heartbeat, name="site-heartbeat", daemon=True).start()
        try:
            for msg in call:
                state["last"] = time.monotonic()
                part = msg.WhichOneof("part")
                if part == "welcome":
                    state["interval"] = max(0.05, msg.welcome.heartbeat_interval_s or 5.0)
                    state["welcomed"] = True
                    self.echo(
                        f"site {self.name}: connected to the registry {self.config.registry} "
                        "(outgoing connection; no listening socket)"
                    )
                elif part == "forward":
                    response = self.handle(msg.forward)
                    out.put(pb.SiteToRelay(answer=pb.Answer(call_id=msg.forward.call_id, response=response)))
                elif part == "end_job":
                    worker = self.jobs.pop(msg.end_job.job_id, None)
                    if worker is not None:
                        self._record(msg.end_job.job_id, "", "end_job", "noted")
                        _close_guard(worker)
        except grpc.RpcError as exc:
            code = exc.code()
            if self._stop.is_set() or code == grpc.StatusCode.CANCELLED:
                return state["welcomed"]
            if code in FATAL:
                self._record("", "", "connect", "cut_off", rule=code.name, detail=exc.details() or "")
                raise SiteRefused(f"the registry refused site {self.name!r}: {code.name}: {exc.details()}") from None
            self.echo(f"site {self.name}: connection lost ({code.name}: {exc.details()})")
        finally:
            done.set()
            out.put(None)
            self._call = None
            channel.close()
        return state["welcomed"]

    # ------------------------------------------------------------------ requests
    def handle(self, fwd: pb.Forward):
        """The SiteResponse to one relayed request (never raises)."""
        job, admin, method = fwd.job_id, fwd.admin, fwd.request.method
        worker, before = None, 0
        try:
            method, msg = wire.from_proto(fwd.request, wire.REQUESTS)
            if method not in RELAY_METHODS:
                raise PrivacyError(
                    "relay_methods",
                    self.name,
                    f"{method!r}: it does not answer it from its process (it answers {sorted(RELAY_METHODS)})",
                )
            if method == "join_job":
                if not isinstance(msg, m.JobSetup):
                    raise wire.WireError("join_job takes a JobSetup")
                out = self._join(job, admin, msg)
            else:
                worker = self.jobs.get(job)
                if worker is None:
                    raise SiteStateLost(f"site {self.name!r} has no state for job {job!r} (restarted?)")
                before = worker.guard.audit.count
                out = getattr(worker, method)(msg)
            response = wire.to_proto(method, out, wire.RESPONSES)
        except (MsaFedError, wire.WireError) as exc:
            if not _guard_wrote(worker, before):  # the policy's checks record their own refusals
                rule = exc.rule if isinstance(exc, PrivacyError) and exc.rule else type(exc).__name__
                self._record(job, admin, method, "refused", rule=rule, detail=str(exc))
            return wire.failure_proto(exc)  # a PrivacyError keeps its rule and site
        except Exception as exc:  # noqa: BLE001 - library text stays here; the job sees the type only
            log.exception("site %s: %s for job %s failed", self.name, method, job)
            if not _guard_wrote(worker, before):
                self._record(job, admin, method, "error", detail=type(exc).__name__)
            return wire.error_proto(type(exc).__name__, "internal error at the site (see the site's log)")
        if not _guard_wrote(worker, before):  # join_job, info, ping: not the policy's requests
            self._record(job, admin, method, "answered", answer=_describe(out))
        return response

    def _record(self, job: str, admin: str, request: str, outcome: str, **extra) -> None:
        """One record of the site's audit log, in the policy's format (``msa-fed site audit`` reads it)."""
        self.audit.append(
            {"site": self.name, "job": job, "admin": admin, "request": request, "outcome": outcome, **extra}
        )

    def _join(self, job: str, admin: str, msg: m.JobSetup) -> m.SiteInfo:
        sites = list(msg.sites)
        if not (0 <= msg.index < len(sites)) or sites[msg.index] != self.name:
            raise ConfigError(f"job {job!r} does not name site {self.name!r} at index {msg.index}")
        if len(msg.predictor_sha256) != len(sites) or len(set(sites)) != len(sites):
            raise ConfigError(f"job {job!r}: one predictor sha256 per site, each site once")
        if msg.task not in ("classification", "regression"):
            raise ConfigError(f"job {job!r}: unknown task {msg.task!r}")
        want_loss = "cross_entropy" if msg.task == "classification" else "squared"
        if msg.loss != want_loss:
            raise ConfigError(f"job {job!r}: loss {msg.loss!r} does not go with task {msg.task!r}")
        key = job_key(job, msg)  # approvals are for this content, not for a reusable name
        state = self.book.seen(key, admin, sites)
        if self.config.accept_jobs == "approve" and state == "pending":
            raise PrivacyError(
                "accept_jobs",
                self.name,
                f"job {job!r}: it serves only approved jobs and job {job!r} "
                f"is pending: its operator runs 'msa-fed site approve {key}'",
            )
        if msg.predictor_sha256[msg.index] != self.predictor_sha256:
            raise ConfigError(
                f"job {job!r} uses predictor {msg.predictor_sha256[msg.index][:16]}... for site "
                f"{self.name!r}, which holds {self.predictor_sha256[:16]}..."
            )
        kind = "regression" if msg.task == "regression" else "probabilities"
        predictors = [self._predictor(job, name, sha, kind) for name, sha in zip(sites, msg.predictor_sha256)]
        d = self.data
        worker = SiteWorker(
            self.name,
            msg.index,
            d["X_labeled"],
            d["y_labeled"],
            d["X_unlabeled"],
            predictors=predictors,
            task=msg.task,
            loss=msg.loss,
            classes=msg.classes,
            **worker_policy_kwargs(self.policy, msg, run_key(key)),
        )
        info = worker.info()
        old = self.jobs.pop(job, None)
        if old is not None:  # joined again (the job restarted): the new worker replaces it
            _close_guard(old)
        self.jobs[job] = worker
        self.book.set_state(key, "served")
        return info

    def _predictor(self, job: str, site: str, sha: str, kind: str):
        key = f"{sha}:{kind}"
        if key in self._predictors:
            return self._predictors[key]
        if sha == self.predictor_sha256:
            data = self.predictor_bytes
        else:
            data = self._fetch(job, site)
        loaded = load_predictor(data, expected_sha256=sha, kind=kind)
        self._predictors[key] = loaded
        return loaded

    def _fetch(self, job: str, site: str) -> bytes:
        parts, header = [], None
        try:
            for chunk in self._stub.FetchPredictor(
                pb.FetchPredictorRequest(job_id=job, site=site),
                timeout=120,
                metadata=(("authorization", f"Bearer {self.token}"),),
            ):
                which = chunk.WhichOneof("part")
                if which == "artifact" and header is None:
                    header = chunk.artifact
                elif which == "chunk":
                    parts.append(chunk.chunk)
                    if sum(len(p) for p in parts) > 256 * 2**20:
                        raise ConfigError(f"the predictor of site {site!r} is larger than 256 MiB")
                else:
                    raise ConfigError(f"fetching the predictor of site {site!r}: unexpected message")
        except grpc.RpcError as exc:
            raise ConfigError(
                f"cannot fetch the predictor of site {site!r}: {exc.code().name}: {exc.details()}"
            ) from None
        return b"".join(parts)

    def close(self):
        for worker in self.jobs.values():
            _close_guard(worker)
        self.jobs.clear()
        self.book.close()
        self.audit.close()
        self.ledger.close()


def _guard_wrote(worker, before: int) -> bool:
    """Whether the worker's policy guard wrote an audit record since its count was ``before``."""
    return worker is not None and worker.guard.audit.count > before


def _close_guard(worker) -> None:
    """Close the files of a finished job's policy guard (its audit log and ledger handles)."""
    worker.guard.audit.close()
    worker.guard.ledger.close()


def _describe(msg) -> str:
    """A short description of an answer for the request log (sizes, never values)."""
    if msg is None:
        return ""
    parts = []
    for name, value in vars(msg).items():
        if isinstance(value, np.ndarray):
            parts.append(f"{name}{list(value.shape)}")
        elif hasattr(value, "arrays"):
            parts.append(f"{name}(" + ",".join(f"{k}{list(v.shape)}" for k, v in value.arrays().items()) + ")")
    return f"{type(msg).__name__} " + " ".join(parts)
