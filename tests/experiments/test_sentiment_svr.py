"""The sentiment experiment's per-domain regressor: its fast predict (one sparse-dense product)
equals scikit-learn's SVR.predict on the same transformed counts, for every count transform."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone

from msa_fed.experiments.sentiment import SVR_TRANSFORMS, CountSVR


@pytest.mark.parametrize("transform", SVR_TRANSFORMS)
def test_fast_predict_equals_libsvm(transform):
    rng = np.random.default_rng(0)
    X = rng.poisson(0.3, size=(300, 80)).astype(float)
    y = 1 + 4 * rng.random(300)
    model = CountSVR(C=3.0, transform=transform).fit(X[:200], y[:200])
    ours = model.predict(X[200:])
    ref = model.svr_.predict(model._normalise(X[200:]))
    np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-10)
    assert clone(model).get_params() == {"C": 3.0, "transform": transform}  # CV tuning clones it


def test_transforms_differ_and_bad_transform_is_refused():
    X = np.array([[0.0, 4.0, 1.0], [9.0, 0.0, 1.0]])
    rows = {t: CountSVR(transform=t)._normalise(X).toarray() for t in SVR_TRANSFORMS}
    np.testing.assert_allclose(rows["sqrt"][0], np.array([0, 2, 1]) / np.sqrt(5))
    np.testing.assert_allclose(rows["binary"][1], np.array([1, 0, 1]) / np.sqrt(2))
    assert not np.allclose(rows["counts"], rows["log1p"])
    with pytest.raises(ValueError, match="transform must be one of"):
        CountSVR(transform="tfidf")._normalise(X)
