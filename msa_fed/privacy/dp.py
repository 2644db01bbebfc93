"""Differential privacy at the site: the Gaussian mechanism, accounted by Google's dp-accounting.

Neighbouring data sets differ in one labelled point of the site (replace one; the site's
n, hence pi_i = 1 / (p n), is public).  Every aggregate derived from labelled data gets
Gaussian noise of standard deviation ``noise_multiplier * sensitivity``:

- Qhat partial: with DP on, the site answers the same estimate over its published unlabelled
  sample, (1/p) mean_{x in U} Q(k|x): public, so it costs no epsilon and carries no noise
  (measured: the noisy partial over the labelled points was what sent DP runs at 30 to 100
  labelled points per site to a bad z; docs/RESULTS.md); a noisy labelled partial would have
  L2 sensitivity pi sqrt 2.
- DC sums (DP mode answers the losses L_k only): w_k(i) = pi_i min(q_k(x_i), ratio_clip) and the
  loss clipped to [0, loss_clip], so each coordinate of one point's contribution lies in
  [0, pi ratio_clip loss_clip] and the L2 sensitivity is pi ratio_clip loss_clip sqrt p.

Each answer is one ``GaussianDpEvent(noise_multiplier)``; a job's events are composed with the
RDP accountant of ``dp_accounting`` (never by hand).  The noise multiplier is calibrated once
per job (``calibrate_dp_mechanism``) so that the planned number of answers (``dp_dc_evaluations``
DC answers, and the site's one verdict on the model: :data:`VERDICT_ANSWERS`) spends exactly
``epsilon_per_job`` at ``delta``; an answer beyond the job's or the site's lifetime budget is refused.
The verdict's answers are reserved: any other answer is refused when, after it, the job's or the
lifetime budget could no longer pay for them (so a noisy solver that asks until it is refused
stops at the planned DC answers, and the site still answers the harm request at the end).
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


#: DP answers a job plans besides its DC answers: the site's verdict on the model (harm)
VERDICT_ANSWERS = 1


class DPAccountant:
    """DP state of one job at one site (events are stored in the site's ledger)."""

    def __init__(self, policy: SitePolicy, ledger, job: str, site: str):
        self.policy, self.ledger, self.job, self.site = policy, ledger, job, site
        self.planned = policy.dp_dc_evaluations + VERDICT_ANSWERS
        self.noise_multiplier = calibrate(policy.epsilon_per_job, policy.delta, self.planned)
        self.rng = np.random.default_rng()  # seeded from the OS

    def epsilon_job(self) -> float:
        return epsilon_of(self.ledger.dp_events(self.job), self.policy.delta)

    def epsilon_lifetime(self) -> float:
        return epsilon_of(self.ledger.dp_events(None), self.policy.delta)

    def spend(self, verdict: bool = False) -> dict:
        """Account one more Gaussian answer, or refuse when it would exceed a budget.

        An answer that is not the site's ``verdict`` must leave both budgets able to pay for the
        :data:`VERDICT_ANSWERS` reserved for it.  The check and the event's write happen under
        the ledger's ``dp_lock``: answers of several jobs served at once are counted one after
        the other against the lifetime budget.
        """
        with self.ledger.dp_lock:
            return self._spend(0 if verdict else VERDICT_ANSWERS)

    def _spend(self, reserve: int) -> dict:
        nm, pol = self.noise_multiplier, self.policy
        kept = " (what is left is reserved for the site's verdict on the model)" if reserve else ""
        life = self.ledger.dp_events(None)
        if epsilon_of(life + [(nm, 1 + reserve)], pol.delta) > pol.epsilon_lifetime * (1 + 1e-6):
            raise PrivacyError(
                "dp_budget",
                self.site,
                f"the request: the site's lifetime epsilon_lifetime={pol.epsilon_lifetime:g} is spent{kept}",
            )
        job = self.ledger.dp_events(self.job)
        after_job = epsilon_of(job + [(nm, 1)], pol.delta)
        needed = epsilon_of(job + [(nm, 1 + reserve)], pol.delta) if reserve else after_job
        if needed > pol.epsilon_per_job * (1 + 1e-6):
            raise PrivacyError(
                "dp_budget",
                self.site,
                f"the request: job {self.job!r} has spent its epsilon_per_job="
                f"{pol.epsilon_per_job:g} (delta={pol.delta:g}){kept}",
            )
        self.ledger.add_dp_event(self.job, nm, 1)
        return {"epsilon_job": after_job, "noise_multiplier": nm}

    def noise(self, shape, sensitivity: float) -> np.ndarray:
        return self.rng.normal(scale=self.noise_multiplier * sensitivity, size=shape)


def clipped_losses(points, z, eta: float, policy: SitePolicy) -> tuple[np.ndarray, float]:
    """L_k over the site's points with ratios and losses clipped; (L (p,), L2 sensitivity)."""
    w, pi, H = points.w, points.pi, points.H
    n, p = w.shape
    z = np.asarray(z, dtype=np.float64)
    K = w @ z + eta * pi
    J = (w * H) @ z + (eta / p) * pi * H.sum(axis=1)
    g = J / K
    if points.loss == "cross_entropy":
        loss = -np.log(np.maximum(g, 1e-300))
    else:
        loss = (g - points.y) ** 2
    loss = np.clip(loss, 0.0, policy.loss_clip)
    wc = np.minimum(w, pi[:, None] * policy.ratio_clip)
    L = wc.T @ loss
    sens = (1.0 / (p * n)) * policy.ratio_clip * policy.loss_clip * math.sqrt(p)
    return L, sens
