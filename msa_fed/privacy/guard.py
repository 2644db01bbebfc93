"""The site's policy in force for one job: budgets, the audit trail, and DP accounting.

:class:`SiteGuard` is what :class:`msa_fed.site.worker.SiteWorker` calls before any aggregate
leaves the site: ``guard.request(kind, sizes)`` opens an audit record, the worker's gate runs
the rules of :mod:`msa_fed.privacy.rules`, and the record is written as answered or refused.

A site process keeps one audit writer (and one ledger) for all its jobs: each job's guard is
given it (``audit=``) and writes through it; a guard given none opens its own, from the policy.
Whether the guard wrote the record of the request in progress is told by :func:`recording`,
so that the host writes its own record only for a request the guard did not record.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy

#: ledger kinds with a budget: (per-job limit field, per-day limit field)
BUDGETS = {
    "domain_model": ("domain_models_per_job", "domain_models_per_day"),
    "dc_evaluation": ("dc_evaluations_per_job", "dc_evaluations_per_day"),
}

#: rules decided on the request and public data alone (the policy, the job's published samples):
#: an honest coordinator trips them by mistake (a wrong mu, eta or z, a model without one column
#: per site, a feature map its parameters do not derive), and their outcome tells the coordinator
#: nothing it could not compute itself
PUBLIC_RULES = frozenset(
    {"eta_min", "z", "global_bound", "dp_what", "verify_mu", "verify_columns", "verify_feature_map", "verify_samples"}
)
#: decisions recorded by public checks (a request's other decisions come from its labelled data)
PUBLIC_DECISIONS = frozenset({"min_points", "eta", "theta_sq", "theta_sq_limit"} | {f"{k}s_job" for k in BUDGETS})


def day_charge_waived(rule: str, decisions: dict) -> bool:
    """The rule on a refusal's rolling-day charge: a request refused by a public rule
    (:data:`PUBLIC_RULES`) before any check that read labelled data had passed (its decisions
    so far are all :data:`PUBLIC_DECISIONS`) counts toward the job's budget, not toward the
    site's rolling day.  Any other refusal counts toward both: one that a labelled-data check
    decided, or one that follows a labelled-data check that passed (its rule then tells that
    the check passed)."""
    return rule in PUBLIC_RULES and set(decisions) <= PUBLIC_DECISIONS


def day_charges(counts) -> dict[str, int]:
    """{kind: n} of a request's ledger counts that count toward the site's rolling day (the
    budget lines of ``msa-fed site status``); a count waived for the day is the job's only."""
    if len(counts) == 1:  # a request's one charge (the common case)
        c = counts[0]
        return {str(c[0]): int(c[1])} if len(c) == 2 or c[2] else {}
    out: dict[str, int] = {}
    for c in counts:
        if len(c) == 2 or bool(c[2]):
            out[str(c[0])] = out.get(str(c[0]), 0) + int(c[1])
    return out


class Recorded:
    """The audit records a guard wrote for the request in progress (:func:`recording`)."""

    __slots__ = ("records", "charged")

    def __init__(self) -> None:
        self.records = 0
        self.charged: dict[str, int] = {}  # what its records charged to the rolling day, by kind

    @property
    def wrote(self) -> bool:
        return self.records > 0


#: the request in progress in this thread (its Recorded), while a host's :func:`recording` is open
_RECORDING: ContextVar[Recorded | None] = ContextVar("msa_fed_guard_recording", default=None)


@contextmanager
def recording() -> Iterator[Recorded]:
    """``with recording() as rec:`` answer one request; then ``rec.wrote`` tells whether a policy
    guard wrote its audit record (refused, answered or failed) in this block, in this thread.
    Per request, not per log: concurrent jobs writing to one log do not see each other's lines."""
    rec = Recorded()
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


class SiteGuard:
    """The policy of one job at one site.  ``audit``: the site process's one audit writer (its
    ledger is the guard's), shared with the process's other jobs and left open by :meth:`close`;
    None: the guard opens its own log and ledger from the policy (and closes them)."""

    def __init__(self, site: str, policy: SitePolicy, job: str = "", audit: AuditLog | None = None):
        self.site = site
        self.policy = policy
        self.job = job or uuid.uuid4().hex  # the ledger's key: NAME@DIGEST#RUN from a site agent
        self.job_name = self.job.split("@", 1)[0]  # what the audit log's "job" shows
        if audit is None:
            self.ledger = Ledger(policy.ledger)
            self.audit = AuditLog(policy.audit_log, ledger=self.ledger)
        else:
            if audit.ledger is None:
                raise ConfigError(f"site {site!r}: the shared audit log {audit.path!r} has no ledger")
            if _abs(audit.path) != _abs(policy.audit_log):
                raise ConfigError(
                    f"site {site!r}: the policy's audit log {policy.audit_log!r} is not the site's "
                    f"audit log {audit.path!r}"
                )
            self.ledger = audit.ledger
            self.audit = audit
        self._owns = audit is None
        self._dp: Any = None  # a DPAccountant once DP is on (msa_fed.privacy.dp imports dp-accounting)
        self._pending = threading.local()  # counts charged by the request in progress (this thread)

    @property
    def dp(self):
        """The DP accountant of this job (None when DP is off)."""
        if self.policy.dp_enabled and self._dp is None:
            from msa_fed.privacy.dp import DPAccountant

            self._dp = DPAccountant(self.policy, self.ledger, self.job, self.site)
        return self._dp

    def charge(self, kind: str, n: int = 1):
        """Count ``n`` queries of ``kind`` (refused ones too: a refusal is an answer); refuse over budget."""
        f_job, f_day = BUDGETS[kind]
        per_job, per_day = getattr(self.policy, f_job), getattr(self.policy, f_day)
        # what the job and the day have used, with what other requests in progress hold (jobs
        # served at once share the day); held until the request's audit line commits it
        used_job, used_day = self.ledger.hold(self.job, kind, n)
        self._pending.counts.append((kind, n, True, True))  # held; committed with the request's audit line
        if used_job + n > per_job:
            raise PrivacyError(
                "budget",
                self.site,
                f"the request: job {self.job!r} has used its {per_job} {kind.replace('_', ' ')}s ({BUDGETS[kind][0]})",
            )
        if used_day + n > per_day:
            raise PrivacyError(
                "budget",
                self.site,
                f"the request: the site's budget of {per_day} {kind.replace('_', ' ')}s per "
                f"rolling day is spent ({BUDGETS[kind][1]})",
            )
        return {f"{kind}s_job": used_job + n}

    def request(self, kind: str, **sizes) -> Request:
        """``with guard.request("dc_evaluate", p=3) as decisions:`` ... add measured values to
        ``decisions``; the audit record is written when the block ends (answered or refused)."""
        return Request(self, kind, sizes)

    def _write(self, kind, sizes, decisions, outcome, **extra):
        rec = {"site": self.site, "job": self.job_name, "request": kind, "sizes": sizes, "decisions": decisions}
        rec["outcome"] = outcome
        if extra:
            rec.update(extra)
        if self.job != self.job_name:
            rec["run"] = self.job
        if self._dp is not None:
            rec["epsilon_job"] = self._dp.epsilon_job()
        pending = self._pending
        counts = getattr(pending, "counts", None) or ()
        pending.counts = []
        charged = day_charges(counts)
        if charged:  # the record says what it counts toward the rolling-day budgets (site status sums it)
            rec["charged"] = charged
        self.audit.append(rec, counts, owned=True)  # the request's dicts: nothing changes them after this
        recorded = _RECORDING.get()
        if recorded is not None:
            recorded.records += 1
            for kind, n in charged.items():
                recorded.charged[kind] = recorded.charged.get(kind, 0) + n

    def epsilon_spent(self) -> float:
        return 0.0 if self._dp is None else self._dp.epsilon_job()

    def close(self) -> None:
        """Close the log and ledger this guard opened (a shared writer stays open for the others)."""
        if self._owns:
            self.audit.close()
            self.ledger.close()


def _abs(path: str) -> str:
    return os.path.abspath(path) if path else ""


class Request:
    """The context of one request (a plain class: a generator-based context manager costs more
    per request).  Writes the audit record when the block ends: answered, refused (a
    :class:`PrivacyError`, with what it measured) or error (any other exception, by type name).
    A host may extend it with the checks of a request (the site's gate does)."""

    __slots__ = ("guard", "kind", "sizes", "decisions")

    def __init__(self, guard: SiteGuard, kind: str, sizes: dict):
        self.guard = guard
        self.kind = kind
        self.sizes = sizes
        self.decisions: dict = {}
        guard._pending.counts = []  # what this request charges, written with its record

    def __enter__(self) -> dict:
        return self.decisions

    def __exit__(self, etype, exc, tb) -> Literal[False]:
        if etype is None:
            self.guard._write(self.kind, self.sizes, self.decisions, "answered")
        elif isinstance(exc, PrivacyError):
            pending = self.guard._pending
            if pending.counts and day_charge_waived(exc.rule or "", self.decisions):
                pending.counts = [(c[0], c[1], False, *c[3:]) for c in pending.counts]
                self.decisions["day_charge"] = "waived: refused by a public rule"
            self.decisions.update(getattr(exc, "measured", None) or {})  # kept here, never in the message
            self.guard._write(
                self.kind, self.sizes, self.decisions, "refused", rule=exc.rule or "refused", detail=exc.detail
            )
        elif isinstance(exc, Exception):
            self.guard._write(self.kind, self.sizes, self.decisions, "error", detail=type(exc).__name__)
        return False  # the exception, if any, goes on
