"""Plain records of the operations state: jobs, model promotions, deregistrations, site status.

Times are unix seconds (float); 0/None mean "never".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from msa_fed.control.registry.records import check_pattern

JOB_RUNNING = "running"
JOB_SUCCEEDED = "succeeded"
JOB_FAILED = "failed"
JOB_CANCELLED = "cancelled"  # by an admin (msa-fed job cancel); the relay stops the job's traffic
JOB_INTERRUPTED = "interrupted"  # the driver was stopped (SIGTERM, Ctrl-C)
JOB_END_STATES = (JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELLED, JOB_INTERRUPTED)

JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}\Z")
MAX_ERROR_CHARS = 4000
MAX_REASON_CHARS = 500
MAX_JOB_SITES = 1000


def check_job_id(job_id: str) -> str:
    return check_pattern(
        job_id, JOB_ID_PATTERN, "job id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'"
    )


def one_line(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class JobRecord:
    """One run of the federated job as the registry recorded it."""

    job_id: str
    name: str
    sites: tuple[str, ...]
    topology: str
    status: str
    started_at: float
    started_by: str
    ended_at: float | None = None
    model_version: int | None = None
    error: str = ""


@dataclass(frozen=True)
class PromotionRecord:
    """``version`` was made the current model at ``promoted_at``, when ``after_version`` was the newest stored."""

    version: int
    after_version: int
    promoted_at: float
    promoted_by: str
    reason: str = ""


@dataclass(frozen=True)
class DeregistrationRecord:
    name: str
    deregistered_at: float
    deregistered_by: str
    reason: str = ""


@dataclass(frozen=True)
class SiteStatus:
    """One row of ``admin list-sites``: what the registry knows of a site principal."""

    name: str
    token: str  # "active", "revoked" or "none"
    token_revoked_at: float | None
    registered_at: float | None  # None: not registered now
    last_heartbeat: float | None
    deregistration: DeregistrationRecord | None  # set only while not registered again
    connected: bool | None = None  # None: unknown (filled by the federated topology)
    predictor_sha256: str | None = None
    sample_sha256: str | None = None

    @property
    def registered(self) -> bool:
        return self.registered_at is not None


def current_version(
    max_version: int | None, promotions: list[PromotionRecord], disputed: frozenset[int] = frozenset()
) -> int | None:
    """The version "latest" resolves to: the last promotion while no newer model was stored since.
    A ``disputed`` version (a site did not sign it off: its verdict found the model harms it) is
    never current by being the newest: only an operator's promotion makes it current; "latest"
    then resolves to the newest version stored before it that is not disputed."""
    if not max_version:
        return None
    last = promotions[-1] if promotions else None
    for version in range(max_version, 0, -1):
        if last is not None and last.after_version == version:
            return last.version
        if version not in disputed:
            return version
    return None


def is_disputed(manifest_json: str) -> bool:
    """Whether a stored model's manifest says that a site did not sign it off."""
    import json

    try:
        manifest = json.loads(manifest_json)
        return bool(manifest["info"]["site_check"]["disputed"])
    except (ValueError, KeyError, TypeError):
        return False
