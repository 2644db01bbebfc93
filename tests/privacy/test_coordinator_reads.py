"""A coordinator that reads (and steers) what honest sites send it, under the default policy.

Sites of 300 labelled points with balanced labels independent of x (chance: 50%).  The decoder
(:mod:`tests.privacy.transcript`) solves the transcript for the label bits by least squares.
When the labelled inputs are published it reads every label (the sanity half of each test);
when the site publishes a disjoint sample, as every path that publishes a sample now requires,
it is at chance.  Then the stranger and p-bound refusals, the refusal-text and set_qhat
channels.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from msa_fed.api import SiteData
from msa_fed.boundary import messages as m
from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy
from tests.privacy import attacks as A
from tests.privacy import transcript as T

CHANCE = 0.60  # at most 60% of balanced binary labels


@pytest.fixture(scope="module", params=[3, 4], ids=["p3", "p4"])
def honest(request):
    sites = T.federation(request.param)
    model, live = T.honest_fit(sites)
    return sites, model, live


def test_passive_decoding_of_one_honest_transcript(honest):
    sites, model, live = honest
    victim, site = live["s0"], sites[0]
    assert sum(1 for x in victim.transcript if x[0] == "dc_evaluate") >= 10  # a real DC solve (19 rounds at p = 4)
    # the attack works on a site whose published sample is its labelled inputs ...
    assert T.recovered(victim, site, site.X_labeled) >= 0.90
    # ... and is at chance when the labelled inputs never leave the site
    assert T.recovered(victim, site, site.X_unlabeled) <= CHANCE


def test_the_decoder_reads_every_answer_exactly(honest):
    """The decoder's model of the site is exact: at the true labelled inputs and labels every
    row of the transcript's system holds to rounding, the lockstep rounds' batched requests and
    the harm verdict included (a misread answer leaves a residual; an unread one fails)."""
    sites, _model, live = honest
    victim, site = live["s0"], sites[0]
    assert any(x[0] == "dc_evaluate" and np.ndim(x[1].z) == 2 for x in victim.transcript)
    A, b, source = T.system(victim, site.X_labeled, site.X_labeled.shape[0])
    assert {"dc_evaluate", "harm"} <= set(source)
    residual = A @ site.y_labeled - b
    for kind in ("dc_evaluate", "harm"):
        rows = np.asarray(source) == kind
        assert np.abs(residual[rows]).max() <= 1e-9 * max(1.0, np.abs(b[rows]).max()), kind


def test_z_eta_sweep_with_the_honest_classifier(honest):
    sites, _model, live = honest
    victim, site = live["s0"], sites[0]
    got = T.sweep(victim, 300, seed=1)  # within every default budget: nothing is refused
    assert got == 300
    assert T.recovered(victim, site, site.X_labeled) >= 0.99
    assert T.recovered(victim, site, site.X_unlabeled) <= CHANCE


def test_repeated_jobs_stay_at_chance(tmp_path):
    """Five runs of the same federation sharing the site's ledger, each followed by a sweep; the
    attacker pools every transcript (lifetime composition of exact answers): still chance."""
    pol = SitePolicy(ledger=str(tmp_path / "ledger.sqlite"))
    sites = T.federation(3, seed=3)
    rows = []
    for run in range(5):
        _model, live = T.honest_fit(sites, policies=[pol, None, None], random_state=run)
        T.sweep(live["s0"], 100, seed=run)
        rows.extend(live["s0"].transcript)
    pooled = live["s0"]
    pooled.transcript = rows
    assert T.recovered(pooled, sites[0], sites[0].X_unlabeled) <= CHANCE
    assert T.recovered(pooled, sites[0], sites[0].X_labeled) >= 0.99


def _fakes(sites, k: int, where: np.ndarray, seed: int = 0) -> list[SiteData]:
    """k fake sites registered by the coordinator: each publishes 300 points around where[j]
    and holds made-up labelled data (it answers what the coordinator wants)."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(k):
        Xu = where[j] + 0.05 * rng.normal(size=(300, T.D))
        X = where[j] + 0.05 * rng.normal(size=(300, T.D))
        out.append(SiteData(f"fake{j}", X, rng.permutation(np.arange(300) % 2), Xu, sites[1].predictor))
    return out


def test_fake_sites_without_the_labelled_inputs_are_at_chance():
    """Default policy (peers = "any"): fake sites tile the victim's region with their published
    samples, so the honestly trained classifier cuts it into cells; the decoder works per cell."""
    sites = T.federation(2, seed=5)
    c = sites[0].X_unlabeled.mean(axis=0)
    grid = np.array([c + [dx, dy] for dx in (-1.0, 0.0, 1.0) for dy in (-1.0, 0.0, 1.0)])
    job = sites + _fakes(sites, 9, grid)
    _model, live = T.honest_fit(job)
    T.sweep(live["s0"], 200)
    assert T.recovered(live["s0"], sites[0], sites[0].X_unlabeled) <= CHANCE


def test_fake_sites_are_strangers_to_a_site_that_names_its_peers():
    """Fake sites whose samples sit on the victim's labelled points (the attack with leaked
    inputs): a site whose policy names its peers refuses the job before any aggregate, naming
    the strangers; the honest job of the same sites runs."""
    sites = T.federation(2, seed=6)
    job = sites + _fakes(sites, 3, sites[0].X_labeled[:3])
    pol = SitePolicy(peers=["s0", "s1"])
    with pytest.raises(PrivacyError, match=r"fake0', 'fake1', 'fake2'\]: not among its peers") as err:
        T.honest_fit(job, policies=[pol] + [None] * 4)
    assert err.value.rule == "peers" and err.value.site == "s0"
    victim = T.RecordingSite.live["s0"]
    assert victim.transcript == []  # nothing was answered
    _model, live = T.honest_fit(sites, policies=[pol, None])
    assert live["s0"].transcript


def test_more_sites_than_max_sites_is_refused():
    sites = T.federation(2, seed=7)
    job = sites + _fakes(sites, 3, np.zeros((3, T.D)))
    with pytest.raises(PrivacyError, match="max_sites=4") as err:
        T.honest_fit(job, policies=[SitePolicy(max_sites=4)] + [None] * 4)
    assert err.value.rule == "max_sites"


def _numbers(value) -> list[str]:
    out = []
    if isinstance(value, dict):
        for v in value.values():
            out += _numbers(v)
    elif isinstance(value, (float, np.floating)) and value not in (0.0, 1.0):
        out += [f"{value:.3g}", f"{value:.4g}", repr(float(value))]
    return out


def test_refusals_carry_no_value_measured_on_labelled_data():
    """Every refusal the rules can give on the victim's data: the text names the rule and the
    request's values; the measured ones are in the site's audit log only."""
    from msa_fed.core.features import StandardFeatures, feature_map_state

    w, X, _y = A.victim(2, n=300)
    c = A.Coordinator(w)
    honest = StandardFeatures().fit(X)
    sd = X.std(axis=0)
    specs = [
        A.standard_spec(X.mean(axis=0), sd * 0.01, [1.0, 0.0], 0.0),  # scale below the floor
        A.standard_spec(X.mean(axis=0) + 50 * sd, sd, [1.0, 0.0], 0.0),  # mean too far
    ]
    for spec in specs:
        assert c.ask("set_domain_model", spec) is None
    state = feature_map_state(honest)
    ok = m.DomainModelSpec(
        kind="maxent", n_sources=2, feature_map=state, theta=np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    )
    own = w.set_domain_model(ok).sums
    # a qhat below the site's own share is not refused (a refusal would say "qhat_k < your share",
    # one bit about the labelled points): the site computes with its own share there, silently
    assert c.ask("set_qhat", m.QhatBroadcast(qhat=np.array([own[0] / 3, 1 - own[0] / 3]), eta=0.01)) is not None
    assert json.loads(w.guard.audit.lines[-1])["decisions"]["qhat_floored"] == 1
    refused = [json.loads(x) for x in w.guard.audit.lines if json.loads(x)["outcome"] == "refused"]
    assert [r["rule"] for r in refused] == ["feature_scale", "feature_mean"]
    assert set(c.refusals) == {"feature_scale", "feature_mean"}
    for rec in refused:
        measured = _numbers(rec["decisions"])
        assert measured  # the log kept what was measured ...
        for text in measured:  # ... and the message that left the site carries none of it
            assert text not in rec["detail"], (rec["rule"], text, rec["detail"])


def test_set_qhat_probes_are_charged_and_bounded():
    """Probing qhat (a refusal says whether qhat_k is below the site's own share: one bit) is
    a query: each probe is charged to the DC budget, and the job's probes stop at it."""
    w, X, _y = A.victim(1, n=300, policy=SitePolicy(dc_evaluations_per_job=40))
    from msa_fed.core.features import StandardFeatures, feature_map_state

    spec = m.DomainModelSpec(
        kind="maxent",
        n_sources=2,
        feature_map=feature_map_state(StandardFeatures().fit(X)),
        theta=np.array([2.0, 0.0, 0.0, 0.0]),
    )
    w.set_domain_model(spec)
    c = A.Coordinator(w)
    lo, hi = 0.0, 1.0
    for _ in range(100):  # bisection on qhat_0 against the site's own share
        mid = (lo + hi) / 2
        ok = c.ask("set_qhat", m.QhatBroadcast(qhat=np.array([mid, 1 - mid]), eta=0.01))
        if ok is None and c.refusals.get("budget"):
            break
        lo, hi = (lo, mid) if ok is not None else (mid, hi)
    assert c.refusals["budget"] >= 1
    assert c.answers + c.refusals.get("qhat", 0) == 40  # every probe, answered or refused, was charged
