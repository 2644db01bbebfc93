"""The operations part of the store contract, run against both stores (memory and SQLite)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from msa_fed.control.registry.ops_records import DeregistrationRecord, JobRecord
from msa_fed.control.registry.records import TokenRecord
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.errors import RegistryError


def commit_model(store, n: int, manifest: str = "{}"):
    data = f"model {n}".encode()
    rec, _ = store.commit_combined_model(f"u{n}", hashlib.sha256(data).hexdigest(), data, manifest, "admin", float(n))
    return rec


def test_a_disputed_model_is_latest_only_by_an_operators_promotion(store):
    """A model a site did not sign off (its verdict: the model harms it) is stored, and "latest"
    stays on the newest model every site signed off until an operator promotes it."""
    disputed = '{"info": {"site_check": {"disputed": ["north"]}}}'
    signed = '{"info": {"site_check": {"disputed": []}}}'
    commit_model(store, 1, signed)
    commit_model(store, 2, disputed)
    assert store.current_model_version() == 1 and store.get_combined_model().version == 1
    assert store.get_combined_model(2).version == 2  # stored all the same
    commit_model(store, 3, disputed)
    assert store.current_model_version() == 1
    store.promote_model(3, 5.0, "admin", "north's dispute reviewed")
    assert store.current_model_version() == 3
    commit_model(store, 4, disputed)  # newer and disputed: the promotion still holds
    assert store.current_model_version() == 3
    commit_model(store, 5, signed)
    assert store.current_model_version() == 5


def test_latest_is_newest_until_an_older_version_is_promoted(store):
    assert store.current_model_version() is None
    assert store.get_combined_model() is None
    for n in (1, 2, 3):
        commit_model(store, n)
    assert store.current_model_version() == 3
    assert store.get_combined_model().version == 3
    store.promote_model(1, 10.0, "admin", "v3 is poisoned")
    assert store.current_model_version() == 1
    assert store.get_combined_model().version == 1  # what clients get as "latest"
    assert store.get_combined_model(3).version == 3  # explicit versions are unaffected
    assert [m.version for m in store.list_combined_models()] == [1, 2, 3]
    commit_model(store, 4)  # a new model becomes current again
    assert store.get_combined_model().version == 4
    store.promote_model(2, 11.0, "admin", "")
    assert store.get_combined_model().version == 2
    promotions = [(p.version, p.after_version, p.reason) for p in store.promotions()]
    assert promotions == [(1, 3, "v3 is poisoned"), (2, 4, "")]


def test_promoting_a_missing_version_is_not_found(store):
    commit_model(store, 1)
    with pytest.raises(RegistryError) as err:
        store.promote_model(7, 1.0, "admin", "")
    assert err.value.code == "NOT_FOUND"
    assert store.promotions() == []


def test_token_revocation_time(store):
    store.put_token(TokenRecord("site", "a", b"1" * 16, b"d" * 32, 1.0))
    assert store.token_revoked_at("site", "a") is None
    assert store.token_revoked_at("site", "nobody") is None
    store.revoke_tokens("site", "a", 5.0)
    assert store.token_revoked_at("site", "a") == 5.0
    store.put_token(TokenRecord("site", "a", b"2" * 16, b"d" * 32, 6.0))  # re-issued: not revoked any more
    assert store.token_revoked_at("site", "a") is None


def test_deregistrations_are_kept_after_the_site_is_gone(store):
    store.register_site("a", {}, 1.0)
    assert store.deregister_site("a")
    store.record_deregistration(DeregistrationRecord("a", 2.0, "admin", "left the consortium"))
    store.record_deregistration(DeregistrationRecord("a", 3.0, "admin", "again"))
    assert store.get_site("a") is None
    assert store.deregistrations() == {"a": DeregistrationRecord("a", 3.0, "admin", "again")}


def test_jobs_start_idempotent_finish_and_list_newest_first(store):
    j1 = JobRecord("j1", "first", ("a", "b"), "ray", "running", 1.0, "admin")
    j2 = JobRecord("j2", "second", ("a",), "ray", "running", 2.0, "admin")
    assert store.start_job(j1) == (j1, True)
    assert store.start_job(dataclasses.replace(j1, name="other")) == (j1, False)
    store.start_job(j2)
    assert [j.job_id for j in store.list_jobs()] == ["j2", "j1"]
    assert [j.job_id for j in store.list_jobs(limit=1)] == ["j2"]
    done = store.finish_job("j1", "failed", 5.0, None, "site 'b' was deregistered")
    assert (done.status, done.ended_at, done.model_version, done.error) == (
        "failed",
        5.0,
        None,
        "site 'b' was deregistered",
    )
    assert store.get_job("j1") == done
    assert store.get_job("j1").sites == ("a", "b")
    assert store.finish_job("missing", "failed", 5.0, None, "") is None
    assert store.get_job("missing") is None


def test_sqlite_operations_state_survives_reopening(tmp_path):
    path = tmp_path / "reg.db"
    with SqliteStore(path) as s:
        commit_model(s, 1)
        commit_model(s, 2)
        s.promote_model(1, 3.0, "admin", "rollback")
        s.start_job(JobRecord("j", "n", ("a",), "ray", "running", 1.0, "admin"))
        s.record_deregistration(DeregistrationRecord("b", 2.0, "admin", "why"))
    with SqliteStore(path, create=False) as s:
        assert s.get_combined_model().version == 1
        assert s.get_job("j").sites == ("a",)
        assert "b" in s.deregistrations()
