"""Feature maps Phi for the domain classifier, as scikit-learn-style transformers.

Each map is a small estimator in scikit-learn's conventions (``fit`` / ``transform``;
``get_params`` / ``set_params``, so ``sklearn.base.clone`` copies it; learned state ends in
``_``) that can also be written as plain arrays and JSON (``get_state`` / ``from_state``) so
that a saved model never needs pickle.  The module is numpy only: a site re-derives and applies
these maps without scikit-learn installed.

- ``standard``  : standardised identity, (x - mean) / std
- ``onehot``    : one-hot encoding of categorical columns (unknown categories map to zeros)
- ``threshold`` : for 1-D inputs, indicators 1[x <= t_j] at quantile thresholds t_j
- ``rff``       : random Fourier features of the standardised input, approximating a
                  Gaussian-kernel RKHS (Rahimi and Recht)
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

#: (params, arrays) of a fitted map: JSON-able parameters and named arrays
State = tuple[dict[str, Any], dict[str, np.ndarray]]


class NotFittedError(ValueError, AttributeError):
    """A map's ``transform`` was called before ``fit`` (both a ValueError and an AttributeError, as
    scikit-learn's exception of that name)."""


def check_is_fitted(fmap: object, attribute: str) -> None:
    if not hasattr(fmap, attribute):
        raise NotFittedError(f"this {type(fmap).__name__} is not fitted yet; call 'fit' first")


class FeatureMap:
    """A feature map that is written as plain parameters and arrays, never pickled.

    scikit-learn's estimator protocol without scikit-learn: the parameters are the keyword
    arguments of ``__init__``, stored as attributes of the same names."""

    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return sorted(
            name
            for name, p in signature.parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> FeatureMap:
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"invalid parameter {name!r} for {type(self).__name__}; valid: {valid}")
            setattr(self, name, value)
        return self

    def fit_transform(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> np.ndarray:
        return self.fit(X, y, sample_weight=sample_weight).transform(X)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    def fit(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> FeatureMap:
        raise NotImplementedError

    def transform(self, X: ArrayLike) -> np.ndarray:
        raise NotImplementedError

    def get_state(self) -> State:
        raise NotImplementedError

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> FeatureMap:
        raise NotImplementedError


class StandardFeatures(FeatureMap):
    """(x - mean_) / scale_ with a floor on the scale of constant columns."""

    mean_: np.ndarray
    scale_: np.ndarray

    def fit(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> StandardFeatures:
        X = np.asarray(X, dtype=np.float64)
        w = None if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        self.mean_ = np.average(X, axis=0, weights=w)
        var = np.average((X - self.mean_) ** 2, axis=0, weights=w)
        scale = np.sqrt(var)
        self.scale_ = np.where(scale > 1e-12, scale, 1.0)
        self.n_features_in_ = X.shape[1]
        return self

    def transform(self, X: ArrayLike) -> np.ndarray:
        check_is_fitted(self, "mean_")
        Z: np.ndarray = (np.asarray(X, dtype=np.float64) - self.mean_) / self.scale_
        return Z

    def get_state(self) -> State:
        return {}, {"mean": self.mean_, "scale": self.scale_}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> StandardFeatures:
        obj = cls()
        obj.mean_, obj.scale_ = arrays["mean"], arrays["scale"]
        obj.n_features_in_ = obj.mean_.size
        return obj


class OneHotFeatures(FeatureMap):
    """One-hot encoding of every column (values are compared exactly; unseen values give zeros)."""

    categories_: list[np.ndarray]

    def __init__(self, max_categories: int = 256) -> None:
        self.max_categories = max_categories

    def fit(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> OneHotFeatures:
        X = np.asarray(X, dtype=np.float64)
        self.categories_ = []
        for j in range(X.shape[1]):
            cats = np.unique(X[:, j])
            if cats.size > self.max_categories:
                raise ValueError(
                    f"onehot features: column {j} has {cats.size} distinct values, more than "
                    f"max_categories={self.max_categories}; is it really categorical?"
                )
            self.categories_.append(cats)
        self.n_features_in_ = X.shape[1]
        return self

    def transform(self, X: ArrayLike) -> np.ndarray:
        check_is_fitted(self, "categories_")
        X = np.asarray(X, dtype=np.float64)
        blocks = [(X[:, [j]] == cats[None, :]).astype(np.float64) for j, cats in enumerate(self.categories_)]
        return np.hstack(blocks)

    def get_state(self) -> State:
        sizes = np.array([c.size for c in self.categories_], dtype=np.int64)
        return {"max_categories": self.max_categories}, {"sizes": sizes, "values": np.concatenate(self.categories_)}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> OneHotFeatures:
        obj = cls(max_categories=params["max_categories"])
        bounds = np.cumsum(np.concatenate([[0], arrays["sizes"]]))
        obj.categories_ = [arrays["values"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        obj.n_features_in_ = len(obj.categories_)
        return obj


class ThresholdFeatures(FeatureMap):
    """For 1-D x: the indicators 1[x <= t_j] at ``n_thresholds`` quantiles of the sample.

    A linear model on these features is a weighted sum of threshold functions, so conditional
    Maxent on them can select thresholds between domains (the paper's synthetic experiment).
    """

    thresholds_: np.ndarray

    def __init__(self, n_thresholds: int = 200) -> None:
        self.n_thresholds = n_thresholds

    def fit(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> ThresholdFeatures:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != 1:
            raise ValueError(f"threshold features need 1-D inputs (shape (n, 1)); got shape {X.shape}")
        qs = np.linspace(0.0, 1.0, self.n_thresholds + 2)[1:-1]
        self.thresholds_ = np.unique(np.quantile(X[:, 0], qs))
        self.n_features_in_ = 1
        return self

    def transform(self, X: ArrayLike) -> np.ndarray:
        check_is_fitted(self, "thresholds_")
        X = np.asarray(X, dtype=np.float64)
        return (X[:, [0]] <= self.thresholds_[None, :]).astype(np.float64)

    def get_state(self) -> State:
        return {"n_thresholds": self.n_thresholds}, {"thresholds": self.thresholds_}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> ThresholdFeatures:
        obj = cls(n_thresholds=params["n_thresholds"])
        obj.thresholds_ = arrays["thresholds"]
        obj.n_features_in_ = 1
        return obj


class RandomFourierFeatures(FeatureMap):
    """sqrt(2/D) cos(W x_std + b), W ~ N(0, 2 gamma I), b ~ U[0, 2 pi], on standardised x.

    gamma=None uses 1 / n_features (the median-heuristic scale for standardised data).
    """

    standard_: StandardFeatures
    weights_: np.ndarray
    offset_: np.ndarray

    def __init__(
        self, n_components: int = 500, gamma: float | None = None, random_state: int | np.random.Generator | None = 0
    ) -> None:
        self.n_components = n_components
        self.gamma = gamma
        self.random_state = random_state

    def fit(self, X: ArrayLike, y: object = None, sample_weight: ArrayLike | None = None) -> RandomFourierFeatures:
        X = np.asarray(X, dtype=np.float64)
        self.standard_ = StandardFeatures().fit(X, sample_weight=sample_weight)
        d = X.shape[1]
        gamma = 1.0 / d if self.gamma is None else float(self.gamma)
        rng = np.random.default_rng(self.random_state)
        self.weights_ = rng.normal(scale=np.sqrt(2.0 * gamma), size=(d, self.n_components))
        self.offset_ = rng.uniform(0.0, 2.0 * np.pi, size=self.n_components)
        self.n_features_in_ = d
        return self

    def transform(self, X: ArrayLike) -> np.ndarray:
        check_is_fitted(self, "weights_")
        Z = self.standard_.transform(X) @ self.weights_ + self.offset_
        features: np.ndarray = np.sqrt(2.0 / self.n_components) * np.cos(Z)
        return features

    def get_state(self) -> State:
        # the seed is declared (an int; None for a Generator or no seed) so that anyone with the
        # same samples can derive the same map
        seed = (
            self.random_state
            if isinstance(self.random_state, int) and not isinstance(self.random_state, bool)
            else None
        )
        return (
            {"n_components": self.n_components, "gamma": self.gamma, "random_state": seed},
            {
                "mean": self.standard_.mean_,
                "scale": self.standard_.scale_,
                "weights": self.weights_,
                "offset": self.offset_,
            },
        )

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> RandomFourierFeatures:
        obj = cls(n_components=params["n_components"], gamma=params["gamma"], random_state=params.get("random_state"))
        obj.standard_ = StandardFeatures.from_state({}, arrays)
        obj.weights_, obj.offset_ = arrays["weights"], arrays["offset"]
        obj.n_features_in_ = obj.weights_.shape[0]
        return obj


FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "standard": StandardFeatures,
    "onehot": OneHotFeatures,
    "threshold": ThresholdFeatures,
    "rff": RandomFourierFeatures,
}


def make_feature_map(spec: Any, random_state: int | np.random.Generator | None = 0) -> Any:
    """A fresh, unfitted feature map from a name, a (name, kwargs) pair or a transformer object."""
    if isinstance(spec, str):
        if spec not in FEATURE_MAPS:
            raise ValueError(f"features must be one of {sorted(FEATURE_MAPS)} or a transformer; got {spec!r}")
        cls = FEATURE_MAPS[spec]
        return RandomFourierFeatures(random_state=random_state) if cls is RandomFourierFeatures else cls()
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        name, kwargs = spec
        if name not in FEATURE_MAPS:
            raise ValueError(f"features must be one of {sorted(FEATURE_MAPS)}; got {name!r}")
        kwargs = dict(kwargs)
        if FEATURE_MAPS[name] is RandomFourierFeatures:
            kwargs.setdefault("random_state", random_state)
        return FEATURE_MAPS[name](**kwargs)
    if hasattr(spec, "fit") and hasattr(spec, "transform"):
        from sklearn.base import clone

        try:
            return clone(spec)
        except TypeError:
            return spec
    raise ValueError(
        f"features must be a name in {sorted(FEATURE_MAPS)} or a transformer with fit/transform; got {spec!r}"
    )


def feature_map_state(fmap: object) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """(name, params, arrays) of a built-in fitted map; ValueError for custom transformers."""
    for name, cls in FEATURE_MAPS.items():
        if type(fmap) is cls and isinstance(fmap, FeatureMap):
            params, arrays = fmap.get_state()
            return name, params, arrays
    raise ValueError(
        f"cannot save a model whose feature map is a custom {type(fmap).__name__}: only the built-in "
        f"maps {sorted(FEATURE_MAPS)} are stored without pickle"
    )


def feature_map_from_state(name: str, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> FeatureMap:
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r} in saved model")
    return FEATURE_MAPS[name].from_state(params, arrays)
