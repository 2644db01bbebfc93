"""The target population of a deployed model: its mixture over the sites, its loss, its support.

A combined model is guaranteed for any mixture D_lambda = sum_k lambda_k D_k of the sites'
distributions.  Given unlabelled target points x_1..x_n, this module answers three questions
with the domain classifier Q(k | x) alone (no query to the sites):

- **lambda**: treat the site as the label; the target differs from the classifier's training
  distribution only in the label prior (prior shift).  Q(k | x) is trained with equal domain
  weights (DESIGN.md section 2), so its training prior is uniform, pi_k = 1 / p.

  * EM re-weighting (Saerens, Latinne, Decaestecker 2002): under prior lambda the posterior is
    Q_lambda(k | x) = (lambda_k / pi_k) Q(k | x) / sum_j (lambda_j / pi_j) Q(j | x); iterate
    lambda_k <- mean_i Q_lambda(k | x_i).  Each step raises the target likelihood
    prod_i sum_k lambda_k D_k(x_i); the fixed point is its maximiser.  Assumes Q calibrated.
  * Black-box shift estimation, BBSE (Lipton, Wang, Smola 2018): with the confusion matrix
    C[i, j] = P(argmax Q = i | site j), measured on site-labelled points, the target's
    prediction frequencies are mu = C lambda; solve for lambda on the simplex.  Assumes only
    that C is invertible; needs labelled (site) points outside the classifier's errors.

  An interval per site comes from the bootstrap over the target points.
- **the loss**: sum_k lambda_k L_k(z) with the per-site losses L_k of the combined model; the
  interval carries lambda's bootstrap spread and each L_k's standard error.
- **the support**: a conformal p-value per point of the score s_k(x) = distance to the r-th
  nearest reference point of site k (in the classifier's feature space), calibrated on the
  leave-one-out scores of the reference points: p_k(x) = (1 + #{c : s_k(c) >= s_k(x)}) / (n_cal + 1).  For x drawn
  from D_k, P(p_k(x) <= alpha) <= alpha; the point's p-value is max_k p_k(x), so a point of any
  mixture of the sites is flagged at level alpha with probability at most alpha.  A point unlike
  every site has every p_k small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from msa_fed.core.threads import blas_threads_for

Array = NDArray[np.float64]
#: a mixture estimator: (Q (n, p) posteriors of the target points) -> lambda (p,)
Estimator = Callable[[Array], Array]


def _posteriors(posteriors: NDArray[np.floating], name: str = "Q") -> Array:
    Q: Array = np.asarray(posteriors, dtype=np.float64)
    if Q.ndim != 2 or Q.shape[1] < 2:
        raise ValueError(f"{name} must have shape (n_points, n_sites >= 2); got {Q.shape}")
    if Q.shape[0] == 0:
        raise ValueError(f"{name} has no rows: the target sample is empty")
    if not np.all(np.isfinite(Q)) or np.any(Q < 0):
        raise ValueError(f"{name} must hold finite probabilities >= 0")
    return Q


def em_mixture(
    Q: NDArray[np.floating],
    train_prior: NDArray[np.floating] | None = None,
    *,
    tol: float = 1e-9,
    max_iter: int = 10000,
    start: NDArray[np.floating] | None = None,
) -> Array:
    """Target prior lambda (p,) by EM re-weighting of the posteriors ``Q`` (n, p).

    ``train_prior``: the prior the classifier was trained under (default uniform, 1 / p: the
    balanced domain classifier).  Stops when lambda moves by less than ``tol`` (L1);
    ``start``: the first lambda (default uniform)."""
    Q = _posteriors(Q)
    n, p = Q.shape
    pi = np.full(p, 1.0 / p) if train_prior is None else np.asarray(train_prior, dtype=np.float64)
    if pi.shape != (p,) or np.any(pi <= 0):
        raise ValueError(f"train_prior must be {p} positive numbers; got {train_prior!r}")
    # R[i, k] proportional to D_k(x_i) / sum_j D_j(x_i): the posteriors with the training prior divided out
    R = Q / pi
    R = R / np.maximum(R.max(axis=1, keepdims=True), np.finfo(np.float64).tiny)
    lam = np.full(p, 1.0 / p) if start is None else np.asarray(start, dtype=np.float64)
    for _ in range(max_iter):
        mix = np.maximum(R @ lam, np.finfo(np.float64).tiny)
        new: Array = lam * (R.T @ (1.0 / mix)) / n  # mean_i of the re-weighted posteriors
        done = float(np.abs(new - lam).sum()) < tol
        lam = new
        if done:
            break
    out: Array = lam / lam.sum()
    return out


def confusion_matrix(site_posteriors: Sequence[NDArray[np.floating]], soft: bool = False) -> Array:
    """C (p, p) with C[i, j] = P(classifier says i | the point is site j's), from each site's
    labelled points' posteriors (one (m_j, p) array per site).  ``soft``: mean posterior
    E[Q(i | x) | site j] instead of the argmax frequencies."""
    p = len(site_posteriors)
    C = np.zeros((p, p))
    for j, Qj in enumerate(site_posteriors):
        Qj = _posteriors(Qj, f"posteriors of site {j}")
        if Qj.shape[1] != p:
            raise ValueError(f"posteriors of site {j} have {Qj.shape[1]} columns; expected {p}")
        C[:, j] = Qj.mean(axis=0) if soft else np.bincount(Qj.argmax(axis=1), minlength=p) / Qj.shape[0]
    return C


def bbse_mixture(Q: NDArray[np.floating], C: NDArray[np.floating], soft: bool = False) -> Array:
    """Target prior lambda (p,) by black-box shift estimation: mu = C lambda, solved on the
    simplex (non-negative least squares with the sum-to-one row weighted heavily).  ``mu`` is the
    target's argmax frequencies (``soft``: its mean posterior), as ``C`` was measured."""
    Q = _posteriors(Q)
    C = np.asarray(C, dtype=np.float64)
    p = Q.shape[1]
    if C.shape != (p, p):
        raise ValueError(f"C must have shape ({p}, {p}); got {C.shape}")
    from scipy.optimize import nnls  # here: loading a model and predicting need no scipy

    mu = Q.mean(axis=0) if soft else np.bincount(Q.argmax(axis=1), minlength=p) / Q.shape[0]
    weight = 1e3
    A = np.vstack([C, weight * np.ones((1, p))])
    b = np.concatenate([mu, [weight]])
    lam, _ = nnls(A, b)
    if lam.sum() <= 0:
        return np.full(p, 1.0 / p)
    out: Array = lam / lam.sum()
    return out


@dataclass(frozen=True)
class MixtureEstimate:
    """lambda-hat (p,), its bootstrap interval ``low``/``high`` (p,) at ``level``, and the
    bootstrap draws (B, p) the interval is read from."""

    lam: Array
    low: Array
    high: Array
    level: float
    draws: Array


def bootstrap_mixture(
    Q: NDArray[np.floating],
    estimator: Estimator,
    *,
    n_boot: int = 200,
    level: float = 0.95,
    random_state: int | np.random.Generator | None = 0,
) -> MixtureEstimate:
    """``estimator`` on the target posteriors ``Q`` (n, p), with a percentile interval from
    ``n_boot`` bootstrap resamples of the target points."""
    Q = _posteriors(Q)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1; got {n_boot!r}")
    rng = np.random.default_rng(random_state)
    lam = estimator(Q)
    n = Q.shape[0]
    draws = np.stack([estimator(Q[rng.integers(0, n, n)]) for _ in range(n_boot)])
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail], axis=0)
    # the percentile interval of a bootstrap can miss the estimate itself near the simplex's edge
    return MixtureEstimate(lam, np.minimum(low, lam), np.maximum(high, lam), level, draws)


@dataclass(frozen=True)
class LossPrediction:
    """Predicted target loss sum_k lambda_k L_k and its interval at ``level``."""

    loss: float
    low: float
    high: float
    level: float


def predicted_loss(
    mixture: MixtureEstimate,
    losses: NDArray[np.floating],
    loss_se: NDArray[np.floating],
    *,
    random_state: int | np.random.Generator | None = 0,
) -> LossPrediction:
    """sum_k lambda_k L_k with a percentile interval over the bootstrap draws of lambda, each
    paired with losses drawn as L_k + loss_se_k * N(0, 1) (each site's estimate of its own loss
    is a mean over its n_k points: standard error loss_se_k)."""
    L = np.asarray(losses, dtype=np.float64)
    se = np.asarray(loss_se, dtype=np.float64)
    p = mixture.lam.size
    if L.shape != (p,) or se.shape != (p,):
        raise ValueError(f"losses and loss_se must have shape ({p},); got {L.shape} and {se.shape}")
    if not np.all(np.isfinite(L)) or not np.all(np.isfinite(se)) or np.any(se < 0):
        raise ValueError("losses must be finite and loss_se finite and >= 0")
    rng = np.random.default_rng(random_state)
    Ls = L + se * rng.standard_normal((mixture.draws.shape[0], p))
    totals = np.einsum("bk,bk->b", mixture.draws, Ls)
    tail = (1.0 - mixture.level) / 2.0
    low, high = np.quantile(totals, [tail, 1.0 - tail])
    point = float(mixture.lam @ L)
    return LossPrediction(point, min(float(low), point), max(float(high), point), mixture.level)


# --------------------------------------------------------------------------- support


def knn_distance(Phi: NDArray[np.floating], reference: NDArray[np.floating], r: int) -> Array:
    """Euclidean distance (n,) from each row of ``Phi`` (n, D) to its ``r``-th nearest row of
    ``reference`` (m, D); computed in blocks of rows."""
    Phi = np.asarray(Phi, dtype=np.float64)
    R = np.asarray(reference, dtype=np.float64)
    if Phi.ndim != 2 or R.ndim != 2 or Phi.shape[1] != R.shape[1]:
        raise ValueError(f"Phi and reference must be 2-D with the same width; got {Phi.shape} and {R.shape}")
    if not 1 <= r <= R.shape[0]:
        raise ValueError(f"r must be in [1, {R.shape[0]}] (the reference rows); got {r}")
    r2 = np.einsum("ij,ij->i", R, R)
    out = np.empty(Phi.shape[0])
    rows = max(1, (1 << 22) // max(R.shape[0], 1))
    # a block's product is small (rows x m x D): on one BLAS thread (core/threads.py; a second
    # thread doubled the CPU of the fit's reference, 1000 rows of D = 5)
    with blas_threads_for(min(Phi.shape[0], rows) * R.shape[0] * R.shape[1]):
        for a in range(0, Phi.shape[0], rows):
            P = Phi[a : a + rows]
            G = P @ R.T
            G *= -2.0
            G += r2[None, :]  # |p|^2 is the same along a row: added after the selection
            G.partition(r - 1, axis=1)
            out[a : a + rows] = G[:, r - 1] + np.einsum("ij,ij->i", P, P)
    dist: Array = np.sqrt(np.maximum(out, 0.0))
    return dist


def leave_one_out_distance(reference: NDArray[np.floating], r: int) -> Array:
    """Each reference row's distance (m,) to its ``r``-th nearest OTHER reference row: the
    calibration scores of :func:`knn_distance` on the reference itself.

    A new point's score counts all m rows, a reference row's only the m - 1 others (full
    conformal would add the new point to them): calibration scores are never smaller than full
    conformal's, so the p-values of :func:`conformal_pvalues` on them are conservative."""
    R = np.asarray(reference, dtype=np.float64)
    if not 1 <= r < R.shape[0]:
        raise ValueError(f"r must be in [1, {R.shape[0] - 1}] (the other reference rows); got {r}")
    return knn_distance(R, R, r + 1)  # the row itself is its own nearest (distance 0)


def conformal_pvalues(
    scores: NDArray[np.floating], calibration: NDArray[np.floating], ties: NDArray[np.floating] | None = None
) -> Array:
    """p(x) = (1 + #{c : c >= s(x)}) / (n_cal + 1) for each score (larger: more atypical).

    ``ties``: one uniform number u in [0, 1) per score: the randomised p-value
    (#{c : c > s(x)} + u (1 + #{c : c = s(x)})) / (n_cal + 1), which is uniform for an
    exchangeable point instead of above it.  Where scores take few values (categorical inputs)
    the first counts every tie against the point, and it can never go below 1 / (n_cal + 1): a
    site with fewer than 1 / alpha - 1 reference rows could never flag at level alpha."""
    cal: Array = np.sort(np.asarray(calibration, dtype=np.float64))
    if cal.ndim != 1 or cal.size == 0:
        raise ValueError("calibration must be a non-empty 1-D array of scores")
    s = np.asarray(scores, dtype=np.float64)
    at_least = (cal.size - np.searchsorted(cal, s, side="left")).astype(np.float64)
    if ties is None:
        out: Array = (1.0 + at_least) / (cal.size + 1.0)
        return out
    u = np.asarray(ties, dtype=np.float64)
    if u.shape != s.shape:
        raise ValueError(f"ties must have the scores' shape {s.shape}; got {u.shape}")
    above = (cal.size - np.searchsorted(cal, s, side="right")).astype(np.float64)
    out = (above + u * (1.0 + at_least - above)) / (cal.size + 1.0)
    return out


def combine_pvalues(P: NDArray[np.floating]) -> Array:
    """The point's p-value (n,) from the per-site ones (n, p): max_k p_k(x), over the sites whose
    column is not NaN (NaN: the site carries no reference; a row of NaN stays NaN)."""
    P = np.asarray(P, dtype=np.float64)
    ok = ~np.isnan(P)
    out: Array = np.where(ok.any(axis=1), np.max(np.where(ok, P, -np.inf), axis=1), np.nan)
    return out


# ------------------------------------------------------------------ categorical support
#: the pseudo-count of the Good-Turing estimate of a column's unseen mass in :func:`category_score`
CATEGORY_SMOOTHING = 0.5

#: per column of a reference: its distinct values (sorted), their counts, and how many occur once
CategoryTable = tuple[Array, Array, int]


def category_tables(reference: NDArray[np.floating]) -> list[CategoryTable]:
    """Per column of ``reference`` (m, d): its distinct values (sorted), their counts and the
    number of values seen exactly once."""
    R = np.asarray(reference, dtype=np.float64)
    if R.ndim != 2 or R.shape[0] == 0:
        raise ValueError(f"reference must be a non-empty 2-D array; got shape {R.shape}")
    out = []
    for j in range(R.shape[1]):
        values, counts = np.unique(R[:, j], return_counts=True)
        out.append((values.astype(np.float64), counts.astype(np.float64), int(np.sum(counts == 1))))
    return out


def _rarity(count: Array, m: int, once: NDArray[np.integer] | int, a: float) -> Array:
    """-log of a value's probability in a column of m rows: count / m times the seen mass where
    the value was seen (count > 0), else the Good-Turing unseen mass (once + a) / (m + 2a)."""
    unseen = (np.asarray(once, dtype=np.float64) + a) / (m + 2.0 * a)
    seen = np.maximum(count, 1.0) / m * (1.0 - unseen)
    out: Array = -np.log(np.where(count > 0, seen, unseen))
    return out


def category_score(
    X: NDArray[np.floating], tables: list[CategoryTable], m: int, a: float = CATEGORY_SMOOTHING
) -> Array:
    """Score (n,) of categorical rows against a site's reference of ``m`` rows (larger: more
    atypical): the rarity of the row's rarest value, max_j -log P_j(x_j), with P_j(v) the
    frequency of v in column j of the reference and, for a value the reference does not have,
    the column's Good-Turing unseen mass (values seen once + a) / (m + 2a).

    It takes the place of the nearest-neighbour distance on categorical inputs, where distances
    take few values and a value unseen in the one-hot map (all zeros) sits closer to every row
    than a seen, different one.  A value missing from a column where every value recurs (a site
    whose rows all share one education) is as rare as a value can be; one missing from a
    long-tailed column (countries) much less so."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != len(tables):
        raise ValueError(f"X must have shape (n, {len(tables)}); got {X.shape}")
    s = np.full(X.shape[0], -np.inf)
    for j, (values, counts, once) in enumerate(tables):
        pos = np.clip(np.searchsorted(values, X[:, j]), 0, max(values.size - 1, 0))
        count = np.where(values[pos] == X[:, j], counts[pos], 0.0)
        s = np.maximum(s, _rarity(count, m, once, a))
    return s


def category_rarities(
    reference: NDArray[np.floating], a: float = CATEGORY_SMOOTHING
) -> tuple[Array, NDArray[np.int64], Array, Array]:
    """The tables of :func:`category_score` flattened: every column's distinct values (in column
    order), their column, their rarity -log P_j(v), and each column's unseen rarity (d,)."""
    R = np.asarray(reference, dtype=np.float64)
    m = R.shape[0]
    values, cols, seen, unseen = [], [], [], []
    for j, (v, counts, once) in enumerate(category_tables(R)):
        values.append(v)
        cols.append(np.full(v.size, j, dtype=np.int64))
        seen.append(_rarity(counts, m, once, a))
        unseen.append(float(_rarity(np.zeros(1), m, once, a)[0]))
    return np.concatenate(values), np.concatenate(cols), np.concatenate(seen), np.array(unseen)


def leave_one_out_category_score(reference: NDArray[np.floating], a: float = CATEGORY_SMOOTHING) -> Array:
    """Each reference row's :func:`category_score` against the m - 1 OTHER rows (its own count
    taken off, the columns' once-seen counts as they are without it): the calibration scores."""
    R = np.asarray(reference, dtype=np.float64)
    m = R.shape[0]
    if m < 2:
        raise ValueError(f"the reference needs at least 2 rows; got {m}")
    s = np.full(m, -np.inf)
    for j in range(R.shape[1]):
        _, inverse, counts = np.unique(R[:, j], return_inverse=True, return_counts=True)
        own = counts[inverse.reshape(-1)].astype(np.float64)
        # without the row: its value's count drops by one, so a pair becomes a single (+1) and a
        # single disappears (-1) from the column's once-seen count
        once = int(np.sum(counts == 1)) + (own == 2).astype(np.int64) - (own == 1).astype(np.int64)
        s = np.maximum(s, _rarity(own - 1.0, m - 1, once, a))
    return s
