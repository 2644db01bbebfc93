"""Registry state behind one abstract class, with an in-memory implementation.

:class:`RegistryStore` is the whole persistence contract; :class:`MemoryStore`
(here) and :class:`msa_fed.control.registry.sqlite_store.SqliteStore` implement it, and
one test suite (``tests/control/test_control_store.py``) runs against both.

Artifacts and combined models are stored content-addressed: the bytes live
once under their sha256, records point at them.  A commit is atomic: the blob
and its record appear together or not at all.  ``(site, upload_id)`` is the
idempotency key of an artifact upload, ``upload_id`` that of a combined model.
"""

from __future__ import annotations

import abc
import dataclasses
import threading

from msa_fed.control.registry.ops_records import (
    DeregistrationRecord,
    JobRecord,
    PromotionRecord,
    current_version,
    is_disputed,
)
from msa_fed.control.registry.records import (
    ROLE_SITE,
    ArtifactRecord,
    CombinedModelRecord,
    SiteRecord,
    TokenRecord,
)
from msa_fed.errors import RegistryError


def upload_conflict(upload_id: str) -> RegistryError:
    return RegistryError(
        "ALREADY_EXISTS", f"upload_id {upload_id!r} was already used for different content; use a new upload_id"
    )


def not_registered(site: str) -> RegistryError:
    return RegistryError("FAILED_PRECONDITION", f"site {site!r} is not registered; run 'msa-fed site register' first")


class RegistryStore(abc.ABC):
    """Persistence of tokens, sites, artifacts and combined models. Thread-safe."""

    # tokens -------------------------------------------------------------
    @abc.abstractmethod
    def put_token(self, record: TokenRecord) -> None:
        """Store ``record`` as the only active token of its (role, principal); older ones are revoked."""

    @abc.abstractmethod
    def get_token(self, role: str, principal: str) -> TokenRecord | None:
        """The active token of (role, principal), or None."""

    @abc.abstractmethod
    def revoke_tokens(self, role: str, principal: str, now: float) -> int:
        """Revoke the active tokens of (role, principal); return how many were active."""

    @abc.abstractmethod
    def token_states(self, role: str) -> dict[str, str]:
        """{principal: "active" | "revoked"} for every principal of ``role`` that ever had a token."""

    @abc.abstractmethod
    def revoked_tokens(self, role: str, principal: str, limit: int = 8) -> list[TokenRecord]:
        """The latest ``limit`` revoked (or replaced) tokens of (role, principal), newest first."""

    def site_access(self, names) -> dict[str, TokenRecord | None]:
        """{name: the site's active token, or None} for each of ``names`` that is registered (a
        name that is not registered is left out): what the relay checks before it forwards a
        request to a site, for all the sites of one call at once.  This default asks
        :meth:`get_site` and :meth:`get_token` per site; a store may answer in one query."""
        out = {}
        for name in names:
            if self.get_site(name) is not None:
                out[name] = self.get_token(ROLE_SITE, name)
        return out

    # sites --------------------------------------------------------------
    @abc.abstractmethod
    def register_site(self, name: str, labels: dict[str, str], now: float) -> SiteRecord:
        """Register ``name`` (idempotent: keeps the first registration time, replaces the labels)."""

    @abc.abstractmethod
    def heartbeat(self, name: str, now: float) -> bool:
        """Record a heartbeat; False when the site is not registered."""

    @abc.abstractmethod
    def get_site(self, name: str) -> SiteRecord | None:
        """The site with its latest predictor and sample, or None."""

    @abc.abstractmethod
    def list_sites(self) -> list[SiteRecord]:
        """Every registered site, sorted by name."""

    @abc.abstractmethod
    def deregister_site(self, name: str) -> bool:
        """Remove the site and its artifact records (unreferenced blobs go too); False when absent."""

    # artifacts ----------------------------------------------------------
    @abc.abstractmethod
    def commit_artifact(self, record: ArtifactRecord, data: bytes) -> tuple[ArtifactRecord, bool]:
        """Atomically store ``data`` and ``record``; return (stored record, created).

        A retry with the same (site, upload_id) and content returns the first
        record and ``created=False``; different content raises ALREADY_EXISTS.
        The site must be registered (FAILED_PRECONDITION otherwise).
        """

    @abc.abstractmethod
    def artifact_history(self, site: str, kind: str) -> list[ArtifactRecord]:
        """Every committed artifact of ``kind`` for ``site``, oldest first."""

    @abc.abstractmethod
    def get_blob(self, sha256: str) -> bytes | None:
        """The bytes stored under ``sha256``, or None."""

    # combined models ----------------------------------------------------
    @abc.abstractmethod
    def commit_combined_model(
        self, upload_id: str, sha256: str, data: bytes, manifest_json: str, created_by: str, now: float
    ) -> tuple[CombinedModelRecord, bool]:
        """Store a combined model as the next version; idempotent on ``upload_id``."""

    @abc.abstractmethod
    def get_combined_model(self, version: int | None = None) -> CombinedModelRecord | None:
        """Version ``version`` (None: the current one, see :meth:`current_model_version`), or None."""

    # operations: model promotion, deregistrations, jobs ------------------
    @abc.abstractmethod
    def list_combined_models(self) -> list[CombinedModelRecord]:
        """Every stored combined model, oldest first."""

    @abc.abstractmethod
    def promote_model(self, version: int, now: float, by: str, reason: str) -> PromotionRecord:
        """Make ``version`` the current model (NOT_FOUND when it is not stored)."""

    @abc.abstractmethod
    def promotions(self) -> list[PromotionRecord]:
        """Every promotion, oldest first."""

    def current_model_version(self) -> int | None:
        """The version "latest" resolves to: the newest stored unless an older one was promoted since."""
        newest = self.max_model_version()
        return current_version(newest, self.promotions(), self.disputed_versions())

    def disputed_versions(self) -> frozenset[int]:
        """The stored versions that a site did not sign off (:func:`is_disputed`)."""
        return frozenset(r.version for r in self.list_combined_models() if is_disputed(r.manifest_json))

    @abc.abstractmethod
    def max_model_version(self) -> int | None:
        """The highest stored version, or None."""

    @abc.abstractmethod
    def token_revoked_at(self, role: str, principal: str) -> float | None:
        """When the last token of (role, principal) was revoked, if it has no active token; else None."""

    @abc.abstractmethod
    def record_deregistration(self, record: DeregistrationRecord) -> None:
        """Remember that a site was deregistered (kept after the site's own records are gone)."""

    @abc.abstractmethod
    def deregistrations(self) -> dict[str, DeregistrationRecord]:
        """The latest deregistration of every site that was ever deregistered."""

    @abc.abstractmethod
    def start_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Store a running job; idempotent on ``job_id`` (returns the stored record and created)."""

    @abc.abstractmethod
    def finish_job(
        self, job_id: str, status: str, ended_at: float, model_version: int | None, error: str
    ) -> JobRecord | None:
        """Record a job's end (a later call overwrites: an upload done later completes a failed job); None when unknown."""

    @abc.abstractmethod
    def get_job(self, job_id: str) -> JobRecord | None:
        """The job ``job_id``, or None."""

    @abc.abstractmethod
    def list_jobs(self, limit: int = 100) -> list[JobRecord]:
        """The ``limit`` most recently started jobs, newest first."""

    @abc.abstractmethod
    def append_job_log(self, job_id: str, lines: list[str], now: float, max_lines: int) -> tuple[int, int]:
        """Append ``lines`` to the job's log, up to ``max_lines`` in all; (lines stored, lines dropped)."""

    @abc.abstractmethod
    def job_log(self, job_id: str, after: int, limit: int) -> tuple[list[tuple[int, float, str]], int, int]:
        """((seq, time, text) with seq > ``after``, at most ``limit``), lines stored, lines dropped."""

    def close(self) -> None:
        """Release resources; the default does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryStore(RegistryStore):
    """Everything in dictionaries under one lock; lost when the process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str], TokenRecord | None] = {}  # None: revoked
        self._revoked: dict[tuple[str, str], list[TokenRecord]] = {}  # newest first
        self._sites: dict[str, SiteRecord] = {}
        self._blobs: dict[str, bytes] = {}
        self._artifacts: list[ArtifactRecord] = []
        self._combined: list[CombinedModelRecord] = []
        self._revoked_at: dict[tuple[str, str], float] = {}
        self._promotions: list[PromotionRecord] = []
        self._deregistrations: dict[str, DeregistrationRecord] = {}
        self._jobs: dict[str, JobRecord] = {}
        self._job_logs: dict[str, tuple[list[tuple[int, float, str]], list[int]]] = {}  # (lines, [dropped])

    def put_token(self, record: TokenRecord) -> None:
        with self._lock:
            key = (record.role, record.principal)
            current = self._tokens.get(key)
            if current is not None:
                self._revoked.setdefault(key, []).insert(0, current)
            self._tokens[key] = record

    def get_token(self, role: str, principal: str) -> TokenRecord | None:
        with self._lock:
            return self._tokens.get((role, principal))

    def revoke_tokens(self, role: str, principal: str, now: float) -> int:
        with self._lock:
            current = self._tokens.get((role, principal))
            if current is not None:
                self._revoked.setdefault((role, principal), []).insert(0, current)
            if (role, principal) in self._tokens:
                self._tokens[(role, principal)] = None
            if current is not None:
                self._revoked_at[(role, principal)] = now
            return int(current is not None)

    def revoked_tokens(self, role: str, principal: str, limit: int = 8) -> list[TokenRecord]:
        with self._lock:
            return list(self._revoked.get((role, principal), ())[:limit])

    def token_states(self, role: str) -> dict[str, str]:
        with self._lock:
            return {
                p: ("active" if rec is not None else "revoked") for (r, p), rec in self._tokens.items() if r == role
            }

    def register_site(self, name: str, labels: dict[str, str], now: float) -> SiteRecord:
        with self._lock:
            old = self._sites.get(name)
            self._sites[name] = SiteRecord(
                name=name,
                registered_at=old.registered_at if old else now,
                last_heartbeat=old.last_heartbeat if old else None,
                labels=dict(labels),
            )
            view = self._site_view(name)
            assert view is not None  # just stored
            return view

    def heartbeat(self, name: str, now: float) -> bool:
        with self._lock:
            old = self._sites.get(name)
            if old is None:
                return False
            self._sites[name] = SiteRecord(old.name, old.registered_at, now, dict(old.labels))
            return True

    def _latest(self, site: str, kind: str) -> ArtifactRecord | None:
        for rec in reversed(self._artifacts):
            if rec.site == site and rec.kind == kind:
                return rec
        return None

    def _site_view(self, name: str) -> SiteRecord | None:
        base = self._sites.get(name)
        if base is None:
            return None
        return SiteRecord(
            base.name,
            base.registered_at,
            base.last_heartbeat,
            dict(base.labels),
            predictor=self._latest(name, "predictor"),
            sample=self._latest(name, "sample"),
        )

    def get_site(self, name: str) -> SiteRecord | None:
        with self._lock:
            return self._site_view(name)

    def list_sites(self) -> list[SiteRecord]:
        with self._lock:
            return [view for n in sorted(self._sites) if (view := self._site_view(n)) is not None]

    def deregister_site(self, name: str) -> bool:
        with self._lock:
            if self._sites.pop(name, None) is None:
                return False
            dropped = {a.sha256 for a in self._artifacts if a.site == name}
            self._artifacts = [a for a in self._artifacts if a.site != name]
            still_used = {a.sha256 for a in self._artifacts} | {c.sha256 for c in self._combined}
            for sha in dropped - still_used:
                self._blobs.pop(sha, None)
            return True

    def commit_artifact(self, record: ArtifactRecord, data: bytes) -> tuple[ArtifactRecord, bool]:
        with self._lock:
            for old in self._artifacts:
                if old.site == record.site and old.upload_id == record.upload_id:
                    if old.kind == record.kind and old.sha256 == record.sha256:
                        return old, False
                    raise upload_conflict(record.upload_id)
            if record.site not in self._sites:
                raise not_registered(record.site)
            self._blobs.setdefault(record.sha256, bytes(data))
            self._artifacts.append(record)
            return record, True

    def artifact_history(self, site: str, kind: str) -> list[ArtifactRecord]:
        with self._lock:
            return [a for a in self._artifacts if a.site == site and a.kind == kind]

    def get_blob(self, sha256: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(sha256)

    def commit_combined_model(
        self, upload_id: str, sha256: str, data: bytes, manifest_json: str, created_by: str, now: float
    ) -> tuple[CombinedModelRecord, bool]:
        with self._lock:
            for old in self._combined:
                if old.upload_id == upload_id:
                    if old.sha256 == sha256 and old.manifest_json == manifest_json:
                        return old, False
                    raise upload_conflict(upload_id)
            rec = CombinedModelRecord(
                version=len(self._combined) + 1,
                upload_id=upload_id,
                sha256=sha256,
                size=len(data),
                manifest_json=manifest_json,
                created_by=created_by,
                created_at=now,
            )
            self._blobs.setdefault(sha256, bytes(data))
            self._combined.append(rec)
            return rec, True

    def get_combined_model(self, version: int | None = None) -> CombinedModelRecord | None:
        with self._lock:
            if not self._combined:
                return None
            if version is None:
                disputed = frozenset(c.version for c in self._combined if is_disputed(c.manifest_json))
                version = current_version(self._combined[-1].version, self._promotions, disputed)
            return next((c for c in self._combined if c.version == version), None)

    def list_combined_models(self) -> list[CombinedModelRecord]:
        with self._lock:
            return list(self._combined)

    def max_model_version(self) -> int | None:
        with self._lock:
            return self._combined[-1].version if self._combined else None

    def promote_model(self, version: int, now: float, by: str, reason: str) -> PromotionRecord:
        with self._lock:
            if not any(c.version == version for c in self._combined):
                raise RegistryError("NOT_FOUND", f"no combined model version {version} is stored")
            rec = PromotionRecord(version, self._combined[-1].version, now, by, reason)
            self._promotions.append(rec)
            return rec

    def promotions(self) -> list[PromotionRecord]:
        with self._lock:
            return list(self._promotions)

    def token_revoked_at(self, role: str, principal: str) -> float | None:
        with self._lock:
            if self._tokens.get((role, principal)) is not None:
                return None
            return self._revoked_at.get((role, principal))

    def record_deregistration(self, record: DeregistrationRecord) -> None:
        with self._lock:
            self._deregistrations[record.name] = record

    def deregistrations(self) -> dict[str, DeregistrationRecord]:
        with self._lock:
            return dict(self._deregistrations)

    def start_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        with self._lock:
            old = self._jobs.get(record.job_id)
            if old is not None:
                return old, False
            self._jobs[record.job_id] = record
            return record, True

    def finish_job(self, job_id, status, ended_at, model_version, error) -> JobRecord | None:
        with self._lock:
            old = self._jobs.get(job_id)
            if old is None:
                return None
            rec = dataclasses.replace(old, status=status, ended_at=ended_at, model_version=model_version, error=error)
            self._jobs[job_id] = rec
            return rec

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list_jobs(self, limit: int = 100) -> list[JobRecord]:
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.started_at)  # stable: ties in start order
            jobs.reverse()
            return jobs[:limit]

    def append_job_log(self, job_id: str, lines: list[str], now: float, max_lines: int) -> tuple[int, int]:
        with self._lock:
            stored, dropped = self._job_logs.setdefault(job_id, ([], [0]))
            room = max(0, max_lines - len(stored))
            start = len(stored)
            stored.extend((start + k + 1, now, text) for k, text in enumerate(lines[:room]))
            dropped[0] += len(lines) - min(room, len(lines))
            return len(stored), dropped[0]

    def job_log(self, job_id: str, after: int, limit: int) -> tuple[list[tuple[int, float, str]], int, int]:
        with self._lock:
            stored, dropped = self._job_logs.get(job_id, ([], [0]))
            return [line for line in stored if line[0] > after][:limit], len(stored), dropped[0]
