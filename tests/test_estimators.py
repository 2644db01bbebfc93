"""``msa_fed.DMSA`` / ``msa_fed.GMSA``: scikit-learn's conventions over the same fit as the functions."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

import msa_fed


@pytest.mark.parametrize(("estimator", "fit"), [(msa_fed.DMSA, msa_fed.fit_dmsa), (msa_fed.GMSA, msa_fed.fit_gmsa)])
def test_the_estimator_gives_the_model_of_the_function(estimator, fit, demo_federation):
    sites, fed = demo_federation
    est = estimator(solver_options={"n_restarts": 2}, random_state=3)
    assert est.fit(sites) is est
    model = fit(sites, solver_options={"n_restarts": 2}, random_state=3)
    X = fed["east"]["X_test"]
    np.testing.assert_array_equal(est.z_, model.z)
    assert est.gamma_ == model.gamma
    np.testing.assert_array_equal(est.domain_losses_, model.domain_losses)
    np.testing.assert_array_equal(est.predict_proba(X), model.predict_proba(X))
    np.testing.assert_array_equal(est.predict(X), model.predict(X))
    np.testing.assert_array_equal(est.classes_, model.classes_)
    assert est.site_names_ == ["north", "east", "west"] and est.n_features_in_ == 2
    assert est.model_.method == est._method


def test_init_only_stores_and_fit_names_the_bad_parameter(demo_federation):
    sites, _ = demo_federation
    est = msa_fed.DMSA(mu=-1.0, solver_options={"nope": 1})  # no check yet
    assert est.mu == -1.0 and est.solver_options == {"nope": 1}
    with pytest.raises(ValueError, match="mu"):
        est.fit(sites)
    with pytest.raises(ValueError, match="nope"):
        est.set_params(mu=1e-3).fit(sites)
    assert not hasattr(est, "model_")  # a failed fit leaves no learned state
    with pytest.raises(ValueError, match="sites only"):
        msa_fed.DMSA().fit(sites, np.zeros(3))


def test_params_round_trip_and_clone():
    est = msa_fed.GMSA("regression", bandwidth=0.5, solver_options={"tol": 1e-8})
    params = est.get_params()
    assert params["task"] == "regression" and params["bandwidth"] == 0.5 and params["features"] is None
    assert set(params) == set(msa_fed.DMSA().get_params())  # the same parameters, only defaults differ
    copy = clone(est)
    assert copy is not est and copy.get_params() == params
    assert est.set_params(eta=0.1) is est and est.eta == 0.1
    with pytest.raises(ValueError):
        est.set_params(no_such_parameter=1)


def test_predictions_need_a_fit():
    for method in ("predict", "predict_proba"):
        with pytest.raises(NotFittedError):
            getattr(msa_fed.DMSA(), method)(np.zeros((2, 2)))
