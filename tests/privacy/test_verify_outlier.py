"""The verification's decision reads no labelled point (msa_fed/privacy/verify.py).

The attack: a coordinator sends a model crafted to sit on the border of the site's tolerance.
If the tolerance depended on max |Phi(x)| over the site's labelled points, a site holding one
labelled outlier would refuse the model its twin accepts: one bit about one patient per probe.
Two sites identical except one labelled point far outside every published point answer every
crafted model alike; where they compute with the model, the outlier reaches it through the map
capped at the published points' largest norm, so the bound the decision rests on holds there too.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.core.features import feature_map_state
from msa_fed.errors import PrivacyError
from msa_fed.privacy.verify import PUBLISHED_MEMO, NormCappedMap, check_maxent
from msa_fed.site.worker import SiteWorker

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs  # noqa: E402
from test_verify import ROOMY, honest, spec_of  # noqa: E402

P = 3


@pytest.fixture(scope="module")
def sites():
    return make_sites(n_labeled=(61, 73, 89), n_unlabeled=(120, 150, 180), random_state=11)


@pytest.fixture(scope="module")
def opt(sites):
    return honest(sites)


def outlier_rows(sites):
    """Site 0's labelled points with the first replaced by a point 40 standard deviations out
    along the first feature (far beyond every published point)."""
    X = sites[0].X_labeled.copy()
    U = np.vstack([s.X_unlabeled for s in sites])
    X[0] = U.mean(axis=0)
    X[0, 0] += 40.0 * U[:, 0].std()
    return X


def twins(sites, policy):
    """Site 0 as given and its twin whose labelled sample differs in one point (the outlier)."""
    out = []
    for X in (sites[0].X_labeled, outlier_rows(sites)):
        kw = site_kwargs(sites)[0]
        kw.update(policy=policy, X_labeled=X)
        w = SiteWorker(**kw)
        w.set_published(m.PublishedSamples(tuple(s.X_unlabeled for s in sites)))
        out.append(w)
    return out


def answer(worker, spec):
    try:
        worker.set_domain_model(spec)
    except PrivacyError as exc:
        return exc.rule
    return "ok"


def crafted(opt, sites, scales):
    """Models off the optimum along one direction aligned with the outlier (the first feature's
    weight of the first column), with the deviation each has at a site (public data only)."""
    D = opt.n_features_
    U = [s.X_unlabeled for s in sites]
    state = feature_map_state(opt.feature_map)
    loose = replace(ROOMY, verify_tolerance=1e9)
    out = []
    for t in scales:
        theta = opt.theta_.copy()
        theta[0] += t
        theta[D + 1 + 1] -= 0.5 * t  # and a second, so the model is not a single-weight move
        dev = check_maxent(theta, opt.mu, state, U, loose, "probe")["verify_deviation"]
        out.append((theta, dev))
    return out


def test_twins_that_differ_in_one_labelled_outlier_answer_every_borderline_model_alike(sites, opt):
    models = crafted(opt, sites, np.geomspace(1e-6, 3e-2, 7))
    for theta, dev in models:
        spec = spec_of(opt, P, theta=theta)
        # the tolerance just above the model's deviation (accept) and just below it (refuse)
        for tol, want in ((dev * (1 + 1e-9), "ok"), (dev * (1 - 1e-9), "verify_optimum")):
            PUBLISHED_MEMO.clear()
            plain, with_outlier = twins(sites, replace(ROOMY, verify_tolerance=tol))
            got = (answer(plain, spec), answer(with_outlier, spec))
            assert got == (want, want), (dev, tol, got)
            if want == "ok":  # both audited the same deviation, from the published points alone
                devs = [w.guard.audit.records()[-1]["decisions"]["verify_deviation"] for w in (plain, with_outlier)]
                assert devs[0] == devs[1] == pytest.approx(dev, rel=1e-12)


def test_the_outlier_is_computed_with_at_the_published_radius_and_the_bound_holds_there(sites, opt):
    D = opt.n_features_
    theta, dev = crafted(opt, sites, [3e-3])[0]
    _, twin = twins(sites, replace(ROOMY, verify_tolerance=1.0))
    twin.set_domain_model(spec_of(opt, P, theta=theta))
    rec = twin.guard.audit.records()[-1]["decisions"]
    R = rec["verify_phi_max"]
    Phi = np.asarray(opt.feature_map.transform(twin.X_labeled))
    norms = np.linalg.norm(Phi, axis=1)
    assert norms[0] > 5 * R and norms[1:].max() <= R  # the outlier is beyond every published point
    capped = NormCappedMap(opt.feature_map, R).transform(twin.X_labeled)
    np.testing.assert_allclose(np.linalg.norm(capped, axis=1), np.minimum(norms, R), rtol=1e-12)
    np.testing.assert_array_equal(capped[1:], Phi[1:])  # the other points are unchanged
    np.testing.assert_allclose(capped[0], Phi[0] * R / norms[0], rtol=1e-12)
    # the site's Q is the model's softmax over the capped map
    Wb = theta.reshape(P, D + 1)
    Z = capped @ Wb[:, :D].T + Wb[:, D]
    Q = np.exp(Z - Z.max(axis=1, keepdims=True))
    Q /= Q.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(twin._Q, Q, rtol=1e-10, atol=1e-15)
    # the bound: at every point the site computes with, the weights' part of each log-odds moves
    # by at most the audited deviation from the optimum's
    dW = Wb[:, :D] - opt.theta_.reshape(P, D + 1)[:, :D]
    shift = capped @ dW.T
    pairwise = np.abs(shift[:, :, None] - shift[:, None, :]).max()
    assert pairwise <= rec["verify_deviation"] * (1 + 1e-9)


def test_honest_models_are_unchanged_at_points_inside_the_published_radius(sites, opt):
    """The cap moves nothing an honest job computes with at a site without outliers: Q on its
    labelled points is the model's own predict_proba."""
    plain, _ = twins(sites, ROOMY)
    plain.set_domain_model(spec_of(opt, P))
    np.testing.assert_array_equal(plain._Q, opt.predict_proba(plain.X_labeled))


@pytest.mark.parametrize("verify", [True, False])
def test_twins_answer_borderline_maps_and_kde_bandwidths_alike(sites, opt, verify):
    """The other checks of a domain model that measure the site's data (a map's scale against the
    site's spread, a KDE bandwidth against it) measure its published sample, so the twins answer
    models crafted on their border alike too, with the verification on or off."""
    from msa_fed.core.density import KDEDomainModel

    policy = replace(ROOMY, verify_domain_models=verify)
    X0 = sites[0].X_unlabeled  # the site's published sample: what the coordinator knows
    sd = X0.std(axis=0)
    name, params, arrays = feature_map_state(opt.feature_map)
    kde = KDEDomainModel(bandwidth=0.5).fit([s.X_unlabeled for s in sites])
    floor = policy.kde_bandwidth_floor * float(np.mean(sd))
    specs = []
    for f in (1 + 1e-6, 1 - 1e-6):
        scale = arrays["scale"].copy()
        scale[0] = policy.scale_floor * sd[0] * f
        specs.append(spec_of(opt, P, feature_map=(name, params, {**arrays, "scale": scale})))
        specs.append(replace(m.domain_model_spec(kde, P), bandwidths=np.full(P, floor * f)))
    for spec in specs:
        PUBLISHED_MEMO.clear()
        plain, with_outlier = twins(sites, policy)
        assert answer(plain, spec) == answer(with_outlier, spec)
    # and the border is where the rules put it (the outcomes differ across it)
    PUBLISHED_MEMO.clear()
    outcomes = [answer(twins(sites, policy)[1], spec) for spec in specs]
    # (above the floor, a map other than the derived one is the verification's to refuse)
    assert outcomes == ["verify_feature_map" if verify else "ok", "ok", "feature_scale", "kde"]
