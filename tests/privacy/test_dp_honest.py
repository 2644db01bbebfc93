"""DP that is honest: DP at one site never makes another site refuse, DP losses are shown as
estimates (never negative), and the epsilon of each site is in the summary, the report and
``model show``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

from msa_fed.artifacts.privacy_view import ESTIMATE_NOTE, MEASURED_NOTE, epsilon_line, loss_texts, shown_losses
from msa_fed.jobs.operations import summary_lines
from msa_fed.jobs.report import report_html
from msa_fed.privacy.dp import VERDICT_ANSWERS, calibrate, epsilon_of
from msa_fed.privacy.policy import SitePolicy
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.local import LocalSites

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs  # noqa: E402


def _fit(sites, policies, recorder=None):
    kw = site_kwargs(sites)
    for k, pol in zip(kw, policies):
        k["policy"] = pol
    backend = LocalSites(kw)
    with Coordinator(backend, [s.predictor for s in sites], FitConfig(), recorder=recorder) as c:
        model = c.fit()
        audits = [w.guard.audit.records() for w in backend.workers]
    return model, audits


@pytest.mark.parametrize("seed", range(4))
def test_dp_at_one_site_never_makes_another_refuse(seed):
    """A small DP budget makes the DP site's Qhat partial noisy enough to pull the broadcast
    Qhat below a non-DP site's own share (the refusal this test was written for); the non-DP
    sites compute with their own share there and answer."""
    sites = make_sites(random_state=seed)
    dp = SitePolicy(dp_enabled=True, epsilon_per_job=0.3, dp_dc_evaluations=30)
    model, audits = _fit(sites, [dp, SitePolicy(), SitePolicy()])
    assert not [r for recs in audits for r in recs if r["outcome"] != "answered"]
    assert model.epsilon_by_site["a"] > 0 and model.epsilon_by_site["b"] == model.epsilon_by_site["c"] == 0
    assert np.all(model.domain_losses >= 0)
    assert model.z.sum() == pytest.approx(1.0)


def test_a_dp_site_answers_qhat_from_its_published_sample_at_no_epsilon():
    """The DP site's Qhat partial is over its published sample: no noise, nothing spent, and
    the broadcast can no longer fall below another site's own share."""
    from msa_fed.boundary.messages import Recorder

    sites = make_sites(random_state=2)
    dp = SitePolicy(dp_enabled=True, epsilon_per_job=0.3, dp_dc_evaluations=30)
    rec = Recorder()
    model, audits = _fit(sites, [dp, SitePolicy(), SitePolicy()], recorder=rec)
    (part,) = [msg for d, s, meth, msg in rec.records if d == "from_site" and s == "a" and meth == "set_domain_model"]
    Q = model.domain_model.predict_proba(sites[0].X_unlabeled)
    assert part.dp and part.epsilon == 0.0
    assert np.allclose(part.sums, Q.mean(axis=0) / 3)
    assert sum(r["decisions"].get("qhat_floored", 0) for recs in audits[1:] for r in recs) == 0


def test_losses_and_epsilon_are_shown_as_dp_estimates(tmp_path):
    sites = make_sites(random_state=1)
    dp = SitePolicy(dp_enabled=True, epsilon_per_job=1.0, dp_dc_evaluations=12)
    model, _ = _fit(sites, [dp, dp, SitePolicy()])
    # the DP sites' verdicts are answered (from the answer their plan reserves for them): the
    # losses shown are the sites' measurements, the DP sites' marked noisy
    assert model.info["site_check"]["noisy"] == [True, True, False]
    text = "\n".join(summary_lines(model))
    assert "epsilon spent by site: a=" in text and "c=0 (DP off)" in text and MEASURED_NOTE in text
    assert "L_k(z) = a=~" in text and " c=~" not in text
    # the epsilon shown is what each DP site spent: the composition (dp-accounting) of its 12 DC
    # answers and its verdict, under the multiplier calibrated for that plan
    nm = calibrate(1.0, dp.delta, dp.dp_dc_evaluations + VERDICT_ANSWERS)
    spent = epsilon_of([(nm, dp.dp_dc_evaluations + VERDICT_ANSWERS)], dp.delta)
    assert model.epsilon_by_site["a"] == pytest.approx(spent, rel=1e-9) and spent <= 1.0 + 1e-6
    line = f"epsilon spent by site: a={spent:.4g}, b={spent:.4g}, c=0 (DP off)"
    assert line in text
    page = report_html(model)
    assert line in page and "measured by site k" in page
    # a model without the sites' verdicts shows the solver's losses as DP estimates
    bare = copy.copy(model)
    bare.info = {**model.info, "site_check": None}
    assert ESTIMATE_NOTE in "\n".join(summary_lines(bare)) and "DP estimate" in report_html(bare)
    # a negative noisy loss is never shown as a loss
    eps = {"a": 1.0, "b": 0.0}
    assert loss_texts([-1.4958, 0.3], eps) == ["~0.0000", "~0.3000"]
    assert list(shown_losses([-1.0, 0.2], eps)) == [0.0, 0.2]
    assert loss_texts([-1.0], {"a": 0.0}) == ["-1.0000"]  # without DP: the measured value as it is
    assert epsilon_line(["a", "b"], eps) == "a=1, b=0 (DP off)" and epsilon_line(["a"], {"a": 0.0}) is None
    # what `msa-fed model show` prints from a stored manifest
    import contextlib
    import io

    from msa_fed.control.ops import cli as ops_cli

    man = model.manifest()
    assert man["epsilon_by_site"]["a"] > 0

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ops_cli.print_model_facts(man)
    shown = out.getvalue()
    assert "epsilon" in shown and "a=" in shown and "~" in shown
