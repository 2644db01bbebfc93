"""The site's query ledger: what each job asked, per rolling day, and the DP events spent.

A SQLite file named by the policy (``[budget] ledger``; in memory when empty), so that budgets
survive a restart of the site process.  Also holds the audit log's anchor (line count and the
hash of the last line), so that a truncated log is detected.
"""
from __future__ import annotations

import sqlite3
import threading
import time

DAY_S = 86400.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS queries (job TEXT NOT NULL, kind TEXT NOT NULL, t REAL NOT NULL, n INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS queries_job ON queries (job, kind);
CREATE INDEX IF NOT EXISTS queries_t ON queries (kind, t);
CREATE TABLE IF NOT EXISTS dp_events (job TEXT NOT NULL, t REAL NOT NULL, noise_multiplier REAL NOT NULL,
                                      count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS audit_anchor (log TEXT PRIMARY KEY, count INTEGER NOT NULL, head TEXT NOT NULL);
"""


class Ledger:
    """Counts of answered and refused requests by job and kind; DP events; audit anchors."""

    def __init__(self, path: str = ""):
        self.path = path or ":memory:"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self):
        with self._lock:
            self._db.close()

    def record(self, job: str, kind: str, n: int = 1, t: float | None = None):
        with self._lock:
            self._db.execute("INSERT INTO queries VALUES (?, ?, ?, ?)", (job, kind, time.time() if t is None else t, n))

    def job_count(self, job: str, kind: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT COALESCE(SUM(n), 0) FROM queries WHERE job = ? AND kind = ?",
                                   (job, kind)).fetchone()
        return int(row[0])

    def day_count(self, kind: str, now: float | None = None) -> int:
        since = (time.time() if now is None else now) - DAY_S
        with self._lock:
            row = self._db.execute("SELECT COALESCE(SUM(n), 0) FROM queries WHERE kind = ? AND t > ?",
                                   (kind, since)).fetchone()
        return int(row[0])

    # ------------------------------------------------------------------ DP
    def add_dp_event(self, job: str, noise_multiplier: float, count: int = 1):
        with self._lock:
            self._db.execute("INSERT INTO dp_events VALUES (?, ?, ?, ?)", (job, time.time(), float(noise_multiplier),
                                                                           int(count)))

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
            self._db.execute("INSERT INTO audit_anchor VALUES (?, ?, ?) ON CONFLICT(log) DO UPDATE SET "
                             "count = excluded.count, head = excluded.head", (log, int(count), head))

    def anchor(self, log: str) -> tuple[int, str] | None:
        with self._lock:
            row = self._db.execute("SELECT count, head FROM audit_anchor WHERE log = ?", (log,)).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))
