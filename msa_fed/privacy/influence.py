"""Bounded influence: each labelled point's weight in every returned sum over labels is capped.

Every number a site returns about its labelled points is a sum ``sum_i a(i) f(x_i, y_i)`` with
non-negative weights a(i) = pi_i r(i), r(i) a density ratio: q_k(x_i) = Q(k|x_i) / Qhat(k) for
the DC weights w_k (the sums L_k, u_k, v_k and their gradients, which carry the labels).  A
Qhat partial sum_i pi_i Q(k|x_i) carries no label and one point adds at most pi_i = 1 / (p n)
to it; the partials must add up to a probability vector, so they are not clipped (the site
logs their largest share).  With tau = ``weight_floor`` (a ratio
below tau is "far from the domain", small influence), the share of point i in column k is

    share_k(i) = r_k(i) / (sum_j r_k(j) + n tau)

Instead of refusing a request whose weights concentrate on a point (an honest domain model at
a small site does that), the site clips: in each column it lowers the largest ratios to the
one cap c_k for which the largest share after clipping is exactly ``share_bound(policy)``
(water-filling; columns already within the bound are untouched).  After clipping no point
carries more than that share of any returned sum; the effective sample size of every column
is then at least 1 / share.  The u_k / v_k weights c_k(i) = w_k(i) + eta pi_i and the mixture
K_z = sum_k z_k w_k(i) + eta pi_i mix the clipped columns with a constant, and the share of one
point in such a mixture is at most its largest share in a column or 1/n (mediant inequality),
so clipping the columns bounds every sum the site returns.
"""

from __future__ import annotations

import numpy as np

from msa_fed.privacy.policy import SitePolicy

#: bisection steps for the cap (relative precision 2^-60 of the largest ratio)
_STEPS = 60


def share_bound(policy: SitePolicy) -> float:
    """The largest share one point may carry: max_point_share, and 1 / min_effective_points
    (a share bound s gives an effective sample size of at least 1 / s)."""
    return float(min(policy.max_point_share, 1.0 / policy.min_effective_points))


def shares(R: np.ndarray, tau: float) -> np.ndarray:
    """(p,) the largest share of one point in each column of the ratios R (n, p)."""
    R = np.asarray(R, dtype=np.float64)
    n = R.shape[0]
    if n == 0:
        return np.ones(R.shape[1])
    out: np.ndarray = R.max(axis=0) / (R.sum(axis=0) + n * tau)
    return out


def clip_ratios(R: np.ndarray, share: float, tau: float) -> tuple[np.ndarray, dict]:
    """R (n, p) with each column's largest values lowered to a common cap so that no point
    carries more than ``share`` of the column (shares as in the module docstring).

    Returns (clipped R, what was clipped: the number of clipped entries, the largest share
    before clipping and the fraction of the column mass removed, for the audit log).  With
    g(c) = share (sum_j min(r_j, c) + n tau) - c concave and g(0) >= 0, the cap is the largest
    c with g(c) >= 0: every entry at or below it is kept, so clipping removes the least mass.
    """
    R = np.asarray(R, dtype=np.float64)
    n, p = R.shape
    before = shares(R, tau)
    over = np.nonzero(before > share * (1 + 1e-12))[0]
    info = {"clipped_points": 0, "share_before": float(before.max(initial=0.0)), "mass_clipped": 0.0}
    if over.size == 0 or n == 0:
        return R, info
    Rc = R[:, over]
    lo = np.zeros(over.size)  # g(lo) >= 0
    hi = Rc.max(axis=0)  # g(hi) < 0 (the column is over the bound)
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        ok = share * (np.minimum(Rc, mid[None, :]).sum(axis=0) + n * tau) >= mid
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    clipped = np.minimum(Rc, lo[None, :])
    out = R.copy()
    out[:, over] = clipped
    total = R.sum()
    info["clipped_points"] = int(np.count_nonzero(Rc > lo[None, :]))
    info["mass_clipped"] = float((Rc.sum() - clipped.sum()) / total) if total > 0 else 0.0
    return out, info


def bounded(R: np.ndarray, policy: SitePolicy, what: str) -> tuple[np.ndarray, dict]:
    """:func:`clip_ratios` at the policy's share bound; the audit entries are named ``what_*``."""
    out, info = clip_ratios(R, share_bound(policy), policy.weight_floor)
    return out, {f"{what}_{k}": v for k, v in info.items()}
