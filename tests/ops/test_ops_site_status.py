"""`msa-fed site status` from a site's own files: budgets used and left with their refill
times (read-only), the serving process from the site's lock, the last jobs from the audit log."""

from __future__ import annotations

import json

from msa_fed.cli import main
from msa_fed.federation.serve_ops import SiteLock
from msa_fed.federation.site_status import budget_status, serving_process
from msa_fed.privacy.ledger import HOUR_S, Ledger
from msa_fed.privacy.policy import SitePolicy


def test_budgets_count_the_rolling_day_and_say_when_they_refill(tmp_path):
    path = tmp_path / "ledger.db"
    t0 = 1_800_000_000.0  # an hour boundary plus some seconds
    ledger = Ledger(str(path))
    ledger.record("job-a", "domain_model", 2, t=t0)
    ledger.record("job-b", "domain_model", 3, t=t0 + 5 * HOUR_S)
    ledger.record("job-b", "dc_evaluation", 70, t=t0 + 5 * HOUR_S)
    ledger.record("old", "domain_model", 4, t=t0 - 30 * HOUR_S)  # out of the window
    ledger.close()
    policy = SitePolicy(domain_models_per_day=10)
    status = budget_status(path, policy, now=t0 + 6 * HOUR_S)
    dm = status["domain_model"]
    assert (dm["used"], dm["left"], dm["limit_per_day"]) == (5, 5, 10)
    hour = int(t0 // HOUR_S)
    refill = [[t, n] for t, n in dm["refills"]]
    assert [n for _, n in refill] == [2, 3]
    # the ledger's window is whole hours (the hour 24 h ago included): back when hour h + 25 begins
    import time

    assert refill[0][0] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((hour + 25) * HOUR_S))
    ledger = Ledger(str(path))
    assert ledger.day_count("domain_model", now=(hour + 25) * HOUR_S) == 3  # the first two are back then
    assert ledger.day_count("domain_model", now=(hour + 25) * HOUR_S - 1) == 5
    ledger.close()
    assert status["dc_evaluation"]["used"] == 70 and status["dp_events"] == []
    assert budget_status(tmp_path / "none.db", policy)["domain_model"]["used"] == 0  # no ledger yet: nothing used


def test_the_serving_process_is_read_from_the_lock(tmp_path):
    audit = tmp_path / "audit.jsonl"
    assert serving_process(tmp_path / "audit.jsonl.lock") is None
    with SiteLock("east", [audit]):
        held = serving_process(tmp_path / "audit.jsonl.lock")
        assert held is not None and held.startswith("pid ")
    assert serving_process(tmp_path / "audit.jsonl.lock") is None  # released: nobody serves


def test_site_status_offline_prints_and_json(tmp_path, capsys):
    (tmp_path / "token.txt").write_text("mft1.site.east.secret\n")
    (tmp_path / "site.toml").write_text(
        'name = "east"\nregistry = "127.0.0.1:1"\ntoken_file = "token.txt"\ninsecure = true\n'
        'data = "data.npz"\npredictor = "p.onnx"\naudit_log = "state/audit.jsonl"\n'
    )
    assert main(["site", "status", "--config", str(tmp_path / "site.toml"), "--offline"]) == 0
    out = capsys.readouterr().out
    assert "process:  not running (start it: msa-fed site serve --config site.toml)" in out
    assert "domain models: 0 of 10 used in the rolling day, 10 left (at most 3 per job)" in out
    assert "jobs:     none yet" in out
    assert main(["site", "status", "--config", str(tmp_path / "site.toml"), "--offline", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["budgets"]["dc_evaluation"]["left"] == 50000 and status["dp"]["epsilon_spent"] == 0.0


def test_site_status_names_an_unreachable_registry_in_one_line(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token.txt").write_text("mft1.site.east.secret\n")
    (tmp_path / "site.toml").write_text(
        f'name = "east"\nregistry = "127.0.0.1:{port}"\ntoken_file = "token.txt"\ninsecure = true\n'
        'data = "data.npz"\npredictor = "p.onnx"\naudit_log = "audit.jsonl"\n'
    )
    assert main(["site", "status", "--config", str(tmp_path / "site.toml")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("registry:"))
    assert f"127.0.0.1:{port} not reachable (UNAVAILABLE" in line
