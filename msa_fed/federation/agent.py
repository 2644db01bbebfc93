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
3. hands every request relayed on that stream to the site's one request chain,
   :meth:`msa_fed.site.chain.SiteApp.handle` (open the seal, the site's allowlist, admission,
   the gate table's row, the body, the audit record, the sealed answer), each job's requests in
   order (:class:`msa_fed.federation.dispatch.JobDispatcher`), and sends its answer back; it
   fetches, for the chain, the published predictors and samples of a job's peers.

Every rule the site applies lives in :mod:`msa_fed.site` and :mod:`msa_fed.privacy`; this module
is the transport only.  The site keeps one audit log and one ledger, shared by all its jobs
(:func:`load_site_policy`).
"""

from __future__ import annotations

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

from msa_fed import __version__
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.errors import ConfigError, MsaFedError
from msa_fed.federation.config import SiteConfig
from msa_fed.federation.dispatch import JobDispatcher
from msa_fed.federation.relay_client import open_channel
from msa_fed.federation.serve_ops import JobLines
from msa_fed.federation.site_sealing import sealing_opener
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy, load_policy
from msa_fed.runtime.exclusions import ExclusionBook
from msa_fed.site.admission import job_key, run_key, sample_sha256, worker_policy_kwargs  # noqa: F401 - also here
from msa_fed.site.chain import SiteApp
from msa_fed.site.data import load_site_data
from msa_fed.site.job_book import JobBook

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


# ---------------------------------------------------------------------- the site's policy
def load_site_policy(config: SiteConfig) -> SitePolicy:
    """The site's privacy policy, read by the site's own process: ``config.policy``
    (:func:`msa_fed.privacy.policy.load_policy`), the defaults when absent.

    The site keeps one audit log, ``config.audit_log``: the policy's hash-chained log
    (:class:`msa_fed.privacy.audit.AuditLog`; ``msa-fed site audit --log F --ledger L`` verifies
    it), written through one writer in the process by the policy's checks inside each job's
    :class:`msa_fed.site.worker.SiteWorker` and by the site's chain (jobs joined and ended,
    refusals before the policy's checks), one record per request.  Its ledger (budgets, epsilon
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
        self.policy = load_site_policy(config)
        # load the domain models' libraries (torch, scikit-learn) now, not in the first request:
        # a request's time counts against the job's site_timeout_s
        import msa_fed.core.density  # noqa: F401
        import msa_fed.core.domain_classifier  # noqa: F401

        self.book = JobBook(config.jobs_path)
        # the process's one audit writer and ledger, shared by the chain and every job's guard
        self.ledger = Ledger(self.policy.ledger)
        self.audit = AuditLog(self.policy.audit_log, ledger=self.ledger)
        self.app = SiteApp(
            self.name,
            self.data,
            self.predictor_bytes,
            policy=self.policy,
            audit=self.audit,
            book=self.book,
            opener=sealing_opener(config, self.book, self.ledger),  # None: this site takes unsealed jobs (no seal_key)
            accept_jobs=config.accept_jobs,
            # peers whose predictor broke a limit here, refused until the operator clears them
            excluded=ExclusionBook(excluded_peers_path(config), f"site {self.name!r}"),
            lines=self.lines,
            transport=self,
        )
        self.predictor_sha256, self.sample_sha256 = self.app.predictor_sha256, self.app.sample_sha256
        self.opener = self.app.opener
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
        from msa_fed.control.registry.client import RegistryClient
        from msa_fed.control.transport.connection import KEY_LABELS
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
        self.app.end_job(job_id)

    def answer(self, fwd: pb.Forward) -> pb.Answer:
        """The Answer to one relayed request, from the site's chain (never raises)."""
        response, sealed = self.app.handle(fwd.job_id, fwd.admin, sealed=fwd.sealed, request=fwd.request)
        if sealed:
            return pb.Answer(call_id=fwd.call_id, sealed=sealed)
        return pb.Answer(call_id=fwd.call_id, response=response)

    def _record(self, job: str, admin: str, request: str, outcome: str, **extra) -> None:
        self.app.record(job, admin, request, outcome, **extra)

    # ------------------------------------------------------------------ the chain's fetches
    def _fetch(self, what: str, call, request, site: str) -> tuple[Any, bytes]:
        """The header and the bytes of site ``site``'s ``what`` ("predictor" or "sample") as
        ``call(request)`` streams them: the header first, then at most 256 MiB of chunks."""
        from msa_fed.site.admission import MAX_SAMPLE_BYTES

        parts, header, size = [], None, 0
        try:
            for chunk in call(request, timeout=120, metadata=(("authorization", f"Bearer {self.token}"),)):
                which = chunk.WhichOneof("part")
                if which == "artifact" and header is None:
                    header = chunk.artifact
                elif which == "chunk" and header is not None:
                    parts.append(chunk.chunk)
                    size += len(chunk.chunk)
                    if size > MAX_SAMPLE_BYTES:
                        raise ConfigError(f"the {what} of site {site!r} is larger than 256 MiB")
                else:
                    raise ConfigError(f"fetching the {what} of site {site!r}: unexpected message")
        except grpc.RpcError as exc:
            raise ConfigError(f"cannot fetch the {what} of site {site!r}: {exc.code().name}: {exc.details()}") from None
        if header is None:
            raise ConfigError(f"fetching the {what} of site {site!r}: no header")
        return header, b"".join(parts)

    def fetch_predictor(self, job: str, site: str) -> bytes:
        request = pb.FetchPredictorRequest(job_id=job, site=site)
        return self._fetch("predictor", self._stub.FetchPredictor, request, site)[1]

    def fetch_sample(self, job: str, site: str) -> tuple[bytes, str, int, int]:
        request = pb.FetchSampleRequest(job_id=job, site=site)
        header, data = self._fetch("sample", self._stub.FetchSample, request, site)
        if header.WhichOneof("meta") != "sample":
            raise ConfigError(f"the sample of site {site!r} has no readable shape")
        return data, header.sha256, int(header.sample.rows), int(header.sample.cols)

    def close(self):
        self.dispatch.close()
        self.app.close()
        self.book.close()
        self.audit.close()
        self.ledger.close()
