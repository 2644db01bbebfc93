"""A lying site and a predictor that is confidently wrong on real rows, in process: the
coordinator's plausibility checks name the liar, the influence report flags the flip site and
the liar and no honest site, and the "regret" objective protects the honest sites."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import liars  # noqa: E402
from hostile_predictors import whole_number_sites  # noqa: E402

from msa_fed.api import SiteData, build_config, make_backend  # noqa: E402
from msa_fed.artifacts.predictors import load_predictor  # noqa: E402
from msa_fed.errors import PeerFault  # noqa: E402
from msa_fed.jobs.run import check_influence  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.plausibility import AnswerChecker, ImplausibleAnswer  # noqa: E402


def _fit(hostile=None, liar: str = "", lie: str = "", objective: str = "minmax"):
    """The in-process fit of the three whole-number sites; (model, {site: (X_test, y_test)})."""
    data = whole_number_sites(hostile)
    sites = [
        SiteData(n, Xl, yl, Xu, load_predictor(onnx, kind="probabilities")) for n, (Xl, yl, Xu, onnx, _) in data.items()
    ]
    config = build_config("dmsa", solver_options={"objective": objective}, random_state=0, influence=True)
    backend = make_backend(sites, config)
    backend.worker_cls = liars.LyingSite
    liars.LIAR, liars.MODE = liar, lie
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Coordinator(backend, [s.predictor for s in sites], config) as coordinator:
                return coordinator.fit()
    finally:
        liars.LIAR, liars.MODE = "", ""


@pytest.fixture(scope="module")
def honest():
    return _fit()


@pytest.fixture(scope="module")
def flip():
    return _fit({"west": "flip"})


def test_a_forged_qhat_partial_names_the_liar_not_the_site_that_would_refuse():
    with pytest.raises(ImplausibleAnswer) as err:
        _fit(liar="west", lie="qhat")
    assert err.value.site == "west"
    text = str(err.value)
    assert "'west'" in text and "north" not in text and "east" not in text and "\n" not in text


def test_losses_that_do_not_follow_their_gradients_name_the_liar():
    with pytest.raises(ImplausibleAnswer) as err:
        _fit(liar="east", lie="noise")
    assert err.value.site == "east"


def test_the_influence_report_flags_no_honest_site(honest):
    table = honest.info["influence"]
    assert table["sites"] == ["north", "east", "west"]
    assert table["flagged"] == []
    assert table["evaluations"] > 0
    check_influence(honest, 0.1)  # an honest model is stored


def test_the_influence_report_flags_the_flip_site(flip):
    table = flip.info["influence"]
    assert table["flagged"] == ["west"]
    with pytest.raises(PeerFault) as err:
        check_influence(flip, 0.1)
    assert err.value.site == "west" and "not stored" in str(err.value)
    check_influence(flip, None)  # no margin: reported, not refused


def test_the_influence_report_flags_the_site_that_overstates_its_losses(honest):
    # north adds 3.0 to its own domain's loss: consistent with its gradients, so its answers are
    # plausible; the min-max pulls z towards north to lower that claim, at west's expense
    model = _fit(liar="north", lie="inflate")
    table = model.info["influence"]
    assert table["flagged"] == ["north"]
    assert model.z[0] > honest.z[0] + 0.3


def _accuracy(model, site: str) -> float:
    Xl, yl, *_ = whole_number_sites()[site]
    return float(np.mean(model.predict(Xl) == yl))


def test_the_regret_objective_protects_the_honest_sites_from_the_flip_site(honest, flip):
    regret = _fit({"west": "flip"}, objective="regret")
    # min-max lets the flip site, the worst-off domain, pull north's loss up to lower its own
    assert flip.domain_losses[0] > honest.domain_losses[0] * 1.15
    assert regret.domain_losses[0] < flip.domain_losses[0] * 0.9
    assert regret.info["influence"]["flagged"] == []
    liar = _fit(liar="north", lie="inflate", objective="regret")  # a constant overstatement cancels
    np.testing.assert_allclose(liar.z, _fit(objective="regret").z, atol=1e-6)


def test_the_answer_checker_alone():
    from msa_fed.core.dc_terms import DCSums
    from msa_fed.boundary import messages as m

    ch = AnswerChecker(["a", "b"], [10, 20], "cross_entropy")
    ok = [m.QhatPartial(sums=np.array([0.4, 0.1]), n=10), m.QhatPartial(sums=np.array([0.05, 0.45]), n=20)]
    ch.qhat_partials(ok)
    with pytest.raises(ImplausibleAnswer, match="'b'"):
        ch.qhat_partials([ok[0], m.QhatPartial(sums=np.array([0.05, 0.45]), n=21)])
    with pytest.raises(ImplausibleAnswer, match="'a'"):
        ch.qhat_partials([m.QhatPartial(sums=np.array([0.6, -0.1]), n=10), ok[1]])
    ch.qhat(ok, np.array([0.45, 0.55]))
    z = np.array([0.5, 0.5])
    part = [
        m.DCPartial(sums=DCSums(L=np.array([0.3, 0.1]), n=10)),
        m.DCPartial(sums=DCSums(L=np.array([0.1, 0.2]), n=20)),
    ]
    ch.dc_partials(part, z, 0.01, ("L",))
    ch.dc_partials(part, z, 0.01, ("L",))  # the same answer again: fine
    other = [part[0], m.DCPartial(sums=DCSums(L=np.array([0.1, 0.25]), n=20))]
    with pytest.raises(ImplausibleAnswer, match="'b'.*same z"):
        ch.dc_partials(other, z, 0.01, ("L",))
    # site a holds 0.4/0.45 of domain 0's mass: its loss on it is at most that times -log(1e-12)
    too_big = [m.DCPartial(sums=DCSums(L=np.array([25.0, 0.1]), n=10)), part[1]]
    with pytest.raises(ImplausibleAnswer, match="'a'.*above its bound"):
        ch.dc_partials(too_big, np.array([0.4, 0.6]), 0.01, ("L",))
    negative = [part[0], m.DCPartial(sums=DCSums(L=np.array([0.1, -0.2]), n=20))]
    with pytest.raises(ImplausibleAnswer, match="'b'.*negative"):
        ch.dc_partials(negative, np.array([0.3, 0.7]), 0.01, ("L",))


def test_the_report_and_the_summary_print_the_influence_table(flip):
    from msa_fed.jobs.operations import summary_lines
    from msa_fed.jobs.report import report_html

    page = report_html(flip)
    assert "<h2>Influence</h2>" in page and "including west changes" in page and "FLAGGED" in page
    lines = summary_lines(flip)
    assert any(line.startswith("influence:") for line in lines)
    assert any("including west" in line and "FLAGGED" in line for line in lines)


def _fit_whole_number_sites(data: dict) -> None:
    """DMSA's fit by the coordinator over the sites of :func:`whole_number_sites`' ``data``."""
    sites = [
        SiteData(n, Xl, yl, Xu, load_predictor(onnx, kind="probabilities")) for n, (Xl, yl, Xu, onnx, _) in data.items()
    ]
    config = build_config("dmsa", random_state=0)
    with Coordinator(make_backend(sites, config), [s.predictor for s in sites], config) as coordinator:
        coordinator.fit()


@pytest.mark.parametrize("kind,what", [("nan", "NaN or inf"), ("range", "values outside \\[0, 1\\]")])
def test_a_predictor_whose_outputs_fail_the_check_is_named_by_its_owner(kind, what):
    """A peer's predictor that answers NaN (or probabilities outside [0, 1]) on an honest site's
    rows (whole numbers) stops the fit with one line naming the predictor's OWNER and the site
    where it failed, never an index nor which rows or how many (a count of the rows a hostile
    function fails on is a counting query on the site's data)."""
    data = whole_number_sites({"west": kind})
    Xl, yl, Xu, onnx, est = data["west"]
    data["west"] = (Xl + 0.5, yl, Xu, onnx, est)  # its own rows pass: only the peers' fail
    with pytest.raises(PeerFault) as err:
        _fit_whole_number_sites(data)
    assert err.value.site == "west"
    msg = str(err.value)
    assert re.fullmatch(
        rf"site 'west''s predictor: predict_proba returned {what} for some of site '(north|east)''s labelled points",
        msg,
    ), msg
    assert not re.search(r"\d", msg.replace("[0, 1]", ""))  # no index, no count, no measured value


def test_a_sites_own_predictor_failing_on_its_points_is_a_config_error_naming_it():
    from msa_fed.errors import ConfigError

    data = whole_number_sites({"west": "nan"})
    for name in ("north", "east"):  # the peers' rows pass: only west's own fail
        Xl, yl, Xu, onnx, est = data[name]
        data[name] = (Xl + 0.25, yl, Xu + 0.25, onnx, est)
    with pytest.raises(ConfigError) as err:
        _fit_whole_number_sites(data)
    assert not isinstance(err.value, PeerFault)
    assert str(err.value) == (
        "site 'west''s own predictor: predict_proba returned NaN or inf for some of its labelled points"
    )
