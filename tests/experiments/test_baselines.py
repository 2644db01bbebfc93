"""Uniform combination and the jointly trained baseline."""

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, LogisticRegression

from msa_fed.experiments.baselines import UniformCombination, fit_joint


def _data(seed, n=200, shift=0.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(shift, 1.0, size=(n, 3))
    y = (X @ np.array([1.0, -1.0, 0.5]) + rng.normal(0, 0.5, n) > shift).astype(int)
    return X, y


def test_uniform_classification_averages_probabilities():
    (X1, y1), (X2, y2) = _data(0), _data(1, shift=1.0)
    hs = [LogisticRegression().fit(X1, y1), LogisticRegression(C=0.01).fit(X2, y2)]
    u = UniformCombination(hs, "classification")
    X = _data(2)[0]
    manual = (hs[0].predict_proba(X) + hs[1].predict_proba(X)) / 2
    np.testing.assert_allclose(u.predict_proba(X), manual)
    np.testing.assert_array_equal(u.predict(X), hs[0].classes_[manual.argmax(1)])
    np.testing.assert_allclose(u.predict_proba(X).sum(1), 1.0)


def test_uniform_regression_averages_values():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(50, 2))
    hs = [LinearRegression().fit(X, X @ [1, 2]), LinearRegression().fit(X, X @ [-1, 0] + 3)]
    u = UniformCombination(hs, "regression")
    np.testing.assert_allclose(u.predict(X), (X @ [1, 2] + X @ [-1, 0] + 3) / 2)
    with pytest.raises(ValueError, match="predict_proba needs task='classification'"):
        u.predict_proba(X)


def test_uniform_rejects_bad_input():
    X, y = _data(0)
    a = LogisticRegression().fit(X, y)
    b = LogisticRegression().fit(X, y + 1)
    with pytest.raises(ValueError, match="classes_"):
        UniformCombination([a, b], "classification")
    with pytest.raises(ValueError, match="task must be"):
        UniformCombination([a], "ranking")
    with pytest.raises(ValueError, match="at least one"):
        UniformCombination([], "classification")


def test_joint_balancing_equals_replicating_the_small_source():
    (X1, y1), (X2, y2) = _data(0, n=300), _data(1, n=100, shift=1.0)
    make = lambda: LogisticRegression(C=1e6, max_iter=5000, tol=1e-10)  # noqa: E731
    joint = fit_joint(make, [X1, X2], [y1, y2])
    # balanced weights = each source counted equally = the small source repeated 3 times
    ref = make().fit(np.concatenate([X1, X2, X2, X2]), np.concatenate([y1, y2, y2, y2]))
    np.testing.assert_allclose(joint.coef_, ref.coef_, rtol=1e-4, atol=1e-6)
    pooled = fit_joint(make, [X1, X2], [y1, y2], balance=False)
    plain = make().fit(np.concatenate([X1, X2]), np.concatenate([y1, y2]))
    np.testing.assert_allclose(pooled.coef_, plain.coef_, rtol=1e-4, atol=1e-6)
