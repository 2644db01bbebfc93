"""The distribution-weighted combination and the empirical weights (DESIGN.md section 2).

With Q(k | x) from a domain model (Maxent classifier, or the KDE posterior for GMSA),
Qhat(k) = sum_i pi_i Q(k | x_i) and q_k(x) = Q(k | x) / Qhat(k):

    g(x) = sum_k (z_k q_k(x) + eta / p) h_k(x) / (sum_k z_k q_k(x) + eta)

for the regression model (h_k(x) a number) and the probability model (h_k(x) a vector of class
probabilities; g(x) is then a probability vector).  Combination weights are computed in log
space, so no underflow of Q(k | x) can give 0 / 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike

from msa_fed.core.dc_terms import PROB_FLOOR, PointSet
from msa_fed.core.numeric import logsumexp


def class_union(class_lists: Iterable[ArrayLike]) -> np.ndarray:
    """The sorted union of the predictors' classes (the columns of every probability output)."""
    union: np.ndarray = np.unique(np.concatenate([np.asarray(c).reshape(-1) for c in class_lists]))
    return union


def qhat_partial(Q: np.ndarray, n_sources: int) -> np.ndarray:
    """One site's share of Qhat(k): sum over its n_s points of pi_i Q(k | x_i), pi_i = 1/(p n_s).

    Q : ndarray (n_s, p).  Returns ndarray (p,); the sites' shares add up to Qhat.
    """
    Q = np.asarray(Q, dtype=np.float64)
    share: np.ndarray = Q.sum(axis=0) / (n_sources * Q.shape[0])
    return share


def site_point_set(Q: np.ndarray, qhat: np.ndarray, H: np.ndarray, loss: str, y: np.ndarray | None = None) -> PointSet:
    """The DC point set of one site: pi_i = 1/(p n_s), w_k(i) = pi_i Q(k|x_i) / Qhat(k)."""
    Q = np.asarray(Q, dtype=np.float64)
    n, p = Q.shape
    pi = np.full(n, 1.0 / (p * n))
    w = np.empty((n, p), order="F")  # column-major, as PointSet keeps it (no copy there)
    np.multiply(pi[:, None], Q, out=w)
    w /= np.asarray(qhat, dtype=np.float64)[None, :]
    return PointSet(w=w, pi=pi, H=H, y=y, loss=loss)


def combination_weights(log_Q: np.ndarray, log_qhat: np.ndarray, z: np.ndarray, eta: float) -> np.ndarray:
    """a_k(x) = (z_k q_k(x) + eta/p) / (sum_j z_j q_j(x) + eta); ndarray (n, p), rows sum to 1.

    log_Q : (n, p) log Q(k | x);  log_qhat : (p,) log Qhat(k).
    """
    log_Q = np.asarray(log_Q, dtype=np.float64)
    n, p = log_Q.shape
    z = np.asarray(z, dtype=np.float64)
    with np.errstate(divide="ignore"):
        log_zq = np.log(z)[None, :] + log_Q - np.asarray(log_qhat)[None, :]  # log z_k q_k(x)
    if eta > 0:
        log_num = np.logaddexp(log_zq, np.log(eta / p))
        log_den = np.logaddexp(logsumexp(log_zq, axis=1), np.log(eta))
    else:
        log_num = log_zq
        log_den = logsumexp(log_zq, axis=1)
    weights: np.ndarray = np.exp(log_num - log_den[:, None])
    return weights


def combine_regression(weights: np.ndarray, H: np.ndarray) -> np.ndarray:
    """g(x) = sum_k a_k(x) h_k(x).  weights, H : (n, p) -> (n,)."""
    g: np.ndarray = np.einsum("nk,nk->n", weights, H)
    return g


def combine_proba(weights: np.ndarray, P: np.ndarray) -> np.ndarray:
    """g(x, .) = sum_k a_k(x) h_k(x, .).  weights (n, p), P (n, p, c) -> (n, c).

    Each h_k(x, y) is floored at :data:`msa_fed.core.dc_terms.PROB_FLOOR` first, as the losses
    and the solver floor it (so the model's own log-loss is the loss the solver minimised), and
    the rows are renormalised (the floor adds at most c * PROB_FLOOR to a row).
    """
    g: np.ndarray = np.einsum("nk,nkc->nc", weights, np.maximum(P, PROB_FLOOR))
    out: np.ndarray = g / g.sum(axis=1, keepdims=True)
    return out


def paper_z(z: np.ndarray, qhat: np.ndarray) -> np.ndarray:
    """Proposition 1: z'_k = (z_k / Qhat(k)) / sum_j z_j / Qhat(j), the weight of the paper's
    g_{z'}(x) = sum_k z'_k Q(k|x) h_k / sum_j z'_j Q(j|x), equal to g above with eta = 0."""
    r = np.asarray(z, dtype=np.float64) / np.asarray(qhat, dtype=np.float64)
    z_paper: np.ndarray = r / r.sum()
    return z_paper
