"""The distribution-weighted combination: stability, Proposition 1, the empirical weights."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from msa_fed.core.combination import (
    combination_weights,
    combine_proba,
    combine_regression,
    paper_z,
    qhat_partial,
    site_point_set,
)

rng = np.random.default_rng(0)


def softmax(a):
    a = a - a.max(axis=1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(axis=1, keepdims=True)


def direct_weights(Q, qhat, z, eta):
    """a_k(x) = (z_k q_k(x) + eta / p) / (sum_j z_j q_j(x) + eta), straight from DESIGN.md."""
    p = Q.shape[1]
    q = Q / qhat
    return (z * q + eta / p) / ((z * q).sum(axis=1, keepdims=True) + eta)


@pytest.mark.parametrize("eta", [0.0, 1e-3, 0.5])
def test_weights_match_the_formula_and_rows_sum_to_one(eta):
    Q = softmax(rng.normal(size=(50, 4)) * 2)
    qhat = Q.mean(axis=0)
    for z in (rng.dirichlet(np.ones(4)), np.array([0.0, 0.5, 0.5, 0.0])):
        a = combination_weights(np.log(Q), np.log(qhat), z, eta)
        assert_allclose(a, direct_weights(Q, qhat, z, eta), rtol=1e-12)
        assert_allclose(a.sum(axis=1), 1.0, atol=1e-12)
        assert a.min() >= 0
        if eta == 0:
            assert np.all(a[:, z == 0] == 0)


def test_eta_zero_is_stable_for_huge_log_q_differences():
    log_Q = np.array(
        [
            [0.0, -800.0, -1200.0],
            [-900.0, -1e4, 0.0],
            [-745.0, -746.0, -1e5],  # Q underflows to 0 for every k in float64
            [-5000.0, -5000.0, -5000.0],
        ]
    )
    z = np.array([0.2, 0.5, 0.3])
    for eta in (0.0, 1e-6):
        a = combination_weights(log_Q, np.log([0.3, 0.3, 0.4]), z, eta)
        assert np.all(np.isfinite(a))
        assert_allclose(a.sum(axis=1), 1.0, atol=1e-12)
    a = combination_weights(log_Q, np.log([0.3, 0.3, 0.4]), z, 0.0)
    assert_allclose(a[0], [1, 0, 0], atol=1e-300)
    assert_allclose(a[2], [0.2 / (0.2 + 0.5 * np.exp(-1)), 0.5 * np.exp(-1) / (0.2 + 0.5 * np.exp(-1)), 0], rtol=1e-12)
    assert_allclose(a[3], [0.2 / 0.3, 0.5 / 0.3, 0.3 / 0.4] / np.sum([0.2 / 0.3, 0.5 / 0.3, 0.3 / 0.4]), rtol=1e-12)


def test_proposition_1_gmsa_with_induced_densities_is_dmsa():
    """With D_k(x) = Q(k|x) D(x) / Qhat(k), GMSA's h_z = sum_k z_k D_k h_k / sum_j z_j D_j equals the
    paper's g_{z'} = sum_k z'_k Q(k|x) h_k / sum_j z'_j Q(j|x) with z'_k proportional to z_k / Qhat(k),
    and equals combination_weights (eta = 0) applied to log Q."""
    n, p, c = 40, 3, 4
    Q = softmax(rng.normal(size=(n, p)) * 1.5)
    qhat = np.array([0.2, 0.5, 0.3])
    Dx = rng.gamma(2.0, size=n)  # any positive density values D(x)
    Dk = Q * Dx[:, None] / qhat  # (n, p)
    z = rng.dirichlet(np.ones(p))
    zp = paper_z(z, qhat)
    assert_allclose(zp, (z / qhat) / np.sum(z / qhat))
    # regression model
    Hreg = rng.normal(size=(n, p))
    gmsa = (z * Dk * Hreg).sum(1) / (z * Dk).sum(1)
    paper = (zp * Q * Hreg).sum(1) / (zp * Q).sum(1)
    ours = combine_regression(combination_weights(np.log(Q), np.log(qhat), z, 0.0), Hreg)
    assert_allclose(gmsa, paper, rtol=1e-12)
    assert_allclose(ours, paper, rtol=1e-12)
    # probability model
    P = softmax(rng.normal(size=(n * p, c))).reshape(n, p, c)
    gmsa_p = np.einsum("nk,nkc->nc", z * Dk, P) / (z * Dk).sum(1, keepdims=True)
    paper_p = np.einsum("nk,nkc->nc", zp * Q, P) / (zp * Q).sum(1, keepdims=True)
    ours_p = combine_proba(combination_weights(np.log(Q), np.log(qhat), z, 0.0), P)
    assert_allclose(gmsa_p, paper_p, rtol=1e-12)
    assert_allclose(ours_p, paper_p, rtol=1e-12)
    assert_allclose(ours_p.sum(1), 1.0, atol=1e-12)


@pytest.mark.parametrize("eta", [0.0, 0.1])
def test_combined_outputs(eta):
    n, p, c = 30, 4, 3
    Q = softmax(rng.normal(size=(n, p)))
    a = combination_weights(np.log(Q), np.log(Q.mean(0)), rng.dirichlet(np.ones(p)), eta)
    H = rng.normal(size=(n, p))
    g = combine_regression(a, H)
    assert np.all(g >= H.min(1) - 1e-12) and np.all(g <= H.max(1) + 1e-12)  # a convex combination
    P = softmax(rng.normal(size=(n * p, c))).reshape(n, p, c)
    assert_allclose(combine_proba(a, P).sum(1), 1.0, atol=1e-12)


def test_site_point_sets_carry_the_balanced_weights():
    """pi_i = 1 / (p n_s), Qhat = sum of the sites' shares, and sum_i w_k(i) = 1 for every k."""
    p = 3
    Qs = [softmax(rng.normal(size=(m, p)) + 2 * np.eye(p)[k]) for k, m in enumerate((20, 45, 70))]
    qhat = sum(qhat_partial(Q, p) for Q in Qs)
    assert_allclose(qhat, np.mean([Q.mean(0) for Q in Qs], axis=0), rtol=1e-12)
    assert qhat.sum() == pytest.approx(1.0)
    sets = [site_point_set(Q, qhat, rng.uniform(0.1, 1, size=Q.shape), "cross_entropy") for Q in Qs]
    assert_allclose(sum(s.w.sum(0) for s in sets), 1.0, rtol=1e-12)
    assert sum(s.pi.sum() for s in sets) == pytest.approx(1.0)
    for s, Q in zip(sets, Qs):
        assert_allclose(s.pi, 1.0 / (p * Q.shape[0]))
