"""msa_fed.core.target: the target's mixture (EM, BBSE), the predicted loss, conformal support.

Known truth: two 1-D Gaussian domains whose exact posterior under equal priors is the
"classifier"; every estimator is checked against a slow reference or an exact answer."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose
from scipy.optimize import minimize_scalar
from scipy.stats import norm

from msa_fed.core.target import (
    MixtureEstimate,
    bbse_mixture,
    bootstrap_mixture,
    category_rarities,
    category_score,
    category_tables,
    combine_pvalues,
    conformal_pvalues,
    confusion_matrix,
    em_mixture,
    knn_distance,
    leave_one_out_category_score,
    leave_one_out_distance,
    predicted_loss,
)

MEANS = np.array([-1.0, 1.0])


def posterior(x: np.ndarray, prior=(0.5, 0.5)) -> np.ndarray:
    """Exact P(k | x) of the two unit Gaussians under ``prior``."""
    dens = norm.pdf(x[:, None], MEANS[None, :]) * np.asarray(prior)[None, :]
    return dens / dens.sum(axis=1, keepdims=True)


def draw(lam, n, rng) -> np.ndarray:
    k = rng.choice(2, size=n, p=lam)
    return rng.normal(MEANS[k], 1.0)


def test_em_is_the_maximum_likelihood_mixture_weight():
    rng = np.random.default_rng(0)
    x = draw([0.3, 0.7], 4000, rng)
    lam = em_mixture(posterior(x))

    # slow reference: maximise the target likelihood sum_i log(sum_k lam_k D_k(x_i)) directly
    def nll(a):
        return -np.sum(np.log(a * norm.pdf(x, -1) + (1 - a) * norm.pdf(x, 1)))

    ref = minimize_scalar(nll, bounds=(0, 1), method="bounded", options={"xatol": 1e-10}).x
    assert_allclose(lam, [ref, 1 - ref], atol=1e-6)
    assert abs(lam[0] - 0.3) < 0.04


def test_em_divides_out_the_training_prior():
    # a classifier trained under prior (0.8, 0.2): told so, EM gives the same answer as on the balanced one
    rng = np.random.default_rng(1)
    x = draw([0.6, 0.4], 3000, rng)
    balanced = em_mixture(posterior(x))
    skewed = em_mixture(posterior(x, (0.8, 0.2)), train_prior=np.array([0.8, 0.2]))
    assert_allclose(skewed, balanced, atol=1e-6)
    # ignoring the skew (treating it as uniform) is a different, wrong answer
    assert abs(em_mixture(posterior(x, (0.8, 0.2)))[0] - balanced[0]) > 0.1


def test_bbse_recovers_the_mixture_from_the_confusion_matrix():
    rng = np.random.default_rng(2)
    sites = [posterior(rng.normal(m, 1.0, 5000)) for m in MEANS]
    C = confusion_matrix(sites)
    # exact confusion of the Bayes rule (threshold 0): P(say 0 | site 0) = Phi(1)
    assert_allclose(C, [[norm.cdf(1), norm.cdf(-1)], [norm.cdf(-1), norm.cdf(1)]], atol=0.02)
    assert_allclose(C.sum(axis=0), 1.0)
    x = draw([0.25, 0.75], 20000, rng)
    assert_allclose(bbse_mixture(posterior(x), C), [0.25, 0.75], atol=0.03)
    assert_allclose(bbse_mixture(posterior(x), confusion_matrix(sites, soft=True), soft=True), [0.25, 0.75], atol=0.03)


def test_bbse_stays_on_the_simplex_when_the_target_is_outside_the_sites_hull():
    C = np.array([[0.9, 0.2], [0.1, 0.8]])
    Q = np.tile([[0.99, 0.01]], (50, 1))  # every target point said site 0: beyond C's first column
    lam = bbse_mixture(Q, C)
    assert lam.min() >= 0 and abs(lam.sum() - 1) < 1e-12 and lam[0] > 0.99


def test_the_bootstrap_interval_holds_the_estimate_and_covers_the_truth():
    rng = np.random.default_rng(3)
    hits = 0
    for _ in range(10):
        x = draw([0.4, 0.6], 1000, rng)
        est = bootstrap_mixture(posterior(x), lambda Q: em_mixture(Q, tol=1e-6), n_boot=60, random_state=rng)
        assert np.all(est.low <= est.lam) and np.all(est.lam <= est.high)
        assert est.draws.shape == (60, 2)
        hits += est.low[0] <= 0.4 <= est.high[0]
    assert hits >= 8  # 95% intervals: 9.5 expected of 10


def test_predicted_loss_is_the_mixture_of_the_site_losses():
    lam = np.array([0.25, 0.75])
    est = MixtureEstimate(lam, lam, lam, 0.95, np.tile(lam, (50, 1)))
    exact = predicted_loss(est, np.array([0.2, 0.6]), np.zeros(2))
    assert exact.loss == pytest.approx(0.5) and exact.low == pytest.approx(0.5) and exact.high == pytest.approx(0.5)
    # each site's standard error widens it: the half-width is about 1.96 * sqrt(sum lam_k^2 se_k^2)
    wide = predicted_loss(
        MixtureEstimate(lam, lam, lam, 0.95, np.tile(lam, (4000, 1))), np.array([0.2, 0.6]), np.array([0.04, 0.02])
    )
    half = 1.96 * np.sqrt((0.25 * 0.04) ** 2 + (0.75 * 0.02) ** 2)
    assert wide.high - wide.low == pytest.approx(2 * half, rel=0.1)
    with pytest.raises(ValueError, match="loss_se"):
        predicted_loss(est, np.array([0.2, 0.6]), np.array([-1.0, 0.0]))


def test_knn_distance_matches_brute_force():
    rng = np.random.default_rng(4)
    A, R = rng.normal(size=(37, 3)), rng.normal(size=(20, 3))
    brute = np.sort(np.linalg.norm(A[:, None, :] - R[None, :, :], axis=2), axis=1)
    for r in (1, 5, 20):
        assert_allclose(knn_distance(A, R, r), brute[:, r - 1], atol=1e-9)
    with pytest.raises(ValueError, match="r must be"):
        knn_distance(A, R, 21)
    # leave one out: the r-th nearest of the OTHER rows, duplicates included
    D = np.vstack([R, R[:3]])
    full = np.linalg.norm(D[:, None, :] - D[None, :, :], axis=2)
    np.fill_diagonal(full, np.inf)
    assert_allclose(leave_one_out_distance(D, 2), np.sort(full, axis=1)[:, 1], atol=1e-7)


def test_knn_distance_at_the_fit_reference_size_matches_brute_force():
    """The size a fit's target reference uses (1000 rows per site, D = 5; on one BLAS thread),
    scored in two blocks of rows (5000 points against 1000 reference rows)."""
    rng = np.random.default_rng(5)
    R, A = rng.normal(size=(1000, 5)), rng.normal(size=(5000, 5)) * 1.5
    dist = np.vstack([np.linalg.norm(A[a : a + 500, None, :] - R[None, :, :], axis=2) for a in range(0, 5000, 500)])
    for r in (1, 10):
        brute = np.partition(dist, r - 1, axis=1)[:, r - 1]
        assert_allclose(knn_distance(A, R, r), brute, rtol=1e-9, atol=1e-9)
    full = np.linalg.norm(R[:, None, :] - R[None, :, :], axis=2)
    np.fill_diagonal(full, np.inf)
    assert_allclose(leave_one_out_distance(R, 10), np.sort(full, axis=1)[:, 9], rtol=1e-9, atol=1e-9)


def test_leave_one_out_calibration_is_valid():
    # a new point of the same distribution is flagged at most alpha of the time (on average)
    rng = np.random.default_rng(7)
    rates = []
    for _ in range(100):
        R = rng.normal(size=(200, 2))
        cal = leave_one_out_distance(R, 5)
        rates.append(np.mean(conformal_pvalues(knn_distance(rng.normal(size=(500, 2)), R, 5), cal) <= 0.05))
    # expected rate <= 10/201 (exactly, for full conformal; leave-one-out is more conservative);
    # the mean of 100 calibration draws has a standard error of about 0.0015
    assert np.mean(rates) <= 0.05 + 0.005


def test_conformal_pvalues_match_their_definition_and_are_valid():
    rng = np.random.default_rng(5)
    cal = rng.exponential(size=199)
    s = np.concatenate([rng.exponential(size=5), [0.0, cal.max(), cal.max() + 1]])
    ref = np.array([(1 + np.sum(cal >= v)) / (cal.size + 1) for v in s])
    assert_allclose(conformal_pvalues(s, cal), ref)
    assert conformal_pvalues([cal.max() + 1], cal)[0] == pytest.approx(1 / 200)
    # exchangeable points: P(p <= alpha) <= alpha (averaged over many calibration draws)
    flagged = [np.mean(conformal_pvalues(rng.normal(size=500), rng.normal(size=199)) <= 0.05) for _ in range(200)]
    assert np.mean(flagged) <= 0.05 + 0.005


def test_the_max_over_sites_is_valid_for_any_mixture_and_flags_what_no_site_has():
    rng = np.random.default_rng(6)
    refs = [rng.normal(m, 1.0, (300, 1)) for m in (-4.0, 4.0)]
    cals = [leave_one_out_distance(R, 5) for R in refs]

    def pvals(x):
        return combine_pvalues(
            np.column_stack([conformal_pvalues(knn_distance(x, refs[k], 5), cals[k]) for k in range(2)])
        )

    inside = np.concatenate([rng.normal(-4, 1, (200, 1)), rng.normal(4, 1, (1800, 1))])
    assert np.mean(pvals(inside) <= 0.01) <= 0.015
    outside = rng.normal(0.0, 0.3, (500, 1))  # between the two sites, where neither has points
    assert np.mean(pvals(outside) <= 0.01) > 0.9


def test_combine_pvalues_skips_unavailable_sites():
    P = np.array([[0.2, np.nan], [np.nan, np.nan], [0.01, 0.5]])
    out = combine_pvalues(P)
    assert out[0] == 0.2 and np.isnan(out[1]) and out[2] == 0.5


# ------------------------------------------------------------------ categorical support
def categorical_rows(rng, n, education=None):
    """Rows of three categorical columns: a constant (or given) 'education', a skewed column of 6
    values and a long-tailed one of 300 (most values seen once or never in a few hundred rows)."""
    edu = np.full(n, 3.0 if education is None else education)
    skewed = rng.choice(6, size=n, p=[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]).astype(float)
    tail = rng.zipf(1.6, size=n).clip(max=300).astype(float)
    return np.column_stack([edu, skewed, tail])


def rarity_reference(x, R, a=0.5):
    """-log P of each value of x in the columns of R, by the definition (slow)."""
    m = R.shape[0]
    out = []
    for j in range(R.shape[1]):
        col = R[:, j]
        values, counts = np.unique(col, return_counts=True)
        unseen = (np.sum(counts == 1) + a) / (m + 2 * a)
        c = np.sum(col == x[j])
        out.append(-np.log(c / m * (1 - unseen)) if c > 0 else -np.log(unseen))
    return max(out)


def test_category_score_and_its_leave_one_out_match_the_definition():
    rng = np.random.default_rng(11)
    R = categorical_rows(rng, 120)
    X = np.vstack([categorical_rows(rng, 30), categorical_rows(rng, 5, education=9.0)])
    got = category_score(X, category_tables(R), R.shape[0])
    assert_allclose(got, [rarity_reference(x, R) for x in X], rtol=1e-12)
    # each reference row against the others, with the once-seen counts recomputed without it
    loo = leave_one_out_category_score(R)
    assert_allclose(loo, [rarity_reference(R[i], np.delete(R, i, axis=0)) for i in range(R.shape[0])], rtol=1e-12)
    # an education no reference row has, in a column where every row shares one: the rarest of all
    assert got[-5:].min() > loo.max()
    # the flattened tables (the ONNX graph's) give the same scores
    values, cols, seen, unseen = category_rarities(R)
    hit = X[:, cols] == values[None, :]
    per_column = np.tile(unseen, (X.shape[0], 1))
    for j in range(unseen.size):
        on = cols == j
        per_column[:, j] = np.where(hit[:, on].any(axis=1), (hit[:, on] * seen[on]).sum(axis=1), unseen[j])
    assert_allclose(per_column.max(axis=1), got, rtol=1e-12)


def test_randomised_ties_make_categorical_pvalues_exact_and_let_a_small_site_flag():
    rng = np.random.default_rng(12)
    alpha, rates, conservative, beyond = 0.05, [], [], []
    for _ in range(150):
        R = categorical_rows(rng, 60)  # 60 rows: 1 / 61 > 0.01
        cal = leave_one_out_category_score(R)
        tables = category_tables(R)
        s = category_score(categorical_rows(rng, 400), tables, 60)
        u = rng.random(s.size)
        rates.append(np.mean(conformal_pvalues(s, cal, u) <= alpha))
        conservative.append(np.mean(conformal_pvalues(s, cal) <= alpha))
        out = category_score(categorical_rows(rng, 400, education=7.0), tables, 60)
        beyond.append(np.mean(conformal_pvalues(out, cal, rng.random(out.size)) <= 0.01))
    # exchangeable rows: flagged at most alpha of the time (the leave-one-out calibration counts
    # one row fewer than a new row sees, so a little less; standard error of the mean about
    # 0.003); ties counted against the point: no more
    assert 0.02 < np.mean(rates) <= alpha + 0.005, np.mean(rates)
    assert np.mean(conservative) <= np.mean(rates)
    # rows with an education the site never has: beyond every calibration score, so p = u / 61,
    # flagged at 0.01 with probability 0.61, which the tie-counting p-value (1 / 61) never is
    assert 0.5 < np.mean(beyond) < 0.7
    p = conformal_pvalues([np.inf], cal, [0.3])
    assert p[0] == pytest.approx(0.3 / (cal.size + 1))
    with pytest.raises(ValueError, match="ties"):
        conformal_pvalues([1.0, 2.0], cal, [0.5])
