"""The public in-process API on a tiny synthetic problem: fits, bad inputs, save / load."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, LogisticRegression

import msa_fed
from msa_fed import SiteData, fit_dmsa, fit_gmsa, load_model
from msa_fed.core.simplex import check_simplex
from msa_fed.errors import PeerFault


def make_sites(task="classification", sizes=(50, 70), d=2, seed=0):
    """Shifted Gaussian inputs per site; each site's predictor is trained on its own domain."""
    rng = np.random.default_rng(seed)
    sites = []
    for k, n in enumerate(sizes):
        mean = np.zeros(d)
        mean[k % d] = 3.0 * (1 if k % 2 == 0 else -1)
        w = rng.normal(size=d)

        def draw(m, mean=mean, w=w):
            X = rng.normal(size=(m, d)) + mean
            if task == "classification":
                return X, (X @ w + 0.3 * rng.normal(size=m) > mean @ w).astype(int)
            return X, np.sin(X @ w) + 0.1 * rng.normal(size=m)

        Xt, yt = draw(150)
        h = LogisticRegression().fit(Xt, yt) if task == "classification" else LinearRegression().fit(Xt, yt)
        X, y = draw(n)
        Xu, _ = draw(n + 10)
        sites.append(SiteData(f"site{k}", X, y, Xu, h))
    return sites


class BadProba:
    """A classifier whose probabilities do not sum to 1."""

    classes_ = np.array([0, 1])

    def predict_proba(self, X):
        return np.full((len(X), 2), 0.4)


@pytest.fixture(scope="module")
def sites():
    return make_sites()


def test_fit_dmsa_and_gmsa_give_models_on_the_simplex(sites):
    for fit in (fit_dmsa, fit_gmsa):
        model = fit(sites, task="classification")
        check_simplex(model.z)
        assert model.z.shape == (2,) and model.gamma >= 0
        assert model.domain_losses.shape == (2,)
        X = np.vstack([s.X_labeled for s in sites])
        P = model.predict_proba(X)
        np.testing.assert_allclose(P.sum(1), 1.0, atol=1e-9)
        np.testing.assert_array_equal(model.predict(X), model.classes_[P.argmax(1)])
        Q = model.domain_proba(X)
        assert Q.shape == (len(X), 2)
        np.testing.assert_allclose(Q.sum(1), 1.0, atol=1e-9)
        # the classifier puts each site's points on its own side (the domains are well separated)
        assert Q[: len(sites[0].X_labeled), 0].mean() > 0.8


def test_gamma_objective_solves_to_zero(sites):
    model = fit_dmsa(sites, solver_options={"objective": "gamma"})
    assert model.gamma <= 1e-9
    assert model.info["solver"]["converged"]


def test_regression_task():
    sites = make_sites("regression", seed=1)
    model = fit_dmsa(sites, task="regression", solver_options={"objective": "gamma"})
    X = sites[0].X_labeled
    H = np.column_stack([s.predictor.predict(X) for s in sites])
    g = model.predict(X)
    assert np.all(g >= H.min(1) - 1e-9) and np.all(g <= H.max(1) + 1e-9)
    assert model.gamma <= 1e-9


def test_z_off_the_simplex_is_refused(sites):
    with pytest.raises(ValueError, match="z0 must lie on the simplex; got sum=1.3"):
        fit_dmsa(sites, solver_options={"objective": "gamma", "z0": [0.9, 0.4]})
    with pytest.raises(ValueError, match="z must lie on the simplex; got a negative entry"):
        check_simplex(np.array([1.2, -0.2]))


def test_feature_widths_that_differ_are_refused(sites):
    other = make_sites(d=3, seed=2)[1]
    with pytest.raises(ValueError, match="feature widths differ between sites"):
        fit_dmsa([sites[0], other])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("field", ["X_labeled", "X_unlabeled"])
def test_nan_or_inf_features_are_refused(sites, bad, field):
    s = sites[0]
    X = getattr(s, field).copy()
    X[3, 1] = bad
    kwargs = dict(
        name="broken", X_labeled=s.X_labeled, y_labeled=s.y_labeled, X_unlabeled=s.X_unlabeled, predictor=s.predictor
    )
    kwargs[field] = X
    with pytest.raises(ValueError, match=f"site 'broken': {field} contains NaN or inf"):
        SiteData(**kwargs)


def test_probabilities_that_do_not_sum_to_one_are_refused(sites):
    s = sites[1]
    bad = SiteData(s.name, s.X_labeled, s.y_labeled, s.X_unlabeled, BadProba())
    # the first site to use it is a peer: the fault is the predictor's owner's, named
    with pytest.raises(
        PeerFault, match=rf"^site {s.name!r}'s predictor: predicted probabilities do not sum to 1"
    ) as err:
        fit_dmsa([sites[0], bad])
    assert err.value.site == s.name


def test_site_without_unlabelled_data_is_refused(sites):
    s = sites[0]
    with pytest.raises(ValueError, match="site 'empty' has no unlabelled data"):
        SiteData("empty", s.X_labeled, s.y_labeled, np.zeros((0, 2)), s.predictor)


def test_fewer_than_two_sites_are_refused(sites):
    for few in ([], sites[:1]):
        with pytest.raises(ValueError, match=f"at least two sites; got {len(few)}"):
            fit_dmsa(few)
        with pytest.raises(ValueError, match="at least two sites"):
            fit_gmsa(few)


def test_save_load_round_trip(sites, tmp_path):
    X = np.vstack([s.X_unlabeled for s in sites]) * 0.9
    for fit, name in ((fit_dmsa, "dmsa"), (fit_gmsa, "gmsa")):
        model = fit(sites)
        path = model.save(tmp_path / name)
        back = load_model(path)
        again = load_model(back.save(tmp_path / (name + "2")))
        assert isinstance(back, msa_fed.CombinedModel)
        np.testing.assert_array_equal(back.z, model.z)
        assert back.eta == model.eta and back.gamma == model.gamma
        np.testing.assert_array_equal(back.domain_proba(X), model.domain_proba(X))
        # predictors come back as ONNX (float32 inside): same labels, probabilities to float32 accuracy
        np.testing.assert_array_equal(back.predict(X), model.predict(X))
        np.testing.assert_allclose(back.predict_proba(X), model.predict_proba(X), atol=1e-5)
        # and a loaded model saved again loads to identical predictions
        np.testing.assert_array_equal(again.predict_proba(X), back.predict_proba(X))


def test_no_warning_on_a_converged_default_fit(sites):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_dmsa(sites, solver_options={"objective": "gamma"})


def test_an_unlabelled_sample_sharing_rows_with_the_labelled_inputs_is_refused(sites):
    """The unlabelled sample is published: a row equal to a labelled input (compared as the
    float32 the sample is published in, -0.0 as 0.0) makes the site's answers linear in that
    point's label.  Refused, naming how many rows; the marked rows dropped, the site is built."""
    from msa_fed.privacy.consortium import drop_shared, shared_mask

    s = sites[0]
    with pytest.raises(ValueError, match=rf"site 'same': {len(s.X_labeled)} of the {len(s.X_labeled)} rows"):
        SiteData("same", s.X_labeled, s.y_labeled, s.X_labeled, s.predictor)
    Xu = s.X_unlabeled.copy()
    Xu[[2, 9]] = s.X_labeled[[0, 5]]
    Xu[4] = s.X_labeled[7] * (1 + 1e-12)  # the same float32 row
    with pytest.raises(
        ValueError, match=r"3 of the \d+ rows of X_unlabeled are labelled inputs too.*drop them"
    ) as info:
        SiteData("dup", s.X_labeled, s.y_labeled, Xu, s.predictor)
    assert str(info.value).count("\n") == 0
    assert np.flatnonzero(shared_mask(s.X_labeled, Xu)).tolist() == [2, 4, 9]
    kept, n = drop_shared(s.X_labeled, Xu)
    assert n == 3 and len(kept) == len(Xu) - 3
    site = SiteData("dup", s.X_labeled, s.y_labeled, kept, s.predictor)
    assert not shared_mask(site.X_labeled, site.X_unlabeled).any()
    # a sign of zero is no difference; a difference beyond float32 is one
    L = np.array([[0.0, 1.0], [2.0, 3.0]])
    assert shared_mask(L, np.array([[-0.0, 1.0], [2.0, 3.0 + 1e-6], [5.0, 5.0]])).tolist() == [True, False, False]
