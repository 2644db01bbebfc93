"""The demo's three sites in process, each with a logistic-regression predictor trained on its
own training sample: for the tests that need a realistic fitted model."""

from __future__ import annotations


def demo_sites(random_state: int, n_labeled: int = 150, n_unlabeled: int = 200, n_test: int = 100):
    """``(sites, fed)``: the :class:`msa_fed.SiteData` of north, east and west, and
    ``make_federation``'s dict (their test sets included)."""
    from sklearn.linear_model import LogisticRegression

    import msa_fed
    from msa_fed.experiments.demo_data import SITES, make_federation

    fed = make_federation(n_labeled=n_labeled, n_unlabeled=n_unlabeled, n_test=n_test, random_state=random_state)
    sites = [
        msa_fed.SiteData(
            n,
            fed[n]["X_labeled"],
            fed[n]["y_labeled"],
            fed[n]["X_unlabeled"],
            LogisticRegression().fit(fed[n]["X_train"], fed[n]["y_train"]),
        )
        for n in SITES
    ]
    return sites, fed
