"""Every site's verdict on the combined model: the model's loss on its own labelled data against
its own predictor's, measured by the site (msa_fed/core/harm.py); the sites whose exclusion removes
a harm named as suspects; the losses shown anywhere are the ones the sites measured."""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_predictors import age_sites, framing_sites, poisoning_sites, whole_number_sites  # noqa: E402
from problems import make_sites, site_kwargs  # noqa: E402

from msa_fed import fit_dmsa  # noqa: E402
from msa_fed.api import SiteData, build_config, make_backend  # noqa: E402
from msa_fed.artifacts.model import load_model  # noqa: E402
from msa_fed.artifacts.predictors import load_predictor  # noqa: E402
from msa_fed.artifacts.privacy_view import MEASURED_NOTE, reported_losses  # noqa: E402
from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.boundary import wire  # noqa: E402
from msa_fed.core.config import WHEN_HARMED  # noqa: E402
from msa_fed.core.harm import SUSPECTS_HEAD, harmed, measured_losses, suspects  # noqa: E402
from msa_fed.errors import PrivacyError  # noqa: E402
from msa_fed.jobs.operations import summary_lines  # noqa: E402
from msa_fed.jobs.report import report_html  # noqa: E402
from msa_fed.privacy.dp import VERDICT_ANSWERS, calibrate  # noqa: E402
from msa_fed.privacy.policy import SitePolicy  # noqa: E402
from msa_fed.runtime.config import FitConfig  # noqa: E402
from msa_fed.runtime.coordinator import DP_EVALUATIONS, Coordinator  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402
from msa_fed.site.worker import SiteWorker  # noqa: E402

#: the sites' tolerance in the attack tests: a site that wants to hear of a smaller harm than the
#: default's sets a lower one (the honest run of the same federation stays below it)
TOLERANCE = 0.4
#: the smooth lie: the liar's own domain's loss plus LIE * (1 - z_liar), with its gradient
LIE = 1.0


class SmoothLiar(SiteWorker):
    """Site 'evil' makes its own domain look hard: its DC answers add a smooth term, with the
    matching gradient (plausible along the solver's path), that is large unless z favours it.
    With ``claims`` set it also lies in its verdict: harmed at the model's z, and worse off at
    every mixture without it."""

    claims = False

    def dc_evaluate(self, msg):
        out = SiteWorker.dc_evaluate(self, msg)
        if self.name == "evil":
            e, z = self.index, np.asarray(msg.z)  # one z, or a batch (rows first)
            if out.sums.L is not None:
                out.sums.L = out.sums.L.copy()
                out.sums.L[..., e] += LIE * (1 - z[..., e])
            if out.sums.dL is not None:
                out.sums.dL = out.sums.dL.copy()
                out.sums.dL[..., e, e] -= LIE
        return out

    def harm(self, msg):
        out = SiteWorker.harm(self, msg)
        if self.name == "evil" and self.claims:
            return replace(out, combined=out.combined + 5.0, own=0.01)
        return out


class ClaimingLiar(SmoothLiar):
    claims = True


def _sites():
    """north, east and evil (the whole-number sites; evil's records off the whole numbers)."""
    out = []
    for name, (Xl, yl, Xu, onnx, _) in whole_number_sites().items():
        if name == "west":
            name, Xl, Xu = "evil", Xl + 0.25, Xu + 0.25
        out.append(SiteData(name, Xl, yl, Xu, load_predictor(onnx, kind="probabilities")))
    return out


def _fit(worker_cls=SiteWorker, tolerance=TOLERANCE, accept=True, influence=True, suspects="corroborated"):
    sites = [replace(s, policy=SitePolicy(harm_tolerance=tolerance, accept_harm=accept)) for s in _sites()]
    config = build_config("dmsa", random_state=0, influence=influence, suspects=suspects)
    backend = make_backend(sites, config)
    backend.worker_cls = worker_cls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Coordinator(backend, [s.predictor for s in sites], config) as coordinator:
            return coordinator.fit(), sites


@pytest.fixture(scope="module")
def honest():
    return _fit()


@pytest.fixture(scope="module")
def lied():
    return _fit(SmoothLiar)


def _own_measure(model, site: SiteData, clip: float = 10.0) -> tuple[float, float]:
    """(combined, own): the two means the site measures, recomputed here from the model."""
    P = model.predict_proba(site.X_labeled)
    cols = np.searchsorted(model.classes_, site.y_labeled)
    combined = np.clip(-np.log(np.maximum(P[np.arange(len(cols)), cols], 1e-12)), 0, clip).mean()
    Po = site.predictor.predict_proba(site.X_labeled)
    own = np.clip(-np.log(np.maximum(Po[np.arange(len(cols)), cols], 1e-12)), 0, clip).mean()
    return float(combined), float(own)


# ---------------------------------------------------------------------- the verdict
def test_every_site_measures_the_model_on_its_own_data(honest):
    model, sites = honest
    check = model.info["site_check"]
    assert check["sites"] == ["north", "east", "evil"]
    for k, site in enumerate(sites):
        combined, own = _own_measure(model, site)
        assert check["combined"][k] == pytest.approx(combined, rel=1e-6)
        assert check["own"][k] == pytest.approx(own, rel=1e-6)
        assert model.harm[site.name] == pytest.approx(combined - own, rel=1e-6, abs=1e-9)
    assert check["noisy"] == [False] * 3 and check["signs_off"] == [True] * 3
    # one verdict per site with the influence analysis: the model's z and the p re-solves
    assert len(check["combined_without"]) == 3 and all(len(r) == 3 for r in check["combined_without"])


def test_an_honest_federation_names_nobody(honest):
    model, _ = honest
    assert model.suspects == () and model.disputed == ()
    assert not any(model.info["site_check"]["harmed"])


def test_the_verdicts_are_in_the_manifest_the_summary_and_the_report(honest, tmp_path, capsys):
    model, _ = honest
    loaded = load_model(model.save(tmp_path / "m"))
    assert loaded.harm == pytest.approx(model.harm) and loaded.suspects == ()
    text = "\n".join(summary_lines(model))
    c, o = model.info["site_check"]["combined"][0], model.info["site_check"]["own"][0]
    assert f"north: the combined model's loss on north's data is {c:.4f} against {o:.4f} for north's own predictor" in (
        text
    )
    assert f"{SUSPECTS_HEAD}: none" in text
    assert MEASURED_NOTE in text and f"L_k(z) = north={c:.4f}" in text
    from msa_fed.control.ops.cli import print_model_facts

    print_model_facts(model.manifest())  # `msa-fed model show`: the stored manifest's facts
    shown = capsys.readouterr().out
    assert f"north={c:.4f}" in shown and MEASURED_NOTE in shown
    page = report_html(model)
    assert "<h2>The sites' verdicts</h2>" in page and "for north&#x27;s own predictor" in page


# ---------------------------------------------------------------------- the attack
def test_a_site_that_makes_its_own_domain_look_hard_is_accused_by_the_site_it_harms(honest, lied):
    """North, harmed, says its harm goes away without evil: reported, but north's word alone
    names nobody (a lone accusation reads the same when the accuser lies:
    test_a_lone_lying_verdict_does_not_name_the_site_it_accuses); north protects itself by not
    signing the model off (test_a_site_that_does_not_accept_harm_disputes_the_model)."""
    model, _ = lied
    check = model.info["site_check"]
    assert model.z[2] > honest[0].z[2] + 0.2  # the lie pulled z towards evil
    assert check["harmed"] == [True, False, False] and model.harm["north"] > 2 * honest[0].harm["north"]
    assert check["removed_by"]["north"] == ["evil"]
    assert model.suspects == () and check["not_named"] == ["evil"]
    lines = summary_lines(model)
    assert any("HARMED" in line and line.strip().startswith("north:") for line in lines)
    assert "  north's harm goes away without evil" in lines
    assert any(line.startswith("  not named: evil (one other site, hostile, would account") for line in lines)


def test_a_jobs_default_makes_the_influence_report_only_once_a_site_is_harmed(honest, lied):
    """``influence="when-harmed"`` (a job's default): the honest federation pays the verdict
    request and not one re-solve (its rounds are the solver's); the lie that harms north gets
    the same verdicts as with the report always on, and then the report itself, the same table."""
    counts: list[int] = []  # rows of each dc_evaluate request site 0 answered

    def counting(worker_cls):
        class Counted(worker_cls):
            def dc_evaluate(self, msg):
                if self.index == 0:
                    counts.append(np.atleast_2d(np.asarray(msg.z)).shape[0])
                return worker_cls.dc_evaluate(self, msg)

        return Counted

    model, _ = _fit(counting(SiteWorker), influence=WHEN_HARMED)
    assert model.info["influence"] is None and not any(model.info["site_check"]["harmed"])
    assert np.allclose(model.z, honest[0].z, rtol=0, atol=1e-12) and model.suspects == ()
    # the solve's rounds and no more (the report's re-solves of the fixture's fit: many more)
    assert len(counts) == model.info["solver"]["n_evaluations"] < len(counts) + honest[0].info["influence"]["rounds"]
    counts.clear()
    harmed_model, _ = _fit(counting(SmoothLiar), influence=WHEN_HARMED)
    check, always = harmed_model.info["site_check"], lied[0].info
    assert check["harmed"] == always["site_check"]["harmed"] == [True, False, False]
    assert check["removed_by"] == always["site_check"]["removed_by"] == {"north": ["evil"]}
    table = harmed_model.info["influence"]
    assert table is not None and table["flagged"] == always["influence"]["flagged"]
    np.testing.assert_allclose(table["loss_without"], always["influence"]["loss_without"], rtol=0, atol=1e-9)
    assert any(line.startswith("influence:") for line in summary_lines(harmed_model))
    assert not any(line.startswith("influence:") for line in summary_lines(model))
    assert len(counts) > harmed_model.info["solver"]["n_evaluations"] + table["rounds"]  # and the exclusion solves


def test_a_consortium_that_trusts_its_members_verdicts_names_the_liar_on_one_word(honest):
    """``suspects="any"``: north's accusation alone names evil, in the model, the summary and the
    report; the honest run names nobody under it either."""
    model, _ = _fit(SmoothLiar, suspects="any")
    check = model.info["site_check"]
    assert check["harmed"] == [True, False, False] and check["removed_by"]["north"] == ["evil"]
    assert model.suspects == ("evil",) and check["not_named"] == [] and check["accusers"] == {"evil": ["north"]}
    assert f"  {SUSPECTS_HEAD}: evil (on north's word alone)" in summary_lines(model)
    assert "evil (on north&#x27;s word alone)" in report_html(model)
    assert _fit(suspects="any")[0].suspects == ()


def test_on_one_word_a_lying_verdict_frames_an_honest_site():
    """The price of ``suspects="any"``: evil's lying verdict alone names honest north."""
    model, _ = _fit(FramingLiar, tolerance=SitePolicy().harm_tolerance, influence=False, suspects="any")
    assert model.suspects == ("north",) and model.info["site_check"]["accusers"] == {"north": ["evil"]}


def test_the_exclusion_solves_advance_in_lockstep_to_the_z_they_reach_one_after_another():
    """The re-solves without each site and its data (asked once a site is harmed) share their
    rounds: one batched request per site per round, the rounds those of the longest solve, and
    the same z's, to rounding, as the solves one after another (one request per z)."""
    sites = [replace(s, policy=SitePolicy(harm_tolerance=TOLERANCE)) for s in _sites()]
    config = build_config("dmsa", random_state=0, influence=True)
    backend = make_backend(sites, config)
    backend.worker_cls = SmoothLiar
    requests: list[int] = []  # rows of each dc_evaluate request site 0 answered
    real = SmoothLiar.dc_evaluate

    def counted(self, msg):
        if self.index == 0:
            requests.append(np.atleast_2d(np.asarray(msg.z)).shape[0])
        return real(self, msg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Coordinator(backend, [s.predictor for s in sites], config) as coordinator:
            model = coordinator.fit()
            SmoothLiar.dc_evaluate = counted
            try:
                together, rounds, refused = coordinator.exclusion_solves()
                n_together, rows_together = len(requests), sum(requests)
                requests.clear()
                apart, evaluations, refused_apart = coordinator.exclusion_solves(lockstep=False)
            finally:
                SmoothLiar.dc_evaluate = real
    assert refused is None and refused_apart is None
    np.testing.assert_allclose(together, apart, rtol=0, atol=1e-12)
    assert np.all(np.diag(together) == 0.0) and np.allclose(together.sum(axis=1), 1.0)
    # the fit ran them in lockstep, in as many rounds
    assert model.info["site_check"]["rounds_without_site"] == rounds == n_together
    assert len(requests) == evaluations == rows_together  # one request per z one after another
    assert max(requests) == 1 and rounds < evaluations / 2


def test_a_suspect_does_not_clear_itself_by_claiming_harm(lied):
    model, _ = _fit(ClaimingLiar)
    check = model.info["site_check"]
    assert check["harmed"] == [True, False, True]  # evil says the model harms it too
    # its claim holds at every mixture (it accuses nobody); north's harm still goes away without evil
    assert check["removed_by"]["evil"] == [] and check["removed_by"]["north"] == ["evil"]
    assert check["not_named"] == ["evil"] and model.suspects == ()


class FramingLiar(SiteWorker):
    """Site 'evil' frames north with its verdict alone, its DC answers honest: it says the model
    harms it (loss 3 against its own 0.01, past any tolerance), and that the harm goes away at
    every mixture without north (z_north = 0), and at none other."""

    def harm(self, msg):
        out = SiteWorker.harm(self, msg)
        if self.name != "evil":
            return out
        zs = np.atleast_2d(np.asarray(msg.z, dtype=np.float64))
        combined = np.where(zs[:, 0] == 0.0, 0.01, 3.0)
        return replace(out, combined=combined, own=0.01)


def test_a_lone_lying_verdict_does_not_name_the_site_it_accuses():
    """The strongest framing: evil's verdict is a lie shaped exactly like an honest harmed site's
    (harmed at z, not without north), at the default tolerance, with and without the influence
    analysis.  Under the rule "a harmed site names whoever's exclusion removes its harm" honest
    north was named; one site's verdict now names nobody, and the accusation is reported as
    evil's."""
    for influence in (False, True):
        model, _ = _fit(FramingLiar, tolerance=SitePolicy().harm_tolerance, influence=influence)
        check = model.info["site_check"]
        assert check["harmed"] == [False, False, True]
        assert check["removed_by"]["evil"] == ["north"]  # the accusation, as the old rule read it
        assert model.suspects == () and check["not_named"] == ["north"]
        assert "  evil's harm goes away without north" in summary_lines(model)


def _fit_data_sites(data: dict, **fit) -> tuple[list[SiteData], object]:
    """Sites from ``{name: (X_labeled, y_labeled, X_unlabeled, predictor ONNX)}``, each at the
    harm tolerance TOLERANCE, and DMSA fitted over them: (sites, model)."""
    sites = [
        SiteData(n, Xl, yl, Xu, load_predictor(o, kind="probabilities"), policy=SitePolicy(harm_tolerance=TOLERANCE))
        for n, (Xl, yl, Xu, o) in data.items()
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fit_dmsa(sites, "classification", random_state=0, **fit)
    return sites, model


def test_a_site_that_places_its_rows_against_a_peer_does_not_get_it_named():
    """Framing with data only, every verdict measured honestly: evil's labelled rows lie below
    south's published sample, spread where south's predictor is confident, labelled against the
    honest rule, and its own predictor (the opposite rule) is right on them.  Any model that serves
    south harms evil; without south and its data it does not, so evil's honest verdict accuses
    south (named by the rule a lone harm named by).  Nobody is named now."""
    sites, model = _fit_data_sites(framing_sites())
    check = model.info["site_check"]
    for k, site in enumerate(sites):  # the verdicts are the honest measurements
        assert check["combined"][k] == pytest.approx(_own_measure(model, site)[0], rel=1e-6)
    assert check["harmed"] == [False, False, True]
    table = np.asarray(check["loss_without_site"])  # evil is not harmed without south and its data
    assert not harmed(table[2, 1], check["own"][2], TOLERANCE)
    assert check["removed_by"] == {"evil": ["south"]}
    assert model.suspects == () and check["not_named"] == ["south"]


def test_a_site_that_does_not_accept_harm_disputes_the_model():
    model, _ = _fit(SmoothLiar, accept=False)
    assert "north" in model.disputed and "east" not in model.disputed
    assert any("does not sign the model off" in line for line in summary_lines(model))


def test_the_default_tolerance_accepts_the_honest_trade_off(honest):
    """At the default tolerance the sites are not harmed by an honest model (the default lies
    above every honest sweep's harm: msa_fed/core/harm.py)."""
    model, _ = _fit(tolerance=SitePolicy().harm_tolerance)
    assert not any(model.info["site_check"]["harmed"]) and model.suspects == ()


def _age_fit_sites(kind: str) -> list[SiteData]:
    data = age_sites(kind)
    return [SiteData(n, Xl, yl, Xu, load_predictor(o, kind="probabilities")) for n, (Xl, yl, Xu, o) in data.items()]


def _age_fit(kind: str):
    sites = _age_fit_sites(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fit_dmsa(sites, "classification", random_state=0, influence=True)
    return model, {s.name: float(np.mean(model.predict(s.X_labeled) == s.y_labeled)) for s in sites}, sites


def test_a_label_flipping_peer_loses_its_weight_and_harms_nobody():
    """evil's predictor is right on its own rows and on the probe, and confidently wrong on every
    row whose first feature is whole (an age: all of north's and south's).  Its answers reach the
    loss estimates of every domain through h_evil inside g_z, so the min-max sees that z_evil
    costs every domain: z_evil falls to about 0 and south's accuracy stays where the honest run
    has it; no site is harmed, so nobody is named (a site's verdict, not the flip, names a
    suspect: test_a_site_that_makes_its_own_domain_look_hard_is_named)."""
    honest, acc_h, _ = _age_fit("honest")
    flipped, acc_f, sites = _age_fit("flip_first")
    evil, honest_evil = sites[2].predictor, _age_fit_sites("honest")[2].predictor
    for site in sites[:2]:  # the flip is real: the opposite class of its honest twin on every row there
        assert np.all(evil.predict(site.X_labeled) != honest_evil.predict(site.X_labeled))
    own = sites[2].X_labeled  # and none on its own rows (nor on the probe's, which are not whole)
    np.testing.assert_allclose(evil.predict_proba(own), honest_evil.predict_proba(own), atol=1e-6)
    assert honest.z[2] > 0.1 and flipped.z[2] < 0.05  # the honest evil earns weight, the flipper loses it
    assert acc_f["south"] >= acc_h["south"] - 0.05 and acc_f["north"] >= acc_h["north"] - 0.02
    check = flipped.info["site_check"]
    assert not any(check["harmed"]) and flipped.suspects == () and flipped.disputed == ()
    assert max(check["harm"]) < 0.1


def test_a_peer_that_poisons_a_sites_loss_estimate_is_accused():
    """The strongest peer attack found (docs/DESIGN.md, "Each site's verdict"): evil puts labelled
    rows where the domain classifier gives them to north, labelled against north's rule, and
    publishes its sample far away.  North's loss estimate L_north now averages north's rows with
    evil's, so the min-max hands north's region to a predictor unsure of both (z goes to south):
    north's accuracy falls from 0.975 to 0.29.  Dropping evil's domain (the influence analysis's
    z^{-evil}) leaves evil's rows in L_north and the harm with them (measured: z^{-evil} = z, and
    the influence report flagged south); re-solving without evil and its rows removes the harm,
    and without south too: north accuses both.  North's word alone names neither (the same
    accusation from a lying site named an honest one:
    test_a_site_that_places_its_rows_against_a_peer_does_not_get_it_named)."""
    sites, model = _fit_data_sites(poisoning_sites())
    north = sites[0]
    assert np.mean(model.predict(north.X_labeled) == north.y_labeled) < 0.5  # honest: 0.975
    check = model.info["site_check"]
    assert check["harmed"][0] and model.harm["north"] > 0.5
    # the table the accusation used: north's loss without evil and its rows is within its tolerance
    table = np.asarray(check["loss_without_site"])
    assert table[0, 2] - check["own"][0] <= TOLERANCE * max(check["own"][0], 0.25)
    assert any(line.strip() == "north's harm goes away without south, evil" for line in summary_lines(model))
    # north is the only site that says so (evil is harmed too, by any mixture): one site's word
    # names nobody, honest south (whose exclusion also removes the harm) included
    assert check["harmed"] == [True, False, True] and check["removed_by"]["evil"] == []
    assert model.suspects == () and check["not_named"] == ["south", "evil"]


# ---------------------------------------------------------------------- DP
def test_reported_losses_are_within_dp_noise_of_the_sites_measurements():
    """With one DP site among honest ones, the losses shown (summary, report) are the sites' own
    measurements: the honest sites' exactly, the DP site's within the noise of its verdict,
    never the DP solver's estimates.  The DP site plans fewer DC answers than the DP solver asks
    for: the solver stops at them and the verdict is answered from the answer reserved for it."""
    n_dp = 4000  # the DP site's labelled points: its verdict's noise is ~1/n_dp, small enough to tell
    sites = make_sites(n_labeled=(n_dp, 53, 67), random_state=1)
    dp = SitePolicy(dp_enabled=True, epsilon_per_job=1.0, dp_dc_evaluations=12)
    kw = site_kwargs(sites)
    kw[0]["policy"] = dp
    backend = LocalSites(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Coordinator(backend, [s.predictor for s in sites], FitConfig()) as c:
            model = c.fit()
    assert model.info["solver"]["n_evaluations"] == dp.dp_dc_evaluations < DP_EVALUATIONS
    check = model.info["site_check"]
    assert check is not None and check["noisy"] == [True, False, False]
    values, texts, measured = reported_losses(model.info, model.domain_losses, model.epsilon_by_site)
    assert measured and texts[0].startswith("~") and not texts[1].startswith("~")
    # the verdict's noise: two means (combined, own), each moved by at most loss_clip / n by one
    # point, under the multiplier calibrated for the DP site's plan (its DC answers and the verdict)
    nm = calibrate(1.0, dp.delta, dp.dp_dc_evaluations + VERDICT_ANSWERS)
    sigma = nm * dp.loss_clip * math.sqrt(2) / n_dp
    assert sigma < 0.1
    for k, site in enumerate(sites):
        combined, own = _own_measure(model, site)
        tol = 5 * sigma if k == 0 else 1e-6
        assert abs(values[k] - combined) <= tol, (k, values[k], combined)
        assert abs(check["own"][k] - own) <= tol, (k, check["own"][k], own)
    text = "\n".join(summary_lines(model))
    assert "Gamma(z)" not in text and MEASURED_NOTE in text
    assert "L_k(z) = " + "  ".join(f"{s.name}={t}" for s, t in zip(sites, texts)) in text
    page = report_html(model)
    assert all(t in page for t in texts)


# ---------------------------------------------------------------------- the boundary
def test_the_verdict_crosses_the_wire_and_nothing_else_does():
    req = m.HarmRequest(z=np.array([[0.2, 0.8], [1.0, 0.0]]), eta=0.01)
    method, back = wire.decode(wire.encode("harm", req, wire.REQUESTS), wire.REQUESTS)
    assert method == "harm" and np.array_equal(back.z, req.z) and back.eta == 0.01
    ans = m.HarmAnswer(combined=np.array([0.3, 0.2]), own=0.1, n=40, epsilon=0.5, noisy=True, tolerance=2.0)
    _, got = wire.decode(wire.encode("harm", ans, wire.RESPONSES), wire.RESPONSES)
    assert np.array_equal(got.combined, ans.combined) and (got.own, got.n, got.noisy, got.signs_off) == (
        0.1,
        40,
        True,
        True,
    )
    with pytest.raises(wire.WireError):  # an answer is never a request
        wire.encode("harm", ans, wire.REQUESTS)
    with pytest.raises(wire.WireError):  # a negative epsilon does not parse
        wire.decode(wire.encode("harm", replace(ans, epsilon=-1.0), wire.RESPONSES), wire.RESPONSES)


def test_a_verdict_is_asked_at_no_more_than_p_plus_one_mixtures(honest):
    """A coordinator cannot turn the verdict into many evaluations of the labelled data."""
    sites = make_sites(random_state=0)
    backend = LocalSites(site_kwargs(sites))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Coordinator(backend, [s.predictor for s in sites], FitConfig()) as c:
            c.fit()
            worker = backend.workers[0]
            ok = worker.harm(m.HarmRequest(z=np.full((4, 3), 1 / 3), eta=0.01))
            assert ok.combined.shape == (4,)
            with pytest.raises(PrivacyError) as err:
                worker.harm(m.HarmRequest(z=np.full((5, 3), 1 / 3), eta=0.01))
            assert err.value.rule == "harm_z"
            with pytest.raises(PrivacyError) as err:
                worker.harm(m.HarmRequest(z=np.array([[0.5, 0.5, 0.0]]), eta=1e-9))
            assert err.value.rule == "eta_min"
            # the influence report's batches: at most p values of z, each charged
            used = worker.guard.ledger.used(worker.guard.job, "dc_evaluation")[0]
            batch = worker.dc_evaluate(m.DCRequest(z=np.full((3, 3), 1 / 3), eta=0.01, what=("L", "dL")))
            assert batch.sums.L.shape == (3, 3) and batch.sums.dL.shape == (3, 3, 3)
            assert worker.guard.ledger.used(worker.guard.job, "dc_evaluation")[0] == used + 3
            with pytest.raises(PrivacyError) as err:
                worker.dc_evaluate(m.DCRequest(z=np.full((4, 3), 1 / 3), eta=0.01, what=("L",)))
            assert err.value.rule == "z"
            records = worker.guard.audit.records()
    verdicts = [r for r in records if r["request"] == "harm"]
    assert [r["outcome"] for r in verdicts] == ["answered", "answered", "refused", "refused"]


def test_the_measurement_and_the_naming_rules():
    # the measured mean is the deployed model's: eta only, z on one site, z on both
    Q = np.array([[0.9, 0.1], [0.2, 0.8]])
    H = np.array([[0.8, 0.3], [0.4, 0.9]])
    qhat = np.array([0.55, 0.45])
    combined, own = measured_losses(Q, qhat, H, np.array([[1.0, 0.0], [0.5, 0.5]]), 0.0, "cross_entropy", 0)
    assert combined[0] == pytest.approx(np.mean(-np.log(H[:, 0])))
    r = Q / qhat
    g = (0.5 * r * H).sum(1) / (0.5 * r).sum(1)
    assert combined[1] == pytest.approx(np.mean(-np.log(g))) and own == pytest.approx(combined[0])
    clipped, _ = measured_losses(
        Q, qhat, np.full((2, 2), 1e-9), np.array([[0.5, 0.5]]), 0.0, "cross_entropy", 0, loss_clip=3.0
    )
    assert clipped[0] == pytest.approx(3.0)
    assert harmed(1.15, 0.2, 4.0) is False and harmed(1.3, 0.2, 2.0) is True and harmed(0.205, 0.2, 0.0) is False
    # a harmed, and not without c; c's own claim of harm accuses a and b: one accuser each, nobody named
    combined = np.array([[0.9, 0.9, 0.9, 0.2], [0.3, 0.3, 0.3, 0.3], [2.0, 0.1, 0.1, 2.0]])
    named, removed = suspects(["a", "b", "c"], combined, np.array([0.2, 0.3, 0.1]), np.full(3, 1.0))
    assert removed == {"a": ["c"], "c": ["a", "b"]} and named == ()  # each accused by one site
    # two harmed sites each cleared without c: c is named, and only c
    combined = np.array([[0.9, 0.9, 0.9, 0.2], [2.0, 2.0, 0.3, 0.3], [0.1, 0.1, 0.1, 0.1]])
    named, removed = suspects(["a", "b", "c"], combined, np.array([0.2, 0.3, 0.1]), np.full(3, 1.0))
    assert removed == {"a": ["c"], "b": ["c"]} and named == ("c",)
