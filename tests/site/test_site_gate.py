"""The labelled half's one gate (msa_fed.site.gate): the table says what each request costs and
records, and the site does what its row says: the budget it charges (a replay of a set-up the
site answered for the job, in this run or an earlier one of the same content, is free), whether
it writes an audit record and with which sizes, the min_points check on its sample, and what
differential privacy changes (refused before the charge, or only the losses, noised, with one
DP answer spent)."""

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
        assert rule.replay_key is None or rule.charges, method


def test_each_request_costs_and_records_what_its_row_says():
    w, X, _ = A.victim(1, job_id=JOB)
    requests = [
        ("info", None),
        ("set_domain_model", _spec(X)),
        ("set_domain_model", _spec(X)),  # a replay of the model in force: not a new query
        ("set_qhat", m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01)),
        ("set_qhat", m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01)),  # a replay: free
        ("dc_evaluate", m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",))),
        ("max_bound", None),
    ]
    replayed: set = set()
    for method, msg in requests:
        rule = LABELLED[method]
        before, lines = _counts(w), w.guard.audit.count
        with recording() as rec:
            getattr(w, method)(msg)
        charged = {k: n - before[k] for k, n in _counts(w).items() if n != before[k]}
        free = rule.replay_key is not None and method in replayed
        assert charged == ({rule.charges: 1} if rule.charges and not free else {}), method
        assert rec.records == w.guard.audit.count - lines == (0 if rule.sizes is None else 1), method
        if rule.replay_key is not None:
            replayed.add(method)
        if rule.sizes is None:
            continue
        last = w.guard.audit.records()[-1]
        assert (last["request"], last["outcome"]) == (method, "answered")
        assert last["sizes"] == rule.sizes(w, msg)
        assert ("min_points" in last["decisions"]) == bool(rule.sample and not rule.quiet), method
        if rule.charges and not free:
            assert last["decisions"][f"{rule.charges}s_job"] == _counts(w)[rule.charges]
        assert ("replay" in last["decisions"]) == free, method


def _joined(tmp_path, run: str, policy: SitePolicy, seed: int = 0):
    """A site process's worker of one run of job "resume" (as SiteApp._join makes it): its
    ledger and audit log on disk, its set-ups kept in the site's job book per job content."""
    from msa_fed.site.job_book import JobBook, KeptSetups, labelled_digest, setup_scope

    policy = replace(policy, audit_log=str(tmp_path / "audit.jsonl"), ledger=str(tmp_path / "ledger.sqlite"))
    X, y, _ = A.victim_data(1, seed=seed)
    book = JobBook(tmp_path / "jobs.sqlite")  # a new process opens the book again
    scope = setup_scope("resume@abc", labelled_digest({"X_labeled": X, "y_labeled": y}), policy)
    return A.victim(1, seed=seed, policy=policy, job_id=f"resume@abc#{run}", setups=KeptSetups(book, scope))[0]


def test_a_later_run_of_the_job_replays_its_set_up_uncharged_and_only_the_same_content(tmp_path):
    """A resumed job (a new run: a new join, after the site process restarted too) sends its
    domain model and Qhat again: the site answers them, charges neither budget, and says so in
    its audit record; another domain model, another Qhat, or the same job under another policy
    or other labelled data is new and charged."""
    from msa_fed.privacy.ledger import Ledger

    policy = SitePolicy()
    qhat = m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01)

    def day(kind):
        ledger = Ledger(str(tmp_path / "ledger.sqlite"))
        try:
            return ledger.day_count(kind)
        finally:
            ledger.close()

    first = _joined(tmp_path, "1", policy)
    spec = _spec(first.X_labeled)
    partial = first.set_domain_model(spec)
    first.set_qhat(qhat)
    first.guard.close()
    assert (day("domain_model"), day("dc_evaluation")) == (1, 1)

    again = _joined(tmp_path, "2", policy)  # the resumed run
    assert np.array_equal(again.set_domain_model(spec).sums, partial.sums)  # the same answer
    again.set_qhat(qhat)
    assert (day("domain_model"), day("dc_evaluation")) == (1, 1)  # neither charged again
    replays = [r for r in again.guard.audit.records() if r.get("run") == "resume@abc#2"]
    assert [r["request"] for r in replays] == ["set_domain_model", "set_qhat"]
    assert all("replay" in r["decisions"] and "charged" not in r for r in replays)
    # another Qhat for the same model is new, and so is the first Qhat once another model is in force
    again.set_qhat(m.QhatBroadcast(qhat=np.array([0.4, 0.6]), eta=0.01))
    assert day("dc_evaluation") == 2
    other = replace(spec, theta=np.asarray(spec.theta) * 0.5)
    again.set_domain_model(other)
    again.set_qhat(qhat)
    assert (day("domain_model"), day("dc_evaluation")) == (2, 3)
    again.guard.close()
    # the same job under another policy (e.g. DP turned on or off) or other labelled data: new
    stricter = replace(policy, eta_min=policy.eta_min * 2)
    for worker in (_joined(tmp_path, "3", stricter), _joined(tmp_path, "4", policy, seed=1)):
        worker.set_domain_model(spec)
        worker.guard.close()
    assert day("domain_model") == 4


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
