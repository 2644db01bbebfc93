"""The site's policy rules as pure functions (docs/DESIGN.md, "Site privacy policy").

Each ``check_*`` takes the request, the site's own data or weights and the policy, and returns
a dict of what it measured (written to the audit log) or raises
:class:`~msa_fed.errors.PrivacyError` (rule, site, detail).  Nothing here talks to the network.

Concentration.  Every number a site returns about its labelled points is a sum
``sum_i a(i) f(x_i, y_i)`` with non-negative weights a(i).  Writing a(i) = pi_i r(i) (pi_i the
point's mass, r(i) a density ratio: Q(k|x_i) for a Qhat partial, q_k(x_i) = Q(k|x_i)/Qhat(k)
for w_k, q_k(x_i) + eta for the u_k/v_k weights c_k(i) = w_k(i) + eta pi_i), a point dominates
a sum when r(i) is large against the others.  A ratio below ``weight_floor`` (tau) is small
influence: the point is far from the domain.  With r'(i) = r(i) + tau,

    share = max_i r(i) / (sum_i r(i) + n tau)      <= max_point_share
    ESS   = (sum_i r'(i))^2 / sum_i r'(i)^2         >= min_effective_points

K_z(i) = sum_k z_k w_k(i) + eta pi_i mixes the columns, and the share of one point in a
mixture is at most its largest share in a column (mediant inequality), so checking the
columns of w and c covers K_z and the loss sums L_k, u_k, v_k.
"""

from __future__ import annotations

import math

import numpy as np

from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy

QHAT_ATOL = 1e-6


def _fail(rule: str, site: str, detail: str):
    """Raise the refusal; the message reads "site 'a' refuses <detail> (rule: <rule>)"."""
    raise PrivacyError(rule, site, detail if detail.startswith("to ") else f"the request: {detail}")


def check_min_points(n: int, policy: SitePolicy, site: str, what: str = "labelled") -> dict:
    if n < policy.min_points:
        _fail(
            "min_points",
            site,
            f"to aggregate over {n} {what} points: fewer than the site's minimum of {policy.min_points}",
        )
    return {"min_points": int(n)}


def check_eta(eta, policy: SitePolicy, site: str) -> dict:
    eta = float(eta)
    if not (math.isfinite(eta) and eta >= policy.eta_min):
        _fail("eta_min", site, f"eta={eta!r} is below the site's eta_min={policy.eta_min:g}")
    return {"eta": eta}


def check_z(z, eta, p: int, policy: SitePolicy, site: str) -> None:
    """z: p non-negative finite numbers.  The solver may evaluate off the simplex (z scaled);
    g_z and the weights' shares depend on z and eta only through eta / sum(z), so that ratio
    is what must respect eta_min.  (Plain Python on the p numbers: this runs every DC round.)"""
    z = np.asarray(z, dtype=np.float64)
    zl = z.tolist() if z.shape == (p,) else None
    total = sum(zl) if zl else float("nan")
    if zl is None or not math.isfinite(total) or min(zl) < -1e-9 or total <= 0:
        _fail("z", site, f"z must be {p} non-negative numbers; got {np.array2string(z, precision=4)}")
    eff = float(eta) / total
    if eff < policy.eta_min * (1 - 1e-9):
        _fail("eta_min", site, f"eta / sum(z) = {eff:.3g} is below the site's eta_min={policy.eta_min:g}")


def check_qhat(qhat, own_partial: np.ndarray, site: str) -> dict:
    """qhat must be a probability vector with qhat_k >= this site's own share of it.

    The sites' partials s_k = sum_i pi_i Q(k|x_i) are non-negative and add up to Qhat, so an
    honest Qhat satisfies Qhat(k) >= s_k; with it every w_k sums to at most 1 over the site's
    points, which a smaller qhat would inflate.
    """
    qhat = np.asarray(qhat, dtype=np.float64)
    own = np.asarray(own_partial, dtype=np.float64)
    if qhat.shape != own.shape or not np.all(np.isfinite(qhat)) or qhat.min() <= 0:
        _fail("qhat", site, f"qhat must be {own.size} positive numbers; got {np.array2string(qhat, precision=4)}")
    if abs(qhat.sum() - 1.0) > QHAT_ATOL:
        _fail("qhat", site, f"qhat must sum to 1; sums to {qhat.sum():.6g}")
    short = np.nonzero(qhat < own * (1 - 1e-9) - 1e-15)[0]
    if short.size:
        k = int(short[0])
        _fail("qhat", site, f"qhat[{k}]={qhat[k]:.4g} is below this site's own share {own[k]:.4g} of it")
    return {"qhat_min_ratio": float(np.min(qhat / np.maximum(own, 1e-300)))}


def concentration(R: np.ndarray, tau: float) -> tuple[float, float]:
    """(largest share, smallest ESS) over the columns of the density ratios R (n, p)."""
    R = np.asarray(R, dtype=np.float64)
    n = R.shape[0]
    if n == 0:
        return 1.0, 0.0
    tot = R.sum(axis=0)
    share = R.max(axis=0) / (tot + n * tau)
    Rp = R + tau
    ess = (tot + n * tau) ** 2 / np.maximum(np.einsum("ik,ik->k", Rp, Rp), 1e-300)
    return float(share.max()), float(ess.min())


def check_concentration(R: np.ndarray, policy: SitePolicy, site: str, what: str) -> dict:
    share, ess = concentration(R, policy.weight_floor)
    if not share <= policy.max_point_share:
        _fail(
            "concentration",
            site,
            f"one labelled point carries {share:.3g} of the {what} sums (max_point_share={policy.max_point_share:g})",
        )
    if not ess >= policy.min_effective_points:
        _fail(
            "concentration",
            site,
            f"the {what} weights have an effective sample size of {ess:.3g} "
            f"(min_effective_points={policy.min_effective_points:g})",
        )
    return {f"{what}_share": share, f"{what}_ess": ess}


# ------------------------------------------------------------------ domain models
def _std(X: np.ndarray) -> np.ndarray:
    return np.asarray(X, dtype=np.float64).std(axis=0)


def _check_standard(site: str, policy: SitePolicy, mean, scale, X: np.ndarray, name: str) -> dict:
    mean = np.asarray(mean, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    d = X.shape[1]
    if mean.shape != (d,) or scale.shape != (d,) or not (np.all(np.isfinite(mean)) and np.all(np.isfinite(scale))):
        _fail("feature_map", site, f"{name} map: mean and scale must be {d} finite numbers")
    sd = _std(X)
    floor = np.where(sd > 0, policy.scale_floor * sd, 0.0)
    if np.any(scale <= 0) or np.any(scale < floor):
        j = int(np.argmin(scale - floor))
        _fail(
            "feature_scale",
            site,
            f"{name} map: scale[{j}]={scale[j]:.3g} is below scale_floor * the site's "
            f"std ({policy.scale_floor:g} * {sd[j]:.3g})",
        )
    off = np.abs(mean - X.mean(axis=0))
    lim = policy.mean_bound * np.maximum(sd, scale)
    if np.any(off > lim):
        j = int(np.argmax(off - lim))
        _fail(
            "feature_mean",
            site,
            f"{name} map: mean[{j}] lies {off[j]:.3g} from the site's mean (mean_bound={policy.mean_bound:g} std)",
        )
    return {"min_scale_ratio": float(np.min(scale / np.where(sd > 0, sd, scale)))}


def _arrays_finite(arrays: dict, site: str, name: str):
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind not in "biuf" or not np.all(np.isfinite(a)):
            _fail("feature_map", site, f"{name} map: array {key!r} must be finite numbers")


def check_feature_map(state, X: np.ndarray, policy: SitePolicy, site: str) -> dict:
    """A built-in feature map's (name, params, arrays), checked against the site's own X."""
    if not (
        isinstance(state, tuple)
        and len(state) == 3
        and isinstance(state[0], str)
        and isinstance(state[1], dict)
        and isinstance(state[2], dict)
    ):
        _fail("feature_map", site, "malformed feature map")
    name, params, arrays = state
    if name not in policy.feature_maps:
        _fail("feature_map", site, f"feature map {name!r} is not in the site's allowlist {list(policy.feature_maps)}")
    _arrays_finite(arrays, site, name)
    d = X.shape[1]
    out: dict = {"feature_map": name}
    if name == "standard":
        out.update(_check_standard(site, policy, arrays.get("mean"), arrays.get("scale"), X, name))
    elif name == "onehot":
        sizes = np.asarray(arrays.get("sizes"))
        values = np.asarray(arrays.get("values"))
        if sizes.shape != (d,) or sizes.min(initial=0) < 0 or int(sizes.sum()) != values.size:
            _fail("feature_map", site, "onehot map: sizes and values do not match the site's columns")
        mc = params.get("max_categories")
        if not isinstance(mc, int) or isinstance(mc, bool) or mc < 1 or sizes.max(initial=0) > mc:
            _fail("feature_map", site, "onehot map: bad max_categories")
    elif name == "threshold":
        t = np.asarray(arrays.get("thresholds"), dtype=np.float64)
        if d != 1 or t.ndim != 1 or t.size < 1:
            _fail("feature_map", site, "threshold map: needs 1-D inputs and at least one threshold")
        if t.size > policy.max_thresholds:
            _fail(
                "feature_map",
                site,
                f"threshold map: {t.size} thresholds, more than max_thresholds={policy.max_thresholds}",
            )
        if np.any(np.diff(t) <= 0):
            _fail("feature_map", site, "threshold map: thresholds must be strictly increasing")
        out["n_thresholds"] = int(t.size)
    elif name == "rff":
        W = np.asarray(arrays.get("weights"), dtype=np.float64)
        b = np.asarray(arrays.get("offset"), dtype=np.float64)
        if W.ndim != 2 or W.shape[0] != d or b.shape != (W.shape[1],) or W.shape[1] < 1:
            _fail("feature_map", site, "rff map: weights and offset do not match the site's columns")
        if W.shape[1] > policy.max_components:
            _fail(
                "feature_map",
                site,
                f"rff map: {W.shape[1]} components, more than max_components={policy.max_components}",
            )
        gamma = float(np.mean(W**2) / 2.0)
        # W ~ N(0, 2 gamma): no single frequency beyond 8 standard deviations of the allowed spread
        if gamma > policy.rff_gamma_max or np.abs(W).max() > 8.0 * math.sqrt(2.0 * policy.rff_gamma_max):
            _fail(
                "feature_map",
                site,
                f"rff map: frequencies too sharp (gamma={gamma:.3g}, rff_gamma_max={policy.rff_gamma_max:g})",
            )
        out.update(_check_standard(site, policy, arrays.get("mean"), arrays.get("scale"), X, name))
        out["rff_gamma"] = gamma
    return out


def check_theta(theta, n_sources: int, policy: SitePolicy, site: str) -> dict:
    """|W|^2 <= log p / mu_min (intercepts excluded, as in the Maxent objective).

    The Maxent objective F(theta) = (balanced log-loss) + mu |W|^2 has F(0) = log p, so any
    point that does not do worse than theta = 0 (in particular the optimum) has
    mu |W|^2 <= F(theta) <= log p.
    """
    theta = np.asarray(theta, dtype=np.float64)
    p = int(n_sources)
    if theta.ndim != 1 or p < 2 or theta.size % p or theta.size // p < 2 or not np.all(np.isfinite(theta)):
        _fail("theta", site, "theta must be p (D + 1) finite numbers")
    Wb = theta.reshape(p, -1)
    sq = float(np.sum(Wb[:, :-1] ** 2))
    lim = math.log(p) / policy.mu_min
    if sq > lim * (1 + 1e-9):
        _fail(
            "theta_norm",
            site,
            f"|W|^2 = {sq:.4g} exceeds log p / mu_min = {lim:.4g} (mu_min={policy.mu_min:g}): "
            "no Maxent optimum with mu >= mu_min is that sharp",
        )
    return {"theta_sq": sq, "theta_sq_limit": lim}


def check_kde(bandwidths, samples, Phi_site: np.ndarray, n_sources: int, policy: SitePolicy, site: str) -> dict:
    bw = np.asarray(bandwidths, dtype=np.float64).reshape(-1)
    if bw.size != n_sources or not np.all(np.isfinite(bw)) or len(samples) != n_sources:
        _fail("kde", site, "KDE model: need one bandwidth and one sample per source")
    sd = float(np.mean(_std(Phi_site))) if Phi_site.size else 0.0
    floor = policy.kde_bandwidth_floor * sd
    if np.any(bw <= 0) or np.any(bw < floor):
        _fail(
            "kde",
            site,
            f"KDE bandwidth {bw.min():.3g} is below kde_bandwidth_floor * the site's std "
            f"({policy.kde_bandwidth_floor:g} * {sd:.3g})",
        )
    few = [len(s) for s in samples if len(s) < policy.min_points]
    if few:
        _fail("kde", site, f"KDE sample of {few[0]} points, fewer than min_points={policy.min_points}")
    return {"kde_min_bandwidth_ratio": float(bw.min() / sd) if sd > 0 else None}
