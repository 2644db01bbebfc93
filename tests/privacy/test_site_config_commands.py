"""``msa-fed site publish`` and ``msa-fed site audit`` with ``--config site.toml``, through the
real CLI (in this process) against a real registry on a loopback port and the site's own files.

publish: a sample sharing a row with the site's data file is refused (naming how many rows) or
published without them (``--drop-shared``), a sample published
without any labelled inputs to check against is refused unless the operator says so
(``--no-labeled-check``), a disjoint sample is published.  audit: the audit log and ledger the
site process writes are verified from site.toml alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer
from msa_fed.federation.agent import load_site_policy
from msa_fed.federation.config import SiteConfig
from msa_fed.federation.local import site_toml
from msa_fed.privacy.guard import SiteGuard


def one_error(rc, err, *fragments):
    assert rc == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture
def site(tmp_path):
    """A registry with site 'a' registered, and a's folder: site.toml, token.txt, data.npz."""
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    token = registry.issue_token("site", "a")
    folder = tmp_path / "a"
    folder.mkdir()
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    np.savez(folder / "data.npz", X_labeled=X, y_labeled=np.arange(40) % 2, X_unlabeled=rng.normal(size=(30, 3)))
    (folder / "token.txt").write_text(token + "\n")
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        (folder / "site.toml").write_text(site_toml("a", server.address))
        rc, _, err = run_cli(
            "site", "register", "--registry", server.address, "--token", token, "--insecure", "--name", "a"
        )
        assert rc == 0, err
        yield dict(folder=folder, X=X, token=token, address=server.address, store=store)
    store.close()


def test_publish_checks_the_sample_against_the_site_data_file(site, tmp_path):
    folder, X, store = site["folder"], site["X"], site["store"]
    toml = folder / "site.toml"
    rng = np.random.default_rng(2)
    leaky = rng.normal(size=(20, 3))
    leaky[7] = X[11]  # one labelled input among the published rows
    np.save(tmp_path / "leaky.npy", leaky)
    clean = rng.normal(size=(20, 3))
    np.save(tmp_path / "clean.npy", clean)
    conn = ("--registry", site["address"], "--token", site["token"], "--insecure")

    # a shared row is refused, with --config (site.toml's data file) and with --labeled, naming how
    # many rows (to the operator at the site: never which) and the way out
    rc, _, err = run_cli("site", "publish", "--config", toml, "--unlabeled", tmp_path / "leaky.npy")
    one_error(rc, err, "1 of the 20 rows of the sample is a labelled input", "--drop-shared")
    assert "11" not in err and " 7" not in err  # no index of the shared row
    rc, _, err = run_cli(
        "site", "publish", *conn, "--unlabeled", tmp_path / "leaky.npy", "--labeled", folder / "data.npz"
    )
    one_error(rc, err, "1 of the 20 rows of the sample is a labelled input", "--drop-shared")
    # --drop-shared without labelled inputs to compare with, or without a sample
    rc, _, err = run_cli(
        "site", "publish", *conn, "--no-labeled-check", "--drop-shared", "--unlabeled", tmp_path / "leaky.npy"
    )
    one_error(rc, err, "--drop-shared", "--no-labeled-check")
    rc, _, err = run_cli("site", "publish", "--config", toml, "--drop-shared", "--predictor", tmp_path / "h.onnx")
    one_error(rc, err, "--drop-shared", "--unlabeled")
    # every row shared: nothing is left to publish
    np.save(tmp_path / "all_shared.npy", X[:5])
    rc, _, err = run_cli(
        "site", "publish", "--config", toml, "--drop-shared", "--unlabeled", tmp_path / "all_shared.npy"
    )
    one_error(rc, err, "5 of the 5 rows of the sample are labelled inputs", "nothing is left")
    # no labelled inputs to check against: refused, naming the ways out
    rc, _, err = run_cli("site", "publish", *conn, "--unlabeled", tmp_path / "clean.npy")
    one_error(rc, err, "--config site.toml", "--labeled DATA.npz", "--no-labeled-check")
    # contradictory flags
    rc, _, err = run_cli(
        "site", "publish", "--config", toml, "--labeled", folder / "data.npz", "--unlabeled", tmp_path / "clean.npy"
    )
    one_error(rc, err, "not both")
    rc, _, err = run_cli(
        "site", "publish", "--config", toml, "--no-labeled-check", "--unlabeled", tmp_path / "clean.npy"
    )
    one_error(rc, err, "--no-labeled-check")
    assert store.get_site("a").sample is None  # nothing of the above reached the registry

    # a disjoint sample: published, the connection taken from site.toml (registry, token file)
    rc, out, err = run_cli("site", "publish", "--config", toml, "--unlabeled", tmp_path / "clean.npy")
    assert rc == 0 and "published unlabelled sample" in out and "shape=(20, 3)" in out, err
    assert store.get_site("a").sample is not None
    # the operator's explicit opt-out: published, with one line on what it gives away
    rc, out, err = run_cli("site", "publish", *conn, "--no-labeled-check", "--unlabeled", tmp_path / "clean.npy")
    assert rc == 0 and "published unlabelled sample" in out, err
    assert err.count("\n") == 1 and "--no-labeled-check" in err and "decode" in err

    # the duplicate records left out: the sample published without them, saying how many
    leaky[3] = X[30]
    np.save(tmp_path / "leaky2.npy", leaky)
    rc, out, err = run_cli("site", "publish", "--config", toml, "--drop-shared", "--unlabeled", tmp_path / "leaky2.npy")
    assert rc == 0 and "2 of the 20 rows of the sample are labelled inputs" in out and "other 18 rows" in out, err
    assert "shape=(18, 3)" in out
    rec = store.get_site("a").sample
    got = np.frombuffer(store.get_blob(rec.sha256), dtype="<f4").reshape(18, 3)
    np.testing.assert_array_equal(got, np.delete(leaky, [3, 7], axis=0).astype("<f4"))


def test_audit_reads_the_site_files_from_site_toml(site):
    folder = site["folder"]
    toml = folder / "site.toml"
    policy = load_site_policy(SiteConfig.from_toml(toml))  # what `site serve` writes to
    guard = SiteGuard("a", policy, job="job@abc#1")
    for kind in ("join", "dc_evaluate", "dc_evaluate"):
        with guard.request(kind) as dec:
            if kind == "dc_evaluate":
                dec.update(guard.charge("dc_evaluation"))
    guard.ledger.close()
    rc, out, err = run_cli("site", "audit", "--config", toml)
    assert rc == 0, err
    assert "chain intact, 3 records (length matches the ledger)" in out and "dc_evaluate: 2" in out
    rc2, out2, _ = run_cli("site", "audit", "--log", policy.audit_log, "--ledger", policy.ledger)
    assert rc2 == 0 and out2 == out  # the same files as the explicit paths
    # a line cut off the end is detected through site.toml's ledger
    log = Path(policy.audit_log)
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:-1]))
    rc, _, err = run_cli("site", "audit", "--config", toml)
    one_error(rc, err, "2 lines but the ledger anchor records 3 (the log was truncated)")
    # user mistakes: one line each
    rc, _, err = run_cli("site", "audit", "--config", toml, "--log", policy.audit_log)
    one_error(rc, err, "not both")
    rc, _, err = run_cli("site", "audit")
    one_error(rc, err, "--config site.toml", "--log")
    rc, _, err = run_cli("site", "audit", "--config", folder / "missing.toml")
    one_error(rc, err, "not found")
