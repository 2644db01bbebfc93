"""Refusals and the rolling-day budget: a refusal by a public rule (a coordinator's mistake) is
charged to its job only, so that a retry of the same content finds the day's budget intact;
every refusal that depends on labelled data, or follows a labelled-data check that passed, is
charged to the day too (otherwise a coordinator would probe the site's data for free)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from msa_fed.errors import PrivacyError
from msa_fed.privacy import rules
from msa_fed.privacy.audit import verify_log
from msa_fed.privacy.guard import SiteGuard
from msa_fed.privacy.ledger import Ledger, budget_status
from msa_fed.privacy.policy import SitePolicy


def _policy(tmp_path, **kw) -> SitePolicy:
    return replace(
        SitePolicy(),
        audit_log=str(tmp_path / "audit.jsonl"),
        ledger=str(tmp_path / "ledger.sqlite"),
        dc_evaluations_per_day=3,
        dc_evaluations_per_job=50,
        **kw,
    )


def _dc_request(guard: SiteGuard, eta: float, X=None):
    """What SiteWorker.dc_evaluate does up to its answer: charge, then the request's rules."""
    with guard.request("dc_evaluate", n_labeled=40) as dec:
        dec.update(guard.charge("dc_evaluation"))
        if X is not None:  # a check on the labelled inputs that passed (the feature map's)
            dec.update(rules._check_standard(guard.site, guard.policy, X.mean(0), X.std(0), X, "standard"))
        dec.update(rules.check_eta(eta, guard.policy, guard.site))


def test_a_public_refusal_is_charged_to_the_job_not_to_the_day(tmp_path):
    policy = _policy(tmp_path)
    ok = policy.eta_min * 2
    first = SiteGuard("a", policy, job="job@abc#1")
    for _ in range(5):  # five mistakes of one run: more than the day's budget of 3
        with pytest.raises(PrivacyError, match=r"rule: eta_min"):
            _dc_request(first, policy.eta_min / 10)
    ledger = Ledger(policy.ledger)
    assert ledger.job_count("job@abc#1", "dc_evaluation") == 5
    assert ledger.day_count("dc_evaluation") == 0
    assert budget_status(ledger, policy)["dc_evaluations_per_day"]["left"] == 3
    # the retry of the same content (a new run) has the whole day's budget, and spends it
    retry = SiteGuard("a", policy, job="job@abc#2")
    for _ in range(3):
        _dc_request(retry, ok)
    with pytest.raises(PrivacyError, match=r"rule: budget"):
        _dc_request(retry, ok)
    assert ledger.day_count("dc_evaluation") == 4  # the refusal over budget is charged too
    records = [r for r in first.audit.records() if r["outcome"] == "refused"]
    assert records and all(r["decisions"]["day_charge"].startswith("waived") for r in records[:5])
    verify_log(policy.audit_log, ledger.anchor(policy.audit_log))  # the chain and its length hold
    ledger.close()


def test_a_refusal_after_a_labelled_data_check_passed_is_charged_to_the_day(tmp_path):
    """The attacker's probe: a feature map that the site checks against its labelled inputs,
    then an eta below the floor.  'eta_min' instead of 'feature_scale' tells that the labelled
    check passed, so the refusal costs the day's budget: the probe is not free."""
    policy = _policy(tmp_path)
    X = np.random.default_rng(0).normal(size=(40, 3))
    guard = SiteGuard("a", policy, job="probe@abc#1")
    for _ in range(3):
        with pytest.raises(PrivacyError, match=r"rule: eta_min"):
            _dc_request(guard, policy.eta_min / 10, X=X)
    with pytest.raises(PrivacyError, match=r"rule: budget"):
        _dc_request(guard, policy.eta_min / 10, X=X)
    ledger = Ledger(policy.ledger)
    assert ledger.day_count("dc_evaluation") == 4
    assert not any("day_charge" in r["decisions"] for r in guard.audit.records())
    ledger.close()


def test_a_refusal_decided_on_labelled_data_is_charged_to_the_day(tmp_path):
    policy = _policy(tmp_path)
    guard = SiteGuard("a", policy, job="q@abc#1")
    own = np.array([0.5, 0.3, 0.2])
    with pytest.raises(PrivacyError, match=r"rule: qhat"):
        with guard.request("set_qhat", n_sources=3) as dec:
            dec.update(guard.charge("dc_evaluation"))
            dec.update(rules.check_qhat(np.array([0.4, 0.3, 0.3]), own, "a"))
    ledger = Ledger(policy.ledger)
    assert ledger.day_count("dc_evaluation") == 1 and ledger.job_count("q@abc#1", "dc_evaluation") == 1
    ledger.close()


def test_the_memory_ledger_follows_the_same_rule(tmp_path):
    policy = replace(_policy(tmp_path), ledger="", audit_log="")
    guard = SiteGuard("a", policy, job="m@abc#1")
    with pytest.raises(PrivacyError, match=r"rule: eta_min"):
        _dc_request(guard, policy.eta_min / 10)
    assert guard.ledger.job_count("m@abc#1", "dc_evaluation") == 1
    assert guard.ledger.day_count("dc_evaluation") == 0
