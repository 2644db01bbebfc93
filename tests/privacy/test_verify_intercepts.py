"""The intercepts a site re-solves when it verifies a Maxent model (msa_fed/privacy/verify.py):
the returned b is the minimiser (its gradient at round-off level, centred) and the softmax
returned with it is softmax(A + b) itself, on problems of every shape; intercepts the site
cannot re-solve (a class given no mass, a start far out) are a refusal, never a library error
or a model accepted on a gradient taken off the optimal intercepts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from msa_fed.core.features import feature_map_state
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
            sites[0].X_labeled,
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
