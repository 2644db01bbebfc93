"""The site's query ledger: what each job asked, per rolling day, and the DP events spent.

A SQLite file named by the policy (``[budget] ledger``; in memory when empty), so that budgets
survive a restart of the site process.  Also holds the audit log's anchor (line count and the
hash of the last line), so that a truncated log is detected, and, for a site process, each sealed
job's seal floor (the last request the site took: :meth:`Ledger.keep_floor`), written in the same
transaction as the request's counts and anchor: one commit per request.
"""

from __future__ import annotations

import sqlite3
import threading
import time

DAY_S = 86400.0
HOUR_S = 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS job_queries (job TEXT NOT NULL, kind TEXT NOT NULL, n INTEGER NOT NULL,
                                        PRIMARY KEY (job, kind));
CREATE TABLE IF NOT EXISTS hourly_queries (kind TEXT NOT NULL, hour INTEGER NOT NULL, n INTEGER NOT NULL,
                                           PRIMARY KEY (kind, hour));
CREATE TABLE IF NOT EXISTS dp_events (job TEXT NOT NULL, t REAL NOT NULL, noise_multiplier REAL NOT NULL,
                                      count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS audit_anchor (log TEXT PRIMARY KEY, count INTEGER NOT NULL, head TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS seal_floors (key TEXT PRIMARY KEY, seq INTEGER NOT NULL);
"""
_FLOOR = "INSERT INTO seal_floors VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET seq = MAX(seq, excluded.seq)"


class Ledger:
    """Counts of answered and refused requests by job and kind; DP events; audit anchors.

    ``path`` empty: kept in this process only (plain dicts, no SQLite; the in-process API).
    """

    def __new__(cls, path: str = ""):
        if cls is Ledger and not path:
            return super().__new__(MemoryLedger)
        return super().__new__(cls)

    def __init__(self, path: str = ""):
        self.path = path
        self._lock = threading.Lock()
        self._hold_lock = threading.Lock()
        self._held: dict[tuple[str | None, str], int] = {}  # (job or None: the day, kind)
        #: held by a DP spend from its budget check to its event's write (DPAccountant.spend):
        #: two jobs answering at once cannot both take the last of the lifetime epsilon
        self.dp_lock = threading.Lock()
        #: seal floors taken (:meth:`keep_floor`) and not committed yet; the highest committed
        self._floors: dict[str, int] = {}
        self._kept: dict[str, int] = {}
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self):
        with self._lock:
            self._db.close()

    def record(self, job: str, kind: str, n: int = 1, t: float | None = None):
        """Count n queries of ``kind`` for ``job`` (per job, and per hour for the rolling day)."""
        hour = int((time.time() if t is None else t) // HOUR_S)
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO job_queries VALUES (?, ?, ?) ON CONFLICT(job, kind) DO UPDATE SET n = n + excluded.n",
                (job, kind, int(n)),
            )
            self._db.execute(
                "INSERT INTO hourly_queries VALUES (?, ?, ?) ON CONFLICT(kind, hour) DO UPDATE SET n = n + excluded.n",
                (kind, hour, int(n)),
            )
            self._db.execute("COMMIT")

    def commit(self, job: str, counts=(), anchor: tuple[str, int, str] | None = None, t: float | None = None):
        """In one transaction: add ``counts`` [(kind, n)] for ``job`` and set an audit anchor
        (log, line count, last hash).  The site calls this once per request, before it answers.
        A count ``(kind, n, False)`` is counted for the job only, not in the rolling day
        (:data:`msa_fed.privacy.guard.PUBLIC_RULES`); a count ``(kind, n, day, True)`` was held
        by :meth:`hold`, and committing it releases the hold."""
        hour = int((time.time() if t is None else t) // HOUR_S)
        with self._lock:
            self._db.execute("BEGIN")
            for kind, n, day in _counts(counts):
                self._db.execute(
                    "INSERT INTO job_queries VALUES (?, ?, ?) ON CONFLICT(job, kind) DO UPDATE SET n = n + excluded.n",
                    (job, kind, int(n)),
                )
                if not day:
                    continue
                self._db.execute(
                    "INSERT INTO hourly_queries VALUES (?, ?, ?) ON CONFLICT(kind, hour) DO UPDATE "
                    "SET n = n + excluded.n",
                    (kind, hour, int(n)),
                )
            if anchor is not None:
                self._db.execute(
                    "INSERT INTO audit_anchor VALUES (?, ?, ?) ON CONFLICT(log) DO UPDATE SET "
                    "count = excluded.count, head = excluded.head",
                    (anchor[0], int(anchor[1]), anchor[2]),
                )
            floors = self._floors
            if floors:  # the requests taken since the last commit: in this transaction
                self._db.executemany(_FLOOR, floors.items())
            self._db.execute("COMMIT")
            if floors:
                self._settled(floors)
        self._release(job, counts)

    # ------------------------------------------------------------------ seal floors
    # A sealed request's sequence number must be on disk before its answer leaves the site (a
    # restarted site refuses it and every earlier one: msa_fed.crypto.sealing.SiteOpener).  The
    # opener notes it here as it takes the request (keep_floor); the request's audit record
    # commits it with the record's counts and anchor (commit), and sealing the answer makes sure
    # it was (floor_kept: its own commit where no record was committed since, a rare path).
    def keep_floor(self, key: str, seq: int) -> None:
        """Note that the request ``seq`` of the sealed job ``key`` was taken; committed by the
        next :meth:`commit` or :meth:`floor_kept`, whichever comes first."""
        with self._lock:
            if seq > self._floors.get(key, 0):
                self._floors[key] = int(seq)

    def floor_kept(self, key: str, seq: int) -> None:
        """On return, the floor of ``key`` on disk is at least ``seq``: committed now unless a
        commit since :meth:`keep_floor` carried it."""
        with self._lock:
            if self._kept.get(key, 0) >= seq:
                return
            floors = dict(self._floors)
            floors[key] = max(int(seq), floors.get(key, 0))
            self._db.execute("BEGIN")
            self._db.executemany(_FLOOR, floors.items())
            self._db.execute("COMMIT")
            self._settled(floors)

    def _settled(self, floors: dict[str, int]) -> None:
        """``floors`` were committed (the caller holds the lock)."""
        for key, seq in floors.items():
            if seq > self._kept.get(key, 0):
                self._kept[key] = seq
        self._floors = {k: v for k, v in self._floors.items() if v > self._kept.get(k, 0)}

    def seal_floor(self, key: str) -> int:
        """The last request of the sealed job ``key`` committed here (0: none)."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM seal_floors WHERE key = ?", (key,)).fetchone()
        return 0 if row is None else int(row[0])

    def job_count(self, job: str, kind: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT n FROM job_queries WHERE job = ? AND kind = ?", (job, kind)).fetchone()
        return 0 if row is None else int(row[0])

    def day_count(self, kind: str, now: float | None = None) -> int:
        """Queries of ``kind`` in the last 24 hours, counted by whole hours (the hour 24 hours ago
        included, so the window is at least a day: stricter, never looser)."""
        hour = int((time.time() if now is None else now) // HOUR_S)
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(n), 0) FROM hourly_queries WHERE kind = ? AND hour >= ?", (kind, hour - 24)
            ).fetchone()
        return int(row[0])

    def used(self, job: str, kind: str, now: float | None = None) -> tuple[int, int]:
        """``(job_count(job, kind), day_count(kind, now))`` read in one statement (what a request's
        budget check needs)."""
        hour = int((time.time() if now is None else now) // HOUR_S)
        with self._lock:
            row = self._db.execute(
                "SELECT (SELECT n FROM job_queries WHERE job = ? AND kind = ?), "
                "(SELECT COALESCE(SUM(n), 0) FROM hourly_queries WHERE kind = ? AND hour >= ?)",
                (job, kind, kind, hour - 24),
            ).fetchone()
        return (0 if row[0] is None else int(row[0])), int(row[1])

    def day_hours(self, kind: str, now: float | None = None) -> list[tuple[int, int]]:
        """(hour, count) of ``kind`` in the rolling day's window (the hours ``day_count`` sums)."""
        hour = int((time.time() if now is None else now) // HOUR_S)
        with self._lock:
            rows = self._db.execute(
                "SELECT hour, n FROM hourly_queries WHERE kind = ? AND hour >= ? AND n > 0 ORDER BY hour",
                (kind, hour - 24),
            ).fetchall()
        return [(int(h), int(n)) for h, n in rows]

    # ------------------------------------------------------------------ counts held
    # by requests in progress in this process, not yet committed: a site process answers several
    # jobs at once, and a budget check must see what the others are about to count (else two
    # jobs could each take the rolling day's last query)
    def hold(self, job: str, kind: str, n: int, now: float | None = None) -> tuple[int, int]:
        """``used(job, kind)`` plus what requests in progress hold, then hold ``n`` more (one
        step, so two requests never both see the same last unit of a budget)."""
        with self._hold_lock:
            used_job, used_day = self.used(job, kind, now)
            used_job += self._held.get((job, kind), 0)
            used_day += self._held.get((None, kind), 0)
            self._held[(job, kind)] = self._held.get((job, kind), 0) + int(n)
            self._held[(None, kind)] = self._held.get((None, kind), 0) + int(n)
        return used_job, used_day

    def _release(self, job: str, counts) -> None:
        held = [c for c in counts if len(c) > 3 and c[3]]
        if not held:
            return
        with self._hold_lock:
            for c in held:
                for key in ((job, c[0]), (None, c[0])):
                    left = self._held.get(key, 0) - int(c[1])
                    if left > 0:
                        self._held[key] = left
                    else:
                        self._held.pop(key, None)

    def held(self) -> int:
        """The counts held by requests in progress (of the jobs and of the day, all kinds)."""
        with self._hold_lock:
            return sum(self._held.values())

    # ------------------------------------------------------------------ DP
    def add_dp_event(self, job: str, noise_multiplier: float, count: int = 1):
        with self._lock:
            self._db.execute(
                "INSERT INTO dp_events VALUES (?, ?, ?, ?)", (job, time.time(), float(noise_multiplier), int(count))
            )

    def dp_events(self, job: str | None = None) -> list[tuple[float, int]]:
        """(noise multiplier, count) pairs, of one job or of the site's lifetime."""
        q = "SELECT noise_multiplier, SUM(count) FROM dp_events"
        args: tuple = ()
        if job is not None:
            q += " WHERE job = ?"
            args = (job,)
        with self._lock:
            rows = self._db.execute(q + " GROUP BY noise_multiplier", args).fetchall()
        return [(float(a), int(b)) for a, b in rows]

    # ------------------------------------------------------------------ audit anchor
    def set_anchor(self, log: str, count: int, head: str):
        with self._lock:
            self._db.execute(
                "INSERT INTO audit_anchor VALUES (?, ?, ?) ON CONFLICT(log) DO UPDATE SET "
                "count = excluded.count, head = excluded.head",
                (log, int(count), head),
            )

    def anchor(self, log: str) -> tuple[int, str] | None:
        with self._lock:
            row = self._db.execute("SELECT count, head FROM audit_anchor WHERE log = ?", (log,)).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))


def _counts(counts):
    """(kind, n, counted in the rolling day) from (kind, n), (kind, n, day) or (kind, n, day,
    held) entries."""
    for c in counts:
        yield (c[0], c[1], True) if len(c) == 2 else (c[0], c[1], bool(c[2]))


class MemoryLedger(Ledger):
    """The ledger of a site without a ledger file: the same interface, in this process's memory."""

    def __init__(self, path: str = ""):
        self.path = ""
        self._lock = threading.Lock()
        self._hold_lock = self._lock  # the holds beside the counts, under one lock
        self._held: dict[tuple[str | None, str], int] = {}  # (job or None: the day, kind)
        self.dp_lock = threading.Lock()
        self._jobs: dict = {}
        self._hours: dict = {}
        self._dp: list = []
        self._anchors: dict = {}
        self._floors: dict[str, int] = {}
        self._kept: dict[str, int] = {}

    def close(self):
        pass

    def record(self, job: str, kind: str, n: int = 1, t: float | None = None):
        hour = int((time.time() if t is None else t) // HOUR_S)
        with self._lock:
            self._jobs[(job, kind)] = self._jobs.get((job, kind), 0) + int(n)
            self._hours[(kind, hour)] = self._hours.get((kind, hour), 0) + int(n)

    def hold(self, job: str, kind: str, n: int, now: float | None = None) -> tuple[int, int]:
        low = int((time.time() if now is None else now) // HOUR_S) - 24
        key, day_key = (job, kind), (None, kind)
        held = self._held
        with self._lock:
            day = held.get(day_key, 0)
            for (k, h), v in self._hours.items():
                if h >= low and k == kind:
                    day += v
            mine = held.get(key, 0)
            held[key] = mine + n
            held[day_key] = held.get(day_key, 0) + n
            return self._jobs.get(key, 0) + mine, day

    def commit(self, job: str, counts=(), anchor: tuple[str, int, str] | None = None, t: float | None = None):
        if counts:
            hour = int((time.time() if t is None else t) // HOUR_S)
            jobs, hours, held = self._jobs, self._hours, self._held
            with self._lock:
                for c in counts:
                    kind, n = c[0], int(c[1])
                    key = (job, kind)
                    jobs[key] = jobs.get(key, 0) + n
                    if len(c) == 2 or c[2]:
                        hours[(kind, hour)] = hours.get((kind, hour), 0) + n
                    if len(c) > 3 and c[3]:  # committed: no longer held (the job's key goes)
                        left = held.get(key, 0) - n
                        if left > 0:
                            held[key] = left
                        else:
                            held.pop(key, None)
                        held[(None, kind)] = max(0, held.get((None, kind), 0) - n)
        if anchor is not None:
            self.set_anchor(*anchor)

    def job_count(self, job: str, kind: str) -> int:
        return self._jobs.get((job, kind), 0)

    def used(self, job: str, kind: str, now: float | None = None) -> tuple[int, int]:
        low = int((time.time() if now is None else now) // HOUR_S) - 24
        with self._lock:
            day = 0
            for (k, h), v in self._hours.items():
                if h >= low and k == kind:
                    day += v
            return self._jobs.get((job, kind), 0), day

    def day_count(self, kind: str, now: float | None = None) -> int:
        hour = int((time.time() if now is None else now) // HOUR_S)
        with self._lock:
            return sum(v for (k, h), v in self._hours.items() if k == kind and h >= hour - 24)

    def day_hours(self, kind: str, now: float | None = None) -> list[tuple[int, int]]:
        hour = int((time.time() if now is None else now) // HOUR_S)
        with self._lock:
            return sorted((h, v) for (k, h), v in self._hours.items() if k == kind and h >= hour - 24 and v > 0)

    def add_dp_event(self, job: str, noise_multiplier: float, count: int = 1):
        with self._lock:
            self._dp.append((job, float(noise_multiplier), int(count)))

    def dp_events(self, job: str | None = None) -> list[tuple[float, int]]:
        out: dict = {}
        with self._lock:
            for j, nm, c in self._dp:
                if job is None or j == job:
                    out[nm] = out.get(nm, 0) + c
        return sorted(out.items())

    def set_anchor(self, log: str, count: int, head: str):
        self._anchors[log] = (int(count), head)

    def floor_kept(self, key: str, seq: int) -> None:
        with self._lock:
            self._kept[key] = max(self._kept.get(key, 0), int(seq), self._floors.pop(key, 0))

    def seal_floor(self, key: str) -> int:
        with self._lock:
            return max(self._kept.get(key, 0), self._floors.get(key, 0))

    def anchor(self, log: str) -> tuple[int, str] | None:
        return self._anchors.get(log)


#: the budgets of a site's policy counted over a rolling day: (ledger kind, policy field)
DAY_BUDGETS = (("domain_model", "domain_models_per_day"), ("dc_evaluation", "dc_evaluations_per_day"))
JOB_BUDGETS = (("domain_model", "domain_models_per_job"), ("dc_evaluation", "dc_evaluations_per_job"))


def _budget(limit, used, refills: list | None = None) -> dict:
    """One entry of :func:`budget_status`."""
    refills = refills or []
    return {
        "limit": limit,
        "used": used,
        "left": max(type(limit)(0), limit - used),
        "refills": refills,
        "next_refill": refills[0][0] if refills else None,
    }


def budget_status(ledger: Ledger, policy, now: float | None = None, job: str | None = None) -> dict:
    """What is used and left of each budget of ``policy`` in ``ledger``, and when it refills.

    Returns ``{budget name: entry}`` where the names are the policy's fields:

    - ``domain_models_per_day``, ``dc_evaluations_per_day`` (rolling day, all jobs):
      ``{"limit": int, "used": int, "left": int, "refills": [(unix time, count), ...],
      "next_refill": unix time or None}``; ``refills`` lists when the queries counted now leave
      the window (an hour's queries leave 25 hours after the start of that hour, since the
      window counts whole hours), oldest first;
    - ``epsilon_lifetime``: ``{"limit": float, "used": float, "left": float, "refills": [],
      "next_refill": None, "delta": float, "dp_answers": int}``: the epsilon at ``delta`` of the
      composition (RDP, dp-accounting) of every Gaussian answer the site ever gave; it never
      refills;
    - with ``job`` (a ledger job key): ``domain_models_per_job``, ``dc_evaluations_per_job`` and
      ``epsilon_per_job`` for that job, in the same form (no refills).
    """
    t = time.time() if now is None else float(now)
    out: dict = {}
    for kind, field in DAY_BUDGETS:
        hours = ledger.day_hours(kind, t)
        refills = [(float((h + 25) * HOUR_S), int(n)) for h, n in hours]
        out[field] = _budget(int(getattr(policy, field)), sum(n for _, n in hours), refills)
    from msa_fed.privacy.dp import epsilon_of

    events = ledger.dp_events(None)
    used_eps = epsilon_of(events, policy.delta) if events else 0.0
    out["epsilon_lifetime"] = {
        **_budget(float(policy.epsilon_lifetime), used_eps),
        "delta": float(policy.delta),
        "dp_answers": int(sum(c for _, c in events)),
    }
    if job is not None:
        for kind, field in JOB_BUDGETS:
            out[field] = _budget(int(getattr(policy, field)), ledger.job_count(job, kind))
        jev = ledger.dp_events(job)
        out["epsilon_per_job"] = _budget(float(policy.epsilon_per_job), epsilon_of(jev, policy.delta) if jev else 0.0)
    return out
