"""The reconstruction attacks of a malicious coordinator that chooses the domain model, against
a SiteWorker whose labelled inputs it knows (as if leaked: the worst case for these rules).

Each attack sends only allowed request types.  Under the default policy (and with DP on at
epsilon = 1) each filed attack is refused or recovers at most 60% of the 60 labels (chance:
50%).  The "policy-aware" variants are the strongest versions we could build: the attacker
knows every labelled x, respects every smoothness rule at its limit and hides the target in a
small weight (clipping bounds a point's share, not how small a weight may be); what stops
them is the query budget.  The multi-column variant (p = 21 coordinator-chosen sources, one
point per column) is refused by max_sites; with that bound lifted it reads every label
without DP, and noise with DP on.  tests/privacy/test_coordinator_reads.py has the attacks on
sites whose labelled inputs stay private."""

import math

import numpy as np
import pytest
from scipy.special import expit

from msa_fed.boundary import messages as m
from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy
from tests.privacy import attacks as A

MAX_CORRECT = int(0.6 * A.N)  # 36 of 60
DP1 = dict(dp_enabled=True, epsilon_per_job=1.0)


def _isolation_1d(worker, X, y, *, coef, eta, qhat_mode, inside_logit, known_x=False):
    """Locate each point by counts (bisection on one threshold), then isolate it with a bump of
    two thresholds and read its loss through dc_evaluate(z=[1, 0])."""
    c = A.Coordinator(worker)
    h0 = worker.predictors[0]
    n = X.shape[0]
    if known_x:
        xs = np.sort(X[:, 0])
    else:
        xs = []
        for k in range(1, n + 1):  # the k-th smallest x: smallest t with count(x <= t) >= k
            lo, hi = -8.0, 8.0
            for _ in range(25):
                mid = (lo + hi) / 2
                r = c.ask("set_domain_model", A.threshold_spec([mid], [coef], -coef / 2))
                if r is None:
                    break
                count = round(r.sums[0] * 2 * n)
                lo, hi = (lo, mid) if count >= k else (mid, hi)
            else:
                xs.append(hi)
                continue
            break
        xs = np.array(xs)
    decoded = {}
    order = np.argsort(X[:, 0])
    for rank, x in enumerate(xs):
        lo = xs[rank - 1] if rank else x - 1.0
        hi = xs[rank + 1] if rank + 1 < len(xs) else x + 1.0
        t = [(lo + x) / 2, (x + hi) / 2]
        # logit of Q(0|x): inside_logit inside the bump, inside_logit - coef outside
        r = c.ask("set_domain_model", A.threshold_spec(t, [-coef, coef], inside_logit - coef))
        if r is None:
            continue
        Q0 = 1 / (
            1 + np.exp(-(np.where(X[:, 0] <= t[1], coef, 0) - np.where(X[:, 0] <= t[0], coef, 0) + inside_logit - coef))
        )
        qhat = np.array([1.0, 1.0]) if qhat_mode == "ones" else np.array([0.5, 0.5])
        if c.ask("set_qhat", m.QhatBroadcast(qhat=qhat, eta=eta)) is None:
            continue
        out = c.ask("dc_evaluate", m.DCRequest(z=np.array([1.0, 0.0]), eta=eta, what=("L",)))
        if out is None:
            continue
        i = int(order[rank]) if known_x else int(np.argmin(np.abs(X[:, 0] - x)))  # attacker's point
        weights = (1 / (2 * n)) * Q0 / qhat[0]
        decoded[i] = A.decode(float(out.sums.L[0]), weights, i, X, h0, decoded)
    return c, decoded


@pytest.mark.parametrize("dp", [False, True], ids=["default", "dp-eps1"])
def test_point_isolation_1d_as_filed_is_refused(dp):
    """The attack as filed: sharp threshold theta, qhat = [1, 1], eta = 0, z = [1, 0]."""
    worker, X, y = A.victim(1, policy=SitePolicy(**(DP1 if dp else {})))
    c, decoded = _isolation_1d(worker, X, y, coef=200.0, eta=0.0, qhat_mode="ones", inside_logit=100.0)
    assert A.score(decoded, y) <= MAX_CORRECT
    assert not decoded and c.answers == 0
    assert "theta_norm" in c.refusals


#: every limit of the policy lifted: the attacks' own sanity checks (they do read the labels then)
LOOSE = SitePolicy(
    min_effective_points=1e-9,
    max_point_share=1.0,
    mu_min=1e-12,
    eta_min=1e-300,
    domain_models_per_job=10**6,
    domain_models_per_day=10**6,
)


def test_point_isolation_1d_without_the_rules_recovers_every_label():
    """Sanity of the attack itself: with every limit lifted it reads all 60 labels."""
    worker, X, y = A.victim(1, policy=LOOSE)
    _c, decoded = _isolation_1d(worker, X, y, coef=200.0, eta=1e-300, qhat_mode="half", inside_logit=100.0)
    assert A.score(decoded, y) == A.N


@pytest.mark.parametrize("dp", [False, True], ids=["default", "dp-eps1"])
def test_point_isolation_1d_policy_aware(dp, tmp_path):
    """Strongest variant: x known, theta at |W|^2 = log 2 / mu_min, eta = eta_min, consistent
    qhat, the target's weight small enough to pass the concentration rule; repeated over jobs
    that share the site's ledger until the daily budget is spent."""
    pol = SitePolicy(ledger=str(tmp_path / "ledger.sqlite"), **(DP1 if dp else {}))
    coef = math.sqrt(math.log(2) / pol.mu_min) / math.sqrt(2) * 0.999
    decoded_all, refusals = {}, {}
    for job in range(30):
        worker, X, y = A.victim(1, policy=pol, job_id=f"job{job}")
        c, decoded = _isolation_1d(
            worker, X, y, coef=coef, eta=pol.eta_min, qhat_mode="half", inside_logit=-3.0, known_x=True
        )
        decoded_all.update(decoded)
        for k, v in c.refusals.items():
            refusals[k] = refusals.get(k, 0) + v
        assert len(decoded) <= pol.domain_models_per_job
    assert A.score(decoded_all, y) <= MAX_CORRECT
    assert len(decoded_all) <= pol.domain_models_per_day
    assert refusals.get("budget", 0) > 0


def _differencing_2d(worker, X, y, *, scale_w, eta, known=True):
    """Two sharp half-spaces along u holding the k and k-1 points with the largest u.x: the
    difference of the two answers is one point's loss."""
    c = A.Coordinator(worker)
    h0 = worker.predictors[0]
    n = X.shape[0]
    mean, scale = X.mean(axis=0), X.std(axis=0)
    u = np.array([1.0, 0.3]) / np.hypot(1.0, 0.3)
    proj = ((X - mean) / scale) @ u
    order = np.argsort(-proj)
    decoded = {}
    prev = None
    for k in range(n // 2 - 1, n // 2 + 30):
        if k >= n:
            break
        cut = (proj[order[k - 1]] + proj[order[k]]) / 2 if k < n else proj[order[-1]] - 1
        w0 = scale_w * u
        spec = A.standard_spec(mean, scale, w0, -scale_w * cut)
        r = c.ask("set_domain_model", spec)
        if r is None:
            prev = None
            continue
        qhat = np.array([0.5, 0.5])
        if c.ask("set_qhat", m.QhatBroadcast(qhat=qhat, eta=eta)) is None:
            prev = None
            continue
        out = c.ask("dc_evaluate", m.DCRequest(z=np.array([1.0, 0.0]), eta=eta, what=("L",)))
        if out is None:
            prev = None
            continue
        Q0 = expit(scale_w * (proj - cut))
        weights = (1 / (2 * n)) * Q0 / qhat[0]
        L = float(out.sums.L[0])
        if prev is not None:  # the point that entered between the two half-spaces
            i = int(order[k - 1])
            decoded[i] = A.decode(L - prev[0], weights - prev[1], i, X, h0, decoded)
        prev = (L, weights)
    return c, decoded


@pytest.mark.parametrize("dp", [False, True], ids=["default", "dp-eps1"])
def test_differencing_2d_as_filed_is_refused(dp):
    """As filed: default "standard" map, |theta| ~ 9e4, eta = 0."""
    worker, X, y = A.victim(2, policy=SitePolicy(**(DP1 if dp else {})))
    c, decoded = _differencing_2d(worker, X, y, scale_w=9e4, eta=0.0)
    assert not decoded and c.answers == 0
    assert "theta_norm" in c.refusals
    assert A.score(decoded, y) <= MAX_CORRECT


def test_differencing_2d_without_the_rules_recovers_labels():
    worker, X, y = A.victim(2, policy=LOOSE)
    _c, decoded = _differencing_2d(worker, X, y, scale_w=9e4, eta=1e-300)
    assert len(decoded) >= 25 and all(decoded[i] == y[i] for i in decoded)


@pytest.mark.parametrize("dp", [False, True], ids=["default", "dp-eps1"])
def test_differencing_2d_policy_aware(dp, tmp_path):
    """Half-spaces at the sharpest allowed theta (|W|^2 = log 2 / mu_min), eta = eta_min, over
    as many jobs as the site's ledger lets through."""
    pol = SitePolicy(ledger=str(tmp_path / "ledger.sqlite"), **(DP1 if dp else {}))
    w_max = math.sqrt(math.log(2) / pol.mu_min) * 0.999
    decoded_all = {}
    budget_refused = 0
    for job in range(30):
        worker, X, y = A.victim(2, policy=pol, job_id=f"job{job}")
        c, decoded = _differencing_2d(worker, X, y, scale_w=w_max, eta=pol.eta_min)
        decoded_all.update(decoded)
        budget_refused += c.refusals.get("budget", 0)
    assert budget_refused > 0
    assert A.score(decoded_all, y) <= MAX_CORRECT


@pytest.mark.parametrize("dp", [False, True], ids=["default", "dp-eps1"])
def test_job_cannot_lower_min_points_for_a_three_point_site(dp):
    """A job that sets min_points = 1 against a site with 3 labelled points: every aggregate
    over the labelled points is refused by the site's own minimum."""
    X, y, Xu = A.victim_data(1, n=3)
    policy = SitePolicy(**(DP1 if dp else {}))
    for kw in ({"min_points": 1}, {"min_points": 1, "privacy": {"min_points": 1}}):
        worker = A.binary_site("tiny", X, y, Xu, A.predictors(1), policy=policy, **kw)
        assert worker.policy.min_points == 20
        c = A.Coordinator(worker)
        spec = A.threshold_spec([0.0], [1.0], 0.0)
        assert c.ask("set_domain_model", spec) is None
        assert c.refusals == {"min_points": 1}
        with pytest.raises(PrivacyError, match=r"site 'tiny' refuses to aggregate over 3 labelled points"):
            worker.set_domain_model(spec)


def test_job_requests_only_tighten():
    X, y, Xu = A.victim_data(1)
    w = A.binary_site(
        "v",
        X,
        y,
        Xu,
        A.predictors(1),
        min_points=40,
        privacy={"mu_min": 1.0, "eta_min": 0.0, "domain_models_per_job": 10**9},
    )
    assert w.policy.min_points == 40 and w.policy.mu_min == 1.0
    assert w.policy.eta_min == SitePolicy().eta_min
    assert w.policy.domain_models_per_job == SitePolicy().domain_models_per_job


def _multi_column(worker_kw: dict, X, y, p: int = 21, c: float = 27.0):
    """A coordinator that registers p sources: each of 20 columns of one domain model hides a
    different point in a small bump (Q(k|x) ~ e^-5 there, e^-32 elsewhere; column 20 is a sink
    taking the rest), so one DC answer carries 20 points' losses; three models cover 60."""
    n = X.shape[0]
    order = np.argsort(X[:, 0])
    xs = X[order, 0]
    preds = A.predictors(1)
    worker = A.binary_site("victim", X, y, X, [preds[0]] * (p - 1) + [preds[1]], **worker_kw)
    c_ = A.Coordinator(worker)
    h0 = preds[0]
    P = h0.predict_proba(X)
    decoded = {}
    pi = 1.0 / (p * n)
    for m_ in range(3):
        ranks = list(range(m_, n, 3))[: p - 1]
        t = []
        for r in ranks:
            lo = (xs[r - 1] + xs[r]) / 2 if r else xs[r] - 1.0
            hi = (xs[r] + xs[r + 1]) / 2 if r + 1 < n else xs[r] + 1.0
            t += [lo, hi]
        t = np.array(t)
        T = t.size
        theta = np.zeros((p, T + 1))
        for k in range(p - 1):
            theta[k, 2 * k], theta[k, 2 * k + 1], theta[k, T] = -c, c, -(c + 5.0)
        spec = m.DomainModelSpec(
            kind="maxent",
            n_sources=p,
            feature_map=("threshold", {"n_thresholds": T}, {"thresholds": t}),
            theta=theta.reshape(-1),
        )
        if c_.ask("set_domain_model", spec) is None:
            continue
        qhat = np.full(p, 0.04)
        qhat[-1] = 1 - 0.04 * (p - 1)
        eta = worker.policy.eta_min
        if c_.ask("set_qhat", m.QhatBroadcast(qhat=qhat, eta=eta)) is None:
            continue
        z = np.full(p, 1.0 / (p - 1))
        z[-1] = 0.0
        out = c_.ask("dc_evaluate", m.DCRequest(z=z, eta=eta, what=("L",)))
        if out is None:
            continue
        # the attacker's model of each target's loss under either label
        F = (X[:, [0]] <= t[None, :]).astype(float)
        f = F @ theta[:, :T].T + theta[:, T]
        Q = np.exp(f - f.max(axis=1, keepdims=True))
        Q /= Q.sum(axis=1, keepdims=True)
        w = pi * Q / qhat
        for k, r in enumerate(ranks):
            i = int(order[r])
            errs = []
            for lab in (0, 1):
                H = np.full(p, P[i, lab])
                H[-1] = preds[1].predict_proba(X[[i]])[0, lab]
                K = w[i] @ z + eta * pi
                g = ((w[i] * H) @ z + eta * pi / p * H.sum()) / K
                errs.append(abs(out.sums.L[k] - w[i, k] * -np.log(g)))
            decoded[i] = int(np.argmin(errs))
    return c_, decoded


def test_multi_column_attack_is_refused_by_max_sites():
    """p = 21 coordinator-chosen sources: a job of more sites than the policy's max_sites is
    refused before any aggregate leaves, naming the rule."""
    X, y, _ = A.victim_data(1)
    c, decoded = _multi_column({"policy": SitePolicy(verify_domain_models=False)}, X, y)
    assert c.refusals == {"max_sites": 3} and c.answers == 0 and not decoded
    assert A.score(decoded, y) <= MAX_CORRECT


def test_multi_column_attack_without_the_p_bound_reads_every_label():
    """Sanity of the attack: with max_sites lifted, one small-bump column per point passes the
    deterministic limits (what stops such a model within max_sites is that it is not the public
    Maxent optimum over the published samples)."""
    X, y, _ = A.victim_data(1)
    c, decoded = _multi_column({"policy": SitePolicy(max_sites=64, verify_domain_models=False)}, X, y)
    assert not c.refusals
    assert len(decoded) == A.N and A.score(decoded, y) == A.N


def test_multi_column_attack_is_stopped_by_dp(monkeypatch):
    """Same attack, DP on at epsilon = 1: every answer is read, and the labels are noise.  (The
    site's noise generator is seeded here so that the count is reproducible; a site seeds it
    from the OS.)"""
    from msa_fed.privacy.dp import DPAccountant

    init = DPAccountant.__init__

    def seeded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rng = np.random.default_rng(12345)

    monkeypatch.setattr(DPAccountant, "__init__", seeded)
    X, y, _ = A.victim_data(1)
    c, decoded = _multi_column({"policy": SitePolicy(max_sites=64, verify_domain_models=False, **DP1)}, X, y)
    assert not c.refusals and len(decoded) == A.N
    assert A.score(decoded, y) <= MAX_CORRECT
