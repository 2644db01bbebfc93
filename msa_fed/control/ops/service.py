"""Operations on a registry: model promotion, site status and deregistration, job records.

Transport-free like :class:`~msa_fed.control.registry.service.Registry`: the gRPC servicer
(:mod:`msa_fed.control.ops.servicer`) and the ``--db`` admin commands call these methods with
the caller's :class:`Principal`; every method is admin-only.

``connected`` is the hook of the federated topology: a callable ``name -> bool | None`` that
says whether a site's agent holds a connection to the registry now (None: unknown).  When it
is not given, ``registry.site_connected`` is used if the registry has one, so the relay service
can set that attribute on the :class:`Registry` it serves without touching this module.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from msa_fed.control.registry.ops_records import (
    JOB_CANCELLED,
    JOB_END_STATES,
    JOB_RUNNING,
    MAX_ERROR_CHARS,
    MAX_JOB_SITES,
    MAX_REASON_CHARS,
    DeregistrationRecord,
    JobRecord,
    PromotionRecord,
    SiteStatus,
    check_job_id,
    one_line,
)
from msa_fed.control.registry.records import (
    ROLE_SITE,
    CombinedModelRecord,
    Principal,
    check_name,
)
from msa_fed.control.registry.service import Registry
from msa_fed.errors import RegistryError

log = logging.getLogger(__name__)

#: a job's log at the registry (msa-fed job log): lines per job, per call, characters per line
MAX_LOG_LINES = 20_000
MAX_LOG_LINES_PER_CALL = 1000
MAX_LOG_LINE_CHARS = 1000

MAX_NAME_CHARS = 200
TOPOLOGIES_PATTERN_CHARS = 32


def iso(t: float | None) -> str:
    """Unix seconds as ``YYYY-MM-DDTHH:MM:SSZ`` ("-" for None/0)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


def exclusion_reason(status: SiteStatus) -> str | None:
    """Why a job may not use this site, or None when it may."""
    if not status.registered and status.deregistration is not None:
        d = status.deregistration
        why = f": {d.reason}" if d.reason else ""
        return f"site {status.name!r} was deregistered at {iso(d.deregistered_at)} by {d.deregistered_by}{why}"
    if status.token == "revoked":
        return f"site {status.name!r}: its token was revoked at {iso(status.token_revoked_at)}"
    if not status.registered:
        return f"site {status.name!r} is not registered"
    return None


class Operations:
    """Admin operations over a :class:`Registry` (its store, clock and access rules)."""

    def __init__(self, registry: Registry, connected: Callable[[str], bool | None] | None = None):
        self.registry = registry
        self.store = registry.store
        self._connected = connected

    @property
    def connected(self) -> Callable[[str], bool | None] | None:
        return self._connected or getattr(self.registry, "site_connected", None)

    def _admin(self, principal: Principal, action: str) -> None:
        self.registry.require_admin(principal, action)

    # models -----------------------------------------------------------------
    def list_models(self, principal: Principal) -> tuple[list[CombinedModelRecord], int | None, list[PromotionRecord]]:
        """(every stored model oldest first, the current version, every promotion)."""
        self._admin(principal, "list combined models")
        return self.store.list_combined_models(), self.store.current_model_version(), self.store.promotions()

    def get_model(
        self, principal: Principal, version: int = 0
    ) -> tuple[CombinedModelRecord, int | None, list[PromotionRecord]]:
        self._admin(principal, "read a combined model's record")
        if version < 0:
            raise RegistryError("INVALID_ARGUMENT", f"version must be >= 0 (0 = current); got {version}")
        record = self.store.get_combined_model(version or None)
        if record is None:
            raise RegistryError(
                "NOT_FOUND", f"no combined model version {version}" if version else "no combined model stored"
            )
        return record, self.store.current_model_version(), self.store.promotions()

    def promote(self, principal: Principal, version: int, reason: str = "") -> PromotionRecord:
        self._admin(principal, "promote a combined model")
        if version < 1:
            raise RegistryError("INVALID_ARGUMENT", f"version must be >= 1; got {version}")
        rec = self.store.promote_model(
            version, self.registry.clock(), principal.name, one_line(reason, MAX_REASON_CHARS)
        )
        log.info("combined model version %d promoted to current by %s", version, principal)
        return rec

    # sites ------------------------------------------------------------------
    def site_statuses(self, principal: Principal | None = None) -> list[SiteStatus]:
        """Every site with a token, a registration or a deregistration, sorted by name.

        ``principal`` None is the local ``--db`` administrator (file access is the authority)."""
        if principal is not None:
            self._admin(principal, "list site status")
        states = self.store.token_states(ROLE_SITE)
        sites = {s.name: s for s in self.store.list_sites()}
        gone = self.store.deregistrations()
        out = []
        for name in sorted(set(states) | set(sites) | set(gone)):
            site = sites.get(name)
            token = states.get(name, "none")
            out.append(
                SiteStatus(
                    name=name,
                    token=token,
                    token_revoked_at=self.store.token_revoked_at(ROLE_SITE, name) if token == "revoked" else None,
                    registered_at=site.registered_at if site else None,
                    last_heartbeat=site.last_heartbeat if site else None,
                    deregistration=gone.get(name) if site is None else None,
                    connected=self.connected(name) if self.connected is not None else None,
                    predictor_sha256=site.predictor.sha256 if site and site.predictor else None,
                    sample_sha256=site.sample.sha256 if site and site.sample else None,
                )
            )
        return out

    def site_status(self, principal: Principal | None, name: str) -> SiteStatus:
        check_name(name)
        for status in self.site_statuses(principal):
            if status.name == name:
                return status
        raise RegistryError(
            "NOT_FOUND", f"site {name!r} is unknown to the registry (no token, registration or deregistration)"
        )

    def deregister(self, principal: Principal | None, name: str, reason: str = "") -> SiteStatus:
        """Revoke the site's token, remove its registration and artifacts, and record why."""
        if principal is not None:
            self._admin(principal, "deregister a site")
        check_name(name)
        by = principal.name if principal is not None else "local administrator"
        now = self.registry.clock()
        revoked = self.store.revoke_tokens(ROLE_SITE, name, now)
        removed = self.store.deregister_site(name)
        if not revoked and not removed:
            raise RegistryError("NOT_FOUND", f"site {name!r} has neither an active token nor a registration")
        self.store.record_deregistration(DeregistrationRecord(name, now, by, one_line(reason, MAX_REASON_CHARS)))
        log.info(
            "site %r deregistered by %s (token revoked: %s, registration removed: %s)", name, by, bool(revoked), removed
        )
        return self.site_status(None, name)

    # jobs -------------------------------------------------------------------
    def start_job(self, principal: Principal, job_id: str, name: str, sites, topology: str) -> JobRecord:
        self._admin(principal, "record a job")
        check_job_id(job_id)
        sites = tuple(sites)
        if len(sites) > MAX_JOB_SITES:
            raise RegistryError("INVALID_ARGUMENT", f"a job names at most {MAX_JOB_SITES} sites; got {len(sites)}")
        for site in sites:
            check_name(site)
        record = JobRecord(
            job_id=job_id,
            name=one_line(name, MAX_NAME_CHARS),
            sites=sites,
            topology=one_line(topology, TOPOLOGIES_PATTERN_CHARS),
            status=JOB_RUNNING,
            started_at=self.registry.clock(),
            started_by=principal.name,
        )
        stored, _ = self.store.start_job(record)
        return stored

    def finish_job(
        self, principal: Principal, job_id: str, status: str, model_version: int = 0, error: str = ""
    ) -> JobRecord:
        self._admin(principal, "record a job")
        check_job_id(job_id)
        if status not in JOB_END_STATES:
            raise RegistryError("INVALID_ARGUMENT", f"job status must be one of {list(JOB_END_STATES)}; got {status!r}")
        if model_version and self.store.get_combined_model(model_version) is None:
            raise RegistryError("NOT_FOUND", f"no combined model version {model_version} is stored")
        current = self.store.get_job(job_id)
        if current is not None and current.status == JOB_CANCELLED:
            return current  # a cancelled job stays cancelled, whatever its driver records after
        if status == JOB_CANCELLED:
            return self._cancel(principal, job_id, current, error)
        record = self.store.finish_job(
            job_id, status, self.registry.clock(), model_version or None, one_line(error, MAX_ERROR_CHARS)
        )
        if record is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        return record

    def _cancel(self, principal: Principal, job_id: str, current: JobRecord | None, reason: str) -> JobRecord:
        """Record ``job_id`` as cancelled by ``principal`` and stop its traffic at the relay (the
        registry's ``job_cancelled`` hook): its sites get the job's end, its calls are refused."""
        if current is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        if current.status != JOB_RUNNING:
            raise RegistryError("FAILED_PRECONDITION", f"job {job_id} is not running (it is {current.status})")
        now = self.registry.clock()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        why = f"cancelled by {principal.name} at {when}" + (f": {reason}" if reason else "")
        record = self.store.finish_job(job_id, JOB_CANCELLED, now, None, one_line(why, MAX_ERROR_CHARS))
        if record is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        hook = getattr(self.registry, "job_cancelled", None)
        if callable(hook):
            hook(record.name)
        return record

    def cancelled(self, name: str) -> JobRecord | None:
        """The newest recorded job named ``name`` when it was cancelled (the relay refuses its calls)."""
        for record in self.store.list_jobs(100):
            if record.name == name:
                return record if record.status == JOB_CANCELLED else None
        return None

    def append_job_log(self, principal: Principal, job_id: str, lines) -> tuple[int, int]:
        """Store the driver's progress ``lines`` (each cut to one line of MAX_LOG_LINE_CHARS) for a
        recorded job; at most MAX_LOG_LINES per job, the rest counted as dropped."""
        self._admin(principal, "write a job's log")
        check_job_id(job_id)
        lines = list(lines)
        if len(lines) > MAX_LOG_LINES_PER_CALL:
            raise RegistryError(
                "INVALID_ARGUMENT", f"at most {MAX_LOG_LINES_PER_CALL} lines per call; got {len(lines)}"
            )
        if self.store.get_job(job_id) is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        texts = [one_line(str(text), MAX_LOG_LINE_CHARS) for text in lines]
        return self.store.append_job_log(job_id, texts, self.registry.clock(), MAX_LOG_LINES)

    def job_log(self, principal: Principal, job_id: str, after: int = 0, limit: int = 0):
        """(lines (seq, time, text) after ``after``, lines stored, lines dropped) of a recorded job."""
        self._admin(principal, "read a job's log")
        check_job_id(job_id)
        if self.store.get_job(job_id) is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        if after < 0 or not 0 <= limit <= MAX_LOG_LINES_PER_CALL:
            raise RegistryError("INVALID_ARGUMENT", f"after >= 0 and limit in 0..{MAX_LOG_LINES_PER_CALL}")
        return self.store.job_log(job_id, after, limit or MAX_LOG_LINES_PER_CALL)

    def list_jobs(self, principal: Principal | None, limit: int = 100) -> list[JobRecord]:
        if principal is not None:
            self._admin(principal, "list jobs")
        if not 0 <= limit <= 10_000:
            raise RegistryError("INVALID_ARGUMENT", f"limit must be in 0..10000; got {limit}")
        return self.store.list_jobs(limit or 100)

    def get_job(self, principal: Principal | None, job_id: str) -> JobRecord:
        if principal is not None:
            self._admin(principal, "read a job")
        check_job_id(job_id)
        record = self.store.get_job(job_id)
        if record is None:
            raise RegistryError("NOT_FOUND", f"no job {job_id!r} was recorded")
        return record


def manifest_of(record: CombinedModelRecord) -> dict:
    """The manifest stored with a combined model, as a dict ({} when unreadable)."""
    try:
        manifest = json.loads(record.manifest_json)
    except ValueError:
        return {}
    return manifest if isinstance(manifest, dict) else {}
