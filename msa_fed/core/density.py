"""The GMSA baseline's density estimates: one Gaussian kernel density estimate per domain.

The bandwidth of each domain is chosen by 5-fold cross-validation of the held-out
log-likelihood over a logarithmic grid scaled to the data.  GMSA's combination
sum_k z_k D_k(x) h_k / sum_j z_j D_j(x) only depends on the posterior
Q_gen(k | x) = D_k(x) / sum_j D_j(x), so this model exposes the same ``predict_log_proba``
as the Maxent classifier and the rest of the pipeline (weights, DC solver, combination) is
shared: GMSA is DMSA with the generative posterior in place of the discriminative one.

The densities are exact Gaussian KDEs, computed by brute force with BLAS: the squared
distances between query and sample points do not depend on the bandwidth, so one distance
block serves every bandwidth of the cross-validation grid.  scikit-learn's tree-based
``KernelDensity``, used before, rebuilds and queries a tree per bandwidth and fold, which in
high dimension is slow (one sentiment GMSA fit, 2192-d, took ~560 s), and its log-space
bounds can be far off in the tails at small bandwidths; the tests compare this module with
the KDE's definition term by term and with scikit-learn's bandwidth choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from msa_fed.core.numeric import logsumexp

#: query rows per distance block (a block is rows x sample size doubles)
_BLOCK_BYTES = 32 * 1024 * 1024


def _sq_norms(A: np.ndarray) -> np.ndarray:
    norms: np.ndarray = np.einsum("ij,ij->i", A, A)
    return norms


def gaussian_kde_log_density(X_query: ArrayLike, X_sample: ArrayLike, bandwidths: ArrayLike) -> np.ndarray:
    """log of the Gaussian KDE of ``X_sample`` at each query point, for each bandwidth.

    Returns (n_query, n_bandwidths): log( (1/n) sum_j N(x; x_j, h^2 I) ), computed in log space
    (no underflow far from the sample).  Points are centred on the sample mean first, which
    keeps the cancellation in |a|^2 + |b|^2 - 2 a.b small.
    """
    B = np.asarray(X_sample, dtype=np.float64)
    A = np.asarray(X_query, dtype=np.float64)
    h = np.atleast_1d(np.asarray(bandwidths, dtype=np.float64))
    n, d = B.shape
    if n == 0:
        raise ValueError("a KDE needs at least one sample point")
    if A.ndim != 2 or A.shape[1] != d:
        raise ValueError(f"query points have shape {A.shape}; expected (n, {d})")
    center = B.mean(axis=0)
    B = B - center
    B_sq = _sq_norms(B)
    out = np.empty((A.shape[0], h.size))
    rows = max(1, _BLOCK_BYTES // (8 * n))
    for start in range(0, A.shape[0], rows):
        Q = A[start : start + rows] - center
        D = _sq_norms(Q)[:, None] + B_sq[None, :]
        D -= 2.0 * (Q @ B.T)
        np.maximum(D, 0.0, out=D)
        for i, hh in enumerate(h):
            out[start : start + rows, i] = logsumexp(D * (-0.5 / (hh * hh)), axis=1)
    out += -np.log(n) - 0.5 * d * np.log(2.0 * np.pi * h * h)[None, :]
    return out


def select_bandwidth(X: ArrayLike, n_grid: int = 20, cv: int = 5, random_state: int | None = 0) -> float:
    """Bandwidth maximising the 5-fold held-out log-likelihood of a Gaussian KDE.

    The grid is logarithmic, scaled to the data's mean standard deviation; the folds are
    ``KFold(shuffle=True, random_state)``; the score of a bandwidth is the mean over folds of
    the held-out total log-likelihood, and the first best grid point wins (as scikit-learn's
    ``GridSearchCV`` over ``KernelDensity`` would choose).
    """
    from sklearn.model_selection import KFold  # fitting a KDE only (the coordinator's side)

    X = np.asarray(X, dtype=np.float64)
    scale = float(np.mean(np.std(X, axis=0)))
    if not scale > 0:
        scale = 1.0
    grid = scale * np.logspace(-3.0, 0.5, n_grid)
    folds = min(cv, X.shape[0])
    if folds < 2:
        raise ValueError(f"bandwidth selection needs at least 2 points; got {X.shape[0]}")
    scores = np.zeros(grid.size)
    for train, test in KFold(folds, shuffle=True, random_state=random_state).split(X):
        scores += gaussian_kde_log_density(X[test], X[train], grid).sum(axis=0)
    return float(grid[int(np.argmax(scores / folds))])


class KDEDomainModel:
    """Per-domain Gaussian KDEs; ``predict_log_proba`` gives log D_k(x) - log sum_j D_j(x)."""

    #: the name of this kind of domain model in saved models and messages (core.domain_models)
    kind = "kde"
    n_sources: int
    bandwidths_: np.ndarray
    samples_: list[np.ndarray]

    def __init__(
        self, bandwidth: ArrayLike | None = None, feature_map: Any = None, random_state: int | None = 0
    ) -> None:
        self.bandwidth = bandwidth
        self.feature_map = feature_map
        self.random_state = random_state

    def fit(self, X_per_domain: Sequence[ArrayLike]) -> KDEDomainModel:
        if self.feature_map is not None:
            self.feature_map.fit(np.vstack(X_per_domain))
            X_per_domain = [self.feature_map.transform(X) for X in X_per_domain]
        self.n_sources = len(X_per_domain)
        if self.bandwidth is None:
            self.bandwidths_ = np.array([select_bandwidth(X, random_state=self.random_state) for X in X_per_domain])
        else:
            bw = np.broadcast_to(np.asarray(self.bandwidth, dtype=np.float64), (self.n_sources,))
            if np.any(bw <= 0):
                raise ValueError(f"bandwidth must be > 0; got {self.bandwidth!r}")
            self.bandwidths_ = bw.copy()
        self.samples_ = [np.asarray(X, dtype=np.float64) for X in X_per_domain]
        self._build()
        return self

    def _build(self) -> None:
        for X in self.samples_:
            if X.ndim != 2 or X.shape[0] == 0:
                raise ValueError(f"each domain's KDE sample must be a non-empty (n, d) array; got {X.shape}")

    def log_density(self, X: ArrayLike) -> np.ndarray:
        """log D_k(x), ndarray (n, p)."""
        if self.feature_map is not None:
            X = self.feature_map.transform(X)
        X = np.asarray(X, dtype=np.float64)
        return np.column_stack(
            [gaussian_kde_log_density(X, S, h)[:, 0] for S, h in zip(self.samples_, self.bandwidths_)]
        )

    def predict_log_proba(self, X: ArrayLike) -> np.ndarray:
        logd = self.log_density(X)
        log_post: np.ndarray = logd - logsumexp(logd, axis=1, keepdims=True)
        return log_post

    def predict_proba(self, X: ArrayLike) -> np.ndarray:
        proba: np.ndarray = np.exp(self.predict_log_proba(X))
        return proba

    def get_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(params, arrays) without the feature map (saved beside it); see :meth:`from_state`."""
        arrays: dict[str, Any] = {"bandwidths": self.bandwidths_}
        arrays.update({f"kde_sample.{k}": s for k, s in enumerate(self.samples_)})
        return {}, arrays

    @classmethod
    def from_state(
        cls, params: dict[str, Any], arrays: dict[str, Any], feature_map: Any, n_sources: int
    ) -> KDEDomainModel:
        missing = [key for key in ["bandwidths"] + [f"kde_sample.{k}" for k in range(n_sources)] if key not in arrays]
        if missing:
            raise ValueError(f"KDE domain model state lacks arrays {missing}")
        obj = cls(bandwidth=None, feature_map=feature_map)
        obj.n_sources = n_sources
        obj.bandwidths_ = np.asarray(arrays["bandwidths"], dtype=np.float64)
        obj.samples_ = [np.asarray(arrays[f"kde_sample.{k}"], dtype=np.float64) for k in range(n_sources)]
        obj._build()
        return obj
