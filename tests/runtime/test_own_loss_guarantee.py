"""The own-loss guarantee in a fit (solver option ``guarantee``): the sites report their own
predictor's loss in one verdict request before the solve (same policy and budget as any), the
solve keeps every L_k(z) within it where it can, and one line says what it got."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from problems import make_sites, site_kwargs  # noqa: E402

from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.core.config import SolverConfig  # noqa: E402
from msa_fed.jobs.operations import summary_lines  # noqa: E402
from msa_fed.privacy.policy import SitePolicy  # noqa: E402
from msa_fed.runtime.config import FitConfig  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402


def _fit(sites, guarantee, policies=None):
    kw = site_kwargs(sites)
    for k, pol in (policies or {}).items():
        kw[k]["policy"] = pol
    backend = LocalSites(kw)
    rec = m.Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = FitConfig(solver=SolverConfig(guarantee=guarantee))
        with Coordinator(backend, [s.predictor for s in sites], config, recorder=rec) as c:
            model = c.fit()
            audits = [w.guard.audit.records() for w in backend.workers]
    return model, rec, audits


@pytest.fixture(scope="module")
def sites():
    return make_sites()


@pytest.fixture(scope="module")
def tight(sites):
    """slack 0 on this federation: no z keeps every site within its own predictor's loss."""
    return _fit(sites, 0.0)


def test_the_sites_report_their_own_loss_before_the_solve(sites, tight):
    model, rec, audits = tight
    g = model.guarantee
    for records in audits:
        verdicts = [r for r in records if r["request"] == "harm"]
        # the own-loss request and the verdict on the model, each answered under the site's policy
        assert [r["outcome"] for r in verdicts] == ["answered", "answered"]
        first_dc = next(i for i, r in enumerate(records) if r["request"] == "dc_evaluate")
        assert records.index(verdicts[0]) < first_dc  # asked before the solve
    asked = [r[3] for r in rec.records if r[0] == "to_site" and r[2] == "harm"]
    assert len(asked) == 2 * len(sites) and np.asarray(asked[0].z).shape == (1, len(sites))
    # the own losses the solve used are the ones the sites measure in their verdict
    np.testing.assert_allclose(g["own"], model.info["site_check"]["own"], rtol=1e-12)


def test_an_infeasible_guarantee_gives_the_closest_point_in_one_line(sites, tight):
    model, _, _ = tight
    g = model.guarantee
    assert g["status"] == "infeasible" and not g["holds"]
    np.testing.assert_allclose(g["losses"], model.domain_losses, rtol=1e-12)
    # the closest point: its largest excess no larger than the free min-max point's
    free = np.asarray(g["own"])
    assert max(g["excess"]) <= g["max_loss_unconstrained"] - free[int(np.argmax(g["excess"]))] + 1e-9
    lines = [line for line in summary_lines(model) if line.startswith("own-loss guarantee")]
    assert lines == [g["line"]] and "NOT feasible" in g["line"]


def test_a_guarantee_that_holds_moves_nothing(sites):
    model, _, _ = _fit(sites, 1.0)
    g = model.guarantee
    assert g["status"] == "holds at the min-max point" and g["holds"] and g["evaluations"] == 0
    assert np.all(np.asarray(g["excess"]) <= 0) and "at no cost" in g["line"]


def test_with_dp_at_a_site_the_guarantee_is_not_applied_and_no_answer_is_spent(sites):
    dp = SitePolicy(dp_enabled=True, epsilon_per_job=1.0, dp_dc_evaluations=30)
    model, _, audits = _fit(sites, 0.0, policies={0: dp})
    g = model.guarantee
    assert g["status"] == "not applied" and "differential privacy at a" in g["line"]
    assert [r["request"] for r in audits[0]].count("harm") == 1  # only the verdict: the DP plan holds
