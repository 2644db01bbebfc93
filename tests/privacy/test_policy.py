"""The site policy file, the ledger (a real SQLite file across restarts), the hash-chained
audit log with ``msa-fed site audit``, and DP accounting against dp-accounting itself."""

import json
import pickle

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.cli import main
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.audit import AuditError, verify_log
from msa_fed.privacy.policy import SitePolicy, load_policy, tighten
from tests.privacy import attacks as A


def _honest_spec(X):
    from msa_fed.core.features import StandardFeatures, feature_map_state

    fmap = StandardFeatures().fit(X)
    return m.DomainModelSpec(
        kind="maxent", n_sources=2, feature_map=feature_map_state(fmap), theta=np.array([1.0, 0.0, -1.0, 0.0])
    )


def _honest_round(worker, X, n_eval=2):
    r = worker.set_domain_model(_honest_spec(X))
    worker.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    return r, [worker.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",))) for _ in range(n_eval)]


def test_policy_file_is_validated_key_by_key(tmp_path):
    f = tmp_path / "policy.toml"
    f.write_text(
        '[limits]\nmin_points = 50\nmu_min = 1e-3\nfeature_maps = ["standard"]\n'
        '[budget]\ndc_evaluations_per_job = 99\nledger = "x.sqlite"\n[dp]\nenabled = true\nepsilon_per_job = 0.5\n'
    )
    pol = load_policy(f)
    assert (pol.min_points, pol.mu_min, pol.feature_maps, pol.dc_evaluations_per_job, pol.ledger) == (
        50,
        1e-3,
        ("standard",),
        99,
        "x.sqlite",
    )
    assert pol.dp_enabled and pol.epsilon_per_job == 0.5
    bad = {
        "[limits]\nmin_pionts = 5\n": "unknown key 'min_pionts' in \\[limits\\]",
        "[limit]\nmin_points = 5\n": "unknown section \\[limit\\]",
        '[limits]\nmin_points = "5"\n': "min_points must be an integer",
        "[limits]\nmu_min = -1.0\n": "mu_min must be a number > 0",
        '[limits]\nfeature_maps = ["pickle"]\n': "unknown map",
        "[dp]\nepsilon_per_job = 20.0\n": "exceeds epsilon_lifetime",
        "[limits\n": "unreadable",
    }
    for text, msg in bad.items():
        f.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_policy(f)
    with pytest.raises(ConfigError, match="not found"):
        load_policy(tmp_path / "absent.toml")


def test_tighten_never_loosens():
    base = SitePolicy()
    t = tighten(
        base,
        {
            "min_points": 5,
            "mu_min": 1.0,
            "eta_min": 0.0,
            "max_point_share": 0.9,
            "dc_evaluations_per_job": 10,
            "epsilon_per_job": 99.0,
            "dp_enabled": True,
            "feature_maps": ["standard", "rff"],
            "allow_custom_feature_map": True,
        },
    )
    assert t.min_points == base.min_points and t.mu_min == 1.0 and t.eta_min == base.eta_min
    assert t.max_point_share == base.max_point_share and t.dc_evaluations_per_job == 10
    assert t.epsilon_per_job == base.epsilon_per_job and t.dp_enabled
    assert t.feature_maps == ("standard", "rff") and t.allow_custom_feature_map is True
    assert tighten(t, {"dp_enabled": False}).dp_enabled
    for key in ("ledger", "audit_log", "epsilon_lifetime", "nonsense"):
        with pytest.raises(ConfigError, match=repr(key)):
            tighten(base, {key: 1})


def test_privacy_error_names_rule_and_site_and_pickles():
    err = PrivacyError("concentration", "a", "the request: x")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rule, back.site, str(back)) == ("concentration", "a", str(err))
    assert str(err) == "site 'a' refuses the request: x (rule: concentration)"


def test_ledger_survives_a_restart(tmp_path):
    pol = SitePolicy(
        ledger=str(tmp_path / "ledger.sqlite"),
        domain_models_per_job=2,
        domain_models_per_day=3,
        dc_evaluations_per_job=4,
    )
    w, X, _y = A.victim(1, policy=pol, job_id="job-1")
    spec = _honest_spec(X)
    w.set_domain_model(spec)
    w.set_domain_model(spec)  # a replay of the model in force is not a new query
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))  # set_qhat is a query: 1 of 4
    for _ in range(3):
        w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))
    # the site process restarts: same ledger file, same job
    w2, _, _ = A.victim(1, policy=pol, job_id="job-1")
    w2.set_domain_model(spec)
    with pytest.raises(PrivacyError, match="dc_evaluations_per_job") as err:
        w2.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    assert err.value.rule == "budget"
    other = _honest_spec(X + 0.1)
    with pytest.raises(PrivacyError, match="domain_models_per_job"):
        w2.set_domain_model(other)
    # a new job: its own budget, but the rolling day's is shared (2 + 1 + this one)
    w3, _, _ = A.victim(1, policy=pol, job_id="job-2")
    with pytest.raises(PrivacyError, match="per rolling day"):
        w3.set_domain_model(spec)


def test_audit_log_chain_detects_editing_and_truncation(tmp_path, capsys):
    log, ledger = tmp_path / "audit.jsonl", tmp_path / "ledger.sqlite"
    pol = SitePolicy(ledger=str(ledger), audit_log=str(log))
    w, X, _y = A.victim(1, policy=pol, job_id="job-a")
    _honest_round(w, X)
    with pytest.raises(PrivacyError):
        w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.0))
    w.guard.audit.close()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["request"] for r in recs] == ["set_domain_model", "set_qhat", "dc_evaluate", "dc_evaluate", "set_qhat"]
    assert recs[-1]["outcome"] == "refused" and recs[-1]["rule"] == "eta_min" and recs[0]["job"] == "job-a"
    assert (
        "qhat_share" in recs[0]["decisions"]
        and "w_mass_clipped" in recs[1]["decisions"]
        and recs[2]["sizes"]["what"] == ["L"]
    )
    summary = verify_log(log)
    assert summary["lines"] == 5 and summary["refused"] == {"eta_min": 1}

    assert main(["site", "audit", "--log", str(log), "--ledger", str(ledger)]) == 0
    out = capsys.readouterr().out
    assert "chain intact, 5 records" in out and "eta_min 1" in out

    good = log.read_bytes()
    lines = good.splitlines(keepends=True)
    # edit one record (an answer's size): the next line no longer chains to it
    log.write_bytes(b"".join(lines[:3]) + lines[3].replace(b'"n_labeled":60', b'"n_labeled":61') + lines[4])
    assert main(["site", "audit", "--log", str(log)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "line 5" in err[0]
    # edit the last record (a refusal turned into an answer): the ledger's anchor catches it
    log.write_bytes(b"".join(lines[:4]) + lines[4].replace(b'"refused"', b'"answered"'))
    assert main(["site", "audit", "--log", str(log), "--ledger", str(ledger)]) == 1
    assert "rewritten" in capsys.readouterr().err
    # drop a line in the middle
    log.write_bytes(b"".join(lines[:2] + lines[3:]))
    assert main(["site", "audit", "--log", str(log)]) == 1
    assert "line 3 does not chain" in capsys.readouterr().err
    # cut the last line: the chain is intact, the ledger's anchor is not
    log.write_bytes(b"".join(lines[:4]))
    assert main(["site", "audit", "--log", str(log)]) == 0
    capsys.readouterr()
    assert main(["site", "audit", "--log", str(log), "--ledger", str(ledger)]) == 1
    assert "truncated" in capsys.readouterr().err
    # and the site refuses to start on a truncated log
    with pytest.raises(AuditError, match="truncated"):
        A.victim(1, policy=pol, job_id="job-b")
    log.write_bytes(good)
    w4, _, _ = A.victim(1, policy=pol, job_id="job-b")  # intact again: appends continue the chain
    w4.set_domain_model(_honest_spec(X))
    w4.guard.audit.close()
    assert verify_log(log)["lines"] == 6
    assert main(["site", "audit", "--log", str(tmp_path / "none.jsonl")]) == 1


def _harm(worker):
    """The site's verdict on the model at z = (1/2, 1/2) (one DP answer with DP on)."""
    return worker.harm(m.HarmRequest(z=np.array([[0.5, 0.5]]), eta=0.01))


def _dc(worker):
    return worker.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))


def _composed(nm: float, k: int, delta: float) -> float:
    """epsilon at delta of k Gaussian answers of multiplier nm, computed by dp-accounting itself."""
    import dp_accounting
    from dp_accounting import rdp

    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(nm), k))
    return float(acc.get_epsilon(delta))


def test_dp_accounting_matches_dp_accounting(tmp_path):
    from msa_fed.privacy.dp import VERDICT_ANSWERS

    pol = SitePolicy(
        dp_enabled=True, epsilon_per_job=1.0, delta=1e-6, dp_dc_evaluations=4, ledger=str(tmp_path / "l.sqlite")
    )
    w, X, _y = A.victim(1, policy=pol, job_id="dp-job")
    _r, outs = _honest_round(w, X, n_eval=3)
    nm = w.guard.dp.noise_multiplier
    assert outs[-1].epsilon == pytest.approx(_composed(nm, 3, 1e-6), rel=1e-9)
    assert 0 < outs[0].epsilon < outs[1].epsilon < outs[2].epsilon < 1.0
    # the planned answers (4 DC answers and the verdict) spend exactly the job's epsilon (the Qhat
    # partial is public)
    planned = pol.dp_dc_evaluations + VERDICT_ANSWERS
    assert _composed(nm, planned, 1e-6) == pytest.approx(1.0, abs=1e-3)
    # DC answers stop where one more would leave too little for the verdict: the largest k whose
    # k + VERDICT_ANSWERS answers fit in the job's epsilon (derived here by dp-accounting)
    dc_fit = max(k for k in range(planned + 2) if _composed(nm, k + VERDICT_ANSWERS, 1e-6) <= 1.0 * (1 + 1e-6))
    assert dc_fit == pol.dp_dc_evaluations
    for _ in range(dc_fit - 3):
        _dc(w)
    with pytest.raises(PrivacyError, match="epsilon_per_job.*reserved for the site's verdict") as err:
        _dc(w)
    assert err.value.rule == "dp_budget"
    # the verdict is answered from its reserve (noised, said so), and the job's epsilon is then
    # the composition of every answer given
    verdict = _harm(w)
    assert verdict.noisy and verdict.epsilon == pytest.approx(_composed(nm, dc_fit + VERDICT_ANSWERS, 1e-6), rel=1e-9)
    assert verdict.epsilon <= 1.0 + 1e-6
    with pytest.raises(PrivacyError, match="epsilon_per_job") as err:  # nothing is left
        _harm(w)
    assert err.value.rule == "dp_budget"
    assert w.guard.epsilon_spent() == pytest.approx(verdict.epsilon, rel=1e-12)
    # DP answers only the losses, and the noise is there
    with pytest.raises(PrivacyError, match="losses L only"):
        w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L", "dL")))
    assert not np.allclose(outs[0].sums.L, outs[1].sums.L)


def test_dp_lifetime_budget_spans_jobs(tmp_path):
    """The lifetime budget is the composition of every answer of every job, and each job's DC
    answers leave the verdict's reserve in it: a job whose DC answers the lifetime stops still
    gets its verdict, and then nothing more is answered."""
    from msa_fed.privacy.dp import VERDICT_ANSWERS

    pol = SitePolicy(
        dp_enabled=True,
        epsilon_per_job=1.0,
        epsilon_lifetime=1.3,
        dp_dc_evaluations=1,  # 2 DP answers planned: 1 DC answer and the verdict
        ledger=str(tmp_path / "l.sqlite"),
    )
    w, X, _y = A.victim(1, policy=pol, job_id="j1")
    _honest_round(w, X, n_eval=1)
    _harm(w)
    nm = w.guard.dp.noise_multiplier
    # what the lifetime admits, derived with dp-accounting: answers (DC first, the verdict last)
    # while the composition of everything so far, plus the verdict's reserve for a DC answer, fits
    given, dc2 = 1 + VERDICT_ANSWERS, 0
    life = pol.epsilon_lifetime * (1 + 1e-6)
    while dc2 < pol.dp_dc_evaluations and _composed(nm, given + 1 + VERDICT_ANSWERS, pol.delta) <= life:
        given, dc2 = given + 1, dc2 + 1
    verdict2 = _composed(nm, given + VERDICT_ANSWERS, pol.delta) <= life
    assert (dc2, verdict2) == (0, True)  # 1.3 pays for one answer more than the first job's 2, not 2
    w2, _, _ = A.victim(1, policy=pol, job_id="j2")
    w2.set_domain_model(_honest_spec(X))
    w2.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    with pytest.raises(PrivacyError, match="epsilon_lifetime.*reserved for the site's verdict") as err:
        _dc(w2)
    assert err.value.rule == "dp_budget"
    assert _harm(w2).noisy  # the reserve pays for the verdict
    with pytest.raises(PrivacyError, match="epsilon_lifetime"):
        _harm(w2)
    assert w2.guard.dp.epsilon_lifetime() == pytest.approx(_composed(nm, given + VERDICT_ANSWERS, pol.delta))


def test_domain_model_rules(tmp_path):
    from msa_fed.core.features import RandomFourierFeatures, feature_map_state

    w, X, _y = A.victim(2, policy=SitePolicy(domain_models_per_job=100, domain_models_per_day=100))
    spec = _honest_spec(X)
    fm = spec.feature_map
    cases = {
        "feature_scale": m.DomainModelSpec(
            "maxent", 2, ("standard", {}, {"mean": fm[2]["mean"], "scale": fm[2]["scale"] * 1e-3}), theta=spec.theta
        ),
        "feature_mean": m.DomainModelSpec(
            "maxent", 2, ("standard", {}, {"mean": fm[2]["mean"] + 1e3, "scale": fm[2]["scale"]}), theta=spec.theta
        ),
        "theta_norm": m.DomainModelSpec("maxent", 2, fm, theta=np.array([1e3, 0.0, 0.0, 0.0, 0.0, 0.0])),
        "feature_map": m.DomainModelSpec(
            "maxent", 2, ("threshold", {}, {"thresholds": np.array([0.0])}), theta=np.zeros(4)
        ),
    }
    for rule, bad in cases.items():
        with pytest.raises(PrivacyError) as err:
            w.set_domain_model(bad)
        assert err.value.rule == rule, (rule, str(err.value))
    rff = RandomFourierFeatures(n_components=20, gamma=1e4).fit(X)
    with pytest.raises(PrivacyError, match="too sharp"):
        w.set_domain_model(m.DomainModelSpec("maxent", 2, feature_map_state(rff), theta=np.zeros(42)))
    w2, _, _ = A.victim(2, policy=SitePolicy(feature_maps=("rff",)))
    with pytest.raises(PrivacyError, match="allowlist"):
        w2.set_domain_model(spec)


def test_qhat_must_be_consistent_with_the_sites_own_share():
    w, X, _y = A.victim(1)
    r = w.set_domain_model(_honest_spec(X))
    own = r.sums
    for qhat, msg in (
        ([1.0, 1.0], "sum to 1"),
        ([np.nan, 1.0], "positive numbers"),
    ):
        with pytest.raises(PrivacyError, match=msg) as err:
            w.set_qhat(m.QhatBroadcast(qhat=np.array(qhat), eta=0.01))
        # the refusal names the rule and the request's values, never the site's own share
        assert f"{own[0]:.4g}" not in str(err.value) and f"{own[0]:.3g}" not in str(err.value)
    # a qhat below the site's own share (another site's DP noise can do that in an honest run)
    # is not refused: the site computes with its own share there, so no weight is inflated
    w.set_qhat(m.QhatBroadcast(qhat=np.array([own[0] / 2, 1 - own[0] / 2]), eta=0.01))
    low = w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",))).sums.L
    assert w.guard.audit.records()[-2]["decisions"]["qhat_floored"] == 1
    from msa_fed.core.combination import site_point_set

    floored = site_point_set(w._Q, np.array([own[0], 1 - own[0] / 2]), w._outputs(), w.loss)
    assert np.allclose(low, floored.evaluate(np.array([0.5, 0.5]), 0.01, what=("L",)).L)
    assert sum(1 for x in w.guard.audit.lines if json.loads(x)["request"] == "set_qhat") == 3
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    with pytest.raises(PrivacyError, match="eta / sum"):
        w.dc_evaluate(m.DCRequest(z=np.array([50.0, 50.0]), eta=0.01, what=("L",)))
    with pytest.raises(PrivacyError, match="non-negative"):
        w.dc_evaluate(m.DCRequest(z=np.array([1.5, -0.5]), eta=0.01, what=("L",)))


def _exact_cap(r, share, tau):
    """Slow reference: the largest c with share * (sum_j min(r_j, c) + n tau) >= c, by scanning
    the intervals between sorted ratios (g is linear on each)."""
    r = np.sort(np.asarray(r, dtype=float))
    n = r.size
    best = 0.0
    edges = np.concatenate([[0.0], r])
    for m_ in range(n + 1):  # c in [edges[m_], next edge]: the m_ smallest are below c
        lo = edges[m_]
        hi = r[m_] if m_ < n else np.inf
        below = r[:m_].sum()
        slope = 1 - share * (n - m_)
        # g(c) = share (below + (n - m_) c + n tau) - c >= 0
        if slope <= 0:
            best = max(best, hi if np.isfinite(hi) else best)
            continue
        c = share * (below + n * tau) / slope
        if c >= lo:
            best = max(best, min(c, hi))
    return best


def test_influence_is_clipped_not_refused():
    from msa_fed.privacy.influence import clip_ratios, share_bound, shares

    pol = SitePolicy()
    s, tau = share_bound(pol), pol.weight_floor
    assert s == min(pol.max_point_share, 1 / pol.min_effective_points)
    rng = np.random.default_rng(0)
    R = np.exp(-rng.uniform(0, 30, size=(60, 4)))
    R[7, 0] = 2.0  # one point with twice its own mass, the others almost none
    R[:, 3] = rng.uniform(0.5, 1.5, 60)  # a spread column: untouched
    out, info = clip_ratios(R, s, tau)
    assert np.all(shares(out, tau) <= s * (1 + 1e-9))
    assert np.array_equal(out[:, 3], R[:, 3]) and np.all(out <= R)
    assert info["share_before"] > s and info["clipped_points"] >= 1 and 0 < info["mass_clipped"] < 1
    for k in range(3):
        if shares(R[:, [k]], tau)[0] > s:
            cap = _exact_cap(R[:, k], s, tau)
            np.testing.assert_allclose(out[:, k], np.minimum(R[:, k], cap), rtol=1e-9, atol=1e-15)


def test_two_writers_share_one_audit_log(tmp_path):
    """Two jobs' workers at one site append to the same log and ledger: the chain stays whole."""
    pol = SitePolicy(ledger=str(tmp_path / "l.sqlite"), audit_log=str(tmp_path / "a.jsonl"))
    w1, X, _y = A.victim(1, policy=pol, job_id="j1")
    w2, _, _ = A.victim(1, policy=pol, job_id="j2")
    for _ in range(3):
        w1.set_domain_model(_honest_spec(X))
        w2.set_domain_model(_honest_spec(X))
    summary = verify_log(tmp_path / "a.jsonl", w1.guard.ledger.anchor(str(tmp_path / "a.jsonl")))
    assert summary["lines"] == 6 and summary["jobs"] == ["j1", "j2"]


def test_budget_status_reports_used_left_and_refills(tmp_path):
    from msa_fed.privacy.ledger import HOUR_S, Ledger, budget_status

    pol = SitePolicy(domain_models_per_day=10, dc_evaluations_per_day=100, ledger=str(tmp_path / "l.sqlite"))
    ledger = Ledger(pol.ledger)
    t0 = 1_000_000 * HOUR_S + 120.0  # two minutes into an hour
    ledger.record("a@x#1", "domain_model", 2, t=t0 - 3 * HOUR_S)
    ledger.record("a@x#1", "dc_evaluation", 30, t=t0 - 3 * HOUR_S)
    ledger.record("b@y#2", "domain_model", 1, t=t0)
    ledger.record("old", "domain_model", 5, t=t0 - 30 * HOUR_S)  # outside the rolling day
    st = budget_status(ledger, pol, now=t0, job="a@x#1")
    dm = st["domain_models_per_day"]
    assert (dm["limit"], dm["used"], dm["left"]) == (10, 3, 7)
    # the 2 queries of 3 hours ago leave the window 25 hours after their hour began
    assert dm["refills"] == [((1_000_000 - 3 + 25) * HOUR_S, 2), ((1_000_000 + 25) * HOUR_S, 1)]
    assert dm["next_refill"] == dm["refills"][0][0] > t0
    assert st["dc_evaluations_per_day"]["left"] == 70
    assert st["domain_models_per_job"] == {"limit": 3, "used": 2, "left": 1, "refills": [], "next_refill": None}
    assert st["epsilon_lifetime"]["used"] == 0.0 and st["epsilon_lifetime"]["next_refill"] is None
    # the day's count the guard enforces is the status's "used"
    assert ledger.day_count("domain_model", now=t0) == dm["used"]
    ledger.close()


def test_epsilon_lifetime_is_the_composition_of_every_answer_of_every_job(tmp_path):
    """epsilon_lifetime bounds the (epsilon, delta) of the RDP composition (dp-accounting) of all
    Gaussian answers the site gave, over all jobs (not the sum of the jobs' epsilons, which is
    looser): the site gives answers up to the limit (a DC answer only while the verdict's reserve
    still fits after it), and budget_status reports the same number."""
    from msa_fed.privacy.dp import calibrate
    from msa_fed.privacy.ledger import budget_status

    pol = SitePolicy(
        dp_enabled=True,
        epsilon_per_job=1.0,
        epsilon_lifetime=2.0,
        dp_dc_evaluations=2,
        ledger=str(tmp_path / "l.sqlite"),
    )
    nm = calibrate(1.0, pol.delta, 3)  # a job's planned DP answers: its 2 DC evaluations and the verdict

    # predicted: every answer whose composition with all before it stays within 2.0
    def eps(k):
        return _composed(nm, k, pol.delta)

    answers = 0
    while eps(answers + 1) <= pol.epsilon_lifetime * (1 + 1e-6):
        answers += 1
    assert answers >= 8  # composition is sub-additive: two jobs of epsilon 1 cost less than 2
    # each job: its 2 DC answers, then its verdict; a DC answer is refused once it would leave too
    # little for the verdict, which is then still answered from the reserve
    given, verdict_after_refusal = 0, False
    for j in range(10):
        w, X, _y = A.victim(1, policy=pol, job_id=f"job-{j}")
        w.set_domain_model(_honest_spec(X))  # a DP site's Qhat partial is public: no epsilon
        w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
        refused = False
        try:
            for _ in range(2):
                _dc(w)
                given += 1
        except PrivacyError as exc:
            assert exc.rule == "dp_budget" and "epsilon_lifetime" in str(exc) and "reserved" in str(exc)
            refused = True
        try:
            _harm(w)
        except PrivacyError as exc:
            assert exc.rule == "dp_budget" and "epsilon_lifetime" in str(exc)
            break
        given += 1
        verdict_after_refusal |= refused
    assert given == answers and verdict_after_refusal
    st = budget_status(w.guard.ledger, pol)
    assert st["epsilon_lifetime"]["used"] == pytest.approx(eps(answers), rel=1e-9)
    assert st["epsilon_lifetime"]["used"] <= pol.epsilon_lifetime + 1e-6
    assert st["epsilon_lifetime"]["dp_answers"] == answers


def test_dp_weights_use_the_fixed_cap_only():
    """With DP on, the share cap (which depends on every point) is not applied: the weights are
    the plain w, capped later by the data-independent ratio_clip of the DP answer."""
    from msa_fed.core.combination import site_point_set

    w, X, _y = A.victim(1, n=40, policy=SitePolicy(dp_enabled=True))
    w.set_domain_model(A.threshold_spec([np.sort(X[:, 0])[1]], [8.0], -4.0))  # 2 points set apart
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    plain = site_point_set(w._Q, np.array([0.5, 0.5]), w._outputs(), "cross_entropy")
    np.testing.assert_array_equal(w._points.w, plain.w)
    rec = json.loads(w.guard.audit.lines[-1])
    assert rec["request"] == "set_qhat" and not any(k.startswith("w_") for k in rec["decisions"])
    # the same request without DP is clipped
    w2, _, _ = A.victim(1, n=40)
    w2.set_domain_model(A.threshold_spec([np.sort(X[:, 0])[1]], [8.0], -4.0))
    w2.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    assert json.loads(w2.guard.audit.lines[-1])["decisions"]["w_clipped_points"] >= 1


def test_peers_and_max_sites_are_read_and_checked(tmp_path):
    import tomllib

    from msa_fed.experiments.demo_data import SITES
    from msa_fed.jobs.demo import DEMO_POLICY
    from msa_fed.privacy.consortium import check_consortium
    from msa_fed.privacy.policy import policy_from_mapping

    demo = policy_from_mapping(tomllib.loads(DEMO_POLICY))
    assert set(demo.peers) == set(SITES)  # the demo's sites name their consortium
    assert check_consortium("north", list(SITES), 3, demo)["p"] == 3
    with pytest.raises(PrivacyError, match=r"\['mallory'\]: not among its peers") as err:
        check_consortium("north", ["north", "east", "mallory"], 3, demo)
    assert err.value.rule == "peers"
    with pytest.raises(PrivacyError, match="does not name its sites"):
        check_consortium("north", None, 3, demo)
    assert check_consortium("north", None, 3, SitePolicy())["p"] == 3  # "any": in-process callers
    with pytest.raises(PrivacyError, match="max_sites=16") as err:
        check_consortium("a", [f"s{k}" for k in range(17)], 17, SitePolicy())
    assert err.value.rule == "max_sites"
    for bad, msg in (
        ("[limits]\npeers = []\n", "peers must be"),
        ('[limits]\npeers = ["any", "a"]\n', "peers must be"),
        ('[limits]\npeers = "any"\n', "peers must be"),
        ("[limits]\nmax_sites = 1\n", "max_sites must be an integer >= 2"),
    ):
        (tmp_path / "p.toml").write_text(bad)
        with pytest.raises(ConfigError, match=msg):
            load_policy(tmp_path / "p.toml")
    assert tighten(SitePolicy(), {"max_sites": 4}).max_sites == 4  # a job may only lower it
    assert tighten(SitePolicy(), {"max_sites": 400}).max_sites == 16
