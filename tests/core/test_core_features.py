"""Feature maps of the domain classifier: shapes, exact state round trips, input errors."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from msa_fed.core.features import (
    FEATURE_MAPS,
    OneHotFeatures,
    RandomFourierFeatures,
    StandardFeatures,
    ThresholdFeatures,
    feature_map_from_state,
    feature_map_state,
    make_feature_map,
)

rng = np.random.default_rng(0)
X_NUM = rng.normal(size=(300, 4)) * [1.0, 10.0, 0.1, 3.0] + [0.0, 5.0, -2.0, 1.0]
X_CAT = rng.integers(0, 4, size=(300, 3)).astype(float)
X_1D = rng.normal(size=(300, 1))

CASES = {
    "standard": (StandardFeatures(), X_NUM, 4),
    "onehot": (OneHotFeatures(), X_CAT, None),
    "threshold": (ThresholdFeatures(n_thresholds=50), X_1D, 50),
    "rff": (RandomFourierFeatures(n_components=64, random_state=3), X_NUM, 64),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shapes_and_exact_state_round_trip(name):
    fmap, X, width = CASES[name]
    fmap.fit(X)
    Phi = fmap.transform(X)
    if name == "onehot":
        width = sum(np.unique(X[:, j]).size for j in range(X.shape[1]))
    assert Phi.shape == (X.shape[0], width)
    assert np.all(np.isfinite(Phi))
    saved_name, params, arrays = feature_map_state(fmap)
    assert saved_name == name
    # what a saved model stores: JSON-able params and plain arrays (round trip through npz-like copies)
    arrays = {k: np.array(v, copy=True) for k, v in arrays.items()}
    back = feature_map_from_state(saved_name, params, arrays)
    X_new = X[::-1] * 1.01
    assert_array_equal(back.transform(X_new), fmap.transform(X_new))


def test_standard_features_are_standardised_with_weights():
    w = np.where(np.arange(300) < 100, 2.0, 0.5)
    f = StandardFeatures().fit(X_NUM, sample_weight=w)
    Z = f.transform(X_NUM)
    np.testing.assert_allclose(np.average(Z, axis=0, weights=w), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.average(Z**2, axis=0, weights=w), 1.0, rtol=1e-12)
    const = np.column_stack([X_NUM[:, 0], np.full(300, 7.0)])
    assert np.all(np.isfinite(StandardFeatures().fit(const).transform(const)))


def test_threshold_features_are_indicators_of_x_below_quantiles():
    f = ThresholdFeatures(n_thresholds=20).fit(X_1D)
    Phi = f.transform(X_1D)
    assert set(np.unique(Phi)) <= {0.0, 1.0}
    np.testing.assert_array_equal(Phi, (X_1D <= f.thresholds_[None, :]).astype(float))
    assert np.all(np.diff(f.thresholds_) > 0)


@pytest.mark.parametrize("X", [X_NUM, X_NUM[:, :2], np.zeros((10, 1, 1))])
def test_threshold_features_refuse_more_than_one_dimension(X):
    with pytest.raises(ValueError, match=r"1-D inputs \(shape \(n, 1\)\)"):
        ThresholdFeatures().fit(X)


def test_onehot_unseen_category_gives_zeros():
    f = OneHotFeatures().fit(X_CAT)
    x = np.array([[0.0, 9.0, 1.0]])  # 9 never seen in column 1
    Phi = f.transform(x)
    sizes = [c.size for c in f.categories_]
    blocks = np.split(Phi[0], np.cumsum(sizes)[:-1])
    assert blocks[0].sum() == 1 and blocks[2].sum() == 1
    assert not blocks[1].any()
    with pytest.raises(ValueError, match="max_categories"):
        OneHotFeatures(max_categories=3).fit(X_CAT)


def test_rff_is_deterministic_given_random_state():
    a = RandomFourierFeatures(n_components=32, random_state=5).fit(X_NUM).transform(X_NUM)
    b = RandomFourierFeatures(n_components=32, random_state=5).fit(X_NUM).transform(X_NUM)
    c = RandomFourierFeatures(n_components=32, random_state=6).fit(X_NUM).transform(X_NUM)
    assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # approximates the Gaussian kernel exp(-gamma ||x - x'||^2) on standardised inputs
    f = RandomFourierFeatures(n_components=4000, gamma=0.2, random_state=0).fit(X_NUM)
    Z, S = f.transform(X_NUM[:20]), f.standard_.transform(X_NUM[:20])
    K = np.exp(-0.2 * ((S[:, None, :] - S[None, :, :]) ** 2).sum(-1))
    assert np.max(np.abs(Z @ Z.T - K)) < 0.1


def test_make_feature_map():
    assert isinstance(make_feature_map("standard"), StandardFeatures)
    assert make_feature_map(("rff", {"n_components": 7}), random_state=4).random_state == 4
    assert make_feature_map(("threshold", {"n_thresholds": 9})).n_thresholds == 9
    assert sorted(FEATURE_MAPS) == ["onehot", "rff", "standard", "threshold"]
    with pytest.raises(ValueError, match="features must be one of"):
        make_feature_map("polynomial")
    with pytest.raises(ValueError, match="features must be"):
        make_feature_map(42)

    class Custom:
        def fit(self, X):
            return self

        def transform(self, X):
            return X

    with pytest.raises(ValueError, match="custom Custom"):
        feature_map_state(Custom())
