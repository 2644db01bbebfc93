"""The API's configuration tree: every bad argument is a TypeError or ValueError naming it,
raised before any work; the options reach the fit; the probability floor is applied the same
way in the solver's losses and in the model's predict_proba."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

import msa_fed
from msa_fed import SiteData, fit_dmsa, fit_gmsa, load_model
from msa_fed.api import build_config
from msa_fed.core.dc_solver import SolverConfig
from msa_fed.core.domain_classifier import ClassifierConfig
from msa_fed.errors import ArtifactError
from msa_fed.privacy.policy import SitePolicy
from msa_fed.runtime.config import FitConfig, RayConfig


def make_sites(sizes=(150, 180), d=2, seed=0):
    rng = np.random.default_rng(seed)
    sites = []
    for k, n in enumerate(sizes):
        mean = np.zeros(d)
        mean[k % d] = 3.0 if k % 2 == 0 else -3.0
        w = rng.normal(size=d)

        def draw(m, mean=mean, w=w):
            X = rng.normal(size=(m, d)) + mean
            return X, (X @ w + 0.3 * rng.normal(size=m) > mean @ w).astype(int)

        h = LogisticRegression().fit(*draw(150))
        X, y = draw(n)
        sites.append(SiteData(f"site{k}", X, y, draw(n + 10)[0], h))
    return sites


#: the Ray runtime named in the config tests below: they build and check the configuration only
RAY = "ray"


@pytest.fixture(scope="module")
def sites():
    return make_sites()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"mu": "x"}, TypeError, "mu must be a number > 0; got 'x'"),
        ({"mu": 0.0}, ValueError, "mu must be a number > 0; got 0.0"),
        ({"mu": -1.0}, ValueError, "mu must be a number > 0; got -1.0"),
        ({"mu": math.nan}, ValueError, "mu must be a number > 0; got nan"),
        ({"random_state": "x"}, TypeError, "random_state must be an integer >= 0; got 'x'"),
        ({"random_state": 1.5}, TypeError, "random_state must be an integer >= 0; got 1.5"),
        ({"eta": -0.1}, ValueError, "eta must be a number >= 0; got -0.1"),
        ({"eta": "0.1"}, TypeError, "eta must be a number >= 0; got '0.1'"),
        ({"min_points": 0}, ValueError, "min_points must be an integer >= 1; got 0"),
        ({"runtime": "spark"}, ValueError, "runtime must be one of 'local', 'ray'; got 'spark'"),
        ({"features": "nope"}, ValueError, "features must be one of 'standard'"),
        ({"verbose": "yes"}, TypeError, "verbose must be true or false; got 'yes'"),
        ({"classifier_options": {"lr": math.nan}}, ValueError, "classifier_options: lr must be a number > 0; got nan"),
        (
            {"classifier_options": {"epochs": -1}},
            ValueError,
            "classifier_options: epochs must be an integer >= 1; got -1",
        ),
        ({"classifier_options": {"optimizer": "adam"}}, ValueError, "classifier_options: optimizer must be one of"),
        ({"classifier_options": {"speed": 2}}, ValueError, r"classifier_options: unknown key\(s\) \['speed'\]"),
        ({"classifier_options": {"mu": 0.1}}, ValueError, r"classifier_options: unknown key\(s\) \['mu'\]"),
        ({"classifier_options": "lbfgs"}, TypeError, "classifier_options: must be a mapping"),
        ({"solver_options": {"maxiter": 3}}, ValueError, r"solver_options: unknown key\(s\) \['maxiter'\]"),
        ({"solver_options": {"max_iter": "3"}}, TypeError, "solver_options: max_iter must be an integer >= 1; got '3'"),
        ({"solver_options": {"method": "dca"}}, ValueError, "method='dca' applies only to objective='gamma'"),
        ({"solver_options": {"bound": "global"}}, ValueError, "bound='global' applies only to objective='gamma'"),
        ({"solver_options": {"objective": "gamma", "method": "bfgs"}}, ValueError, "solver_options: method must be"),
        ({"ray_options": {"workers_per_site": 2}}, ValueError, "ray_options apply only to runtime='ray'"),
        ({"runtime": "ray", "ray_options": {"bogus": 1}}, ValueError, r"ray_options: unknown key\(s\) \['bogus'\]"),
        (
            {"runtime": "ray", "ray_options": {"data_channel": "udp"}},
            ValueError,
            "ray_options: data_channel must be one",
        ),
        (
            {"runtime": "ray", "ray_options": {"workers_per_site": 0}},
            ValueError,
            "workers_per_site must be an integer >= 1",
        ),
        ({"bandwidth": 0.5}, ValueError, "bandwidth applies only to method 'gmsa'"),
    ],
)
def test_bad_arguments_are_named_before_any_work(sites, kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        fit_dmsa(sites, **kwargs)
    assert "\n" not in str(info.value)


def test_gmsa_arguments_are_checked_too(sites):
    with pytest.raises(ValueError, match="bandwidth must be a number > 0, one per site"):
        fit_gmsa(sites, bandwidth=-1.0)
    with pytest.raises(TypeError, match="mu must be a number > 0; got 'x'"):
        fit_gmsa(sites, mu="x")


def test_checkpoint_dir_naming_a_file_is_refused(sites, tmp_path):
    f = tmp_path / "state"
    f.write_text("not a directory")
    with pytest.raises(ValueError, match=r"checkpoint_dir must be a directory path .* exists but is not a directory"):
        fit_dmsa(sites, checkpoint_dir=f)
    assert f.read_text() == "not a directory"


def test_object_dtype_inputs_are_refused(sites):
    s = sites[0]
    X = s.X_labeled.astype(object)
    with pytest.raises(TypeError, match="site 'x': X_labeled must be a numeric array .*got dtype object"):
        SiteData("x", X, s.y_labeled, s.X_unlabeled, s.predictor)
    with pytest.raises(TypeError, match="X_unlabeled must be a numeric array"):
        SiteData("x", s.X_labeled, s.y_labeled, np.array([["1", "2"]] * 5), s.predictor)
    with pytest.raises(TypeError, match="policy must be a SitePolicy"):
        SiteData("x", s.X_labeled, s.y_labeled, s.X_unlabeled, s.predictor, policy={"eta_min": 0})


def test_sites_must_be_a_list_of_site_data(sites):
    with pytest.raises(TypeError, match="sites must be a list of SiteData; got str"):
        fit_dmsa("cleveland")


def test_the_options_reach_the_config_tree():
    cfg = build_config(
        "dmsa",
        "classification",
        mu=0.25,
        classifier_options={"optimizer": "sgd", "epochs": 3},
        solver_options={"objective": "gamma", "method": "dca", "max_iter": 7},
        runtime=RAY,  # builds the config only: no Ray starts
        ray_options={"workers_per_site": 2, "data_channel": "off"},
        random_state=3,
    )
    assert isinstance(cfg, FitConfig)
    assert cfg.classifier == ClassifierConfig(mu=0.25, optimizer="sgd", epochs=3)
    assert cfg.solver == SolverConfig(objective="gamma", method="dca", max_iter=7)
    assert cfg.ray.workers_per_site == 2 and cfg.ray.data_channel == "off" and isinstance(cfg.ray, RayConfig)
    assert cfg.random_state == 3 and cfg.loss == "cross_entropy"
    # one default objective: the solver's and the fit's
    assert build_config("dmsa").solver.objective == SolverConfig().objective == "minmax"
    # ints are accepted where numbers are expected, and stored as floats
    assert build_config("dmsa", mu=1).classifier.mu == 1.0
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        cfg.eta = 0.5


def test_solver_options_change_the_fit(sites):
    model = fit_dmsa(sites, solver_options={"objective": "gamma", "method": "dca", "max_iter": 200})
    assert model.info["solver"]["method"] == "dca"
    assert fit_dmsa(sites).info["solver"]["method"] == "slsqp-minmax"


def test_all_starts_reaches_the_solve_of_a_fit(sites):
    every = fit_dmsa(sites, solver_options={"all_starts": True, "n_restarts": 2}).info["solver"]
    first = fit_dmsa(sites, solver_options={"n_restarts": 2}).info["solver"]
    assert len(every["restarts"]) == 3 and len(first["restarts"]) == 1
    assert every["n_evaluations"] > first["n_evaluations"]


def test_reported_domain_losses_are_the_models_own_log_loss(sites):
    """With eta = 0 and a predictor that gives the true labels probability ~0, the losses the
    solver reports are the combined model's own log-loss on each domain's weighted sample (the
    probability floor is applied the same way in both)."""

    class Wrong:
        """Certain, and wrong where ``wrong(X)``: all mass on the label the rule does not give;
        elsewhere the rule's own probabilities."""

        classes_ = np.array([0, 1])

        def __init__(self, rule, wrong):
            self.rule, self.wrong = rule, wrong

        def predict_proba(self, X):
            P = self.rule.predict_proba(X)
            y = self.rule.predict(X)
            bad = self.wrong(X)
            P[bad] = 0.0
            P[np.flatnonzero(bad), 1 - y[bad]] = 1.0
            return P

    # site0's predictor is wrong everywhere, site1's where x_1 > 0: there g gives the true label
    # probability 0 and only the floor keeps the loss finite
    wrong = [lambda X: np.ones(len(X), bool), lambda X: X[:, 1] > 0]
    # eta ~ 0 (1e-9) is below the default policy's eta_min: in-process, the sites set their own
    # policy; the true-label probabilities still fall far below the floor
    own_policy = SitePolicy(eta_min=1e-9)
    bad = [
        SiteData(s.name, s.X_labeled, s.y_labeled, s.X_unlabeled, Wrong(s.predictor, wrong[k]), policy=own_policy)
        for k, s in enumerate(sites)
    ]
    model = fit_dmsa(bad, eta=1e-9)
    X = np.vstack([s.X_labeled for s in bad])
    y = np.concatenate([s.y_labeled for s in bad])
    n = np.concatenate([np.full(len(s.X_labeled), len(s.X_labeled)) for s in bad])
    pi = 1.0 / (len(bad) * n)
    w = pi[:, None] * model.domain_proba(X) / model.qhat[None, :]
    P = model.predict_proba(X)
    own = -(w * np.log(P[np.arange(len(y)), np.searchsorted(model.classes_, y)])[:, None]).sum(axis=0)
    assert np.all(np.isfinite(own)) and np.max(own) > 1.0  # the floor matters here
    np.testing.assert_allclose(model.domain_losses, own, rtol=1e-6)
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-9)


def test_manifest_missing_a_key_is_an_artifact_error(sites, tmp_path):
    model = fit_dmsa(sites)
    path = model.save(tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["qhat"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest lacks the key\(s\) \['qhat'\]"):
        load_model(path)
    manifest["qhat"] = model.qhat.tolist()
    del manifest["domain_model"]["kind"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="domain model's state lacks the key 'kind'"):
        load_model(path)
    manifest["domain_model"]["kind"] = "maxent"
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert isinstance(load_model(path), msa_fed.CombinedModel)


def test_the_light_config_module_knows_the_feature_maps():
    """core.config lists the feature maps without importing them (job files are checked
    without torch or scikit-learn); the list is the real one."""
    from msa_fed.core.config import FEATURE_NAMES
    from msa_fed.core.features import FEATURE_MAPS

    assert FEATURE_NAMES == tuple(FEATURE_MAPS)


def test_ray_startup_hint_names_both_times_and_the_local_runtime():
    from msa_fed.api import ray_startup_hint

    assert ray_startup_hint(2.14, 0.031) == (
        "Ray start-up 2.1 s, fit 0.03 s: runtime='local' is faster for a problem this size"
    )
    assert ray_startup_hint(0.5, 0.5) is None and ray_startup_hint(1.0, 30.0) is None
