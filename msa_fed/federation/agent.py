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
   :class:`msa_fed.site.worker.SiteWorker` per job, only for the methods of
   :data:`msa_fed.runtime.federated.RELAY_METHODS` (aggregates over its points, counts), with
   requests and answers decoded and encoded by :mod:`msa_fed.boundary.wire` (the boundary schema);
4. applies its own privacy policy (``policy`` in site.toml, :mod:`msa_fed.privacy`) inside each
   job's worker, decides which jobs it serves (``accept_jobs``: every job the registry's admin
   opens, or only those approved with ``msa-fed site approve``), and writes every answer and
   refusal to its one hash-chained audit log, through one writer and one ledger shared by all
   its jobs (:func:`load_site_policy`).

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
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from msa_fed import __version__
from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.predictors import load_predictor, sha256_hex
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as bpb
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.crypto.sealing import job_content_digest
from msa_fed.errors import ConfigError, MsaFedError, PeerFault, PrivacyError
from msa_fed.federation.config import SiteConfig
from msa_fed.federation.dispatch import JobDispatcher
from msa_fed.federation.relay_client import open_channel
from msa_fed.federation.serve_ops import JobLines
from msa_fed.federation.site_sealing import check_join_content, sealing_opener, unsealed_content
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.guard import recording
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy, load_policy
from msa_fed.runtime.exclusions import ExclusionBook
from msa_fed.runtime.federated import RELAY_METHODS
from msa_fed.site.data import load_site_data
from msa_fed.site.job_book import JobBook
from msa_fed.site.published import SiteStateLost
from msa_fed.site.worker import SiteWorker

log = logging.getLogger(__name__)

#: the agent gives up on a silent stream after this many heartbeat intervals
SILENCE_INTERVALS = 4
RECONNECT_MAX_S = 30.0
#: gRPC codes of a registry that is not up yet or too busy to answer in time: the site's
#: start-up check waits them out (with back-off, a line each time) instead of exiting
STARTUP_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
#: how long the start-up check waits for a registry that does not answer
STARTUP_WAIT_S = 300.0
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
    it), written through one writer in the process by the policy's checks inside each job's
    :class:`SiteWorker` and by the agent (jobs joined and ended, refusals before the policy's
    checks), one record per request.  Its ledger (budgets, epsilon
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


def excluded_peers_path(config: SiteConfig) -> Path:
    """The site's record of excluded peers, next to its job book (``<audit>.excluded.json``)."""
    jobs = Path(config.jobs_path)
    return jobs.with_name(jobs.name.split(".")[0] + ".excluded.json")


def job_key(job: str, digest: str) -> str:
    """``job@digest``: the job's id and (the start of) the digest of its content
    (:func:`msa_fed.crypto.sealing.job_content_digest`), the name the audit log and the ledger
    give one content of a job."""
    return f"{job}@{digest[:16]}"


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
        self.lines = JobLines(config.name, echo)  # a line per job joined, ended, refused
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
        # the process's one audit writer and ledger, shared by the agent and every job's guard
        self.ledger = Ledger(self.policy.ledger)
        self.audit = AuditLog(self.policy.audit_log, ledger=self.ledger)
        self.jobs: dict[str, SiteWorker] = {}
        self.opener = sealing_opener(config, self.book)  # None: this site takes unsealed jobs (no seal_key)
        self._queries: dict[str, int] = {}  # job -> labelled-data queries answered
        self._predictors: dict[str, object] = {}  # sha256 -> loaded predictor
        # one download from the registry at a time: the Connect stream holds one of the site
        # token's transfer slots (two by default), so two jobs joining at once would be refused
        # the second fetch; a predictor two jobs share is fetched and loaded once
        self._downloads = threading.RLock()
        # peers whose predictor broke a limit here, refused until the operator clears them
        self.excluded = ExclusionBook(excluded_peers_path(config), f"site {self.name!r}")
        self.dispatch = JobDispatcher()  # jobs answered concurrently, each job's requests in order
        self._stop = threading.Event()
        self._call: Any = None
        self._stub: Any = None

    # ------------------------------------------------------------------ start-up checks
    def check_published(self, wait_s: float = STARTUP_WAIT_S) -> None:
        """Refuse to start unless the predictor and X_unlabeled are what the site published.

        A registry that is not up yet or does not answer in time (UNAVAILABLE,
        DEADLINE_EXCEEDED) is asked again with back-off for up to ``wait_s`` seconds, a line
        each time; any other answer (a refused token, a wrong artifact) ends the start at once."""
        record = self._own_record(wait_s)
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

    def _own_record(self, wait_s: float):
        from msa_fed.control.client import RegistryClient
        from msa_fed.control.connection import KEY_LABELS
        from msa_fed.errors import RegistryError

        deadline = time.monotonic() + float(wait_s)
        pause = 0.5
        while True:
            # a fresh channel per attempt: a channel that failed to connect waits out gRPC's own
            # reconnect back-off (up to 120 s), which would hide a registry that is back already
            try:
                with RegistryClient(
                    self.config.registry, self.token, retries=0, labels=KEY_LABELS, **self.config.channel_kwargs()
                ) as client:  # retried here, with a line each time; a TLS mistake ends the start at once
                    return client.get_site("")
            except RegistryError as exc:
                if exc.code not in STARTUP_TRANSIENT or time.monotonic() + pause > deadline:
                    raise
                self.echo(
                    f"site {self.name}: the registry {self.config.registry} did not answer ({exc.code}); "
                    f"asking again in {pause:.1f} s"
                )
                if self._stop.wait(pause):
                    raise
                pause = min(RECONNECT_MAX_S, pause * 2)

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
                    self.dispatch.submit(msg.forward.job_id, partial(self._answer, msg.forward, out))
                elif part == "end_job":
                    self.dispatch.submit(msg.end_job.job_id, partial(self._end_job, msg.end_job.job_id))
        except grpc.RpcError as exc:
            code = exc.code()
            if self._stop.is_set() or code == grpc.StatusCode.CANCELLED:
                return state["welcomed"]
            if code in FATAL:
                self._record("", "", "connect", "cut_off", rule=code.name, detail=exc.details() or "")
                raise SiteRefused(f"the registry refused site {self.name!r}: {code.name}: {exc.details()}") from None
            why = " ".join((exc.details() or code.name).split())[:200]
            self.echo(f"site {self.name}: lost the connection to the registry {self.config.registry} ({why})")
        finally:
            done.set()
            out.put(None)
            self._call = None
            channel.close()
        return state["welcomed"]

    # ------------------------------------------------------------------ requests
    def _answer(self, fwd: pb.Forward, out: queue.Queue) -> None:
        out.put(pb.SiteToRelay(answer=self.answer(fwd)))

    def _end_job(self, job_id: str) -> None:
        if self.opener is not None:
            self.opener.forget(job_id)
        worker = self.jobs.pop(job_id, None)
        if worker is not None:
            self._record(job_id, "", "end_job", "noted")
            worker.guard.close()  # the shared writer stays open
            self.lines.ended(job_id)

    def answer(self, fwd: pb.Forward) -> pb.Answer:
        """The Answer to one relayed request: sealed and signed when the request was sealed for
        this site (never raises).  A request that fails its seal's checks, or an unsealed request
        at a site that holds a sealing key, is refused in the clear (nothing to seal it to)."""
        if not fwd.sealed and self.opener is None:
            return pb.Answer(call_id=fwd.call_id, response=self.handle(fwd))
        from msa_fed.crypto.sealing import TamperedError

        opener = self.opener
        if opener is None:
            exc: MsaFedError = ConfigError(
                f"site {self.name!r} holds no sealing key (seal_key in site.toml); it takes unsealed jobs"
            )
            self._record(fwd.job_id, fwd.admin, "sealed", "refused", rule="ConfigError", detail=str(exc))
            return pb.Answer(call_id=fwd.call_id, response=wire.failure_proto(exc))
        ctx = None
        try:
            if not fwd.sealed:
                raise PrivacyError("sealed", self.name, f"job {fwd.job_id!r}: it serves only sealed jobs")
            ctx, plain = opener.open(fwd.job_id, fwd.sealed)
            request = bpb.SiteRequest.FromString(plain)
        except (TamperedError, PrivacyError) as err:
            rule = err.rule if isinstance(err, PrivacyError) else "tampered"
            self._record(fwd.job_id, fwd.admin, "sealed", "refused", rule=rule, detail=str(err))
            return pb.Answer(call_id=fwd.call_id, response=wire.failure_proto(err))
        except Exception:  # noqa: BLE001 - authentic bytes that are no SiteRequest: the job's fault
            if ctx is None:
                return pb.Answer(call_id=fwd.call_id, response=wire.error_proto("WireError", "unreadable request"))
            failure = wire.error_proto("WireError", "not a SiteRequest")
            return pb.Answer(call_id=fwd.call_id, sealed=opener.seal(ctx, failure.SerializeToString()))
        response = self.handle(fwd, request, ctx.certificate.content)
        if request.method == "join_job" and response.WhichOneof("body") != "failure":
            self.book.set_seal_floor(ctx.certificate.digest.hex(), ctx.seq)  # no replayed join after a restart
        return pb.Answer(call_id=fwd.call_id, sealed=opener.seal(ctx, response.SerializeToString()))

    def handle(self, fwd: pb.Forward, request=None, content: dict | None = None):
        """The SiteResponse to one relayed request (never raises); ``request``: the opened
        SiteRequest of a sealed frame, ``content``: the signed content of its job.  One audit
        record per request: the policy guard's where it wrote one, else the agent's."""
        with recording() as guard:
            return self._handle(fwd, request, content, guard)

    def _handle(self, fwd: pb.Forward, request, content: dict | None, guard):
        request = fwd.request if request is None else request
        job, admin, method = fwd.job_id, fwd.admin, request.method
        try:
            method, msg = wire.from_proto(request, wire.REQUESTS)
            if method not in RELAY_METHODS:
                raise PrivacyError(
                    "relay_methods",
                    self.name,
                    f"{method!r}: it does not answer it from its process (it answers {sorted(RELAY_METHODS)})",
                )
            if method == "join_job":
                if not isinstance(msg, m.JobSetup):
                    raise wire.WireError("join_job takes a JobSetup")
                out = self._join(job, admin, msg, content)
            else:
                worker = self.jobs.get(job)
                if worker is None:
                    raise SiteStateLost(f"site {self.name!r} has no state for job {job!r} (restarted?)")
                if content is not None:
                    self._check_planned(job, method, content)
                out = getattr(worker, method)(msg)
            response = wire.to_proto(method, out, wire.RESPONSES)
        except (MsaFedError, wire.WireError) as exc:
            if isinstance(exc, PeerFault):  # a peer's predictor broke a limit here: it is named
                self.excluded.add(exc.site, str(exc))
            if not guard.wrote:  # the policy's checks record their own refusals
                rule = exc.rule if isinstance(exc, PrivacyError) and exc.rule else type(exc).__name__
                self._record(job, admin, method, "refused", rule=rule, detail=str(exc))
            self.lines.refused(job, method, getattr(exc, "rule", None) or type(exc).__name__, str(exc))
            return wire.failure_proto(exc)  # a PrivacyError keeps its rule and site
        except Exception as exc:  # noqa: BLE001 - library text stays here; the job sees the type only
            log.exception("site %s: %s for job %s failed", self.name, method, job)
            if not guard.wrote:
                self._record(job, admin, method, "error", detail=type(exc).__name__)
            return wire.error_proto(type(exc).__name__, "internal error at the site (see the site's log)")
        if not guard.wrote:  # join_job, info, ping: not the policy's requests
            self._record(job, admin, method, "answered", answer=_describe(out))
        if method == "join_job":
            self.lines.joined(job, admin, msg.sites)
        else:
            self.lines.answered(job, method)
        return response

    def _record(self, job: str, admin: str, request: str, outcome: str, **extra) -> None:
        """One record of the site's audit log, in the policy's format (``msa-fed site audit`` reads it)."""
        self.audit.append(
            {"site": self.name, "job": job, "admin": admin, "request": request, "outcome": outcome, **extra}
        )

    def _check_planned(self, job: str, method: str, content: dict) -> None:
        """A sealed job's content names the most labelled-data queries it sends: one more is refused."""
        if method not in ("dc_evaluate", "max_bound") or content.get("planned_queries") is None:
            return
        done = self._queries.get(job, 0)
        if done >= int(content["planned_queries"]):
            raise PrivacyError(
                "planned_queries",
                self.name,
                f"job {job!r} planned {content['planned_queries']} labelled-data queries and sent one more",
            )
        self._queries[job] = done + 1

    def _join(self, job: str, admin: str, msg: m.JobSetup, content: dict | None = None) -> m.SiteInfo:
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
        if content is not None:
            check_join_content(self, job, msg, content)
        else:  # an unsealed job: what the join says of it
            content = unsealed_content(job, msg)
        digest = job_content_digest(content)
        key = job_key(job, digest)
        # approvals are for this content, not for a reusable name (a new content is pending again)
        state = self.book.seen(job, admin, sites, digest=digest, content=content)
        if self.config.accept_jobs == "approve" and state == "pending":
            raise PrivacyError(
                "accept_jobs",
                self.name,
                f"job {job!r}: it serves only approved jobs and job {job!r} "
                f"is pending: its operator runs 'msa-fed site approve {job} --config site.toml'",
            )
        if msg.predictor_sha256[msg.index] != self.predictor_sha256:
            raise ConfigError(
                f"job {job!r} uses predictor {msg.predictor_sha256[msg.index][:16]}... for site "
                f"{self.name!r}, which holds {self.predictor_sha256[:16]}..."
            )
        self.excluded.check([s for s in sites if s != self.name], "msa-fed site clear-peer --config site.toml")
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
            audit=self.audit,
            **worker_policy_kwargs(self.policy, msg, run_key(key)),
        )
        worker.published = self._published_samples(job, sites)  # to verify domain models
        info = worker.info()
        old = self.jobs.pop(job, None)
        if old is not None:  # joined again (the job restarted): the new worker replaces it
            old.guard.close()
        self.jobs[job] = worker
        self._queries[job] = 0
        self.book.set_state(job, "served")
        return info

    def _predictor(self, job: str, site: str, sha: str, kind: str):
        key = f"{sha}:{kind}"
        with self._downloads:
            if key in self._predictors:
                return self._predictors[key]
            if sha == self.predictor_sha256:
                data = self.predictor_bytes
            else:
                data = self._fetch(job, site)
            loaded = load_predictor(data, expected_sha256=sha, kind=kind)
            if sha != self.predictor_sha256:  # a peer's: every call in a limited worker process
                loaded = isolate(loaded, site)
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

    def _published_samples(self, job: str, sites: list[str]):
        """A source of the job's published samples (fetched from the registry on first use, each
        checked against the sha256 the registry recorded; this site's own against its own)."""
        got: list = []

        def samples():
            if not got:
                with self._downloads:
                    got.append(tuple(self._fetch_sample(job, name) for name in sites))
            return got[0]

        return samples

    def _fetch_sample(self, job: str, site: str) -> np.ndarray:
        from msa_fed.control.convert import artifact_from_pb

        parts, header = [], None
        try:
            for chunk in self._stub.FetchSample(
                pb.FetchSampleRequest(job_id=job, site=site),
                timeout=120,
                metadata=(("authorization", f"Bearer {self.token}"),),
            ):
                which = chunk.WhichOneof("part")
                if which == "artifact" and header is None:
                    header = artifact_from_pb(chunk.artifact)
                elif which == "chunk" and header is not None:
                    parts.append(chunk.chunk)
                    if sum(len(p) for p in parts) > 256 * 2**20:
                        raise ConfigError(f"the sample of site {site!r} is larger than 256 MiB")
                else:
                    raise ConfigError(f"fetching the sample of site {site!r}: unexpected message")
        except grpc.RpcError as exc:
            raise ConfigError(f"cannot fetch the sample of site {site!r}: {exc.code().name}: {exc.details()}") from None
        data = b"".join(parts)
        if header is None or hashlib.sha256(data).hexdigest() != header.sha256:
            raise ConfigError(f"the sample of site {site!r} does not match its published sha256")
        if site == self.name and header.sha256 != self.sample_sha256:
            raise ConfigError(f"the registry's sample of site {site!r} is not the one this site published")
        rows, cols = int(header.meta["rows"]), int(header.meta["cols"])
        if rows * cols * 4 != len(data):
            raise ConfigError(f"the sample of site {site!r}: {len(data)} bytes do not make ({rows}, {cols})")
        return np.frombuffer(data, dtype="<f4").reshape(rows, cols).astype(np.float64)

    def close(self):
        self.dispatch.close()
        for worker in self.jobs.values():
            worker.guard.close()
        self.jobs.clear()
        self.book.close()
        self.audit.close()
        self.ledger.close()


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
