"""Baselines the paper compares DMSA against: the uniform combination and a joint model.

Each single source h_k needs no wrapper (it is the site's own predictor).  The
uniform combination is (1/p) sum_k h_k; the jointly trained model pools every
site's labelled data, which a federated deployment may not do: it is a reference
point for the experiments only.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from msa_fed.core.config import task_loss


class UniformCombination:
    """The fixed combination (1/p) sum_k h_k of p frozen predictors.

    Parameters
    ----------
    predictors : sequence of p objects with ``predict`` (regression) or
        ``predict_proba`` and ``classes_`` (classification), all with the same classes.
    task : "classification" or "regression".
    """

    def __init__(self, predictors: Sequence, task: str = "classification"):
        task_loss(task)  # validates
        predictors = list(predictors)
        if not predictors:
            raise ValueError("predictors must hold at least one predictor; got 0")
        self.predictors = predictors
        self.task = task
        if task == "classification":
            classes = [np.asarray(h.classes_) for h in predictors]
            for k, c in enumerate(classes[1:], start=1):
                if c.shape != classes[0].shape or np.any(c != classes[0]):
                    raise ValueError(
                        f"predictor {k} has classes_ {c.tolist()}; expected {classes[0].tolist()} like predictor 0"
                    )
            self.classes_ = classes[0]

    def predict_proba(self, X) -> np.ndarray:
        """Average class probabilities, shape (n_samples, n_classes)."""
        if self.task != "classification":
            raise ValueError("predict_proba needs task='classification'; got task='regression'")
        return np.mean([np.asarray(h.predict_proba(X), dtype=np.float64) for h in self.predictors], axis=0)

    def predict(self, X) -> np.ndarray:
        """Labels (classification: argmax of the average probability) or average values, shape (n_samples,)."""
        if self.task == "classification":
            return self.classes_[np.argmax(self.predict_proba(X), axis=1)]
        return np.mean([np.asarray(h.predict(X), dtype=np.float64) for h in self.predictors], axis=0)


def fit_joint(
    make_estimator: Callable[[], object],
    X_list: Sequence[np.ndarray],
    y_list: Sequence[np.ndarray],
    *,
    balance: bool = True,
):
    """Train one model on the pooled labelled data of every source.

    ``make_estimator()`` returns an unfitted estimator whose ``fit(X, y, sample_weight=...)``
    accepts sample weights.  With ``balance=True`` each source gets the same total weight
    (point i of source k weighs n / (p n_k)), so the joint model targets the uniform
    mixture of the sources rather than the largest one.
    """
    if len(X_list) != len(y_list) or not X_list:
        raise ValueError(
            f"X_list and y_list must be non-empty and of equal length; got {len(X_list)} and {len(y_list)}"
        )
    X = np.concatenate([np.asarray(x) for x in X_list])
    y = np.concatenate([np.asarray(t) for t in y_list])
    n, p = len(y), len(X_list)
    if balance:
        w = np.concatenate([np.full(len(t), n / (p * len(t))) for t in y_list])
    else:
        w = np.ones(n)
    estimator: Any = make_estimator()
    return estimator.fit(X, y, sample_weight=w)
