"""Centred DP answers (``[dp] difference_clip``): the centre's losses released once per job and
eta, the clipped differences per answer; the sensitivities hold for every replaced point and the
job's events compose (dp-accounting) to its epsilon."""

from types import SimpleNamespace

import numpy as np
import pytest

from msa_fed.errors import PrivacyError
from msa_fed.privacy.dp import centred_losses, clipped_losses
from msa_fed.privacy.policy import SitePolicy
from msa_fed.runtime import messages as m
from tests.privacy import attacks as A
from tests.privacy.test_policy import _honest_spec


def _points(rng, n, p, loss="cross_entropy"):
    """A site's point set with the invariants of a real one: w = pi Q(k|x) / Qhat(k), pi = 1 / (p n)."""
    qhat = rng.dirichlet(np.ones(p) * 5)
    Q = rng.dirichlet(np.ones(p) * 0.3, size=n)
    pi = np.full(n, 1.0 / (p * n))
    H = rng.uniform(1e-9, 1.0, size=(n, p)) if loss == "cross_entropy" else rng.uniform(1, 5, size=(n, p))
    y = rng.uniform(1, 5, size=n)
    return SimpleNamespace(w=pi[:, None] * Q / qhat, pi=pi, H=H, y=y, loss=loss)


def _replace(pts, rng, i, extreme):
    """The neighbour: point i replaced by another (an extreme one: far outside every predictor)."""
    p = pts.w.shape[1]
    w, H, y = pts.w.copy(), pts.H.copy(), pts.y.copy()
    k = rng.integers(p)
    w[i] = pts.pi[i] * rng.uniform(0, 20, size=p) if not extreme else pts.pi[i] * np.where(np.arange(p) == k, 50.0, 0.0)
    H[i] = (
        rng.uniform(1e-12, 1.0, size=p) if not extreme else np.full(p, 1e-300 if pts.loss == "cross_entropy" else 1.0)
    )
    y[i] = 100.0 if extreme else rng.uniform(1, 5)
    return SimpleNamespace(w=w, pi=pts.pi, H=H, y=y, loss=pts.loss)


@pytest.mark.parametrize("loss", ["cross_entropy", "squared"])
@pytest.mark.parametrize("p", [2, 3, 5])
def test_sensitivities_hold_for_every_replaced_point(p, loss):
    rng = np.random.default_rng([p, len(loss)])
    pol = SitePolicy(dp_enabled=True, loss_clip=5.0, ratio_clip=float(p), dp_difference_clip=0.5)
    pts = _points(rng, 40, p, loss)
    worst_ref = worst_diff = 0.0
    for trial in range(200):
        z = rng.dirichlet(np.ones(p) * 0.5)
        eta = float(rng.choice([1e-3, 0.01, 0.1]))
        ref, diff, s_ref, s_diff = centred_losses(pts, z, eta, pol)
        nb = _replace(pts, rng, int(rng.integers(40)), extreme=trial % 2 == 0)
        ref2, diff2, s_ref2, s_diff2 = centred_losses(nb, z, eta, pol)
        assert (s_ref, s_diff) == (s_ref2, s_diff2)  # data-independent
        assert s_diff == pytest.approx(s_ref * 2 * 0.5 / 5.0)  # loss_clip / (2 b) = 5 times less
        worst_ref = max(worst_ref, np.linalg.norm(ref - ref2) / s_ref)
        worst_diff = max(worst_diff, np.linalg.norm(diff - diff2) / s_diff)
    assert worst_ref <= 1 + 1e-12 and worst_diff <= 1 + 1e-12
    assert worst_diff > 0.2  # the extreme neighbours come near the bound: the test can see a breach


def test_centre_plus_differences_is_the_clipped_loss_where_no_difference_is_clipped():
    rng = np.random.default_rng(3)
    pts = _points(rng, 50, 2)
    pts.H = np.clip(pts.H, 0.5, 1.0)  # predictors that agree enough: |loss(z) - loss(centre)| < log 2
    pol = SitePolicy(dp_enabled=True, loss_clip=5.0, ratio_clip=2.0, dp_difference_clip=1.0)
    for z in ([0.5, 0.5], [0.9, 0.1], [0.2, 0.8]):
        ref, diff, _, _ = centred_losses(pts, np.array(z), 0.01, pol)
        L, _ = clipped_losses(pts, np.array(z), 0.01, pol)
        np.testing.assert_allclose(ref + diff, L, rtol=1e-12)


def test_a_centred_job_spends_its_epsilon_once_for_the_centre_then_per_answer(tmp_path):
    import dp_accounting
    from dp_accounting import rdp

    pol = SitePolicy(
        dp_enabled=True,
        epsilon_per_job=1.0,
        delta=1e-6,
        dp_dc_evaluations=4,
        dp_difference_clip=0.5,
        ledger=str(tmp_path / "l.sqlite"),
    )
    w, X, _y = A.victim(1, policy=pol, job_id="centred")
    w.set_domain_model(_honest_spec(X))
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    outs = [w.dc_evaluate(m.DCRequest(z=np.array(z), eta=0.01, what=("L",))) for z in ([0.5, 0.5], [0.2, 0.8])]
    dp = w.guard.dp
    assert dp.reference_multiplier == pytest.approx(dp.noise_multiplier / 2)  # sqrt of the 4 planned
    events = sorted(w.guard.ledger.dp_events("centred"))
    assert events == sorted([(dp.reference_multiplier, 1), (dp.noise_multiplier, 2)])
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(dp.reference_multiplier))
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(dp.noise_multiplier), 2))
    assert outs[-1].epsilon == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    # the plan (the centre once, 4 differences) spends the job's epsilon exactly; a 5th is refused
    for _ in range(2):
        w.dc_evaluate(m.DCRequest(z=np.array([0.7, 0.3]), eta=0.01, what=("L",)))
    assert w.guard.dp.epsilon_job() == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(PrivacyError, match="epsilon_per_job") as err:
        w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))
    assert err.value.rule == "dp_budget"


def test_a_new_eta_pays_for_a_new_centre_release(tmp_path):
    pol = SitePolicy(
        dp_enabled=True,
        epsilon_per_job=1.0,
        delta=1e-6,
        dp_dc_evaluations=4,
        dp_difference_clip=0.5,
        ledger=str(tmp_path / "l.sqlite"),
    )
    w, X, _y = A.victim(1, policy=pol, job_id="etas")
    w.set_domain_model(_honest_spec(X))
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
    w.dc_evaluate(m.DCRequest(z=np.array([0.3, 0.7]), eta=0.01, what=("L",)))
    # the centre at another eta is a new release: half the job's budget again, more than is left
    with pytest.raises(PrivacyError, match="epsilon_per_job") as err:
        w.dc_evaluate(m.DCRequest(z=np.array([0.3, 0.7]), eta=0.02, what=("L",)))
    assert err.value.rule == "dp_budget"
    w.dc_evaluate(m.DCRequest(z=np.array([0.6, 0.4]), eta=0.01, what=("L",)))  # the kept centre: no new release
    dp = w.guard.dp
    assert dict(w.guard.ledger.dp_events("etas")) == {dp.reference_multiplier: 1, dp.noise_multiplier: 2}


def test_difference_clip_is_read_from_the_policy_file(tmp_path):
    from msa_fed.errors import ConfigError
    from msa_fed.privacy.policy import load_policy

    f = tmp_path / "policy.toml"
    f.write_text("[dp]\nenabled = true\ndifference_clip = 0.5\n")
    assert load_policy(f).dp_difference_clip == 0.5
    f.write_text("[dp]\ndifference_clip = -1.0\n")
    with pytest.raises(ConfigError, match="difference_clip must be >= 0"):
        load_policy(f)
