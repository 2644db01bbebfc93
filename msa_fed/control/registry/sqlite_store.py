"""SQLite implementation of :class:`~msa_fed.control.registry.store.RegistryStore`.

One database file holds everything, blobs included, so a commit (blob plus
record) is one transaction: an upload interrupted at any point, even by
SIGKILL, leaves nothing visible.  WAL journaling lets the admin CLI write
(issue or revoke a token) while a server runs on the same file, and
``synchronous=FULL`` makes every committed registration durable.

The schema version lives in ``PRAGMA user_version``; a database written by a
newer msa_fed is refused rather than misread.  All SQL is parameterised.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path

from msa_fed.control.registry.ops_records import DeregistrationRecord, JobRecord, PromotionRecord, current_version
from msa_fed.control.registry.records import ROLE_SITE, ArtifactRecord, CombinedModelRecord, SiteRecord, TokenRecord
from msa_fed.control.registry.store import RegistryStore, not_registered, upload_conflict
from msa_fed.errors import ConfigError, RegistryError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE tokens (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    role        TEXT NOT NULL,
    principal   TEXT NOT NULL,
    salt        BLOB NOT NULL,
    digest      BLOB NOT NULL,
    created_at  REAL NOT NULL,
    revoked_at  REAL
);
CREATE UNIQUE INDEX tokens_active ON tokens(role, principal) WHERE revoked_at IS NULL;
CREATE TABLE sites (
    name            TEXT PRIMARY KEY,
    registered_at   REAL NOT NULL,
    last_heartbeat  REAL,
    labels_json     TEXT NOT NULL
);
CREATE TABLE blobs (
    sha256  TEXT PRIMARY KEY,
    size    INTEGER NOT NULL,
    data    BLOB NOT NULL
);
CREATE TABLE artifacts (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    site        TEXT NOT NULL,
    upload_id   TEXT NOT NULL,
    kind        TEXT NOT NULL,
    sha256      TEXT NOT NULL REFERENCES blobs(sha256),
    size        INTEGER NOT NULL,
    meta_json   TEXT NOT NULL,
    created_at  REAL NOT NULL,
    UNIQUE (site, upload_id)
);
CREATE INDEX artifacts_latest ON artifacts(site, kind, seq);
CREATE TABLE combined_models (
    version        INTEGER PRIMARY KEY AUTOINCREMENT,
    upload_id      TEXT NOT NULL UNIQUE,
    sha256         TEXT NOT NULL REFERENCES blobs(sha256),
    size           INTEGER NOT NULL,
    manifest_json  TEXT NOT NULL,
    created_by     TEXT NOT NULL,
    created_at     REAL NOT NULL
);
"""

# Operations tables (jobs, promotions, deregistrations): created when missing on every open, so
# a database written before they existed gains them without a schema-version change.
_OPS_SCHEMA = """
CREATE TABLE IF NOT EXISTS model_promotions (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    version        INTEGER NOT NULL REFERENCES combined_models(version),
    after_version  INTEGER NOT NULL,
    promoted_at    REAL NOT NULL,
    promoted_by    TEXT NOT NULL,
    reason         TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS deregistrations (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT NOT NULL,
    deregistered_at  REAL NOT NULL,
    deregistered_by  TEXT NOT NULL,
    reason           TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_logs (
    job_id  TEXT NOT NULL,
    seq     INTEGER NOT NULL,
    time    REAL NOT NULL,
    text    TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS job_log_drops (
    job_id   TEXT PRIMARY KEY,
    dropped  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id         TEXT NOT NULL UNIQUE,
    name           TEXT NOT NULL,
    sites_json     TEXT NOT NULL,
    topology       TEXT NOT NULL,
    status         TEXT NOT NULL,
    started_at     REAL NOT NULL,
    started_by     TEXT NOT NULL,
    ended_at       REAL,
    model_version  INTEGER,
    error          TEXT NOT NULL
);
"""


def _open_error(path: Path, exc: sqlite3.DatabaseError) -> str:
    """What went wrong opening the database, said as the operator can act on it: a folder or file
    it may not write (a read-only filesystem, permissions) is not a damaged database."""
    import os

    text = str(exc).lower()
    folder = path.parent if str(path.parent) else Path(".")
    writable = os.access(folder, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    if not writable or "readonly" in text or "read-only" in text or "unable to open" in text:
        where = str(path) if path.exists() and not os.access(path, os.W_OK) else str(folder)
        return (
            f"--db {str(path)!r} cannot be written: {where!r} is read-only for this process (a read-only "
            "filesystem or its permissions); the registry needs to write the database and its -wal file "
            "next to it"
        )
    return f"--db {str(path)!r} is not a usable SQLite database ({exc}); is it another kind of file, or damaged?"


class SqliteStore(RegistryStore):
    """Registry state in the SQLite file ``path``.

    ``create=False`` refuses a missing file (admin commands that only read or
    revoke should not silently create an empty registry).
    """

    def __init__(self, path, *, create: bool = True, busy_timeout_s: float = 30.0):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise ConfigError(f"--db {str(self.path)!r} does not exist; expected an existing registry database")
        if self.path.parent and not self.path.parent.exists():
            raise ConfigError(f"--db {str(self.path)!r}: folder {str(self.path.parent)!r} does not exist")
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(
                str(self.path), isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(_open_error(self.path, exc)) from None

    def _migrate(self) -> None:
        with self._lock:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"--db {str(self.path)!r} has schema version {version}; this msa_fed supports up to {SCHEMA_VERSION}"
                )
            if version == 0:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    # Another process may have created the schema meanwhile.
                    if self._conn.execute("PRAGMA user_version").fetchone()[0] == 0:
                        for statement in _SCHEMA.split(";"):
                            if statement.strip():
                                self._conn.execute(statement)
                        self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
            self._write(lambda c: [c.execute(s) for s in _OPS_SCHEMA.split(";") if s.strip()])

    def _write(self, fn):
        """Run ``fn(conn)`` in one IMMEDIATE transaction and return its result."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return result

    def _read(self, sql: str, params=()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # tokens -------------------------------------------------------------
    def put_token(self, record: TokenRecord) -> None:
        def fn(c):
            c.execute(
                "UPDATE tokens SET revoked_at = ? WHERE role = ? AND principal = ? AND revoked_at IS NULL",
                (record.created_at, record.role, record.principal),
            )
            c.execute(
                "INSERT INTO tokens (role, principal, salt, digest, created_at) VALUES (?, ?, ?, ?, ?)",
                (record.role, record.principal, record.salt, record.digest, record.created_at),
            )

        self._write(fn)

    def get_token(self, role: str, principal: str) -> TokenRecord | None:
        rows = self._read(
            "SELECT salt, digest, created_at FROM tokens WHERE role = ? AND principal = ? AND revoked_at IS NULL",
            (role, principal),
        )
        if not rows:
            return None
        salt, digest, created_at = rows[0]
        return TokenRecord(role, principal, bytes(salt), bytes(digest), created_at)

    def revoke_tokens(self, role: str, principal: str, now: float) -> int:
        return self._write(
            lambda c: (
                c.execute(
                    "UPDATE tokens SET revoked_at = ? WHERE role = ? AND principal = ? AND revoked_at IS NULL",
                    (now, role, principal),
                ).rowcount
            )
        )

    def token_states(self, role: str) -> dict[str, str]:
        rows = self._read(
            "SELECT principal, SUM(revoked_at IS NULL) FROM tokens WHERE role = ? GROUP BY principal", (role,)
        )
        return {p: ("active" if n else "revoked") for p, n in rows}

    def revoked_tokens(self, role: str, principal: str, limit: int = 8) -> list[TokenRecord]:
        rows = self._read(
            "SELECT salt, digest, created_at FROM tokens WHERE role = ? AND principal = ? AND revoked_at IS NOT NULL "
            "ORDER BY revoked_at DESC, id DESC LIMIT ?",
            (role, principal, int(limit)),
        )
        return [
            TokenRecord(role, principal, bytes(salt), bytes(digest), created_at) for salt, digest, created_at in rows
        ]

    def site_access(self, names) -> dict[str, TokenRecord | None]:
        names = list(dict.fromkeys(names))
        rows: list[tuple] = []
        for start in range(0, len(names), 500):  # well within SQLite's limit on parameters
            part = names[start : start + 500]
            rows += self._read(
                "SELECT s.name, t.salt, t.digest, t.created_at FROM sites s LEFT JOIN tokens t ON t.role = ? "
                "AND t.principal = s.name AND t.revoked_at IS NULL WHERE s.name IN (" + ",".join("?" * len(part)) + ")",
                (ROLE_SITE, *part),
            )
        out: dict[str, TokenRecord | None] = {}
        for name, salt, digest, created_at in rows:
            if out.get(name) is None:
                out[name] = (
                    None if salt is None else TokenRecord(ROLE_SITE, name, bytes(salt), bytes(digest), created_at)
                )
        return out

    # sites --------------------------------------------------------------
    def register_site(self, name: str, labels: dict[str, str], now: float) -> SiteRecord:
        labels_json = json.dumps(dict(sorted(labels.items())))
        self._write(
            lambda c: c.execute(
                "INSERT INTO sites (name, registered_at, last_heartbeat, labels_json) VALUES (?, ?, NULL, ?) "
                "ON CONFLICT(name) DO UPDATE SET labels_json = excluded.labels_json",
                (name, now, labels_json),
            )
        )
        record = self.get_site(name)
        assert record is not None  # just written
        return record

    def heartbeat(self, name: str, now: float) -> bool:
        return self._write(
            lambda c: c.execute("UPDATE sites SET last_heartbeat = ? WHERE name = ?", (now, name)).rowcount == 1
        )

    _ARTIFACT_COLUMNS = "site, upload_id, kind, sha256, size, meta_json, created_at"

    @staticmethod
    def _artifact(row) -> ArtifactRecord:
        site, upload_id, kind, sha256, size, meta_json, created_at = row
        return ArtifactRecord(site, upload_id, kind, sha256, size, json.loads(meta_json), created_at)

    def _latest(self, site: str, kind: str) -> ArtifactRecord | None:
        rows = self._read(
            f"SELECT {self._ARTIFACT_COLUMNS} FROM artifacts WHERE site = ? AND kind = ? ORDER BY seq DESC LIMIT 1",
            (site, kind),
        )
        return self._artifact(rows[0]) if rows else None

    def _site(self, row) -> SiteRecord:
        name, registered_at, last_heartbeat, labels_json = row
        return SiteRecord(
            name,
            registered_at,
            last_heartbeat,
            json.loads(labels_json),
            predictor=self._latest(name, "predictor"),
            sample=self._latest(name, "sample"),
        )

    def get_site(self, name: str) -> SiteRecord | None:
        with self._lock:
            rows = self._read(
                "SELECT name, registered_at, last_heartbeat, labels_json FROM sites WHERE name = ?", (name,)
            )
            return self._site(rows[0]) if rows else None

    def list_sites(self) -> list[SiteRecord]:
        with self._lock:
            rows = self._read("SELECT name, registered_at, last_heartbeat, labels_json FROM sites ORDER BY name")
            return [self._site(r) for r in rows]

    def deregister_site(self, name: str) -> bool:
        def fn(c):
            if c.execute("DELETE FROM sites WHERE name = ?", (name,)).rowcount == 0:
                return False
            shas = [r[0] for r in c.execute("SELECT DISTINCT sha256 FROM artifacts WHERE site = ?", (name,))]
            c.execute("DELETE FROM artifacts WHERE site = ?", (name,))
            for sha in shas:
                c.execute(
                    "DELETE FROM blobs WHERE sha256 = ? "
                    "AND NOT EXISTS (SELECT 1 FROM artifacts WHERE sha256 = ?) "
                    "AND NOT EXISTS (SELECT 1 FROM combined_models WHERE sha256 = ?)",
                    (sha, sha, sha),
                )
            return True

        return self._write(fn)

    # artifacts ----------------------------------------------------------
    def commit_artifact(self, record: ArtifactRecord, data: bytes) -> tuple[ArtifactRecord, bool]:
        def fn(c):
            rows = c.execute(
                f"SELECT {self._ARTIFACT_COLUMNS} FROM artifacts WHERE site = ? AND upload_id = ?",
                (record.site, record.upload_id),
            ).fetchall()
            if rows:
                old = self._artifact(rows[0])
                if old.kind == record.kind and old.sha256 == record.sha256:
                    return old, False
                raise upload_conflict(record.upload_id)
            if c.execute("SELECT 1 FROM sites WHERE name = ?", (record.site,)).fetchone() is None:
                raise not_registered(record.site)
            c.execute(
                "INSERT OR IGNORE INTO blobs (sha256, size, data) VALUES (?, ?, ?)",
                (record.sha256, len(data), sqlite3.Binary(data)),
            )
            c.execute(
                f"INSERT INTO artifacts ({self._ARTIFACT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.site,
                    record.upload_id,
                    record.kind,
                    record.sha256,
                    record.size,
                    json.dumps(record.meta),
                    record.created_at,
                ),
            )
            return record, True

        return self._write(fn)

    def artifact_history(self, site: str, kind: str) -> list[ArtifactRecord]:
        rows = self._read(
            f"SELECT {self._ARTIFACT_COLUMNS} FROM artifacts WHERE site = ? AND kind = ? ORDER BY seq", (site, kind)
        )
        return [self._artifact(r) for r in rows]

    def get_blob(self, sha256: str) -> bytes | None:
        rows = self._read("SELECT data FROM blobs WHERE sha256 = ?", (sha256,))
        if not rows:
            return None
        data = bytes(rows[0][0])
        if hashlib.sha256(data).hexdigest() != sha256:
            raise RegistryError("DATA_LOSS", f"stored blob {sha256} is corrupt (its sha256 no longer matches)")
        return data

    # combined models ----------------------------------------------------
    _COMBINED_COLUMNS = "version, upload_id, sha256, size, manifest_json, created_by, created_at"

    def commit_combined_model(
        self, upload_id: str, sha256: str, data: bytes, manifest_json: str, created_by: str, now: float
    ) -> tuple[CombinedModelRecord, bool]:
        def fn(c):
            row = c.execute(
                f"SELECT {self._COMBINED_COLUMNS} FROM combined_models WHERE upload_id = ?", (upload_id,)
            ).fetchone()
            if row is not None:
                old = CombinedModelRecord(*row)
                if old.sha256 == sha256 and old.manifest_json == manifest_json:
                    return old, False
                raise upload_conflict(upload_id)
            c.execute(
                "INSERT OR IGNORE INTO blobs (sha256, size, data) VALUES (?, ?, ?)",
                (sha256, len(data), sqlite3.Binary(data)),
            )
            cur = c.execute(
                "INSERT INTO combined_models (upload_id, sha256, size, manifest_json, created_by, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (upload_id, sha256, len(data), manifest_json, created_by, now),
            )
            return CombinedModelRecord(
                cur.lastrowid, upload_id, sha256, len(data), manifest_json, created_by, now
            ), True

        return self._write(fn)

    def get_combined_model(self, version: int | None = None) -> CombinedModelRecord | None:
        with self._lock:
            if version is None:
                version = self.current_model_version()
                if version is None:
                    return None
            rows = self._read(f"SELECT {self._COMBINED_COLUMNS} FROM combined_models WHERE version = ?", (version,))
            return CombinedModelRecord(*rows[0]) if rows else None

    # operations -----------------------------------------------------------
    def list_combined_models(self) -> list[CombinedModelRecord]:
        rows = self._read(f"SELECT {self._COMBINED_COLUMNS} FROM combined_models ORDER BY version")
        return [CombinedModelRecord(*r) for r in rows]

    def max_model_version(self) -> int | None:
        return self._read("SELECT MAX(version) FROM combined_models")[0][0]

    def promote_model(self, version: int, now: float, by: str, reason: str) -> PromotionRecord:
        def fn(c):
            if c.execute("SELECT 1 FROM combined_models WHERE version = ?", (version,)).fetchone() is None:
                raise RegistryError("NOT_FOUND", f"no combined model version {version} is stored")
            newest = c.execute("SELECT MAX(version) FROM combined_models").fetchone()[0]
            c.execute(
                "INSERT INTO model_promotions (version, after_version, promoted_at, promoted_by, reason) "
                "VALUES (?, ?, ?, ?, ?)",
                (version, newest, now, by, reason),
            )
            return PromotionRecord(version, newest, now, by, reason)

        return self._write(fn)

    def promotions(self) -> list[PromotionRecord]:
        rows = self._read(
            "SELECT version, after_version, promoted_at, promoted_by, reason FROM model_promotions ORDER BY seq"
        )
        return [PromotionRecord(*r) for r in rows]

    def current_model_version(self) -> int | None:
        with self._lock:
            return current_version(self.max_model_version(), self.promotions(), self.disputed_versions())

    def disputed_versions(self) -> frozenset[int]:
        rows = self._read(
            "SELECT version FROM combined_models WHERE json_valid(manifest_json) AND "
            "json_array_length(json_extract(manifest_json, '$.info.site_check.disputed')) > 0"
        )
        return frozenset(int(r[0]) for r in rows)

    def token_revoked_at(self, role: str, principal: str) -> float | None:
        rows = self._read(
            "SELECT SUM(revoked_at IS NULL), MAX(revoked_at) FROM tokens WHERE role = ? AND principal = ?",
            (role, principal),
        )
        active, revoked_at = rows[0]
        return None if active else revoked_at

    def record_deregistration(self, record: DeregistrationRecord) -> None:
        self._write(
            lambda c: c.execute(
                "INSERT INTO deregistrations (name, deregistered_at, deregistered_by, reason) VALUES (?, ?, ?, ?)",
                (record.name, record.deregistered_at, record.deregistered_by, record.reason),
            )
        )

    def deregistrations(self) -> dict[str, DeregistrationRecord]:
        rows = self._read("SELECT name, deregistered_at, deregistered_by, reason FROM deregistrations ORDER BY seq")
        return {r[0]: DeregistrationRecord(*r) for r in rows}

    _JOB_COLUMNS = "job_id, name, sites_json, topology, status, started_at, started_by, ended_at, model_version, error"

    @staticmethod
    def _job(row) -> JobRecord:
        job_id, name, sites_json, topology, status, started_at, started_by, ended_at, model_version, error = row
        return JobRecord(
            job_id,
            name,
            tuple(json.loads(sites_json)),
            topology,
            status,
            started_at,
            started_by,
            ended_at,
            model_version,
            error,
        )

    def start_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        def fn(c):
            row = c.execute(f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE job_id = ?", (record.job_id,)).fetchone()
            if row is not None:
                return self._job(row), False
            c.execute(
                f"INSERT INTO jobs ({self._JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.job_id,
                    record.name,
                    json.dumps(list(record.sites)),
                    record.topology,
                    record.status,
                    record.started_at,
                    record.started_by,
                    record.ended_at,
                    record.model_version,
                    record.error,
                ),
            )
            return record, True

        return self._write(fn)

    def finish_job(self, job_id, status, ended_at, model_version, error) -> JobRecord | None:
        def fn(c):
            n = c.execute(
                "UPDATE jobs SET status = ?, ended_at = ?, model_version = ?, error = ? WHERE job_id = ?",
                (status, ended_at, model_version, error, job_id),
            ).rowcount
            if not n:
                return None
            return self._job(c.execute(f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone())

        return self._write(fn)

    def get_job(self, job_id: str) -> JobRecord | None:
        rows = self._read(f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,))
        return self._job(rows[0]) if rows else None

    def append_job_log(self, job_id: str, lines: list[str], now: float, max_lines: int) -> tuple[int, int]:
        def fn(c):
            count = c.execute("SELECT COUNT(*) FROM job_logs WHERE job_id = ?", (job_id,)).fetchone()[0]
            room = max(0, max_lines - count)
            c.executemany(
                "INSERT INTO job_logs (job_id, seq, time, text) VALUES (?, ?, ?, ?)",
                [(job_id, count + k + 1, now, text) for k, text in enumerate(lines[:room])],
            )
            extra = len(lines) - min(room, len(lines))
            if extra:
                c.execute(
                    "INSERT INTO job_log_drops (job_id, dropped) VALUES (?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET dropped = dropped + excluded.dropped",
                    (job_id, extra),
                )
            row = c.execute("SELECT dropped FROM job_log_drops WHERE job_id = ?", (job_id,)).fetchone()
            return count + min(room, len(lines)), row[0] if row else 0

        return self._write(fn)

    def job_log(self, job_id: str, after: int, limit: int) -> tuple[list[tuple[int, float, str]], int, int]:
        rows = self._read(
            "SELECT seq, time, text FROM job_logs WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, int(after), int(limit)),
        )
        total = self._read("SELECT COUNT(*) FROM job_logs WHERE job_id = ?", (job_id,))[0][0]
        drops = self._read("SELECT dropped FROM job_log_drops WHERE job_id = ?", (job_id,))
        return [(int(s), float(t), str(x)) for s, t, x in rows], int(total), int(drops[0][0]) if drops else 0

    def list_jobs(self, limit: int = 100) -> list[JobRecord]:
        rows = self._read(
            f"SELECT {self._JOB_COLUMNS} FROM jobs ORDER BY started_at DESC, seq DESC LIMIT ?", (int(limit),)
        )
        return [self._job(r) for r in rows]
