"""The built-in demo federation: three sites ("north", "east", "west") in two dimensions.

Each site's inputs are a Gaussian blob in its own region; the label rule is one global XOR-like
function (y = 1 when x1 * x2 > 0), which is linear inside each region but with opposite signs
in "east" and "west".  Every site's linear classifier is accurate at home and wrong elsewhere,
so the uniform average of the three predictors fails where domains meet, while the
distribution-weighted combination uses the right predictor at every x.  Sizes are small so
that the whole federated demo runs in about a minute.
"""

from __future__ import annotations

import numpy as np

SITES = ("north", "east", "west")
CENTERS = {"north": (0.0, 2.0), "east": (2.0, 0.0), "west": (-2.0, 0.0)}


def label(X: np.ndarray) -> np.ndarray:
    return (X[:, 0] * X[:, 1] > 0).astype(np.int64)


def sample(site: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    X = rng.normal(loc=CENTERS[site], scale=1.0, size=(n, 2))
    return X, label(X)


def make_federation(n_labeled: int = 400, n_unlabeled: int = 1000, n_test: int = 4000, random_state=0):
    """Per site: (X_train, y_train) for its predictor, (X_labeled, y_labeled) for z, X_unlabeled,
    and a test sample.  Returns a dict name -> dict of arrays."""
    rng = np.random.default_rng(random_state)
    out = {}
    for name in SITES:
        Xtr, ytr = sample(name, 1000, rng)
        Xl, yl = sample(name, n_labeled, rng)
        Xu, _ = sample(name, n_unlabeled, rng)
        Xt, yt = sample(name, n_test, rng)
        out[name] = dict(X_train=Xtr, y_train=ytr, X_labeled=Xl, y_labeled=yl, X_unlabeled=Xu, X_test=Xt, y_test=yt)
    return out
