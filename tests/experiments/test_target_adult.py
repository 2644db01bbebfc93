"""Target checks on known truth on Adult's Doc / NDoc domains (reads the data sets; see
:func:`msa_fed.experiments.target.adult_case`)."""

from __future__ import annotations

from msa_fed.experiments import target as T


def test_adult_mixtures_losses_and_support():
    model, samplers, losses, _ = T.adult_case(seed=0)
    res = T.run_draws(model, samplers, losses, draws=10, n_target=2000, n_boot=100)
    s = res["summary"]
    assert s["em"]["mean_l1"] <= 0.05 and s["bbse"]["mean_l1"] <= 0.05, s
    # the Doc pool is Adult's 181 Doc test rows: the truth is itself a sample, whose error counts
    assert s["bbse"]["covered_with_pool_error"] >= 9, s
    assert s["flagged_in_support"] <= 0.015, s
