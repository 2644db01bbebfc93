"""The site's one request chain: :meth:`SiteApp.handle` is where every request a site process
receives is answered, through the same steps, in this order (:data:`CHAIN`):

1. ``open_seal``: a sealed request is opened and checked (certificate signed by a pinned job key,
   this site's key pinned, authentic, not replayed; its sequence number on disk before its answer
   is sealed, committed with its audit record: :class:`msa_fed.crypto.sealing.SiteOpener`); an
   unsealed one is refused unless the operator opted out of sealing;
2. ``allowlist``: the request's type must be one of
   :data:`msa_fed.site.methods.SITE_METHODS`, this site's own list;
3. ``admit``: a join is checked against the job's signed content and the site's approvals
   (:mod:`msa_fed.site.admission`), peers and excluded peers; any other request needs a joined
   job and stays within the queries the job's content planned;
4. ``gate`` and ``body``: the job's :class:`msa_fed.site.worker.SiteWorker` method, which
   passes its row of the gate table (:data:`msa_fed.site.gate.LABELLED`: state, min_points,
   budgets, checks, DP) before it computes the answer;
5. ``audit``: one record per request in the site's hash-chained audit log (the gate's, when it
   wrote one, else the chain's);
6. ``seal``: the answer sealed and signed for the job (a refusal of step 1 goes back in the clear:
   there is nothing to seal it to).

The transport (the relay's stream, :mod:`msa_fed.federation.agent`) only hands frames in and
answers out, and fetches what the chain asks for (:class:`Transport`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import numpy as np

from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.predictors import load_predictor, sha256_hex
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as bpb
from msa_fed.crypto.sealing import RequestSeal, SiteOpener, TamperedError, job_content_digest
from msa_fed.errors import ConfigError, MsaFedError, PeerFault, PrivacyError
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.guard import recording
from msa_fed.privacy.policy import SitePolicy
from msa_fed.site.admission import (
    check_join,
    check_join_content,
    check_planned,
    checked_sample,
    job_key,
    run_key,
    sample_sha256,
    unsealed_content,
    worker_policy_kwargs,
)
from msa_fed.site.job_book import JobBook, KeptSetups, labelled_digest, setup_scope
from msa_fed.site.methods import SITE_METHODS, check
from msa_fed.site.published import SiteStateLost
from msa_fed.site.worker import Background, SiteWorker

log = logging.getLogger(__name__)

#: the most bytes of published samples a site keeps between jobs (the last sealed job's, by pin)
KEEP_SAMPLES_BYTES = 64 << 20

#: the steps of the chain, in order (see the module docstring)
CHAIN = ("open_seal", "allowlist", "admit", "gate", "body", "audit", "seal")


class Transport(Protocol):
    """What the chain asks of its transport: the registry's published artifacts of a job's site,
    as raw bytes (the chain checks them)."""

    def fetch_predictor(self, job: str, site: str) -> bytes: ...

    def fetch_sample(self, job: str, site: str) -> tuple[bytes, str, int, int]:
        """(bytes, the sha256 the registry recorded, rows, cols)."""
        ...


class SiteApp:
    """One site's request chain (see the module docstring).

    name, data (``load_site_data``'s dict), predictor_bytes : the site and what it published.
    policy, audit : its policy and its one audit writer.  book : its :class:`JobBook`.
    opener : its :class:`SiteOpener` (None: it takes unsealed jobs, site.toml's opt-out).
    accept_jobs : "all" or "approve".  excluded : the peers refused until the operator clears
    them (``check(sites, hint)``, ``add(site, reason)``).  lines : the operator's console lines.
    transport : :class:`Transport`."""

    def __init__(
        self,
        name: str,
        data: dict,
        predictor_bytes: bytes,
        *,
        policy: SitePolicy,
        audit: AuditLog,
        book: JobBook,
        opener: SiteOpener | None,
        accept_jobs: str,
        excluded: Any,
        lines: Any,
        transport: Transport,
    ):
        self.name, self.data, self.policy, self.audit, self.book = name, data, policy, audit, book
        self.predictor_bytes = predictor_bytes
        self.predictor_sha256 = sha256_hex(predictor_bytes)
        self.sample_sha256 = sample_sha256(data["X_unlabeled"])
        self.labelled_digest = labelled_digest(data)  # the scope of the set-ups kept per job content
        self.opener, self.accept_jobs, self.excluded, self.lines = opener, accept_jobs, excluded, lines
        self.transport = transport
        self.jobs: dict[str, SiteWorker] = {}
        self._queries: dict[str, int] = {}  # job -> labelled-data queries answered
        self._waiting: set[tuple[str, str]] = set()  # (job, content digest) recorded as waiting for approval
        self._predictors: dict[str, object] = {}  # sha256:kind -> loaded predictor
        self._samples: dict[str, np.ndarray] = {}  # one sealed job's samples, by their pinned sha256
        # one download at a time: the transport's fetches share the site token's transfer slots;
        # a predictor two jobs share is fetched and loaded once
        self._downloads = threading.RLock()

    # ------------------------------------------------------------------ the chain
    def handle(self, job: str, admin: str, *, sealed: bytes = b"", request=None) -> tuple[Any, bytes]:
        """The answer to one request (never raises): ``(SiteResponse, b"")`` in the clear, or
        ``(None, sealed answer frame)``.  ``sealed``: the request's sealed frame; ``request``: an
        unsealed SiteRequest."""
        # step 1: open_seal
        if not sealed and self.opener is None:
            return self._answer(job, admin, request, None), b""
        if self.opener is None:
            exc: MsaFedError = ConfigError(
                f"site {self.name!r} holds no sealing key (seal_key in site.toml); it takes unsealed jobs"
            )
            self.record(job, admin, "sealed", "refused", rule="ConfigError", detail=str(exc))
            self.lines.refused(job, "sealed", "ConfigError", str(exc))
            return wire.failure_proto(exc), b""
        ctx: RequestSeal | None = None
        try:
            if not sealed:
                raise PrivacyError("sealed", self.name, f"job {job!r}: it serves only sealed jobs")
            ctx, plain = self.opener.open(job, sealed)
            request = bpb.SiteRequest.FromString(plain)
        except (TamperedError, PrivacyError) as err:  # replayed, altered, moved, unsealed: in the clear
            rule = err.rule if isinstance(err, PrivacyError) else "tampered"
            self.record(job, admin, "sealed", "refused", rule=rule, detail=str(err))
            self.lines.refused(job, "sealed", rule, str(err))
            return wire.failure_proto(err), b""
        except Exception:  # noqa: BLE001 - authentic bytes that are no SiteRequest: the job's fault
            if ctx is None:
                return wire.error_proto("WireError", "unreadable request"), b""
            failure = wire.error_proto("WireError", "not a SiteRequest")
            return None, self.opener.seal(ctx, failure.SerializeToString())
        response = self._answer(job, admin, request, ctx.certificate.content)
        # step 6: seal
        return None, self.opener.seal(ctx, response.SerializeToString())

    def _answer(self, job: str, admin: str, request, content: dict | None):
        """Steps 2 to 5 for an opened request; ``content``: the job's signed content (sealed)."""
        with recording() as guard:  # step 5: one audit record per request, the gate's or ours
            method = request.method
            try:
                method, msg = wire.from_proto(request, wire.REQUESTS)
                # step 2: allowlist (the site process's own list; the worker checks its host's too)
                check(self.name, method, SITE_METHODS)
                # step 3: admit
                if method == "join_job":
                    if not isinstance(msg, m.JobSetup):
                        raise wire.WireError("join_job takes a JobSetup")
                    out = self._join(job, admin, msg, content)
                else:
                    worker = self.jobs.get(job)
                    if worker is None:
                        raise SiteStateLost(f"site {self.name!r} has no state for job {job!r} (restarted?)")
                    self._queries[job] = check_planned(self.name, job, method, content, self._queries.get(job, 0))
                    # step 4: gate and body (the worker's method opens its row of the gate table)
                    out = worker.handle(method, msg)
                response = wire.to_proto(method, out, wire.RESPONSES)
            except (MsaFedError, wire.WireError) as exc:
                if isinstance(exc, PeerFault):  # a peer's predictor broke a limit or its output check: named
                    self.excluded.add(exc.site, str(exc))
                rule = exc.rule if isinstance(exc, PrivacyError) and exc.rule else type(exc).__name__
                # the gate's checks record their own refusals; a job waiting for approval asks
                # again every few seconds and is recorded once per content (_join)
                if not guard.wrote and not getattr(exc, "recorded", False):
                    self.record(job, admin, method, "refused", rule=rule, detail=str(exc))
                self.lines.refused(job, method, rule, str(exc), charged=guard.charged)
                return wire.failure_proto(exc)  # a PrivacyError keeps its rule and site
            except Exception as exc:  # noqa: BLE001 - library text stays here; the job sees the type only
                log.exception("site %s: %s for job %s failed", self.name, method, job)
                if not guard.wrote:
                    self.record(job, admin, method, "error", detail=type(exc).__name__)
                return wire.error_proto(type(exc).__name__, "internal error at the site (see the site's log)")
            if not guard.wrote:  # join_job, info, ping: not the gate's records
                self.record(job, admin, method, "answered", answer=describe(out))
        if method == "join_job":
            self.lines.joined(job, admin, msg.sites, charged=guard.charged)
        else:
            self.lines.answered(job, method, charged=guard.charged)
        return response

    def record(self, job: str, admin: str, request: str, outcome: str, **extra) -> None:
        """One record of the site's audit log, in the policy's format (``msa-fed site audit`` reads it)."""
        self.audit.append(
            {"site": self.name, "job": job, "admin": admin, "request": request, "outcome": outcome, **extra}
        )

    # ------------------------------------------------------------------ admit: the join
    def _join(self, job: str, admin: str, msg: m.JobSetup, content: dict | None) -> m.SiteInfo:
        check_join(self.name, job, msg)
        sealed = content is not None
        if content is not None:
            check_join_content(self.name, self.sample_sha256, job, msg, content)
        else:  # an unsealed job: what the join says of it
            content = unsealed_content(job, msg)
        sites = list(msg.sites)
        digest = job_content_digest(content)
        # approvals are for this content, not for a reusable name (a new content is pending again)
        state = self.book.seen(job, admin, sites, digest=digest, content=content)
        if self.accept_jobs == "approve" and state == "pending":
            waiting = PrivacyError(
                "accept_jobs",
                self.name,
                f"job {job!r}: it serves only approved jobs and job {job!r} "
                f"is pending: its operator runs 'msa-fed site approve {job} --config site.toml'",
            )
            # one audit line per job and content while it waits (the job asks again every few seconds)
            waiting.recorded = (job, digest) in self._waiting  # type: ignore[attr-defined]
            self._waiting.add((job, digest))
            raise waiting
        self._waiting.discard((job, digest))
        if msg.predictor_sha256[msg.index] != self.predictor_sha256:
            raise ConfigError(
                f"job {job!r} uses predictor {msg.predictor_sha256[msg.index][:16]}... for site "
                f"{self.name!r}, which holds {self.predictor_sha256[:16]}..."
            )
        self.excluded.check([s for s in sites if s != self.name], "msa-fed site clear-peer --config site.toml")
        kind = "regression" if msg.task == "regression" else "probabilities"
        predictors = [self._predictor(job, name, sha, kind) for name, sha in zip(sites, msg.predictor_sha256)]
        d = self.data
        key = job_key(job, digest)
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
            # a set-up answered for this job content before (an earlier run: the job resumed, or
            # this process restarted) is answered again, not charged again
            setups=KeptSetups(self.book, setup_scope(key, self.labelled_digest, self.policy)),
            # the outputs start once the job is admitted (below): the peers' models go to their
            # worker with this site's rows, one request, not a load and then the rows
            prestart_peers=False,
            **worker_policy_kwargs(self.policy, msg, run_key(key)),
        )
        pins = [s.get("sample_sha256") for s in content["sites"]] if sealed else [None] * len(sites)
        worker.published = self._published_samples(job, sites, pins)  # to verify domain models
        info = worker.info()
        old = self.jobs.pop(job, None)
        if old is not None:  # joined again (the job restarted): the new worker replaces it
            old.guard.close()
        self.jobs[job] = worker
        self._queries[job] = 0
        self.book.set_state(job, "served")
        # the job is admitted: what its set-up requests will need and that depends on neither the
        # domain model nor Qhat is got ready in the background while the answer goes back (the
        # job's peers' published samples, to verify its domain model; the predictors' outputs on
        # this site's rows, for set_qhat); each request waits for its part and raises its failure
        if self.policy.verify_domain_models:
            # (a failure there is raised again, and answered, by the request that needs them)
            Background(worker.published, f"site-{self.name}-samples")
        worker._start_outputs()
        return info

    def _predictor(self, job: str, site: str, sha: str, kind: str):
        key = f"{sha}:{kind}"
        with self._downloads:
            if key in self._predictors:
                return self._predictors[key]
            data = self.predictor_bytes if sha == self.predictor_sha256 else self.transport.fetch_predictor(job, site)
            loaded = load_predictor(data, expected_sha256=sha, kind=kind)
            if sha != self.predictor_sha256:  # a peer's: every call in a limited worker process
                loaded = isolate(loaded, site)
            self._predictors[key] = loaded
            return loaded

    def _published_samples(self, job: str, sites: list[str], pins: list):
        """A source of the job's published samples (fetched on first use, each checked against
        the sha256 the registry recorded and the one the job's signed content pins; one an
        earlier sealed job's same pin fetched is not fetched again)."""
        got: list = []

        def samples():
            if not got:
                with self._downloads:
                    if got:  # fetched meanwhile (the prefetch after the join, _join)
                        return got[0]
                    out, kept = [], {}
                    for name, pin in zip(sites, pins):
                        sample = self._samples.get(pin) if pin is not None else None
                        if sample is None:
                            data, sha, rows, cols = self.transport.fetch_sample(job, name)
                            sample = checked_sample(
                                self.name,
                                name,
                                data,
                                registry_sha256=sha,
                                rows=rows,
                                cols=cols,
                                signed_sha256=pin,
                                own_sha256=self.sample_sha256,
                            )
                            sample.flags.writeable = False
                        if pin is not None:  # its bytes have the sha256 the signed content pins
                            kept[pin] = sample
                        out.append(sample)
                    if kept:  # (none kept where they are too large to hold between jobs)
                        small = sum(a.nbytes for a in kept.values()) <= KEEP_SAMPLES_BYTES
                        self._samples = kept if small else {}
                    got.append(tuple(out))
            return got[0]

        return samples

    # ------------------------------------------------------------------ the job's end
    def end_job(self, job: str) -> None:
        if self.opener is not None:
            self.opener.forget(job)
        worker = self.jobs.pop(job, None)
        if worker is not None:
            self.record(job, "", "end_job", "noted")
            worker.guard.close()  # the shared writer stays open
            self.lines.ended(job)

    def close(self) -> None:
        for worker in self.jobs.values():
            worker.guard.close()
        self.jobs.clear()


def describe(msg) -> str:
    """A short description of an answer for the audit log (sizes, never values)."""
    if msg is None:
        return ""
    parts = []
    for name, value in vars(msg).items():
        if isinstance(value, np.ndarray):
            parts.append(f"{name}{list(value.shape)}")
        elif hasattr(value, "arrays"):
            parts.append(f"{name}(" + ",".join(f"{k}{list(v.shape)}" for k, v in value.arrays().items()) + ")")
    return f"{type(msg).__name__} " + " ".join(parts)
