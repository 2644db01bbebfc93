"""No experiment publishes a labelled input: the site builders of the experiments whose data sets
hold duplicate records (Adult's rows, sentiment's word counts, digits' images) leave out of the
published sample every row equal to a labelled one (msa_fed.privacy.consortium.drop_shared).
Checked on small stand-ins with duplicates planted across the labelled/unlabelled split."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from msa_fed.privacy.consortium import shared_mask


class Frozen:
    classes_ = np.array([0, 1])

    def predict_proba(self, X):
        return np.full((len(X), 2), 0.5)

    def predict(self, X):
        return np.zeros(len(X))


def test_sentiment_sites_leave_out_reviews_equal_to_labelled_ones():
    from msa_fed.experiments.sentiment import adaptation_sites

    rng = np.random.default_rng(0)
    split = {}
    for letter in "BDEK":
        X = rng.integers(0, 3, size=(40, 6)).astype(float)
        X[25] = X[3]  # a review of the second half with a labelled review's word counts
        X[31] = X[3]
        split[letter] = (X, rng.normal(size=40), None, None)
    sites = adaptation_sites(split, {letter: Frozen() for letter in split})
    for site, (X, _, _, _) in zip(sites, split.values()):
        assert site.X_labeled.shape[0] == 20
        assert not shared_mask(site.X_labeled, site.X_unlabeled).any()
        dropped = int(shared_mask(X[:20], X[20:]).sum())
        assert dropped >= 2 and site.X_unlabeled.shape[0] == 20 - dropped


def test_adult_sites_leave_out_duplicate_records_of_labelled_rows():
    from msa_fed.experiments import adult

    rng = np.random.default_rng(1)
    n = 2000
    X = rng.integers(0, 12, size=(n, 3)).astype(float)  # 1728 distinct rows: many duplicate records
    data = SimpleNamespace(X_train=X, y_train=rng.integers(0, 2, size=n), doc_train=np.arange(n) % 3 == 0)
    sites = adult.adaptation_sites(data, [Frozen(), Frozen()], seed=0)
    assert [s.name for s in sites] == list(adult.DOMAINS)
    for site in sites:
        assert site.X_labeled.shape[0] == min(adult.N_ADAPT, int(np.sum(data.doc_train == (site.name == "Doc"))) // 2)
        assert 0 < site.X_unlabeled.shape[0] < adult.N_ADAPT  # duplicates were left out ...
        assert not shared_mask(site.X_labeled, site.X_unlabeled).any()  # ... all of them
