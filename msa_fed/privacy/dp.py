"""Differential privacy at the site: the Gaussian mechanism, accounted by Google's dp-accounting.

Neighbouring data sets differ in one labelled point of the site (replace one; the site's
n, hence pi_i = 1 / (p n), is public).  Every aggregate derived from labelled data gets
Gaussian noise of standard deviation ``noise_multiplier * sensitivity``:

- Qhat partial: with DP on, the site answers the same estimate over its published unlabelled
  sample, (1/p) mean_{x in U} Q(k|x): public, so it costs no epsilon and carries no noise
  (measured: the noisy partial over the labelled points was what sent DP runs at 30 to 100
  labelled points per site to a bad z; docs/RESULTS.md).  ``qhat_sensitivity`` is kept for
  reference: a noisy labelled partial would have L2 sensitivity pi sqrt 2.
- DC sums (DP mode answers the losses L_k only): w_k(i) = pi_i min(q_k(x_i), ratio_clip) and the
  loss clipped to [0, loss_clip], so each coordinate of one point's contribution lies in
  [0, pi ratio_clip loss_clip] and the L2 sensitivity is pi ratio_clip loss_clip sqrt p.

- Centred DC sums (``difference_clip`` b > 0): the losses at the centre z_c = (1/p, ..., 1/p)
  (same eta), L(z_c) as above, are released once per job and eta with their own noise, kept
  and reused; every answer at z adds to them the differences sum_i w_k(i) clip(loss_i(z) -
  loss_i(z_c), -b, b), whose coordinates move by at most 2 pi ratio_clip b when one point is
  replaced: L2 sensitivity 2 pi ratio_clip b sqrt p, loss_clip / (2 b) times less than L(z)'s.
  The answer is the sum of the two releases (post-processing).  Where the domain classifier
  separates the domains, a point's loss hardly moves with z away from the vertices, so most of
  the difference is inside [-b, b] and the noise on what the solver compares (L at different
  z) shrinks by that factor; the centre's losses carry the rest.

Each answer is one ``GaussianDpEvent(noise_multiplier)``; a job's events are composed with the
RDP accountant of ``dp_accounting`` (never by hand).  The noise multiplier is calibrated once
per job (``calibrate_dp_mechanism``) so that the planned number of answers (``dp_dc_evaluations`` DC
answers) spends exactly ``epsilon_per_job`` at ``delta``; with centred sums the plan is one
release of the centre's losses (multiplier ``reference_multiplier``, given the same share of
the budget as all the differences together, in zero-concentrated terms 1 / (2 nm^2)) and the
planned differences.  An answer beyond the job's or the site's lifetime budget is refused; a
site that restarts draws the centre's noise anew and pays for it again.
"""

from __future__ import annotations

import math

import numpy as np

from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy


def make_accountant():
    from dp_accounting import rdp

    return rdp.RdpAccountant()


def epsilon_of(events: list[tuple[float, int]], delta: float) -> float:
    """epsilon at ``delta`` of the composition of ``count`` Gaussian mechanisms per (multiplier, count)."""
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent

    acc = make_accountant()
    for nm, count in events:
        if count > 0:
            acc.compose(SelfComposedDpEvent(GaussianDpEvent(nm), int(count)))
    return float(acc.get_epsilon(delta))


def calibrate(epsilon: float, delta: float, n_answers: int) -> float:
    """The smallest noise multiplier whose ``n_answers``-fold composition is (epsilon, delta)-DP."""
    import dp_accounting
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent

    return float(
        dp_accounting.calibrate_dp_mechanism(
            make_accountant,
            lambda nm: SelfComposedDpEvent(GaussianDpEvent(nm), int(n_answers)),
            float(epsilon),
            float(delta),
            dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
        )
    )


def calibrate_centred(epsilon: float, delta: float, n_answers: int) -> tuple[float, float]:
    """(difference multiplier s, centre multiplier s / sqrt n): one release of the centre's losses
    and ``n_answers`` differences, together (epsilon, delta)-DP, the centre with the same share
    of the budget (1 / (2 nm^2) each) as all the differences together."""
    import dp_accounting
    from dp_accounting import ComposedDpEvent, GaussianDpEvent, SelfComposedDpEvent

    n = int(n_answers)

    def event(s):
        return ComposedDpEvent([GaussianDpEvent(s / math.sqrt(n)), SelfComposedDpEvent(GaussianDpEvent(s), n)])

    s = float(
        dp_accounting.calibrate_dp_mechanism(
            make_accountant, event, float(epsilon), float(delta), dp_accounting.LowerEndpointAndGuess(1e-3, 1.0)
        )
    )
    return s, s / math.sqrt(n)


class DPAccountant:
    """DP state of one job at one site (events are stored in the site's ledger)."""

    def __init__(self, policy: SitePolicy, ledger, job: str, site: str):
        self.policy, self.ledger, self.job, self.site = policy, ledger, job, site
        self.planned = policy.dp_dc_evaluations
        self.centred = policy.dp_difference_clip > 0
        if self.centred:
            self.noise_multiplier, self.reference_multiplier = calibrate_centred(
                policy.epsilon_per_job, policy.delta, self.planned
            )
        else:
            self.noise_multiplier = calibrate(policy.epsilon_per_job, policy.delta, self.planned)
            self.reference_multiplier = float("nan")
        self._reference: dict[float, np.ndarray] = {}  # eta -> the released (noisy) losses at the centre
        self.rng = np.random.default_rng()  # seeded from the OS

    def epsilon_job(self) -> float:
        return epsilon_of(self.ledger.dp_events(self.job), self.policy.delta)

    def epsilon_lifetime(self) -> float:
        return epsilon_of(self.ledger.dp_events(None), self.policy.delta)

    def spend(self, nm: float | None = None) -> dict:
        """Account one more Gaussian answer (multiplier ``nm``, by default the job's), or refuse
        when it would exceed a budget."""
        nm = self.noise_multiplier if nm is None else float(nm)
        pol = self.policy
        after_life = epsilon_of(self.ledger.dp_events(None) + [(nm, 1)], pol.delta)
        if after_life > pol.epsilon_lifetime * (1 + 1e-6):
            raise PrivacyError(
                "dp_budget",
                self.site,
                f"the request: the site's lifetime epsilon_lifetime={pol.epsilon_lifetime:g} is spent",
            )
        job = self.ledger.dp_events(self.job)
        after_job = epsilon_of(job + [(nm, 1)], pol.delta)
        if after_job > pol.epsilon_per_job * (1 + 1e-6):
            raise PrivacyError(
                "dp_budget",
                self.site,
                f"the request: job {self.job!r} has spent its epsilon_per_job="
                f"{pol.epsilon_per_job:g} (delta={pol.delta:g})",
            )
        self.ledger.add_dp_event(self.job, nm, 1)
        return {"epsilon_job": after_job, "noise_multiplier": nm}

    def noise(self, shape, sensitivity: float, nm: float | None = None) -> np.ndarray:
        nm = self.noise_multiplier if nm is None else float(nm)
        return self.rng.normal(scale=nm * sensitivity, size=shape)

    def answer(self, points, z, eta: float) -> tuple[np.ndarray, dict]:
        """The noisy losses L (p,) at ``z`` and what was spent; refuses over a budget."""
        if not self.centred:
            spent = self.spend()
            L, sens = clipped_losses(points, z, eta, self.policy)
            return L + self.noise(L.shape, sens), spent
        ref, diff, sens_ref, sens_diff = centred_losses(points, z, eta, self.policy)
        key = float(eta)
        if key not in self._reference:
            self.spend(self.reference_multiplier)
            self._reference[key] = ref + self.noise(ref.shape, sens_ref, self.reference_multiplier)
        return self._reference[key] + diff + self.noise(diff.shape, sens_diff), self.spend()


def qhat_sensitivity(n: int, p: int) -> float:
    return math.sqrt(2.0) / (p * n)


def _point_losses(points, z, eta: float) -> np.ndarray:
    """(n,) the loss of g_z at each labelled point (unclipped)."""
    w, pi, H = points.w, points.pi, points.H
    p = w.shape[1]
    z = np.asarray(z, dtype=np.float64)
    K = w @ z + eta * pi
    J = (w * H) @ z + (eta / p) * pi * H.sum(axis=1)
    g = J / K
    if points.loss == "cross_entropy":
        out: np.ndarray = -np.log(np.maximum(g, 1e-300))
    else:
        out = (g - points.y) ** 2
    return out


def clipped_losses(points, z, eta: float, policy: SitePolicy) -> tuple[np.ndarray, float]:
    """L_k over the site's points with ratios and losses clipped; (L (p,), L2 sensitivity)."""
    w, pi = points.w, points.pi
    n, p = w.shape
    loss = np.clip(_point_losses(points, z, eta), 0.0, policy.loss_clip)
    wc = np.minimum(w, pi[:, None] * policy.ratio_clip)
    L = wc.T @ loss
    sens = (1.0 / (p * n)) * policy.ratio_clip * policy.loss_clip * math.sqrt(p)
    return L, sens


def centred_losses(points, z, eta: float, policy: SitePolicy) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(L at the centre (p,), clipped differences (p,), their two L2 sensitivities); see the module."""
    w, pi = points.w, points.pi
    n, p = w.shape
    b = policy.dp_difference_clip
    at_centre = _point_losses(points, np.full(p, 1.0 / p), eta)
    diff = np.clip(_point_losses(points, z, eta) - at_centre, -b, b)
    wc = np.minimum(w, pi[:, None] * policy.ratio_clip)
    scale = (1.0 / (p * n)) * policy.ratio_clip * math.sqrt(p)
    return wc.T @ np.clip(at_centre, 0.0, policy.loss_clip), wc.T @ diff, scale * policy.loss_clip, scale * 2 * b
