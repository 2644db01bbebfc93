"""The DC quantities of DESIGN.md sections 2 and 3: values, gradients, the identity, convexity."""

from __future__ import annotations

import numpy as np
import pytest
from dc_problems import make_dc_problem
from numpy.testing import assert_allclose
from reference import pooled, reference_terms

from msa_fed.core import dc_terms
from msa_fed.core.dc_solver import LocalOracle
from msa_fed.core.dc_terms import WHAT, DCSums, PointSet, sum_all

LOSSES = ["squared", "cross_entropy"]
ETAS = [1e-2, 0.0]


def problem(loss, p=3, n=240, seed=0, kind="coupled"):
    return pooled(make_dc_problem(p, n, loss, kind=kind, random_state=seed))


def rel_err(a, b):
    """Elementwise relative error with a floor at 1e-8 of the largest entry."""
    scale = max(np.max(np.abs(a)), np.max(np.abs(b)), 1e-300)
    return float(np.max(np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-8 * scale)))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("bound", [None, "global"])
def test_values_match_reference(loss, eta, bound, monkeypatch):
    # small blocks: the blocked sums and the one-BLAS-thread branch are exercised
    monkeypatch.setattr(dc_terms, "BLOCK_ELEMENTS", 64)
    ps = problem(loss, p=3, n=2000, seed=1)
    gb = None if bound is None else 1.5 * ps.max_bound() if loss == "squared" else 2.0
    rng = np.random.default_rng(0)
    for z in [np.full(3, 1 / 3), rng.dirichlet(np.ones(3)), np.array([0.0, 0.3, 0.7])]:
        if eta == 0 and np.any(z == 0):
            continue
        got = ps.evaluate(z, eta, what=("L", "u", "v"), global_bound=gb)
        ref = reference_terms(ps, z, eta, global_bound=gb)
        for name in ("L", "u", "v"):
            assert_allclose(getattr(got, name), ref[name], rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("bound", [None, "global"])
def test_gradients_match_central_differences(loss, eta, bound):
    ps = problem(loss, p=4, n=300, seed=2, kind="harsh")
    gb = None if bound is None else 2.0 * ps.max_bound() if loss == "squared" else None
    rng = np.random.default_rng(1)
    h = 1e-6
    for _ in range(3):
        z = rng.dirichlet(np.ones(4)) * 0.9 + 0.025  # interior, K > 0 for eta = 0 too
        got = ps.evaluate(z, eta, what=WHAT, global_bound=gb)
        for f, df in (("L", "dL"), ("u", "du"), ("v", "dv")):
            fd = np.empty((4, 4))
            for j in range(4):
                e = np.zeros(4)
                e[j] = h
                plus = getattr(ps.evaluate(z + e, eta, what=(f,), global_bound=gb), f)
                minus = getattr(ps.evaluate(z - e, eta, what=(f,), global_bound=gb), f)
                fd[:, j] = (plus - minus) / (2 * h)
            assert rel_err(getattr(got, df), fd) <= 1e-5, (f, getattr(got, df), fd)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eta", ETAS)
def test_u_minus_v_is_loss_gap(loss, eta):
    ps = problem(loss, p=4, n=400, seed=3)
    rng = np.random.default_rng(2)
    for bound in (None, 3.0 * max(ps.max_bound(), 1.0)):
        for _ in range(5):
            z = rng.dirichlet(np.ones(4))
            s = ps.evaluate(z, eta, what=("L", "u", "v"), global_bound=bound)
            assert_allclose(s.u - s.v, s.L - z @ s.L, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("bound", [None, "global"])
def test_u_and_v_are_convex_along_segments(loss, eta, bound):
    """Midpoint test f((a + b) / 2) <= (f(a) + f(b)) / 2 on random segments of the simplex,
    including segments ending near vertices and faces."""
    ps = problem(loss, p=3, n=300, seed=4, kind="harsh")
    gb = None if bound is None else ps.max_bound() if loss == "squared" else None
    rng = np.random.default_rng(3)
    floor = 0.0 if eta > 0 else 1e-3
    for _ in range(150):
        a = rng.dirichlet(np.full(3, 0.3 if rng.random() < 0.5 else 1.0)) + floor
        b = rng.dirichlet(np.full(3, 0.3)) + floor
        a, b = a / a.sum(), b / b.sum()
        ends = [ps.evaluate(x, eta, what=("u", "v"), global_bound=gb) for x in (a, b, (a + b) / 2)]
        for name in ("u", "v"):
            fa, fb, fm = (getattr(e, name) for e in ends)
            slack = 1e-10 * (np.abs(fa) + np.abs(fb) + 1.0)
            assert np.all(fm <= (fa + fb) / 2 + slack), (name, a, b, fm - (fa + fb) / 2)


@pytest.mark.parametrize("loss", LOSSES)
def test_midpoint_test_has_teeth(loss):
    """The segments above are long enough to see curvature: u_k and v_k are strictly convex
    there, so -u_k and -v_k fail the same midpoint test by a visible margin."""
    ps = problem(loss, p=3, n=300, seed=4, kind="harsh")
    rng = np.random.default_rng(3)
    worst = {"u": 0.0, "v": 0.0}
    for _ in range(50):
        a, b = rng.dirichlet(np.full(3, 0.3)), rng.dirichlet(np.full(3, 0.3))
        ends = [ps.evaluate(x, 1e-2, what=("u", "v")) for x in (a, b, (a + b) / 2)]
        for name in worst:
            fa, fb, fm = (-getattr(e, name) for e in ends)
            worst[name] = max(worst[name], float(np.max((fm - (fa + fb) / 2) / (np.abs(fa) + np.abs(fb) + 1))))
    assert worst["u"] > 1e-4 and worst["v"] > 1e-4, worst


@pytest.mark.parametrize("loss", LOSSES)
def test_sites_sums_add_up_to_pooled(loss):
    sites = make_dc_problem(4, 600, loss, random_state=5)
    oracle = LocalOracle(sites)
    whole = pooled(sites)
    z = np.array([0.1, 0.2, 0.3, 0.4])
    for gb in (None, 5.0):
        a = oracle.evaluate(z, 1e-2, WHAT, global_bound=gb)
        b = whole.evaluate(z, 1e-2, what=WHAT, global_bound=gb)
        assert a.n == b.n == 600
        for name in WHAT:
            assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-14)
    assert oracle.max_bound() == pytest.approx(whole.max_bound())


def test_dcsums_add_and_refuse_mismatched_fields():
    a = DCSums(L=np.ones(2), n=3)
    b = DCSums(L=np.full(2, 2.0), n=4)
    c = sum_all([a, b, a])
    assert_allclose(c.L, [4.0, 4.0])
    assert c.n == 10
    with pytest.raises(ValueError, match="dL"):
        _ = a + DCSums(L=np.ones(2), dL=np.ones((2, 2)), n=1)
    with pytest.raises(ValueError):
        sum_all([])


def test_empty_point_set_gives_zero_sums():
    ps = PointSet(w=np.zeros((0, 3)), pi=np.zeros(0), H=np.zeros((0, 3)), y=np.zeros(0), loss="squared")
    s = ps.evaluate(np.full(3, 1 / 3), 0.1, what=WHAT)
    for name in WHAT:
        assert not np.any(getattr(s, name))


def test_bad_arguments_are_named():
    ps = problem("cross_entropy", p=3, n=60)
    with pytest.raises(ValueError, match="what"):
        ps.evaluate(np.full(3, 1 / 3), 0.1, what=("L", "gradient"))
    with pytest.raises(ValueError, match="z must have shape"):
        ps.evaluate(np.full(4, 1 / 4), 0.1)
    with pytest.raises(ValueError, match="loss"):
        PointSet(w=ps.w, pi=ps.pi, H=ps.H, loss="hinge")
    with pytest.raises(ValueError, match="targets y"):
        PointSet(w=ps.w, pi=ps.pi, H=ps.H, loss="squared")
    with pytest.raises(ValueError, match="shape mismatch"):
        PointSet(w=ps.w, pi=ps.pi[:-1], H=ps.H, loss="cross_entropy")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eta", ETAS)
def test_losses_path_matches_reference_and_finite_differences(loss, eta, monkeypatch):
    """L and dL alone (what the min-max solver asks: one product per block, a scratch array
    reused across blocks) equal the reference L, central differences of it, and the full path."""
    monkeypatch.setattr(dc_terms, "BLOCK_ELEMENTS", 64)  # many blocks (7 of 285 or 286 rows)
    ps = problem(loss, p=4, n=1999, seed=3)
    rng = np.random.default_rng(4)
    for z in (np.full(4, 0.25), rng.dirichlet(np.ones(4)) * 0.9 + 0.025, np.array([0.0, 0.7, 0.3, 0.0])):
        fast = ps.evaluate(z, eta, what=("L", "dL"))
        only_grad = ps.evaluate(z, eta, what=("dL",))
        full = ps.evaluate(z, eta, what=WHAT)
        assert fast.u is None and only_grad.L is None
        assert_allclose(fast.L, reference_terms(ps, z, eta)["L"], rtol=1e-12)
        assert_allclose(fast.dL, full.dL, rtol=1e-11, atol=1e-14)
        assert_allclose(only_grad.dL, fast.dL, rtol=0, atol=0)
        if z.min() == 0.0:  # on the boundary (eta = 0: K near 0) central differences are too coarse
            continue
        h = 1e-6
        fd = np.column_stack(
            [
                (reference_terms(ps, z + h * e, eta)["L"] - reference_terms(ps, z - h * e, eta)["L"]) / (2 * h)
                for e in np.eye(4)
            ]
        )
        assert_allclose(fast.dL, fd, rtol=1e-5, atol=1e-9)  # atol: the differences' rounding, 1e-16 / h
