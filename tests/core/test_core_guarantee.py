"""The own-loss guarantee of the min-max solve (``guarantee``): min max_k L_k(z) subject to
L_k(z) <= b_k (b_k = own_k + slack), or where no z satisfies them all, min max_k L_k(z) - b_k;
checked against a fine grid over the simplex (p = 3)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dc_problems import make_dc_problem  # noqa: E402

from msa_fed.core.config import SolverConfig  # noqa: E402
from msa_fed.core.dc_solver import LocalOracle, solve_dc  # noqa: E402
from msa_fed.core.harm import guarantee_line  # noqa: E402

ETA = 0.01


@pytest.fixture(scope="module")
def problem():
    """p = 3, whose min-max point leaves domain 0 above its vertex loss (measured: seed 3)."""
    oracle = LocalOracle(make_dc_problem(3, 2000, "cross_entropy", random_state=3))
    own = np.array([oracle.evaluate(np.eye(3)[k], ETA, ("L",)).array("L")[k] for k in range(3)])
    n = 120  # the grid: every z = (a, b, 1 - a - b) / n
    grid = np.array([(a, b, n - a - b) for a in range(n + 1) for b in range(n + 1 - a)], dtype=float) / n
    losses = np.array([oracle.evaluate(z, ETA, ("L",)).array("L") for z in grid])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = solve_dc(oracle, ETA)
    return oracle, own, grid, losses, free


def _solve(oracle, own, slack):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return solve_dc(oracle, ETA, guarantee=slack, own_losses=own)


def test_a_feasible_guarantee_is_the_constrained_min_max(problem):
    oracle, own, grid, losses, free = problem
    assert np.max(free.losses - own) > 1e-4  # the premise: the free min-max point breaks a bound
    res = _solve(oracle, own, 0.0)
    g = res.guarantee
    assert g["status"] == "constrained" and g["holds"]
    assert np.all(res.losses <= own + 1e-6)
    ok = np.all(losses <= own + 1e-9, axis=1)
    best = losses[ok].max(axis=1).min()  # the grid's best point under the bounds
    assert res.max_loss <= best + 1e-5 and res.max_loss >= free.max_loss - 1e-9
    assert g["max_loss_unconstrained"] == pytest.approx(free.max_loss)
    assert g["evaluations"] > 0 and res.n_evaluations == free.n_evaluations + g["evaluations"]
    assert "holds: z moved so that no site is worse off than alone" in guarantee_line(g, ["a", "b", "c"])


def test_an_infeasible_guarantee_gives_the_closest_point_and_says_so(problem):
    oracle, own, grid, losses, _ = problem
    tight = own - 0.2  # no z reaches these
    res = _solve(oracle, tight, 0.0)
    g = res.guarantee
    assert g["status"] == "infeasible" and not g["holds"]
    closest = (losses - tight).max(axis=1).min()  # the grid's smallest largest excess
    assert max(g["excess"]) == pytest.approx(closest, abs=1e-4) and max(g["excess"]) <= closest + 1e-6
    line = guarantee_line(g, ["a", "b", "c"])
    assert line.count("\n") == 0 and "NOT feasible" in line and "smallest" not in line
    assert f"{max(g['excess']):+.4f}" in line


def test_a_guarantee_that_holds_costs_no_round(problem):
    oracle, own, _, _, free = problem
    res = _solve(oracle, own, 1.0)
    assert res.guarantee["status"] == "holds at the min-max point" and res.guarantee["evaluations"] == 0
    np.testing.assert_array_equal(res.z, free.z)
    assert res.n_evaluations == free.n_evaluations


def test_the_option_is_checked(problem):
    oracle, own, _, _, _ = problem
    with pytest.raises(ValueError, match="guarantee needs own_losses"):
        solve_dc(oracle, ETA, guarantee=0.0)
    with pytest.raises(ValueError, match="guarantee needs own_losses"):
        solve_dc(oracle, ETA, guarantee=0.0, own_losses=[0.1, np.nan, 0.2])
    with pytest.raises(ValueError, match="applies only to objective='minmax'"):
        SolverConfig(objective="regret", guarantee=0.0).validate()
    with pytest.raises(ValueError, match="guarantee must be a number >= 0"):
        from msa_fed.core.options import check_value

        check_value(SolverConfig, "guarantee", -0.1)
