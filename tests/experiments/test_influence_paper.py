"""The influence report on the paper's experiments (quick modes): every combined model carries
it, and no honest site is flagged (the min-max trade-off between honest domains is not an
attack; see msa_fed.core.influence.flagged_at)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from msa_fed.experiments import digits, sentiment, synthetic
from msa_fed.runtime import coordinator


@pytest.fixture
def tables(monkeypatch):
    seen = []
    fit = coordinator.Coordinator.fit

    def recording(self):
        self.config = replace(self.config, influence=True)  # the experiments fit without the report
        model = fit(self)
        seen.append(model.info["influence"])
        return model

    monkeypatch.setattr(coordinator.Coordinator, "fit", recording)
    return seen


@pytest.mark.parametrize("experiment", [synthetic, sentiment, digits], ids=["synthetic", "sentiment", "digits"])
def test_no_site_is_flagged_in_the_papers_experiments(experiment, tables):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experiment.run(1, quick=True, log=lambda *_: None)
    assert tables, "no DMSA fit ran"
    for table in tables:
        assert table is not None and len(table["loss_without"]) == len(table["sites"])
        assert table["flagged"] == [], table
