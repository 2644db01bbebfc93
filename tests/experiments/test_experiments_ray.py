"""``--runtime ray`` gives the same experiment numbers as ``--runtime local``."""

import pytest

from msa_fed.experiments import synthetic

#: the experiment's random Fourier features, with fewer components (the paper's 1000 make each
#: fit seconds longer; the map and its messages are the same kind)
RFF = {"features": ("rff", {**synthetic.DMSA_OPTIONS["features"][1], "n_components": 100})}


def test_synthetic_ray_matches_local():
    # one seed, one adaptation size: DMSA and GMSA fitted through Ray site actors and in-process
    runs = {
        rt: synthetic.run_seed(0, (100,), runtime=rt, n_test=2000, with_threshold=False, dmsa_options=RFF)[100]
        for rt in ("local", "ray")
    }
    assert runs["local"].keys() == runs["ray"].keys()
    for method, by_target in runs["local"].items():
        for target, value in by_target.items():
            assert runs["ray"][method][target] == pytest.approx(value, abs=1e-12), (method, target)


def test_adult_ray_matches_local(monkeypatch):
    # one-hot feature maps travel to the site actors: a different message shape than synthetic's
    from msa_fed.experiments import adult

    # both runs read the same data set and train the same frozen predictors from it: loaded and
    # trained once, handed to both (the fits under test are the runtimes' own)
    data = adult.load_adult()
    predictors = adult.train_predictors(data)

    def trained(d, seed=0):
        assert d is data and seed == 0
        return predictors

    monkeypatch.setattr(adult, "load_adult", lambda: data)
    monkeypatch.setattr(adult, "train_predictors", trained)
    runs = {rt: adult.run(1, runtime=rt, log=lambda msg: None) for rt in ("local", "ray")}
    for method, by_target in runs["local"].items():
        for target, stat in by_target.items():
            assert runs["ray"][method][target]["mean"] == pytest.approx(stat["mean"], abs=1e-12), (method, target)
