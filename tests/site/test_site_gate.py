"""The labelled half's one gate (msa_fed.site.gate): the table says what each request costs and
records, and the site does what its row says: the budget it charges (a replay of the domain
model in force is free), whether it writes an audit record and with which sizes, the
min_points check on its sample, and what differential privacy changes (refused before the
charge, or only the losses, noised, with one DP answer spent)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.errors import PrivacyError
from msa_fed.privacy.guard import BUDGETS, recording
from msa_fed.privacy.policy import SitePolicy
from msa_fed.site.gate import CHECKS, LABELLED
from tests.privacy import attacks as A

JOB = "gate@abc#1"


def _spec(X):
    from tests.privacy.test_policy import _honest_spec

    return _honest_spec(X)


def _counts(w) -> dict[str, int]:
    return {kind: w.guard.ledger.job_count(JOB, kind) for kind in BUDGETS}


def test_every_rule_of_the_table_names_known_checks_and_budgets():
    for method, rule in LABELLED.items():
        assert set(rule.before) | set(rule.checks) <= set(CHECKS), method
        assert rule.charges in ("", *BUDGETS), method
        # a request that charges a budget or checks anything writes its audit record
        if rule.charges or rule.checks or rule.before or rule.sample or rule.dp:
            assert rule.sizes is not None, method
        assert not rule.free_replay or rule.charges, method


def test_each_request_costs_and_records_what_its_row_says():
    w, X, _ = A.victim(1, job_id=JOB)
    requests = [
        ("info", None),
        ("set_domain_model", _spec(X)),
        ("set_domain_model", _spec(X)),  # a replay of the model in force: not a new query
        ("set_qhat", m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01)),
        ("dc_evaluate", m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",))),
        ("max_bound", None),
    ]
    replayed = False
    for method, msg in requests:
        rule = LABELLED[method]
        before, lines = _counts(w), w.guard.audit.count
        with recording() as rec:
            getattr(w, method)(msg)
        charged = {k: n - before[k] for k, n in _counts(w).items() if n != before[k]}
        free = rule.free_replay and replayed
        assert charged == ({rule.charges: 1} if rule.charges and not free else {}), method
        assert rec.records == w.guard.audit.count - lines == (0 if rule.sizes is None else 1), method
        replayed = replayed or method == "set_domain_model"
        if rule.sizes is None:
            continue
        last = w.guard.audit.records()[-1]
        assert (last["request"], last["outcome"]) == (method, "answered")
        assert last["sizes"] == rule.sizes(w, msg)
        assert ("min_points" in last["decisions"]) == bool(rule.sample and not rule.quiet), method
        if rule.charges and not free:
            assert last["decisions"][f"{rule.charges}s_job"] == _counts(w)[rule.charges]


def test_min_points_refuses_on_the_rows_sample_and_keeps_its_rule():
    w, X, _ = A.victim(1, policy=SitePolicy(min_points=A.N + 1), job_id=JOB)
    with pytest.raises(PrivacyError) as err:
        w.set_domain_model(_spec(X))
    assert err.value.rule == "min_points" and f"to aggregate over {A.N} labelled points" in str(err.value)
    assert _counts(w) == {"domain_model": 0, "dc_evaluation": 0}  # refused before its charge
    (rec,) = w.guard.audit.records()
    assert (rec["request"], rec["outcome"], rec["rule"]) == ("set_domain_model", "refused", "min_points")


def test_with_dp_max_bound_is_refused_uncharged_and_dc_evaluate_answers_noised_losses_only():
    w, X, _ = A.victim(1, policy=replace(SitePolicy(), dp_enabled=True), job_id=JOB)
    w.set_domain_model(_spec(X))
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    used = _counts(w)["dc_evaluation"]
    with pytest.raises(PrivacyError) as err:
        w.max_bound(None)
    assert err.value.rule == "dp_what" and "the largest per-point bound" in str(err.value)
    assert _counts(w)["dc_evaluation"] == used  # LABELLED["max_bound"].dp == "refused": before the charge
    with pytest.raises(PrivacyError) as err:
        w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L", "dL")))
    assert err.value.rule == "dp_what" and "losses L only" in str(err.value)
    assert _counts(w)["dc_evaluation"] == used + 1  # after the charge: the refusal counts
    assert w.guard.epsilon_spent() == 0.0
    out = w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))
    assert out.epsilon > 0 and out.epsilon == w.guard.epsilon_spent()
    last = w.guard.audit.records()[-1]
    assert last["decisions"]["epsilon_job"] == out.epsilon and "noise_multiplier" in last["decisions"]
    assert [r["rule"] for r in w.guard.audit.records() if r["outcome"] == "refused"] == ["dp_what", "dp_what"]
