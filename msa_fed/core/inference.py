"""A stored domain model evaluated with numpy alone: what loading a model for prediction needs.

Training builds the feature maps of :mod:`msa_fed.core.features` (scikit-learn transformers) and
the Maxent classifier of :mod:`msa_fed.core.domain_classifier` (trained in torch).  A saved
model only needs their arithmetic, so :func:`msa_fed.load_model` builds the objects of this
module instead, from the same state (``name, params, arrays``): no scikit-learn, torch or scipy
is imported to load a model and predict with it.  Every formula here is the one of the training
classes, operation for operation (the tests compare them bit for bit), and each object writes
back the state it was read from (a loaded model saves as it was loaded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

FEATURE_MAP_NAMES = ("standard", "onehot", "threshold", "rff")


class StoredFeatureMap:
    """A fitted built-in feature map read from its state: ``transform`` and ``get_state`` only.

    name : one of :data:`FEATURE_MAP_NAMES`; params and arrays as written by
    :func:`msa_fed.core.features.feature_map_state`.
    """

    def __init__(self, name: str, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        if name not in FEATURE_MAP_NAMES:
            raise ValueError(f"unknown feature map {name!r} in saved model")
        self.name = name
        self.params = dict(params)
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        a = self.arrays
        if name in ("standard", "rff"):
            self.mean_ = np.asarray(a["mean"], dtype=np.float64)
            self.scale_ = np.asarray(a["scale"], dtype=np.float64)
            self.n_features_in_ = self.mean_.size
        if name == "rff":
            self.weights_ = np.asarray(a["weights"], dtype=np.float64)
            self.offset_ = np.asarray(a["offset"], dtype=np.float64)
            self.n_components = int(params["n_components"])
            if self.weights_.shape != (self.n_features_in_, self.n_components) or self.offset_.shape != (
                self.n_components,
            ):
                raise ValueError(
                    f"rff state: weights {self.weights_.shape} and offset {self.offset_.shape} do not match "
                    f"{self.n_features_in_} inputs and {self.n_components} components"
                )
        elif name == "onehot":
            sizes = np.asarray(a["sizes"], dtype=np.int64)
            values = np.asarray(a["values"], dtype=np.float64)
            if sizes.ndim != 1 or np.any(sizes < 0) or int(sizes.sum()) != values.size:
                raise ValueError("onehot state: sizes do not add up to the number of values")
            bounds = np.cumsum(np.concatenate([[0], sizes]))
            self.categories_ = [values[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
            self.n_features_in_ = sizes.size
        elif name == "threshold":
            self.thresholds_ = np.asarray(a["thresholds"], dtype=np.float64).reshape(-1)
            self.n_features_in_ = 1
        if name == "standard" and self.scale_.shape != self.mean_.shape:
            raise ValueError("standard state: mean and scale differ in shape")

    def __repr__(self) -> str:
        return f"StoredFeatureMap({self.name!r}, n_features={self.n_features_in_})"

    def transform(self, X: Any) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if self.name == "standard":
            Z: np.ndarray = (X - self.mean_) / self.scale_
            return Z
        if self.name == "onehot":
            blocks = [(X[:, [j]] == cats[None, :]).astype(np.float64) for j, cats in enumerate(self.categories_)]
            onehot: np.ndarray = np.hstack(blocks)
            return onehot
        if self.name == "threshold":
            below: np.ndarray = (X[:, [0]] <= self.thresholds_[None, :]).astype(np.float64)
            return below
        Z = ((X - self.mean_) / self.scale_) @ self.weights_ + self.offset_
        features: np.ndarray = np.sqrt(2.0 / self.n_components) * np.cos(Z)
        return features

    def get_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return dict(self.params), dict(self.arrays)


class SoftmaxScores:
    """log Q(k | x) and Q(k | x) from ``decision_function`` (a stable log-softmax): the one formula
    of the trained classifier and of the stored one."""

    def decision_function(self, X: Any) -> np.ndarray:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def predict_log_proba(self, X: Any) -> np.ndarray:
        """log Q(k | x), ndarray (n, p)."""
        z = self.decision_function(X)
        z = z - z.max(axis=1, keepdims=True)
        log_q: np.ndarray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return log_q

    def predict_proba(self, X: Any) -> np.ndarray:
        q: np.ndarray = np.exp(self.predict_log_proba(X))
        return q


class StoredMaxent(SoftmaxScores):
    """Q(k | x) = softmax(W Phi(x) + b)_k of a trained Maxent domain classifier, read from its
    state; the same attributes and predictions as :class:`msa_fed.core.domain_classifier.DomainClassifier`."""

    kind = "maxent"

    def __init__(self, feature_map: Any, theta: np.ndarray, n_sources: int, mu: float) -> None:
        self.feature_map = feature_map
        self.n_sources = int(n_sources)
        self.theta_ = np.asarray(theta, dtype=np.float64).reshape(-1)
        if self.n_sources < 1 or self.theta_.size % self.n_sources or self.theta_.size // self.n_sources < 1:
            raise ValueError(f"theta of {self.theta_.size} values does not fit {self.n_sources} sources")
        self.n_features_ = self.theta_.size // self.n_sources - 1
        self.mu = mu
        Wb = self.theta_.reshape(self.n_sources, self.n_features_ + 1)
        self.coef_, self.intercept_ = Wb[:, : self.n_features_], Wb[:, self.n_features_]

    def decision_function(self, X: Any) -> np.ndarray:
        Phi = X if self.feature_map is None else self.feature_map.transform(X)
        scores: np.ndarray = Phi @ self.coef_.T + self.intercept_
        return scores

    def get_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"mu": self.mu}, {"theta": self.theta_}


def stored_domain_model(
    kind: str, params: dict[str, Any], arrays: dict[str, Any], feature_map: Any, n_sources: int
) -> Any:
    """The domain model of a saved model: :class:`StoredMaxent` for ``maxent``; the KDE model of
    :mod:`msa_fed.core.density` otherwise (it is evaluated by its own numpy code)."""
    if kind == "maxent":
        return StoredMaxent(feature_map, arrays["theta"], n_sources, params.get("mu", 0.0))
    from msa_fed.core.domain_models import domain_model_from_state

    return domain_model_from_state(kind, params, arrays, feature_map, n_sources)
