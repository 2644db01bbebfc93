"""Approvals and budgets are keyed on the job's id and content, not on its reusable name."""

from __future__ import annotations

import json

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.cli import main
from msa_fed.crypto.sealing import job_content_digest
from msa_fed.federation.agent import job_key, run_key
from msa_fed.site.admission import unsealed_content
from msa_fed.site.job_book import JobBook
from tests.federation.fedhelpers import write_site_files, write_site_toml


def _setup(**changes) -> m.JobSetup:
    base = dict(
        job_id="monthly",
        sites=("east", "west"),
        index=0,
        predictor_sha256=("a" * 64, "b" * 64),
        task="classification",
        loss="cross_entropy",
        classes=np.array([0, 1]),
        min_points=20,
    )
    return m.JobSetup(**{**base, **changes})


def _digest(job: str = "monthly", **changes) -> str:
    """The content digest a site computes at an (unsealed) job's join."""
    return job_content_digest(unsealed_content(job, _setup(**changes)))


def _key(job: str = "monthly", **changes) -> str:
    return job_key(job, _digest(job, **changes))


def test_the_key_is_the_name_and_the_content():
    k = _key()
    assert k.startswith("monthly@") and k == _key(index=1)  # each site: one key
    for other in (
        dict(predictor_sha256=("a" * 64, "c" * 64)),  # a peer's predictor changed
        dict(sites=("east", "mallory")),
        dict(min_points=5),
        dict(task="regression", loss="squared"),
    ):
        assert _key(**other) != k
    assert _key("weekly") != k
    runs = {run_key(k) for _ in range(50)}  # every run (join) of the job has its own budgets
    assert len(runs) == 50 and all(r.startswith(k + "#") for r in runs)


def test_an_approved_name_does_not_approve_other_content(tmp_path, capsys):
    write_site_files(tmp_path)
    config = write_site_toml(tmp_path, accept_jobs="approve")
    book = JobBook(tmp_path / "audit.jobs.db")
    first = _digest()
    assert book.seen("monthly", "admin", ["east", "west"], digest=first) == "pending"
    book.close()
    assert main(["site", "approve", "monthly", "--config", str(config)]) == 0
    assert f"job monthly approved for content {first}" in capsys.readouterr().out
    book = JobBook(tmp_path / "audit.jobs.db")
    assert book.seen("monthly", "admin", ["east", "west"], digest=first) == "approved"  # the monthly rerun
    other = _digest(predictor_sha256=("a" * 64, "d" * 64))
    assert book.seen("monthly", "admin", ["east", "west"], digest=other) == "pending"  # same name, other content
    book.close()
    assert main(["site", "jobs", "--config", str(config), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)
    assert (job["job_id"], job["state"], job["digest"]) == ("monthly", "pending", other)


def test_the_fourth_monthly_run_has_its_per_job_budget_and_the_day_still_bounds(tmp_path):
    import pytest

    from msa_fed.core.features import StandardFeatures, feature_map_state
    from msa_fed.errors import PrivacyError
    from msa_fed.privacy.policy import SitePolicy
    from tests.privacy import attacks as A

    pol = SitePolicy(ledger=str(tmp_path / "ledger.sqlite"), domain_models_per_day=10)
    key = _key()
    X = A.victim_data(1)[0]
    fmap = feature_map_state(StandardFeatures().fit(X))

    def spec(j):
        return m.DomainModelSpec(kind="maxent", n_sources=2, feature_map=fmap, theta=np.array([0.1 * j, 0, 0, 0]))

    used = 0
    for run in range(4):  # 4 runs x 3 models: the per-job budget never refuses a new run ...
        w, _, _ = A.victim(1, policy=pol, job_id=run_key(key))
        for j in range(3):
            if used == 10:
                with pytest.raises(PrivacyError, match="per rolling day"):  # ... the day's does
                    w.set_domain_model(spec(10 * run + j + 1))
                continue
            w.set_domain_model(spec(10 * run + j + 1))
            used += 1
    assert used == 10


def test_the_audit_log_names_the_job_and_the_run(tmp_path):
    from msa_fed.privacy.policy import SitePolicy
    from tests.privacy import attacks as A
    from tests.privacy.test_policy import _honest_spec

    pol = SitePolicy(ledger=str(tmp_path / "l.sqlite"))
    key = _key()
    run = run_key(key)
    w, X, _ = A.victim(1, policy=pol, job_id=run)
    w.set_domain_model(_honest_spec(X))
    rec = json.loads(w.guard.audit.lines[-1])
    assert rec["job"] == "monthly" and rec["run"] == run
    assert w.guard.ledger.job_count(run, "domain_model") == 1  # budgets count per run
    assert w.guard.ledger.job_count("monthly", "domain_model") == 0
