"""One suite for both RegistryStore implementations (memory and SQLite)."""

from __future__ import annotations

import hashlib
import threading

import pytest

from msa_fed.control.registry.records import ArtifactRecord, TokenRecord
from msa_fed.errors import RegistryError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def artifact(site: str, upload_id: str, data: bytes, kind: str = "sample", t: float = 1.0) -> ArtifactRecord:
    return ArtifactRecord(
        site, upload_id, kind, sha(data), len(data), {"rows": 1, "cols": len(data) // 4, "dtype": "float32"}, t
    )


def token(principal: str, salt: bytes, role: str = "site") -> TokenRecord:
    return TokenRecord(role, principal, salt, hashlib.sha256(salt).digest(), 1.0)


def test_tokens_rotate_and_revoke(store):
    assert store.get_token("site", "a") is None
    store.put_token(token("a", b"1" * 16))
    store.put_token(token("a", b"2" * 16))  # rotation replaces the first
    assert store.get_token("site", "a").salt == b"2" * 16
    assert store.get_token("admin", "a") is None  # roles are separate namespaces
    store.put_token(token("b", b"3" * 16))
    assert store.token_states("site") == {"a": "active", "b": "active"}
    assert store.revoke_tokens("site", "a", 2.0) == 1
    assert store.get_token("site", "a") is None
    assert store.revoke_tokens("site", "a", 3.0) == 0
    assert store.token_states("site") == {"a": "revoked", "b": "active"}
    store.put_token(token("a", b"4" * 16))  # re-issue after revocation
    assert store.get_token("site", "a").salt == b"4" * 16


def test_register_is_idempotent_and_keeps_first_time(store):
    first = store.register_site("a", {"k": "v"}, now=10.0)
    again = store.register_site("a", {"k": "w"}, now=20.0)
    assert first.registered_at == again.registered_at == 10.0
    assert again.labels == {"k": "w"}
    assert [s.name for s in store.list_sites()] == ["a"]


def test_heartbeat_needs_registration(store):
    assert store.heartbeat("a", 5.0) is False
    store.register_site("a", {}, 1.0)
    assert store.get_site("a").last_heartbeat is None
    assert store.heartbeat("a", 5.0) is True
    assert store.get_site("a").last_heartbeat == 5.0


def test_list_sites_sorted_with_latest_artifacts(store):
    for name in ("c", "a", "b"):
        store.register_site(name, {}, 1.0)
    store.commit_artifact(artifact("b", "u1", b"\x00" * 8, t=1.0), b"\x00" * 8)
    store.commit_artifact(artifact("b", "u2", b"\x01" * 8, t=2.0), b"\x01" * 8)
    sites = store.list_sites()
    assert [s.name for s in sites] == ["a", "b", "c"]
    assert sites[1].sample.sha256 == sha(b"\x01" * 8)  # the latest upload wins
    assert sites[0].sample is None and sites[0].predictor is None
    assert [r.upload_id for r in store.artifact_history("b", "sample")] == ["u1", "u2"]


def test_commit_requires_registration(store):
    with pytest.raises(RegistryError) as err:
        store.commit_artifact(artifact("a", "u1", b"abcd"), b"abcd")
    assert err.value.code == "FAILED_PRECONDITION"
    assert store.get_blob(sha(b"abcd")) is None  # nothing partial left behind


def test_retry_with_same_upload_id_is_idempotent(store):
    store.register_site("a", {}, 1.0)
    rec, created = store.commit_artifact(artifact("a", "u1", b"abcd", t=1.0), b"abcd")
    assert created
    again, created_again = store.commit_artifact(artifact("a", "u1", b"abcd", t=9.0), b"abcd")
    assert not created_again and again == rec  # the first record, not a second one
    assert len(store.artifact_history("a", "sample")) == 1
    with pytest.raises(RegistryError) as err:
        store.commit_artifact(artifact("a", "u1", b"efgh"), b"efgh")
    assert err.value.code == "ALREADY_EXISTS"
    assert store.get_blob(sha(b"efgh")) is None


def test_upload_ids_are_scoped_per_site(store):
    store.register_site("a", {}, 1.0)
    store.register_site("b", {}, 1.0)
    store.commit_artifact(artifact("a", "same", b"aaaa"), b"aaaa")
    _, created = store.commit_artifact(artifact("b", "same", b"bbbb"), b"bbbb")
    assert created


def test_content_addressed_blobs_shared_and_collected(store):
    for name in ("a", "b"):
        store.register_site(name, {}, 1.0)
    data = b"shared-bytes"
    store.commit_artifact(artifact("a", "u", data), data)
    store.commit_artifact(artifact("b", "u", data), data)
    own = b"only-a-has-this"
    store.commit_artifact(artifact("a", "v", own), own)
    assert store.get_blob(sha(data)) == data
    assert store.deregister_site("a") is True
    assert store.get_site("a") is None and store.artifact_history("a", "sample") == []
    assert store.get_blob(sha(data)) == data  # still referenced by b
    assert store.get_blob(sha(own)) is None  # collected
    assert store.deregister_site("a") is False


def test_combined_models_are_versioned_and_idempotent(store):
    assert store.get_combined_model() is None
    r1, c1 = store.commit_combined_model("j1", sha(b"m1"), b"m1", '{"z": [1]}', "admin", 1.0)
    r2, c2 = store.commit_combined_model("j2", sha(b"m2"), b"m2", '{"z": [2]}', "admin", 2.0)
    assert (r1.version, r2.version, c1, c2) == (1, 2, True, True)
    again, created = store.commit_combined_model("j1", sha(b"m1"), b"m1", '{"z": [1]}', "admin", 3.0)
    assert again == r1 and not created
    with pytest.raises(RegistryError) as err:
        store.commit_combined_model("j1", sha(b"mX"), b"mX", '{"z": [1]}', "admin", 3.0)
    assert err.value.code == "ALREADY_EXISTS"
    assert store.get_combined_model() == r2
    assert store.get_combined_model(1) == r1
    assert store.get_combined_model(7) is None
    assert store.get_blob(r1.sha256) == b"m1"


def test_concurrent_commits_none_lost_none_duplicated(store):
    names = [f"s{i}" for i in range(8)]
    for n in names:
        store.register_site(n, {}, 1.0)

    def work(name):
        for j in range(20):
            data = f"{name}-{j}".encode().ljust(16, b".")
            store.commit_artifact(artifact(name, f"u{j}", data), data)
            store.commit_artifact(artifact(name, f"u{j}", data), data)  # retry
            store.heartbeat(name, float(j))

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in names:
        history = store.artifact_history(n, "sample")
        assert [r.upload_id for r in history] == [f"u{j}" for j in range(20)]
        for r in history:
            assert sha(store.get_blob(r.sha256)) == r.sha256
