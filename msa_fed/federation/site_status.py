"""``msa-fed site status --config site.toml``: what a site's operator asks first.

Read from the site's own files (never written: the ledger and job book are opened read-only) and
one call to the registry with the site's token:

- **process**: whether a ``site serve`` holds the site's lock now (its pid), see
  :mod:`msa_fed.federation.serve_ops`;
- **registry**: reachable or not (the error's code), the site's registration, its published
  predictor and sample, and whether they match the files site.toml names;
- **budgets**: per budgeted request kind, used and left in the rolling day and when used ones
  come back (the ledger counts by whole hours: a query made in hour h counts until hour h + 25
  begins), with the policy's limits;
- **epsilon** spent over the site's lifetime (differential privacy) against its lifetime cap;
- **last jobs**: from the job book and the audit log, each job's state, what was answered and
  refused and what it charged to the budgets, counted as the job's end line counts them
  (:class:`msa_fed.site.methods.JobCounts`), and its last refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from msa_fed.privacy.ledger import HOUR_S
from msa_fed.site.methods import JobCounts

#: budgeted ledger kinds: (per-day limit field of SitePolicy, per-job limit field)
BUDGET_FIELDS = {
    "domain_model": ("domain_models_per_day", "domain_models_per_job"),
    "dc_evaluation": ("dc_evaluations_per_day", "dc_evaluations_per_job"),
}


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _read_only(path: Path) -> sqlite3.Connection | None:
    if not path.is_file():
        return None
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)


def budget_status(ledger: Path, policy, now: float | None = None) -> dict[str, Any]:
    """Used, left and refill times of the rolling-day budgets, and the DP events, read from the
    ledger file (read-only).  {kind: {"limit", "used", "left", "refills": [[iso time, n], ...]},
    "dp_events": [(noise multiplier, count)]}."""
    now = time.time() if now is None else now
    hour = int(now // HOUR_S)
    out: dict[str, Any] = {}
    db = _read_only(ledger)
    try:
        for kind, (per_day, per_job) in BUDGET_FIELDS.items():
            rows = []
            if db is not None:
                rows = db.execute(
                    "SELECT hour, n FROM hourly_queries WHERE kind = ? AND hour >= ? ORDER BY hour", (kind, hour - 24)
                ).fetchall()
            used = sum(n for _, n in rows)
            limit = int(getattr(policy, per_day))
            out[kind] = {
                "limit_per_day": limit,
                "limit_per_job": int(getattr(policy, per_job)),
                "used": used,
                "left": max(0, limit - used),
                # a query counted in hour h stops counting when hour h + 25 begins
                "refills": [[_iso((h + 25) * HOUR_S), int(n)] for h, n in rows if n],
            }
        events = []
        if db is not None:
            events = db.execute(
                "SELECT noise_multiplier, SUM(count) FROM dp_events GROUP BY noise_multiplier"
            ).fetchall()
        out["dp_events"] = [(float(a), int(b)) for a, b in events]
    finally:
        if db is not None:
            db.close()
    return out


def serving_process(lock_path: Path) -> str | None:
    """The holder of a site's lock ("pid N, started T"), or None when no process holds it."""
    if not lock_path.is_file():
        return None
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 200).decode("utf-8", "replace").strip() or "pid unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def last_jobs(jobs_db: Path, audit_log: Path, limit: int = 5) -> list[dict]:
    """The ``limit`` most recent jobs: state in the job book, answered/refused counts and last
    refusal from the audit log."""
    jobs: dict[str, dict] = {}
    db = _read_only(jobs_db)
    if db is not None:
        try:
            for job_id, state, first_seen, changed in db.execute(
                "SELECT job_id, state, first_seen, changed_at FROM jobs ORDER BY changed_at DESC LIMIT ?", (limit,)
            ):
                jobs[job_id] = {"job": job_id, "state": state, "first_seen": _iso(first_seen), "last": _iso(changed)}
        except sqlite3.Error:
            pass
        finally:
            db.close()
    counts: dict[str, JobCounts] = {}
    last_refusal: dict[str, str] = {}
    ended: set[str] = set()
    approval: set[str] = set()
    if audit_log.is_file():
        with open(audit_log, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                job = rec.get("job") or ""
                if job not in jobs or not isinstance(rec, dict):
                    continue
                outcome, request, rule = rec.get("outcome"), str(rec.get("request")), rec.get("rule")
                charged = rec.get("charged") if isinstance(rec.get("charged"), dict) else None
                counts.setdefault(job, JobCounts()).add(request, str(outcome), rule=rule, charged=charged)
                if outcome == "refused" and rule == "accept_jobs":
                    approval.add(job)  # approve mode: the job waited for its operator (not a refusal)
                elif outcome == "refused":
                    last_refusal[job] = f"{request} ({rule}): {rec.get('detail', '')}"
                elif request == "end_job":
                    ended.add(job)
    for job, info in jobs.items():
        c = counts.get(job) or JobCounts()
        info["answered"] = dict(c.answered)
        info["refused"] = dict(c.refused)
        info["charged"] = dict(c.charged)
        info["last_refusal"] = last_refusal.get(job)
        info["ended"] = job in ended
        info["waited_for_approval"] = job in approval
    return list(jobs.values())


def registry_view(config, client_factory=None) -> dict[str, Any]:
    """The site as the registry sees it (one call with the site's token), or why it could not be asked."""
    from msa_fed.artifacts.predictors import sha256_hex
    from msa_fed.control.registry.client import RegistryClient
    from msa_fed.errors import MsaFedError, RegistryError

    try:
        token = config.read_token()
        factory = client_factory or (
            lambda: RegistryClient(config.registry, token, retries=0, **config.channel_kwargs())
        )
        with factory() as client:
            record = client.get_site("")
    except RegistryError as exc:
        return {"reachable": False, "error": f"{exc.code}: {exc.message}"}
    except MsaFedError as exc:
        return {"reachable": False, "error": str(exc)}
    view: dict[str, Any] = {
        "reachable": True,
        "registered_as": record.name,
        "last_heartbeat": _iso(record.last_heartbeat),
        "predictor_sha256": record.predictor.sha256 if record.predictor else None,
        "sample_sha256": record.sample.sha256 if record.sample else None,
    }
    predictor = Path(config.predictor)
    if predictor.is_file() and record.predictor is not None:
        view["predictor_matches"] = sha256_hex(predictor.read_bytes()) == record.predictor.sha256
    return view


def site_status(config, *, now: float | None = None, ask_registry: bool = True) -> dict[str, Any]:
    """Everything ``msa-fed site status`` shows, as a dict (its ``--json``)."""
    from msa_fed.federation.agent import load_site_policy
    from msa_fed.privacy.dp import epsilon_of

    policy = load_site_policy(config)
    audit = Path(policy.audit_log)
    budgets = budget_status(Path(policy.ledger), policy, now)
    events = budgets.pop("dp_events")
    status: dict[str, Any] = {
        "site": config.name,
        "registry": config.registry,
        "accept_jobs": config.accept_jobs,
        "process": serving_process(Path(str(audit) + ".lock")),
        "budgets": budgets,
        "dp": {
            "enabled": bool(policy.dp_enabled),
            "epsilon_spent": epsilon_of(events, policy.delta) if events else 0.0,
            "epsilon_lifetime": float(policy.epsilon_lifetime),
            "delta": float(policy.delta),
        },
        "jobs": last_jobs(Path(config.jobs_path), audit),
    }
    if ask_registry:
        status["registry_view"] = registry_view(config)
    return status


def status_lines(status: dict[str, Any]) -> list[str]:
    """The human form of :func:`site_status`."""
    name = status["site"]
    lines = [f"site {name} (accepting jobs: {status['accept_jobs']})"]
    proc = status["process"]
    lines.append(
        f"  process:  {'serving, ' + proc if proc else 'not running (start it: msa-fed site serve --config site.toml)'}"
    )
    view = status.get("registry_view")
    if view is not None:
        if not view["reachable"]:
            lines.append(f"  registry: {status['registry']} not reachable ({view['error']})")
        else:
            match = {True: "matches site.toml's predictor", False: "does NOT match site.toml's predictor"}.get(
                view.get("predictor_matches"), "no predictor published"
            )
            lines.append(
                f"  registry: {status['registry']} reachable; registered as {view['registered_as']}; "
                f"published predictor {match}; last heartbeat {view['last_heartbeat'] or 'never'}"
            )
    for kind, b in status["budgets"].items():
        what = kind.replace("_", " ") + "s"
        line = f"  budget:   {what}: {b['used']} of {b['limit_per_day']} used in the rolling day, {b['left']} left"
        if b["refills"]:
            first_t, first_n = b["refills"][0]
            line += f"; {first_n} come back at {first_t}"
        line += f" (at most {b['limit_per_job']} per job)"
        lines.append(line)
    dp = status["dp"]
    if dp["enabled"] or dp["epsilon_spent"] > 0:
        lines.append(
            f"  privacy:  epsilon spent {dp['epsilon_spent']:.4g} of {dp['epsilon_lifetime']:g} over the site's "
            f"lifetime (delta {dp['delta']:g})"
        )
    else:
        lines.append("  privacy:  differential privacy off; no epsilon spent")
    if not status["jobs"]:
        lines.append("  jobs:     none yet")
    for j in status["jobs"]:
        answered = sum(j["answered"].values())
        refused = sum(j["refused"].values())
        outcome = "ended" if j["ended"] else j["state"]
        line = f"  job {j['job']}: {outcome}, last seen {j['last']}; answered {answered}, refused {refused}"
        if j["waited_for_approval"]:
            line += " (waited for approval)"
        if j.get("charged"):
            line += "; charged " + ", ".join(
                f"{n} {kind.replace('_', ' ')}{'s' if n != 1 else ''}" for kind, n in sorted(j["charged"].items())
            )
        if j["last_refusal"]:
            line += f"; last refusal: {' '.join(j['last_refusal'].split())[:200]}"
        lines.append(line)
    return lines
