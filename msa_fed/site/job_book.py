"""The jobs a site process was asked to serve, on the site's own disk.

:class:`JobBook` (SQLite): every job the site was asked to join, with its state ``pending``
(``accept_jobs = "approve"`` and not approved yet), ``approved`` (``msa-fed site approve``) or
``served`` (joined); and, per job content, the set-ups the site answered (a replay of one, when
the job resumes or is replayed to the restarted site, is not charged again: :class:`KeptSetups`).
The site's operator reads and changes it with ``msa-fed site jobs`` and ``msa-fed site approve``;
the site process reads it at every join.  What the site answered and refused is in its one
audit log (:mod:`msa_fed.privacy.audit`).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    admin TEXT NOT NULL,
    sites TEXT NOT NULL,
    state TEXT NOT NULL,
    first_seen REAL NOT NULL,
    changed_at REAL NOT NULL
)
"""
STATES = ("pending", "approved", "served")
#: per sealed job (its certificate's digest): the sequence number of the last request this site
#: took, written before the site answers it (a restarted site refuses it and every earlier one);
#: a site process with a ledger file keeps them in its ledger, with each request's audit record
#: (:meth:`msa_fed.privacy.ledger.Ledger.keep_floor`), and still reads the ones kept here
_FLOORS = """
CREATE TABLE IF NOT EXISTS seal_floors (
    certificate TEXT PRIMARY KEY,
    seq INTEGER NOT NULL
)
"""
#: per job content, labelled data and policy (a scope, :func:`setup_scope`): the set-ups the site
#: answered (their rows' replay keys, :mod:`msa_fed.site.gate`), so that a replay is not charged again
_SETUPS = """
CREATE TABLE IF NOT EXISTS answered_setups (
    scope TEXT NOT NULL,
    method TEXT NOT NULL,
    key TEXT NOT NULL,
    first_answered REAL NOT NULL,
    PRIMARY KEY (scope, method, key)
)
"""
#: columns added since the first schema: the digest of the job's content and the content itself
_COLUMNS = {"digest": "TEXT NOT NULL DEFAULT ''", "content": "TEXT NOT NULL DEFAULT ''"}


class JobBook:
    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # each commit is in the WAL before the call returns: a seal floor survives the site process
        # being killed the moment after (an fsync per request, synchronous=FULL, would also survive
        # a power cut at 0.3 to 10 ms a request here; what such a cut could lose is a replayed
        # request answered once more, under a fresh random nonce: nothing of an old answer)
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.execute(_FLOORS)
        self._db.execute(_SETUPS)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, decl in _COLUMNS.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
        self._lock = threading.Lock()

    def close(self):
        self._db.close()

    def seen(self, job_id: str, admin: str, sites, digest: str = "", content: dict | None = None) -> str:
        """Record that ``job_id`` asked to be served with content ``digest``; its state (new jobs
        are "pending").  An approval binds the content: the same job id with another digest is
        pending again (a job approved in advance without a digest binds the first content seen)."""
        now = time.time()
        text = json.dumps(content or {}, sort_keys=True)
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO jobs (job_id, admin, sites, state, first_seen, changed_at, digest, content) "
                "VALUES (?, ?, ?, 'pending', ?, ?, ?, ?)",
                (job_id, admin, json.dumps(list(sites)), now, now, digest, text),
            )
            state, known = self._db.execute("SELECT state, digest FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if known != digest:
                state = "approved" if (state == "approved" and not known) else "pending"
                self._db.execute(
                    "UPDATE jobs SET admin = ?, sites = ?, state = ?, changed_at = ?, digest = ?, content = ? "
                    "WHERE job_id = ?",
                    (admin, json.dumps(list(sites)), state, now, digest, text, job_id),
                )
            return state

    def set_state(self, job_id: str, state: str, *, create: bool = False, digest: str | None = None) -> bool:
        """Set a job's state; with ``digest``, only while the job's content has that digest (an
        approval in advance, ``create``, records it)."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        now = time.time()
        with self._lock:
            if create:
                self._db.execute(
                    "INSERT OR IGNORE INTO jobs (job_id, admin, sites, state, first_seen, changed_at, digest) "
                    "VALUES (?, '', '[]', ?, ?, ?, ?)",
                    (job_id, state, now, now, digest or ""),
                )
            if digest is None:
                cur = self._db.execute(
                    "UPDATE jobs SET state = ?, changed_at = ? WHERE job_id = ?", (state, now, job_id)
                )
            else:
                cur = self._db.execute(
                    "UPDATE jobs SET state = ?, changed_at = ? WHERE job_id = ? AND digest = ?",
                    (state, now, job_id, digest),
                )
            return cur.rowcount > 0

    def seal_floor(self, certificate: str) -> int:
        """The sequence number of the last request of the sealed job with this certificate digest
        that this site took (0: none): a restarted site process refuses it and every earlier one."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM seal_floors WHERE certificate = ?", (certificate,)).fetchone()
        return int(row[0]) if row else 0

    def set_seal_floor(self, certificate: str, seq: int) -> None:
        """Keep ``seq`` as the job's floor (never lowered); committed (SQLite, WAL) on return."""
        with self._lock:
            self._db.execute(
                "INSERT INTO seal_floors VALUES (?, ?) ON CONFLICT(certificate) DO UPDATE SET seq = "
                "MAX(seq, excluded.seq)",
                (certificate, int(seq)),
            )

    def setup_answered(self, scope: str, method: str, key: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM answered_setups WHERE scope = ? AND method = ? AND key = ?", (scope, method, key)
            ).fetchone()
        return row is not None

    def remember_setup(self, scope: str, method: str, key: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO answered_setups VALUES (?, ?, ?, ?)", (scope, method, key, time.time())
            )

    def jobs(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, admin, sites, state, first_seen, changed_at, digest, content FROM jobs "
                "ORDER BY first_seen"
            ).fetchall()
        return [
            dict(
                job_id=r[0],
                admin=r[1],
                sites=json.loads(r[2]),
                state=r[3],
                first_seen=r[4],
                changed_at=r[5],
                digest=r[6],
                content=json.loads(r[7]) if r[7] else {},
            )
            for r in rows
        ]


def labelled_digest(data: dict) -> str:
    """A digest of a site's labelled data (``load_site_data``'s dict)."""
    h = hashlib.sha256()
    for name in ("X_labeled", "y_labeled"):
        a = np.asarray(data[name])
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def setup_scope(job_key: str, labelled: str, policy) -> str:
    """The scope in which a set-up answered once is a replay: one job content (``job_key``,
    :func:`msa_fed.site.admission.job_key`), the site's labelled data (``labelled``:
    :func:`labelled_digest`; another file gives other answers) and its policy (with DP on, a
    domain model is answered from the published sample)."""
    return hashlib.sha256(repr((job_key, labelled, repr(policy))).encode()).hexdigest()


class KeptSetups:
    """A job's :class:`msa_fed.site.gate.SetupMemory` kept in the site's job book, in ``scope``
    (:func:`setup_scope`): it outlives the job's run and the site process."""

    def __init__(self, book: JobBook, scope: str):
        self.book, self.scope = book, scope

    def answered(self, method: str, key: str) -> bool:
        return self.book.setup_answered(self.scope, method, key)

    def remember(self, method: str, key: str) -> None:
        self.book.remember_setup(self.scope, method, key)
