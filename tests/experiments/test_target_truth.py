"""Target checks on known truth (:mod:`msa_fed.experiments.target`): the paper's synthetic
domains (here) and Adult (``test_target_adult.py``, reads the data sets): 10 random mixtures of
2000 target points each."""

from __future__ import annotations

import numpy as np

from msa_fed.experiments import target as T


def test_synthetic_mixtures_losses_and_support():
    model, samplers, losses, left_out = T.synthetic_case(seed=0, n=500, n_pool=5000)
    res = T.run_draws(model, samplers, losses, draws=10, n_target=2000, n_boot=60)
    s = res["summary"]
    assert s["em"]["mean_l1"] <= 0.05 and s["bbse"]["mean_l1"] <= 0.05, s
    assert s["bbse"]["covered"] >= 9 and s["em"]["covered"] >= 9, s
    # in-support target points flagged at alpha = 0.01: at most 1.5% over the 10 draws
    assert s["flagged_in_support"] <= 0.015, s
    # the truth is checked, not echoed: lambda-hat moves with lambda
    lam = np.array([r["lambda"][0] for r in res["rows"]])
    hat = np.array([r["bbse"]["lambda_hat"][0] for r in res["rows"]])
    assert np.corrcoef(lam, hat)[0, 1] > 0.99
    # a domain outside the federation (N(12, 1), where neither site has points) is flagged
    (X,) = left_out.values()
    assert T.flagged_rate(model, X) > 0.9
