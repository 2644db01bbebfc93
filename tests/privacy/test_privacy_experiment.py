"""The privacy experiment's pieces: DP off gives the plain fit's number, DP on a valid model,
and the "points per site" read-off."""

import numpy as np
import pytest

from msa_fed.experiments import privacy


def test_synthetic_seed_dp_off_equals_the_plain_fit_and_dp_on_stays_sane():
    from sklearn.linear_model import LogisticRegression

    from msa_fed import fit_dmsa
    from msa_fed.experiments import synthetic as S

    res = privacy.synthetic_seed(0, 200, 1000, epsilons=(1.0, float("inf")))
    assert set(res) == {"eps=1", "eps=inf"}
    # the same sites fitted without the experiment's policy and checkpoint
    rng = np.random.default_rng([0, 0])
    predictors = [LogisticRegression().fit(*S.sample(dom, S.N_TRAIN, rng)) for dom in S.DOMAINS]
    test = {dom: S.sample(dom, 1000, rng) for dom in S.DOMAINS}
    sites = S.adaptation_sites(0, 200, predictors)
    model = fit_dmsa(sites, "classification", random_state=0, **S.DMSA_OPTIONS)
    plain = float(np.mean([np.mean(model.predict(X) == y) for X, y in test.values()]))
    assert res["eps=inf"] == pytest.approx(plain, abs=1e-12)
    assert 0.5 <= res["eps=1"] <= 1.0


def test_points_for_one_point_of_accuracy():
    def row(off, on):
        return {"eps=inf": {"synthetic": {"mean": off, "std": 0.0}}, "eps=1": {"synthetic": {"mean": on, "std": 0.0}}}

    by_size = {"100": row(0.99, 0.95), "300": row(0.99, 0.985), "1000": row(0.99, 0.97), "3000": row(0.99, 0.989)}
    assert privacy.points_for_one_point_of_accuracy(by_size) == 3000
    by_size["3000"] = row(0.99, 0.9)
    assert privacy.points_for_one_point_of_accuracy(by_size) is None
