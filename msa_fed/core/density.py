"""The GMSA baseline's density estimates: one Gaussian ``KernelDensity`` per domain.

The bandwidth of each domain is chosen by 5-fold cross-validation of the held-out
log-likelihood over a logarithmic grid scaled to the data.  GMSA's combination
sum_k z_k D_k(x) h_k / sum_j z_j D_j(x) only depends on the posterior
Q_gen(k | x) = D_k(x) / sum_j D_j(x), so this model exposes the same ``predict_log_proba``
as the Maxent classifier and the rest of the pipeline (weights, DC solver, combination) is
shared: GMSA is DMSA with the generative posterior in place of the discriminative one.
"""
from __future__ import annotations

import numpy as np
from scipy.special import logsumexp
from sklearn.model_selection import GridSearchCV, KFold
from sklearn.neighbors import KernelDensity


def select_bandwidth(X: np.ndarray, n_grid: int = 20, cv: int = 5, random_state=0) -> float:
    """Bandwidth maximising the 5-fold held-out log-likelihood of a Gaussian KDE."""
    X = np.asarray(X, dtype=np.float64)
    scale = float(np.mean(np.std(X, axis=0)))
    if not scale > 0:
        scale = 1.0
    grid = scale * np.logspace(-3.0, 0.5, n_grid)
    folds = min(cv, X.shape[0])
    if folds < 2:
        raise ValueError(f"bandwidth selection needs at least 2 points; got {X.shape[0]}")
    search = GridSearchCV(KernelDensity(kernel="gaussian"), {"bandwidth": grid},
                          cv=KFold(folds, shuffle=True, random_state=random_state), n_jobs=1)
    search.fit(X)
    return float(search.best_params_["bandwidth"])


class KDEDomainModel:
    """Per-domain Gaussian KDEs; ``predict_log_proba`` gives log D_k(x) - log sum_j D_j(x)."""

    def __init__(self, bandwidth=None, feature_map=None, random_state=0):
        self.bandwidth = bandwidth
        self.feature_map = feature_map
        self.random_state = random_state

    def fit(self, X_per_domain):
        if self.feature_map is not None:
            pooled = np.vstack(X_per_domain)
            self.feature_map.fit(pooled)
            X_per_domain = [self.feature_map.transform(X) for X in X_per_domain]
        self.n_sources = len(X_per_domain)
        if self.bandwidth is None:
            self.bandwidths_ = np.array([select_bandwidth(X, random_state=self.random_state)
                                         for X in X_per_domain])
        else:
            bw = np.broadcast_to(np.asarray(self.bandwidth, dtype=np.float64), (self.n_sources,))
            if np.any(bw <= 0):
                raise ValueError(f"bandwidth must be > 0; got {self.bandwidth!r}")
            self.bandwidths_ = bw.copy()
        self.samples_ = [np.asarray(X, dtype=np.float64) for X in X_per_domain]
        self._build()
        return self

    def _build(self):
        self.kdes_ = [KernelDensity(kernel="gaussian", bandwidth=float(h)).fit(X)
                      for X, h in zip(self.samples_, self.bandwidths_)]

    def log_density(self, X) -> np.ndarray:
        """log D_k(x), ndarray (n, p)."""
        if self.feature_map is not None:
            X = self.feature_map.transform(X)
        X = np.asarray(X, dtype=np.float64)
        return np.column_stack([kde.score_samples(X) for kde in self.kdes_])

    def predict_log_proba(self, X) -> np.ndarray:
        logd = self.log_density(X)
        return logd - logsumexp(logd, axis=1, keepdims=True)

    def predict_proba(self, X) -> np.ndarray:
        return np.exp(self.predict_log_proba(X))

    @classmethod
    def from_state(cls, bandwidths, samples, feature_map=None):
        obj = cls(bandwidth=None, feature_map=feature_map)
        obj.n_sources = len(samples)
        obj.bandwidths_ = np.asarray(bandwidths, dtype=np.float64)
        obj.samples_ = [np.asarray(s, dtype=np.float64) for s in samples]
        obj._build()
        return obj
