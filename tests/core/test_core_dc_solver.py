"""solve_dc against exhaustive simplex grids, and the solver's contract (history, warnings, z0)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from dc_problems import make_dc_problem
from reference import gamma_on_grid, losses_on_grid, pooled
from sklearn.exceptions import ConvergenceWarning

from msa_fed.core.dc_solver import LocalOracle, SolverConfig, gamma_at, solve_dc
from msa_fed.core.dc_terms import gamma_from_losses
from msa_fed.core.simplex import check_simplex, project_simplex, simplex_grid

GRID_STEP = {2: 0.002, 3: 0.01}
ETA = 1e-2
# (p, loss, kind, seed): random problems of both loss kinds, both generators
CASES = [
    (p, loss, kind, seed)
    for p in (2, 3)
    for loss in ("squared", "cross_entropy")
    for kind, seed in (("coupled", 0), ("coupled", 1), ("harsh", 2))
]


def case_id(case):
    return "p{}-{}-{}-{}".format(*case)


@pytest.fixture(scope="module")
def grids():
    return {p: simplex_grid(p, step) for p, step in GRID_STEP.items()}


def make(p, loss, kind, seed, n=160):
    sites = make_dc_problem(p, n, loss, kind=kind, random_state=seed)
    return LocalOracle(sites), pooled(sites)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("method", ["dca", "auto"])
def test_gamma_no_worse_than_the_grid(case, method, grids):
    p, loss, kind, seed = case
    oracle, whole = make(p, loss, kind, seed)
    grid_best = float(gamma_on_grid(whole, grids[p], ETA).min())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = solve_dc(oracle, ETA, objective="gamma", method=method, max_iter=60)
    check_simplex(res.z)
    # the reported Gamma and losses are those of the returned z (recomputed independently)
    L = losses_on_grid(whole, res.z[None, :], ETA)[0]
    np.testing.assert_allclose(res.losses, L, rtol=1e-10, atol=1e-12)
    assert res.gamma == pytest.approx(gamma_from_losses(L, res.z), abs=1e-12)
    assert res.gamma <= grid_best + 1e-4, (res.gamma, grid_best, res.method)
    if method == "auto":  # the default method reaches Gamma = 0 up to its tolerance
        assert res.converged and res.gamma <= 1e-9


@pytest.mark.parametrize("loss", ["squared", "cross_entropy"])
def test_dca_never_increases_gamma(loss):
    for seed in range(2):
        oracle, _ = make(3, loss, "harsh", seed, n=150)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            res = solve_dc(
                oracle, ETA, objective="gamma", method="dca", max_iter=10, n_restarts=1, tol=1e-12, random_state=seed
            )
        assert len(res.history) >= 2
        assert np.all(np.diff(res.history) <= 0.0), res.history
        assert res.history[-1] == pytest.approx(res.gamma)


@pytest.mark.parametrize("loss", ["squared", "cross_entropy"])
@pytest.mark.parametrize("bound", ["pointwise", "global"])
def test_dca_majoriser_lies_above_gamma(loss, bound):
    """The convex model DCA minimises, max_k u_k(z) - v_k(z_t) - dv_k(z_t).(z - z_t), is >= Gamma(z)
    on the simplex (v_k is convex) and equal to it at z_t: so each exact DCA step cannot raise Gamma."""
    oracle, whole = make(3, loss, "harsh", 3, n=200)
    gb = whole.max_bound() if bound == "global" and loss == "squared" else None
    rng = np.random.default_rng(0)
    for _ in range(5):
        zt = rng.dirichlet(np.ones(3))
        st = whole.evaluate(zt, ETA, what=("L", "v", "dv"), global_bound=gb)
        Z = np.vstack([rng.dirichlet(np.full(3, 0.5)) for _ in range(40)] + [zt])
        for z in Z:
            s = whole.evaluate(z, ETA, what=("L", "u"), global_bound=gb)
            model = float(np.max(s.u - st.v - st.dv @ (z - zt)))
            assert model >= gamma_from_losses(s.L, z) - 1e-11
        s = whole.evaluate(zt, ETA, what=("u",), global_bound=gb)
        assert float(np.max(s.u - st.v)) == pytest.approx(gamma_from_losses(st.L, zt), abs=1e-11)


@pytest.mark.parametrize("method", ["dca", "auto", "newton", "homotopy"])
def test_iteration_cap_gives_warning_and_flag(method):
    oracle, _ = make(4, "squared", "coupled", 4, n=300)
    with pytest.warns(ConvergenceWarning, match="without converging"):
        res = solve_dc(oracle, ETA, objective="gamma", method=method, max_iter=1, n_restarts=0, tol=1e-14)
    assert res.converged is False
    # auto: one homotopy step, then one Newton and one DCA iteration from its best point
    assert res.n_iter <= (3 if method == "auto" else 1)
    # and no warning when it converges
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        res = solve_dc(oracle, ETA, objective="gamma", method="auto")
    assert res.converged


@pytest.mark.parametrize("loss", ["squared", "cross_entropy"])
def test_minmax_objective_against_the_grid(loss, grids):
    for p in (2, 3):
        oracle, whole = make(p, loss, "coupled", 5)
        grid_best = float(losses_on_grid(whole, grids[p], ETA).max(axis=1).min())
        res = solve_dc(oracle, ETA, objective="minmax", n_restarts=2)
        assert res.objective == "minmax"
        assert res.max_loss <= grid_best + 1e-4, (res.max_loss, grid_best)
        check_simplex(res.z)


@pytest.mark.parametrize("loss", ["squared", "cross_entropy"])
def test_larger_problems_reach_gamma_zero(loss):
    """p = 4, 8 and eta = 0 (no smoothing) on both generators: the default method converges."""
    for p, kind, eta in ((4, "coupled", 0.0), (8, "harsh", 0.0), (8, "coupled", ETA)):
        oracle, _ = make(p, loss, kind, 6, n=800)
        res = solve_dc(oracle, eta, objective="gamma")
        assert res.converged and res.gamma <= 1e-9, (p, kind, eta, res.gamma, res.restarts)
        assert gamma_at(oracle, res.z, eta) == pytest.approx(res.gamma, abs=1e-12)


def test_z0_checkpoint_restarts_at_once():
    oracle, _ = make(3, "squared", "coupled", 7, n=300)
    first = solve_dc(oracle, ETA, objective="gamma")
    again = solve_dc(oracle, ETA, objective="gamma", z0=first.z)
    assert again.converged and again.n_evaluations <= 2
    np.testing.assert_allclose(again.z, first.z, atol=1e-12)


def test_bad_arguments_are_named():
    oracle, _ = make(3, "cross_entropy", "coupled", 8, n=100)
    with pytest.raises(ValueError, match="z0 must lie on the simplex; got sum=1.2"):
        solve_dc(oracle, ETA, objective="gamma", z0=[0.5, 0.4, 0.3])
    with pytest.raises(ValueError, match="z0 must lie on the simplex; got a negative entry"):
        solve_dc(oracle, ETA, objective="gamma", z0=[1.5, -0.5, 0.0])
    with pytest.raises(ValueError, match="z0 must have 3 entries"):
        solve_dc(oracle, ETA, objective="gamma", z0=[0.5, 0.5])
    with pytest.raises(ValueError, match="z must lie on the simplex"):
        gamma_at(oracle, np.array([0.2, 0.2, 0.2]), ETA)
    with pytest.raises(ValueError, match="method"):
        solve_dc(oracle, ETA, objective="gamma", method="bfgs")
    with pytest.raises(ValueError, match="objective"):
        solve_dc(oracle, ETA, objective="mean")
    with pytest.raises(ValueError, match="eta"):
        solve_dc(oracle, -1.0)
    with pytest.raises(ValueError, match="max_iter"):
        solve_dc(oracle, ETA, objective="gamma", max_iter=0)


def test_default_objective_is_minmax_and_gamma_options_are_refused_under_it():
    """The solver's default objective is the coordinator's ("minmax"); an option that only the
    objective "gamma" uses is an error under "minmax" instead of being ignored."""
    oracle, _ = make(3, "cross_entropy", "coupled", 8, n=100)
    assert solve_dc(oracle, ETA, n_restarts=0).objective == "minmax"
    assert SolverConfig().objective == "minmax"
    for option in ({"method": "dca"}, {"method": "auto"}, {"bound": "global"}):
        with pytest.raises(ValueError, match=f"{next(iter(option))}=.* applies only to objective='gamma'"):
            solve_dc(oracle, ETA, **option)
        with pytest.raises(ValueError, match="applies only to objective='gamma'"):
            SolverConfig(**option).validate()
    with pytest.raises(TypeError, match="max_iter must be an integer >= 1; got 'x'"):
        SolverConfig(max_iter="x").validate()
    with pytest.raises(ValueError, match="tol must be a number >= 0; got -1"):
        SolverConfig(tol=-1).validate()


def test_simplex_helpers():
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(size=5) * 3
        x = project_simplex(v)
        assert x.min() >= 0 and x.sum() == pytest.approx(1.0)
        # the projection is the closest simplex point: no grid point of the simplex is closer
        for y in rng.dirichlet(np.ones(5), size=50):
            assert np.linalg.norm(v - x) <= np.linalg.norm(v - y) + 1e-12
    G = simplex_grid(3, 0.25)
    assert G.shape == (15, 3) and np.allclose(G.sum(1), 1.0)
    with pytest.raises(ValueError, match="step"):
        simplex_grid(3, 0.3)
    with pytest.raises(ValueError, match="finite"):
        check_simplex([np.nan, 1.0])
