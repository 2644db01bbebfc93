"""A site's logistic-regression predictor as plain numpy, for the tests that ship predictors to
Ray actors: unpickling a scikit-learn estimator imports scikit-learn and SciPy in every actor's
worker process (seconds of CPU per actor on a two-core machine), while these need numpy alone.
The tests register this module with Ray's cloudpickle by value, so the worker processes need not
import it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np


class NumpyLogistic:
    """``predict_proba`` and ``classes_`` of a fitted binary or multinomial LogisticRegression:
    the same linear scores, the same probabilities to rounding."""

    def __init__(self, estimator):
        self.coef_ = np.array(estimator.coef_, dtype=np.float64)
        self.intercept_ = np.array(estimator.intercept_, dtype=np.float64)
        self.classes_ = np.array(estimator.classes_)
        self.n_features_in_ = self.coef_.shape[1]

    def predict_proba(self, X):
        scores = np.asarray(X, dtype=np.float64) @ self.coef_.T + self.intercept_
        if scores.shape[1] == 1:  # binary: one score for the second class
            p = 1.0 / (1.0 + np.exp(-scores[:, 0]))
            return np.column_stack([1.0 - p, p])
        scores = scores - scores.max(axis=1, keepdims=True)
        e = np.exp(scores)
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, X):
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]


def numpy_sites(sites):
    """``sites`` (SiteData with scikit-learn logistic regressions) with NumpyLogistic predictors."""
    return [replace(s, predictor=NumpyLogistic(s.predictor)) for s in sites]
