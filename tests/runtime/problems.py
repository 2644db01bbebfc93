"""Small synthetic federations for the runtime tests (deterministic from a seed)."""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.api import SiteData
from msa_fed.core.combination import class_union

#: labelled sizes chosen distinct from every other dimension that crosses a site boundary
#: (unlabelled sizes, d = 4, p = 3, classes = 2, classifier parameters p (d + 1) = 15)
N_LABELED = (41, 53, 67)
N_UNLABELED = (60, 72, 84)
N_FEATURES = 4


def make_sites(
    n_labeled=N_LABELED, n_unlabeled=N_UNLABELED, d: int = N_FEATURES, random_state: int = 0, names=None
) -> list[SiteData]:
    """p = len(n_labeled) sites: shifted Gaussian inputs, a different linear rule per site,
    each site's predictor a logistic regression on its own extra training sample."""
    rng = np.random.default_rng(random_state)
    p = len(n_labeled)
    names = names or [chr(ord("a") + k) for k in range(p)]
    sites = []
    for k in range(p):
        mean = np.zeros(d)
        mean[k % d] = 1.5
        rule = rng.normal(size=d)

        def draw(n):
            X = rng.normal(size=(n, d)) + mean
            y = (X @ rule + 0.5 * rng.normal(size=n) > mean @ rule).astype(int)
            return X, y

        X_train, y_train = draw(200)
        h = LogisticRegression(C=1.0).fit(X_train, y_train)
        X_lab, y_lab = draw(n_labeled[k])
        X_unl, _ = draw(n_unlabeled[k])
        sites.append(SiteData(names[k], X_lab, y_lab, X_unl, h))
    return sites


def site_kwargs(sites: list[SiteData], min_points: int = 20) -> list[dict]:
    """SiteWorker keyword arguments, as :func:`msa_fed.api.make_backend` builds them."""
    from msa_fed.site.admission import host_content

    predictors = [s.predictor for s in sites]
    classes = class_union(s.predictor.classes_ for s in sites)
    # the job's content, as the API gives it: each site checks the samples it is handed against it
    content = host_content(
        "test", [s.name for s in sites], [s.X_unlabeled for s in sites], task="classification", loss="cross_entropy"
    )
    return [
        dict(
            name=s.name,
            index=k,
            X_labeled=s.X_labeled,
            y_labeled=s.y_labeled,
            X_unlabeled=s.X_unlabeled,
            predictors=predictors,
            task="classification",
            loss="cross_entropy",
            classes=classes,
            min_points=min_points,
            content=content,
        )
        for k, s in enumerate(sites)
    ]
