"""The intercepts a site re-solves when it verifies a Maxent model (msa_fed/privacy/verify.py):
the returned b is the minimiser (its gradient at round-off level, centred) and the softmax
returned with it is softmax(A + b) itself, on problems of every shape; intercepts the site
cannot re-solve (a class given no mass, a start far out) are a refusal, never a library error
or a model accepted on a gradient taken off the optimal intercepts."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from msa_fed.core.config import ClassifierConfig
from msa_fed.core.domain_classifier import (
    balanced_shards,
    polish_maxent,
    sum_minibatch_oracle,
    sum_oracle,
    train_domain_classifier,
)
from msa_fed.core.features import feature_map_state, make_feature_map
from msa_fed.errors import PrivacyError
from msa_fed.privacy.verify import INTERCEPT_GTOL, check_maxent, intercepts_and_softmax, solve_intercepts

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites  # noqa: E402
from test_verify import ROOMY, honest  # noqa: E402


def softmax(Z):
    E = np.exp(Z - Z.max(axis=1, keepdims=True))
    return E / E.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("seed", range(12))
def test_the_intercepts_are_the_minimiser_and_the_softmax_is_theirs(seed):
    rng = np.random.default_rng(seed)
    p, m, D = int(rng.integers(2, 33)), int(rng.integers(20, 800)), int(rng.integers(1, 12))
    sizes = rng.integers(m // 2 + 1, m + 1, size=p)
    Phi = rng.normal(size=(int(sizes.sum()), D)) * rng.uniform(0.1, 3.0)
    W = rng.normal(size=(p, D)) * rng.uniform(0.01, 3.0)
    A = Phi @ W.T
    s = np.concatenate([np.full(n, 1.0 / (p * n)) for n in sizes])
    target = np.full(p, 1.0 / p)
    b0 = rng.normal(size=p) * [0.0, 1e-6, 0.1, 1.0][seed % 4]
    b, P = intercepts_and_softmax(A, s, target, b0)
    assert abs(b.mean()) < 1e-12
    np.testing.assert_allclose(P, softmax(A + b), rtol=0, atol=1e-15)
    assert np.abs(s @ P - target).max() < 1e-12  # the gradient in b
    # the minimiser: no nearby centred point has a lower objective (beyond round-off)
    F = lambda bb: float(s @ np.log(np.exp(A + bb).sum(axis=1)) - target @ bb)  # noqa: E731
    for _ in range(5):
        d = rng.normal(size=p) * 1e-4
        assert F(b) <= F(b + d - d.mean()) + 1e-13
    np.testing.assert_array_equal(solve_intercepts(A, s, target, b0), b)


@pytest.mark.parametrize("shift", [-800.0, -60.0, 60.0, 800.0, 1e6])
def test_intercepts_that_cannot_be_re_solved_are_refused(shift):
    """One intercept of the honest optimum moved far out: a class gets (almost) no mass, the
    Hessian in b is (numerically) singular and Newton cannot recover from there.  The site refuses
    (verify_optimum) rather than fail with a library error or take the gradient in W at
    intercepts that are not optimal (which a crafted W could make small)."""
    sites = make_sites(n_labeled=(61, 73, 89), n_unlabeled=(120, 150, 180))
    opt = honest(sites)
    D = opt.n_features_
    theta = opt.theta_.copy()
    theta[D] += shift
    with pytest.raises(PrivacyError) as info:
        check_maxent(
            theta,
            opt.mu,
            feature_map_state(opt.feature_map),
            [s.X_unlabeled for s in sites],
            ROOMY,
            "a",
        )
    assert (info.value.rule, info.value.site) == ("verify_optimum", "a")
    # and the honest optimum's intercepts re-solve to round-off
    Phis = [opt.feature_map.transform(s.X_unlabeled) for s in sites]
    A = np.vstack(Phis) @ opt.theta_.reshape(3, D + 1)[:, :D].T
    w = np.concatenate([np.full(len(P), 1.0 / (3 * len(P))) for P in Phis])
    _, P = intercepts_and_softmax(A, w, np.full(3, 1 / 3), opt.theta_.reshape(3, D + 1)[:, D])
    assert np.abs(w @ P - 1 / 3).max() <= INTERCEPT_GTOL / 100


# ---------------------------------------------------------------------- against the former solve
def damped_reference(A, s, target, b0, iters=50):
    """The former solve, kept as the reference: damped Newton whose line search compares
    objectives down to one rounding unit and stops at a gradient of 1e-15 (it halves on rounding
    noise near the optimum: many passes, the same minimiser)."""
    b = np.asarray(b0, dtype=np.float64) - np.mean(b0)
    p = b.size
    passes = 0

    def value(bb):
        nonlocal passes
        passes += 1
        Z = A + bb
        top = Z.max(axis=1)
        E = np.exp(Z - top[:, None])
        S = E.sum(axis=1)
        return float(s @ (top + np.log(S)) - target @ bb), E / S[:, None]

    f, P = value(b)
    for _ in range(iters):
        g = s @ P - target
        if np.abs(g).max() < 1e-15:
            break
        H = np.diag(s @ P) - (P * s[:, None]).T @ P + np.full((p, p), 1.0 / p)
        try:
            step = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:
            step = np.linalg.lstsq(H, g, rcond=None)[0]
        t = 1.0
        while t > 1e-8:
            nb = b - t * step
            nb -= np.mean(nb)
            nf, nP = value(nb)
            if nf <= f + 1e-16 * max(1.0, abs(f)):
                break
            t *= 0.5
        if t <= 1e-8:
            break
        b, f, P = nb, nf, nP
    return b, P, passes


def problem(seed, p=None, m=None):
    rng = np.random.default_rng(seed)
    p = p or int(rng.integers(2, 33))
    m = m or int(rng.integers(20, 800))
    D = int(rng.integers(1, 12))
    sizes = rng.integers(m // 2 + 1, m + 1, size=p)
    Phi = rng.normal(size=(int(sizes.sum()), D)) * rng.uniform(0.1, 3.0)
    W = rng.normal(size=(p, D)) * rng.uniform(0.01, 3.0)
    s = np.concatenate([np.full(n, 1.0 / (p * n)) for n in sizes])
    return rng, Phi @ W.T, s, np.full(p, 1.0 / p)


@pytest.mark.parametrize("seed", range(12))
def test_the_solution_is_the_former_solves_within_tolerance(seed):
    rng, A, s, target = problem(seed)
    p = target.size
    for b0 in (np.zeros(p), rng.normal(size=p), rng.normal(size=p) * 5.0):
        ref, P_ref, _ = damped_reference(A, s, target, b0)
        b, P = intercepts_and_softmax(A, s, target, b0)
        if np.abs(s @ P_ref - target).max() <= INTERCEPT_GTOL:  # the former solve converged ...
            assert np.abs(b - ref).max() <= 1e-9
            assert np.abs(s @ P - target).max() <= INTERCEPT_GTOL / 100
        else:  # ... or not (a class left without mass, from a start far out): nor does this one
            assert not np.abs(s @ P - target).max() <= INTERCEPT_GTOL


def fitted(p, m, seed):
    """(A, s, target, received intercepts) of a polished model on p published samples of m points,
    trained as Ray and federated sites receive it: L-BFGS over one float32 shard per site, then
    the coordinator's float64 polish (the fit benchmarks/bench_verify_newton.py measures, smaller)."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(p, 5))
    U = [rng.normal(size=(m, 5)) + means[k] for k in range(p)]
    cfg = ClassifierConfig()
    assert cfg.dtype == "float32"

    def oracles(fmap):  # the sites' shards (float32 products), computed here
        shards = balanced_shards([np.asarray(fmap.transform(X), dtype=np.float64) for X in U], cfg, seed=seed)
        return sum_oracle(shards), sum_minibatch_oracle(shards, cfg.batch_size)

    model = train_domain_classifier(U, make_feature_map("standard", 0), cfg, oracles=oracles)
    Phis = [np.asarray(model.feature_map.transform(X), dtype=np.float64) for X in U]
    oracle = sum_oracle(balanced_shards(Phis, replace(cfg, dtype="float64")))
    model.theta_, _ = polish_maxent(oracle, model.theta_, model.n_features_, p, cfg.mu, cfg.max_iter)
    D = model.n_features_
    Wb = model.theta_.reshape(p, D + 1)
    s = np.concatenate([np.full(m, 1.0 / (p * m)) for _ in range(p)])
    return np.vstack(Phis) @ Wb[:, :D].T, s, np.full(p, 1.0 / p), Wb[:, D].copy()


def gradient_at(A, s, target, b):
    return float(np.abs(s @ softmax(A + b) - target).max())


def test_the_received_intercepts_cost_a_pass_or_two_not_hundreds():
    """What a site re-solves: the intercepts of an honest model, the optimum up to the
    coordinator's polish (a gradient of 1e-11 to 1e-9, above what the check accepts).  The former
    solve compared objectives there, whose decrease lies below their rounding: on a problem with
    p = 32 and intercepts a hair (1e-9 relative) off the optimum it halved its step on that noise
    (983 passes measured; 83 at p = 32, n = 1e5 in a fit); in Newton's quadratic region the full
    step is taken and the solve stops at the tolerance."""
    starts = []
    for seed in range(4):
        A, s, target, b_recv = fitted(4, 500, seed)
        starts.append(gradient_at(A, s, target, b_recv))
        counts: dict = {}
        b, P = intercepts_and_softmax(A, s, target, b_recv, counts=counts)
        ref, _, _ = damped_reference(A, s, target, b_recv)
        assert counts["passes"] <= 3, (seed, counts)
        assert np.abs(s @ P - target).max() <= INTERCEPT_GTOL / 100
        assert np.abs(b - ref).max() <= 1e-9
    assert max(starts) > INTERCEPT_GTOL, starts  # received off the optimum: the re-solve was needed
    # the rounding-noise regime: the optimum's intercepts moved by a controlled hair
    _, A, s, target = problem(2, p=32, m=1000)
    b_star = intercepts_and_softmax(A, s, target, np.zeros(32))[0]
    b_recv = b_star * (1 + 1e-9 * np.random.default_rng(2).normal(size=32))
    assert gradient_at(A, s, target, b_recv) > INTERCEPT_GTOL  # the premise: a re-solve is needed
    counts = {}
    b, P = intercepts_and_softmax(A, s, target, b_recv, counts=counts)
    assert counts["passes"] <= 3, counts
    assert np.abs(s @ P - target).max() <= INTERCEPT_GTOL / 100
    assert np.abs(b - b_star).max() <= 1e-9
    # (the former solve's passes here depend on the rounding of the BLAS in use, 2 to 983
    # measured: benchmarks/bench_verify_newton.py reports them, not this test)


@pytest.mark.parametrize("p", [4, 32])
def test_starts_near_the_optimum_take_full_steps_and_far_ones_stay_guarded(p):
    _, A, s, target = problem(100 + p, p=p, m=400)
    b_star, _, _ = damped_reference(A, s, target, np.zeros(p))
    rng = np.random.default_rng(p)
    for jitter in (0.0, 1e-12, 1e-9, 1e-7, 1e-4):
        counts: dict = {}
        b, P = intercepts_and_softmax(A, s, target, b_star + jitter * rng.normal(size=p), counts=counts)
        assert counts["passes"] <= 3, (jitter, counts)
        assert np.abs(s @ P - target).max() <= INTERCEPT_GTOL / 100
        assert np.abs(b - b_star).max() <= 1e-9
    # from a cold start the line search guards the far steps; the count stays that of the former
    counts = {}
    b, _ = intercepts_and_softmax(A, s, target, np.zeros(p), counts=counts)
    assert counts["passes"] <= damped_reference(A, s, target, np.zeros(p))[2]
    assert np.abs(b - b_star).max() <= 1e-9


def test_every_check_decides_as_with_the_former_solve(monkeypatch):
    """The honest model, models off its optimum and intercepts moved far out: the check's decision
    and what it measures are those of the check run with the former solve."""
    import msa_fed.privacy.verify as verify

    sites = make_sites(n_labeled=(61, 73, 89), n_unlabeled=(120, 150, 180), random_state=4)
    opt = honest(sites)
    D = opt.n_features_
    U = [s.X_unlabeled for s in sites]
    state = feature_map_state(opt.feature_map)
    rng = np.random.default_rng(0)
    thetas = [opt.theta_]
    for scale in (1e-8, 1e-5, 1e-3, 1e-1):
        thetas.append(opt.theta_ + scale * rng.normal(size=opt.theta_.size))
    for shift in (0.3, 5.0, 60.0, 800.0):
        theta = opt.theta_.copy()
        theta[D] += shift
        thetas.append(theta)

    def decide(theta):
        verify.PUBLISHED_MEMO.clear()
        try:
            return check_maxent(theta, opt.mu, state, U, ROOMY, "a")
        except PrivacyError as exc:
            return exc.rule

    new = [decide(t) for t in thetas]
    monkeypatch.setattr(
        verify, "intercepts_and_softmax", lambda A, s, target, b0: damped_reference(A, s, target, b0)[:2]
    )
    old = [decide(t) for t in thetas]
    assert [isinstance(x, dict) for x in new] == [isinstance(x, dict) for x in old]
    assert sum(isinstance(x, dict) for x in new) >= 3 and "verify_optimum" in new  # both outcomes occur
    for a, b in zip(new, old):
        if isinstance(a, dict):
            for key in ("verify_deviation", "verify_intercept_gap", "verify_grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), key
        else:
            assert a == b


# ---------------------------------------------------------------------------- the factored solve
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_factored_solve_is_the_direct_one(seed):
    """exp(A) taken once and scaled by e^b per trial point: the same intercepts and softmax as
    the direct solve (a pass of exponentials per trial point) to rounding."""
    from msa_fed.privacy.verify import intercepts_direct

    rng = np.random.default_rng(seed)
    n, p = 3000, 7
    A = rng.normal(size=(n, p)) * 3.0
    s = np.full(n, 1.0 / n)
    target = np.full(p, 1.0 / p)
    b0 = rng.normal(size=p) * 2.0
    counts: dict = {}
    b, P = intercepts_and_softmax(A, s, target, b0, counts=counts)
    ref_counts: dict = {}
    b_ref, P_ref = intercepts_direct(A, s, target, b0, counts=ref_counts)
    assert counts["factored"] is True
    np.testing.assert_allclose(b, b_ref, atol=1e-11)
    np.testing.assert_allclose(P, P_ref, atol=1e-12)
    assert np.abs(s @ P - target).max() <= INTERCEPT_GTOL
    assert counts["steps"] == ref_counts["steps"]


def test_the_factored_solve_hands_over_where_its_products_underflow():
    """Rows whose exp(A - max A) and e^(b - max b) underflow where they meet (logits 800 apart,
    intercepts 1000 the other way): the direct solve answers, with its own passes."""
    from msa_fed.privacy.verify import intercepts_direct

    rng = np.random.default_rng(3)
    A = rng.normal(size=(400, 3))
    A[:5, 1:] -= 800.0  # rows where the first column leads A by 800 and trails b by 1000
    b0 = np.array([-1000.0, 0.0, 0.0])
    counts: dict = {}
    b, P = intercepts_and_softmax(A, np.full(400, 1 / 400), np.full(3, 1 / 3), b0, counts=counts)
    b_ref, P_ref = intercepts_direct(A, np.full(400, 1 / 400), np.full(3, 1 / 3), b0)
    assert counts["factored"] is False
    np.testing.assert_array_equal(b, b_ref)
    np.testing.assert_array_equal(P, P_ref)


@pytest.mark.parametrize("direct", [False, True])
def test_the_hessian_is_formed_only_where_a_step_follows(monkeypatch, direct):
    """The Gram product (s P)^T P (the Hessian's costly part: a product of the n x p softmax with
    itself) is formed once per Newton step and not at the pass that stops the solve, which needs
    the gradient alone; the intercepts and the softmax are bit for bit those of the solve that
    formed it at every pass."""
    import msa_fed.privacy.verify as verify

    point = verify._Direct if direct else verify._Factored
    solve = verify.intercepts_direct if direct else intercepts_and_softmax
    real_gram, real_gradient = point.gram, point.gradient
    grams: list[int] = []

    def counted_gram(self, state):
        grams.append(1)
        return real_gram(self, state)

    def gradient_with_gram(self, state):  # the former pass: both at every point
        real_gram(self, state)
        return real_gradient(self, state)

    A, s, target, b_recv = fitted(8, 400, 5)
    for b0 in (b_recv, np.zeros(8)):
        grams.clear()
        monkeypatch.setattr(point, "gram", counted_gram)
        counts: dict = {}
        b, P = solve(A, s, target, b0, counts=counts)
        assert counts["steps"] >= 1 and len(grams) == counts["steps"], (counts, len(grams))
        monkeypatch.setattr(point, "gram", real_gram)
        monkeypatch.setattr(point, "gradient", gradient_with_gram)
        b_every, P_every = solve(A, s, target, b0)
        monkeypatch.setattr(point, "gradient", real_gradient)
        assert np.array_equal(b, b_every) and np.array_equal(P, P_every)
