"""The site's policy rules as pure functions (docs/DESIGN.md, "Site privacy policy").

Each ``check_*`` takes the request, the site's own data or weights and the policy, and returns
a dict of what it measured (written to the audit log) or raises
:class:`~msa_fed.errors.PrivacyError` (rule, site, detail).  Nothing here talks to the network.

Refusals name the rule and the request's own values, never a value measured on the site's
data: what was measured goes to the site's audit log only (``measured`` of :func:`_fail`).
How much one labelled point may weigh in a returned sum is not a refusal but a cap
(:mod:`msa_fed.privacy.influence`).
"""

from __future__ import annotations

import math

import numpy as np

from msa_fed.errors import PrivacyError
from msa_fed.privacy.policy import SitePolicy

QHAT_ATOL = 1e-6


def _fail(rule: str, site: str, detail: str, **measured):
    """Raise the refusal; the message reads "site 'a' refuses <detail> (rule: <rule>)".

    ``detail`` must not carry values measured on the site's data; those go in ``measured``,
    which the site's guard writes to its audit log (the exception's ``measured`` attribute is
    not part of its message nor of its pickled form)."""
    exc = PrivacyError(rule, site, detail if detail.startswith("to ") else f"the request: {detail}")
    exc.measured = measured  # type: ignore[attr-defined]  # read back by the guard (getattr)
    raise exc


def check_min_points(n: int, policy: SitePolicy, site: str, what: str = "labelled") -> dict:
    if n < policy.min_points:
        _fail(
            "min_points",
            site,
            # n is public: the site reports its number of points (SiteInfo)
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
        _fail(
            "qhat",
            site,
            f"qhat[{k}]={qhat[k]:.4g}: an honest Qhat is at least each site's own share of it",
            own_share=float(own[k]),
        )
    return {"qhat_min_ratio": float(np.min(qhat / np.maximum(own, 1e-300)))}


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
            f"{name} map: scale[{j}]={scale[j]:.3g} is below scale_floor={policy.scale_floor:g} times the "
            "site's own standard deviation of that feature",
            site_std=float(sd[j]),
        )
    off = np.abs(mean - X.mean(axis=0))
    lim = policy.mean_bound * np.maximum(sd, scale)
    if np.any(off > lim):
        j = int(np.argmax(off - lim))
        _fail(
            "feature_mean",
            site,
            f"{name} map: mean[{j}] lies more than mean_bound={policy.mean_bound:g} standard deviations "
            "from the site's own mean",
            offset=float(off[j]),
        )
    return {"min_scale_ratio": float(np.min(scale / np.where(sd > 0, sd, scale)))}


def _arrays_finite(arrays: dict, site: str, name: str):
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind not in "biuf" or not np.all(np.isfinite(a)):
            _fail("feature_map", site, f"{name} map: array {key!r} must be finite numbers")


def check_feature_map(state, X: np.ndarray, policy: SitePolicy, site: str) -> dict:
    """A built-in feature map's (name, params, arrays), checked against the site's own X (its
    published sample: the decision must not depend on its labelled points)."""
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
            f"KDE bandwidth {bw.min():.3g} is below kde_bandwidth_floor={policy.kde_bandwidth_floor:g} "
            "times the site's own standard deviation",
            site_std=sd,
        )
    few = [len(s) for s in samples if len(s) < policy.min_points]
    if few:
        _fail("kde", site, f"KDE sample of {few[0]} points, fewer than min_points={policy.min_points}")
    return {"kde_min_bandwidth_ratio": float(bw.min() / sd) if sd > 0 else None}
