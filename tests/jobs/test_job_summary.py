"""The job summary names the DC rounds each site answered, from the saved model's info."""

from __future__ import annotations

from collections import Counter

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed import SiteData, fit_dmsa
from msa_fed.artifacts.model import load_model
from msa_fed.boundary.messages import Recorder
from msa_fed.jobs.operations import summary_lines


def _sites(seed: int, n: int) -> list[SiteData]:
    """Three 2-d sites shifted apart, n - 100 labelled points each (100 train the predictor)."""
    rng = np.random.default_rng(seed)
    sites = []
    for k in range(3):
        X = rng.normal(size=(n, 2)) + 2.0 * k
        y = (X[:, 0] + rng.normal(size=n) > 2.0 * k).astype(int)
        predictor = LogisticRegression().fit(X[:100], y[:100])
        sites.append(SiteData(f"s{k}", X[100:], y[100:], rng.normal(size=(200, 2)) + 2.0 * k, predictor))
    return sites


def test_summary_counts_the_rounds_each_site_answered(tmp_path):
    sites = _sites(0, 400)
    recorder = Recorder()
    model = fit_dmsa(sites, "classification", recorder=recorder, influence=True)
    rounds = model.info["solver"]["n_evaluations"]
    extra = model.info["influence"]["rounds"]  # the influence report's re-solves, in lockstep rounds
    assert extra < model.info["influence"]["evaluations"]  # one batched request a round
    asked = Counter(
        site for direction, site, method, _ in recorder.records if direction == "to_site" and method == "dc_evaluate"
    )
    assert asked == {f"s{k}": rounds + extra for k in range(3)}  # the counts are what each site answered
    saved = load_model(model.save(tmp_path / "model"))
    line = next(line for line in summary_lines(saved) if line.startswith("DC solver"))
    assert f": {rounds} rounds for z (queries each site answered; the influence report {extra} more, " in line
    assert f"{rounds + extra} in all" in line
    assert "converged = True" in line


def test_without_the_influence_report_the_sites_answer_the_solver_only():
    """fit_dmsa's default (a researcher's fit): no influence report, no query beyond the solver's."""
    sites = _sites(1, 300)
    recorder = Recorder()
    model = fit_dmsa(sites, "classification", recorder=recorder)
    assert model.info["influence"] is None
    rounds = model.info["solver"]["n_evaluations"]
    asked = Counter(
        site for direction, site, method, _ in recorder.records if direction == "to_site" and method == "dc_evaluate"
    )
    assert asked == {f"s{k}": rounds for k in range(3)}
    line = next(line for line in summary_lines(model) if line.startswith("DC solver"))
    assert "influence report" not in line and f": {rounds} rounds for z" in line


def test_the_data_channel_lines_say_what_each_sites_calls_went_over():
    """One line per site after the run, from the calls its endpoint counted: all over the data
    channel, some through Ray's own connections (said in words, and that nothing less safe is
    used), or none at all (a run that resumed its domain classifier sends no per-round calls)."""
    from types import SimpleNamespace

    from msa_fed.jobs.operations import channel_lines
    from msa_fed.runtime.ray_sites import _Endpoint

    sites = [_Endpoint(n, i, handle=None) for i, n in enumerate(("north", "east", "west"))]
    sites[0].channel_calls = 12
    sites[1].channel_calls, sites[1].ray_calls = 9, 3
    lines = channel_lines(SimpleNamespace(stand_ins=SimpleNamespace(sites=sites)), "tls")
    assert lines[0] == "site north: tls data channel open: it carried all 12 per-round calls"
    assert lines[1].startswith("site east: tls data channel not open for 3 of 12 per-round calls: those went over Ray")
    assert "nothing less safe is used in its place" in lines[1]
    assert lines[2].startswith("site west: tls data channel not needed: this run sent it no per-round calls")
    assert channel_lines(SimpleNamespace(stand_ins=SimpleNamespace(sites=sites)), "off") == []


def test_a_federated_jobs_site_lines_say_where_the_classifier_is_trained():
    """Federated: each site answers from its own process; the line says whether the domain
    classifier's steps go to a Ray actor standing in for it (and over which channel) or the job
    trains it itself on the published samples (small samples: no stand-in actor starts)."""
    from msa_fed.jobs.operations import site_lines

    actors = site_lines(["north", "east"], "tls", topology="federated")
    here = site_lines(["north", "east"], "tls", topology="federated", classifier_in_process=True)
    assert (
        [x.split(";")[0] for x in actors]
        == [x.split(";")[0] for x in here]
        == [
            f"site {n}: answers from its own process through the registry's relay (topology federated)"
            for n in ("north", "east")
        ]
    )
    assert "run in a Ray actor over direct mutual-TLS data channel" in actors[0]
    assert "the domain classifier is trained here, on the published samples" in here[0]
    assert "Ray" not in here[1]
