"""The policy inside the local runtime: a DP run end to end (epsilon in the model's manifest) and
the coordinator's one-line refusal.  A Ray site actor reading its policy from its own node is
tests/runtime/test_ray_runtime.py (on that module's local Ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from msa_fed.artifacts.model import load_model
from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.local import LocalSites

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs


@pytest.fixture(scope="module")
def sites():
    return make_sites()


def _fit(sites, policies, **config):
    kw = site_kwargs(sites)
    for k, pol in zip(kw, policies):
        k["policy"] = pol
    with Coordinator(LocalSites(kw), [s.predictor for s in sites], FitConfig(**config)) as c:
        return c.fit()


def test_dp_run_ends_on_the_simplex_and_records_epsilon(sites, tmp_path):
    pols = [SitePolicy(dp_enabled=True, epsilon_per_job=1.0, dp_dc_evaluations=12)] * len(sites)
    model = _fit(sites, pols)  # the solver would spend DP_EVALUATIONS (30); the sites allow 12
    assert model.z.shape == (3,) and model.z.min() >= 0 and model.z.sum() == pytest.approx(1.0)
    # the sites plan 12 DC answers and their verdict (VERDICT_ANSWERS); the noisy solver asks until
    # a site refuses, which it does once a DC answer would eat into the verdict's reserve: the
    # solver gets exactly the planned DC answers and every site still answers the harm request
    from msa_fed.privacy.dp import VERDICT_ANSWERS, calibrate, epsilon_of

    assert model.info["solver"]["method"] == "dp-surrogate"
    assert model.info["solver"]["n_evaluations"] == 12
    check = model.info["site_check"]
    assert check is not None and check["sites"] == [s.name for s in sites]
    assert check["noisy"] == [True] * 3 and not any(check["harmed"])  # shown, not judged
    # each site reports the exact composition (dp-accounting) of the answers it gave: the 12 DC
    # answers and the verdict, under the multiplier calibrated for that plan
    nm = calibrate(1.0, pols[0].delta, 12 + VERDICT_ANSWERS)
    spent = epsilon_of([(nm, 12 + VERDICT_ANSWERS)], pols[0].delta)
    assert model.epsilon_by_site == pytest.approx({s.name: spent for s in sites}, rel=1e-9)
    assert set(model.epsilon_by_site) == {s.name for s in sites}
    assert all(0.9 < e <= 1.0 + 1e-6 for e in model.epsilon_by_site.values())
    model.save(tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.epsilon_by_site == model.epsilon_by_site
    X = np.vstack([s.X_labeled for s in sites])
    P = back.predict_proba(X)
    assert np.allclose(P.sum(axis=1), 1.0)
    import json

    from msa_fed.errors import ArtifactError

    mf = tmp_path / "m" / "manifest.json"
    for bad in ("x", {"a": -1.0}, {"a": "1"}):
        doc = json.loads(mf.read_text())
        doc["epsilon_by_site"] = bad
        mf.write_text(json.dumps(doc))
        with pytest.raises(ArtifactError, match="epsilon_by_site"):
            load_model(tmp_path / "m")


def test_honest_run_without_dp_records_zero_epsilon(sites):
    model = _fit(sites, [None] * len(sites))
    assert model.epsilon_by_site == {s.name: 0.0 for s in sites}
    assert model.info["solver"]["method"] != "dp-surrogate"


def test_refusal_is_one_line_naming_site_and_rule(sites):
    pols = [SitePolicy(), SitePolicy(dc_evaluations_per_job=2), SitePolicy()]
    with pytest.raises(PrivacyError) as err:
        _fit(sites, pols)
    assert err.value.site == "b" and err.value.rule == "budget"
    assert "\n" not in str(err.value) and str(err.value).startswith("site 'b' refuses")
