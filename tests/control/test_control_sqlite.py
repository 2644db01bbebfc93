"""What only the SQLite store promises: durability, schema versioning, two processes on one file."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from msa_fed.control.registry.records import ArtifactRecord
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SCHEMA_VERSION, SqliteStore
from msa_fed.errors import ConfigError, RegistryError


def test_state_survives_reopen(tmp_path):
    path = tmp_path / "r.db"
    with SqliteStore(path) as store:
        reg = Registry(store)
        tok = reg.issue_token("site", "a")
        store.register_site("a", {"city": "x"}, 1.0)
        data = b"\x00\x00\x80\x3f" * 3
        rec = ArtifactRecord(
            "a",
            "u1",
            "sample",
            hashlib.sha256(data).hexdigest(),
            len(data),
            {"rows": 1, "cols": 3, "dtype": "float32"},
            2.0,
        )
        store.commit_artifact(rec, data)
        store.commit_combined_model("j", hashlib.sha256(b"m").hexdigest(), b"m", "{}", "admin", 3.0)
    with SqliteStore(path, create=False) as store:
        reg = Registry(store)
        assert reg.authenticate(tok).name == "a"
        site = store.get_site("a")
        assert site.labels == {"city": "x"} and site.sample == rec
        assert store.get_blob(rec.sha256) == data
        assert store.get_combined_model().version == 1


def test_wal_and_schema_version(tmp_path):
    path = tmp_path / "r.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(ConfigError, match="schema version"):
        SqliteStore(path)


def test_refuses_missing_or_foreign_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SqliteStore(tmp_path / "missing.db", create=False)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="not a usable SQLite database"):
        SqliteStore(junk)


def test_second_connection_sees_token_changes_immediately(tmp_path):
    """The admin CLI writes while a server holds the file open: revocation takes effect at once."""
    path = tmp_path / "r.db"
    server_store, admin_store = SqliteStore(path), SqliteStore(path)
    try:
        server_side, admin_side = Registry(server_store), Registry(admin_store)
        tok = admin_side.issue_token("site", "a")
        assert server_side.authenticate(tok).name == "a"
        assert admin_side.revoke_token("site", "a")
        with pytest.raises(RegistryError) as err:
            server_side.authenticate(tok)
        assert err.value.code == "UNAUTHENTICATED"
    finally:
        server_store.close()
        admin_store.close()


def test_tokens_are_stored_only_as_salted_hashes(tmp_path):
    path = tmp_path / "r.db"
    with SqliteStore(path) as store:
        reg = Registry(store)
        t1 = reg.issue_token("site", "a")
        t2 = reg.issue_token("site", "b")
    raw = (
        path.read_bytes() + (tmp_path / "r.db-wal").read_bytes()
        if (tmp_path / "r.db-wal").exists()
        else path.read_bytes()
    )
    for tok in (t1, t2):
        secret = tok.rsplit(".", 1)[1]
        assert secret.encode() not in raw
    conn = sqlite3.connect(path)
    salts = [bytes(r[0]) for r in conn.execute("SELECT salt FROM tokens")]
    conn.close()
    assert len(salts) == 2 and salts[0] != salts[1]
