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


def conformal_pvalues(scores: NDArray[np.floating], calibration: NDArray[np.floating]) -> Array:
    """p(x) = (1 + #{c : c >= s(x)}) / (n_cal + 1) for each score (larger: more atypical)."""
    cal: Array = np.sort(np.asarray(calibration, dtype=np.float64))
    if cal.ndim != 1 or cal.size == 0:
        raise ValueError("calibration must be a non-empty 1-D array of scores")
    s = np.asarray(scores, dtype=np.float64)
    at_least = cal.size - np.searchsorted(cal, s, side="left")
    out: Array = (1.0 + at_least.astype(np.float64)) / (cal.size + 1.0)
    return out


def combine_pvalues(P: NDArray[np.floating]) -> Array:
    """The point's p-value (n,) from the per-site ones (n, p): max_k p_k(x), over the sites whose
    column is not NaN (NaN: the site carries no reference; a row of NaN stays NaN)."""
    P = np.asarray(P, dtype=np.float64)
    ok = ~np.isnan(P)
    out: Array = np.where(ok.any(axis=1), np.max(np.where(ok, P, -np.inf), axis=1), np.nan)
    return out
