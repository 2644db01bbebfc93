"""The solver for sites that answer with DP noise: terminates on the simplex, near the optimum
when the noise is small, near the centre (not a corner) when the noise swamps the losses, and
stops cleanly when a site's budget is spent."""

import numpy as np
import pytest

from msa_fed.core.dc_terms import DCSums
from msa_fed.errors import PrivacyError
from msa_fed.privacy.solver import solve_noisy


class NoisyOracle:
    """L_k(z) = |z - e_k|^2 scaled per domain, plus Gaussian noise; refuses after ``budget`` answers."""

    def __init__(self, p, sigma, budget=10**9, seed=0, scales=None):
        self.n_sources = p
        self.sigma = sigma
        self.budget = budget
        self.calls = 0
        self.rng = np.random.default_rng(seed)
        self.scales = np.ones(p) if scales is None else np.asarray(scales)

    def exact(self, z):
        return self.scales * np.array([np.sum((z - np.eye(self.n_sources)[k]) ** 2) for k in range(self.n_sources)])

    def evaluate(self, z, eta, what, global_bound=None):
        assert tuple(what) == ("L",)
        if self.calls >= self.budget:
            raise PrivacyError("dp_budget", "s", "the request: spent")
        self.calls += 1
        return DCSums(L=self.exact(np.asarray(z)) + self.rng.normal(scale=self.sigma, size=self.n_sources), n=1)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_small_noise_finds_the_minmax_point(p):
    scales = np.linspace(1.0, 2.0, p)
    oracle = NoisyOracle(p, 1e-3, scales=scales)
    res = solve_noisy(oracle, 0.01, n_evaluations=30)
    assert res.z.min() >= 0 and res.z.sum() == pytest.approx(1.0) and res.n_evaluations == 30
    # the exact min-max over a fine random set of the simplex
    cand = np.random.default_rng(1).dirichlet(np.ones(p), size=20000)
    best = min(oracle.exact(z).max() for z in cand)
    assert oracle.exact(res.z).max() <= best + 0.03


def test_heavy_noise_stays_near_the_centre_and_budget_stops_it():
    oracle = NoisyOracle(3, 50.0, budget=9)
    res = solve_noisy(oracle, 0.01, n_evaluations=30)
    assert oracle.calls == 9 and res.n_evaluations == 9
    assert res.z.min() >= 0 and res.z.sum() == pytest.approx(1.0)
    assert np.abs(res.z - 1 / 3).max() < 0.34  # not a vertex
    res0 = solve_noisy(NoisyOracle(3, 1.0, budget=0), 0.01)
    assert np.allclose(res0.z, 1 / 3) and res0.n_evaluations == 0 and not res0.converged
    with pytest.raises(PrivacyError):  # other refusals are not swallowed

        class Refusing(NoisyOracle):
            def evaluate(self, *a, **k):
                raise PrivacyError("concentration", "s", "the request: no")

        solve_noisy(Refusing(2, 1.0), 0.01)
