"""Target checks on known truth on Adult's Doc / NDoc domains and its education groups (reads
the data sets; see :func:`msa_fed.experiments.target.adult_case` and ``adult_left_out``)."""

from __future__ import annotations

import numpy as np

from msa_fed.experiments import target as T


def test_adult_mixtures_losses_and_support():
    model, samplers, losses, _ = T.adult_case(seed=0)
    res = T.run_draws(model, samplers, losses, draws=10, n_target=2000, n_boot=100)
    s = res["summary"]
    assert s["em"]["mean_l1"] <= 0.05 and s["bbse"]["mean_l1"] <= 0.05, s
    # the Doc pool is Adult's 181 Doc test rows: the truth is itself a sample, whose error counts
    # (strict coverage over independent trials: benchmarks/bench_target.py --independent)
    assert s["bbse"]["covered_with_pool_error"] >= 9, s
    assert s["flagged_in_support"] <= 0.015, s
    # the loss spread behind the interval: the Doc site's own 49 reference rows say 0.47, its
    # labelled rows (where its loss was measured) 0.54 with their real labels
    assert model.target_reference.loss_sd[0] >= 0.5, model.target_reference.loss_sd


def test_an_education_group_left_out_of_the_federation_is_flagged():
    # Doctorate, Bachelors and HS-grad sites (73 to 143 published rows left once rows equal to a
    # labelled one stay home); Masters rows have an education no site has
    model, X_out, X_in = T.adult_left_out("Masters", seed=0)
    assert model.target_reference.score == "category_rarity"
    assert min(R.shape[0] for R in model.target_reference.reference) < 99  # 1 / (m + 1) > 0.01 there
    assert T.flagged_rate(model, X_in) <= 0.015
    # beyond every calibration score of every site: p = u / (m + 1), flagged with probability
    # min(1, 0.01 (m + 1)) at the smallest site (74 rows: 0.74)
    flagged = T.flagged_rate(model, X_out)
    assert 0.6 < flagged, flagged
    # counting ties against the point, the smallest site could never flag
    assert np.mean(model.support(X_out, randomize_ties=False).pvalue <= 0.01) == 0.0
