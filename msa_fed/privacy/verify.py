"""Verifiable domain models: the site recomputes what it is asked to compute with.

A Maxent domain model is the minimiser of a public objective over public data,

    F(W, b) = mu |W|^2 + sum_k sum_{x in U_k} s_k [lse(W Phi(x) + b) - (W Phi(x) + b)_k],

U_k the published unlabelled sample of site k (m_k points), s_k = 1 / (p m_k), Phi a feature
map fitted on the pooled samples.  So before it computes anything with a model, the site

1. re-derives the feature map from the published samples of the job's sites (the map's
   parameters and declared seed; its arrays must come out the same),
2. checks that mu lies in the policy's range [mu_min, mu_max],
3. re-solves the intercepts for the received W (b_hat(W) = argmin_b F(W, b), Newton on p
   numbers; the received b must be within ``verify_tolerance`` of it, up to the common shift
   that softmax ignores), and
4. computes the gradient G = d F / d W at (W, b_hat(W)) in float64 over all published points.

The bound.  g(W) = min_b F(W, b) is 2 mu-strongly convex (mu |W|^2 plus a partial minimum of
a jointly convex function), and its gradient is G (the intercepts are optimal), so

    |W - W*|_F <= |G|_F / (2 mu).

A change dW moves the log-odds log Q(k|x) / Q(j|x) of a point x by (dW_k - dW_j) . Phi(x), at
most sqrt(2) |dW|_F |Phi(x)|.  The site refuses unless

    deviation = sqrt(2) |G|_F / (2 mu) * R  <=  verify_tolerance,   R = max_x |Phi(x)|

with the maximum over the published points only, so that the decision is a function of public
data and the site's policy: two sites that differ in one labelled point answer every model
alike (a tolerance over the labelled points too made one labelled outlier refuse a model its
twin accepts: one bit about one patient per probe).  The bound must still hold where the
labelled points are used, so they reach the model through the map with each row's norm capped
at R (:class:`NormCappedMap`; a point beyond every published point is computed with as if it lay
at that radius, in its direction).  Within a column, the ratio of two points' weights then
differs from the optimum's by a factor of at most exp(2 deviation): a coordinator cannot single
out a point beyond that.  (The intercepts of W
and of W* may differ by a constant per class: that scales a whole column, as Qhat does, and
does not separate points; with the same identity the weighted mean symmetric KL divergence
between Q and the optimum's Q over the published points is at most |G|_F^2 / (8 mu).)

Steps 1, 3 and 4 and max |Phi| over the published points are the same at every site of a job:
where several sites share a process (the local runtime, a cluster host) they are computed once
per model (:func:`maxent_published_part`, memoised by a digest of every input it reads,
:mod:`msa_fed.privacy.memo`); mu's range and the tolerance are each site's own and are checked
at every request.

Everything here is numpy over :mod:`msa_fed.core`; refusals are
:class:`~msa_fed.errors.PrivacyError` naming the rule, never a measured value (the measured
values go to the site's audit log through the returned dict).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from msa_fed.core.threads import one_blas_thread
from msa_fed.errors import PrivacyError
from msa_fed.privacy.memo import ProcessMemo
from msa_fed.privacy.policy import SitePolicy

#: where a site gets the published unlabelled samples of a job's sites, in site order
#: (the host provides it: in-process the sites' own arrays, in a site process the registry)
SampleSource = Callable[[], Sequence[np.ndarray]]

#: the re-solved intercepts must zero the gradient in b to this (round-off is ~1e-16): G is the
#: gradient of min_b F only at the optimal intercepts
INTERCEPT_GTOL = 1e-10

#: the Newton decrement g . H^-1 g below which the intercept solve takes full Newton steps without
#: a line search: the objective then lies within about half the decrement of its minimum and Newton
#: converges quadratically (measured: 1 to 3 steps from there to a gradient of 1e-12 over the
#: benchmark grid, p up to 64)
NEWTON_PLAIN = 1e-6

#: relative tolerance of a re-derived feature map's arrays (same numpy, same data: bit-equal
#: in practice; the slack covers another BLAS summing in another order)
FMAP_RTOL = 1e-7


def _refuse(rule: str, site: str, what: str) -> NoReturn:
    raise PrivacyError(rule, site, f"the request: {what}")


def derive_feature_map(state, samples: Sequence[np.ndarray], site: str, balanced: bool = True):
    """The built-in feature map ``state`` = (name, params, arrays) re-fitted on ``samples``
    (each site weighing 1/p, as the Maxent classifier fits it; ``balanced=False``: the pooled
    points alike, as the KDE model does); refuses unless the fitted arrays are the ones received."""
    from msa_fed.core.domain_classifier import fit_feature_map
    from msa_fed.core.features import FEATURE_MAPS, RandomFourierFeatures

    name, params, arrays = state
    cls = FEATURE_MAPS.get(name)
    if cls is None:
        _refuse("verify_feature_map", site, f"unknown feature map {name!r}")
    if cls is RandomFourierFeatures:
        seed = params.get("random_state")
        if not isinstance(seed, int) or isinstance(seed, bool):
            _refuse("verify_feature_map", site, "the rff map does not declare an integer seed (random_state)")
    try:
        fmap = cls(**params)
        Xs = [np.asarray(X, dtype=np.float64) for X in samples]
        if balanced:
            fit_feature_map(fmap, Xs)
        else:
            fmap.fit(np.vstack(Xs))
    except (TypeError, ValueError):
        _refuse("verify_feature_map", site, f"the {name} map's parameters do not derive a map from the samples")
    got_params, got = fmap.get_state()
    same = got_params == params and set(got) == set(arrays)
    if same:
        for key, a in got.items():
            b = np.asarray(arrays[key])
            if a.shape != b.shape or not np.allclose(a, b, rtol=FMAP_RTOL, atol=1e-12):
                same = False
                break
    if not same:
        _refuse(
            "verify_feature_map",
            site,
            f"the {name} map is not the one its parameters derive from the published samples",
        )
    return fmap


def _value_softmax(A: np.ndarray, b: np.ndarray, s: np.ndarray, target: np.ndarray, out: np.ndarray):
    """(sum_i s_i lse(A_i + b) - target . b, softmax(A + b)) in one pass over A; the softmax is
    written into ``out`` (an array like A) and returned."""
    np.add(A, b, out=out)
    top = out.max(axis=1)
    out -= top[:, None]
    np.exp(out, out=out)
    S = out.sum(axis=1)
    f = float(s @ (top + np.log(S)) - target @ b)
    out /= S[:, None]
    return f, out


def intercepts_and_softmax(
    A: np.ndarray,
    s: np.ndarray,
    target: np.ndarray,
    b0: np.ndarray,
    iters: int = 50,
    gtol: float | None = None,
    counts: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """argmin_b sum_i s_i lse(A_i + b) - target . b (the intercepts for fixed W; A = Phi W^T),
    and softmax(A + b) at the returned b.

    Newton on the p intercepts (the objective is invariant under b + c 1; every iterate is
    centred), stopped once the gradient's largest entry is at most ``gtol`` (default
    :data:`INTERCEPT_GTOL` / 100: what the check accepts, with room).  Far from the minimiser a
    backtracking line search keeps the objective decreasing; once the Newton decrement
    g . H^-1 g is below :data:`NEWTON_PLAIN` the iterate is in Newton's quadratic region and the
    full step is taken without comparing objectives (their difference is then near one rounding
    unit of the objective, and halving on that noise made 83 passes at p = 32, n = 1e5 where 2
    suffice).  ``target`` is sum_i s_i Y_i (1/p per class for the balanced objective).

    Only b moves, so the exponentials are taken once: exp(A_ik + b_k) = E_ik e^(b_k) with
    E = exp(A - max_k A_ik) (:class:`_Factored`), and each trial point is a product of E with a
    vector (its row sums), the gradient another, the Hessian (only where a step follows: not at
    the stop) one product of E with itself.  Where
    a row sum falls below :data:`FACTORED_MIN` (products that underflow could matter there: b
    far from A's scale) the solve is the direct one (:func:`intercepts_direct`, a pass of
    exponentials per trial point).  ``counts`` (a dict), where given, receives the number of trial
    points plus one ("passes"), of Newton steps ("steps") and whether the solve was "factored".
    """
    gtol = INTERCEPT_GTOL / 100 if gtol is None else float(gtol)
    A = np.ascontiguousarray(A, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    b = np.asarray(b0, dtype=np.float64) - np.mean(b0)
    out = _newton(_Factored(A, s, target), b, iters, gtol)
    if out is None:  # the factored softmax underflows somewhere on the way: the direct solve
        return _direct(A, s, target, b0, iters, gtol, counts)
    b, P, passes, steps = out
    if counts is not None:
        counts.update(passes=passes + 1, steps=steps, factored=True)
    return b, P


def _newton(point, b: np.ndarray, iters: int, gtol: float):
    """The intercept solve's Newton loop (see :func:`intercepts_and_softmax`) over ``point``, the
    objective's evaluation (:class:`_Factored` or :class:`_Direct`): (b, softmax at b, trial
    points, Newton steps), or None where ``point.at`` answers None (the factored softmax
    underflows: the caller hands over to the direct solve)."""
    p = b.size
    state = point.at(b)
    if state is None:
        return None
    passes = steps = 0
    last = math.inf  # the gradient's largest entry before the last full step
    for _ in range(iters):
        f = state[0]
        sP = point.gradient(state)  # s @ softmax(A + b)
        g = sP - point.target
        gmax = float(np.abs(g).max())
        if not gmax > gtol:  # (a NaN gradient stops here too; the caller's check refuses)
            break
        if gmax > 0.5 * last:  # a full step that did not halve it: round-off, nothing more to gain
            break
        # (s P)^T P only where a step follows: the last pass (the stop) needs the gradient alone
        gram = point.gram(state)
        H = np.diag(sP) - gram + np.full((p, p), 1.0 / p)  # + 11^T/p fixes the gauge
        try:
            step = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:  # a class no point gives any mass to (b far off): least squares
            step = np.linalg.lstsq(H, g, rcond=None)[0]
        decrement = float(g @ step)
        t = 1.0
        while True:
            nb = b - t * step
            nb -= np.mean(nb)
            nstate = point.at(nb)
            passes += 1
            if nstate is None:
                return None
            nf = nstate[0]
            if decrement <= NEWTON_PLAIN and math.isfinite(nf):
                last = gmax
                break  # the quadratic region: the full step
            if nf <= f - 1e-4 * t * decrement:  # Armijo: a decrease well above rounding
                break
            t *= 0.5
            if t <= 1e-8:
                break
        if t <= 1e-8:
            break
        b, state = nb, nstate
        steps += 1
    return b, point.softmax(state), passes, steps


def _direct(A, s, target, b0, iters, gtol, counts):
    out = intercepts_direct(A, s, target, b0, iters, gtol, counts)
    if counts is not None:
        counts["factored"] = False
    return out


#: the smallest row sum of the factored softmax (:class:`_Factored`) a solve accepts: each term
#: of a row sum is off by less than the smallest normal number (2.2e-308) where it underflows, so
#: above this the terms lost are below 1e-55 of their row's sum
FACTORED_MIN = 1e-250


class _Factored:
    """exp(A + b) = E e^b (columns scaled) with E = exp(A - max_k A_ik) computed once, for the
    intercept solve: E's entries and e^(b - max b) are at most 1, so nothing overflows; a row sum
    below :data:`FACTORED_MIN` (underflow) makes :meth:`at` answer None."""

    def __init__(self, A: np.ndarray, s: np.ndarray, target: np.ndarray):
        self.s, self.target = s, target
        self.top = A.max(axis=1)
        E = np.subtract(A, self.top[:, None])
        np.exp(E, out=E)
        self.E = E

    def at(self, b: np.ndarray):
        """(objective, row sums S, e^(b - max b)) at b, or None where a row sum underflows."""
        top_b = float(np.max(b))
        eb = np.exp(b - top_b)
        S = self.E @ eb
        if not (float(np.min(S)) >= FACTORED_MIN and math.isfinite(float(np.max(S)))):
            return None
        f = float(self.s @ (self.top + top_b + np.log(S)) - self.target @ b)
        return f, S, eb

    def gradient(self, state) -> np.ndarray:
        """s @ P with P = softmax(A + b)."""
        _, S, eb = state
        sP: np.ndarray = ((self.s / S) @ self.E) * eb
        return sP

    def gram(self, state) -> np.ndarray:
        """(s P)^T P as Q^T Q with Q = E sqrt(s) / S (one symmetric product: half the
        multiply-adds of (s E)^T E)."""
        _, S, eb = state
        Q = self.E * (np.sqrt(self.s) / S)[:, None]
        M = Q.T @ Q
        out: np.ndarray = eb[:, None] * M * eb[None, :]
        return out

    def softmax(self, state) -> np.ndarray:
        _, S, eb = state
        P = np.multiply(self.E, eb, out=self.E)  # E is not needed after this
        P /= S[:, None]
        return P


class _Direct:
    """The objective and softmax(A + b) computed directly, one pass of exponentials over A + b
    per point (:func:`intercepts_direct`)."""

    def __init__(self, A: np.ndarray, s: np.ndarray, target: np.ndarray):
        self.A, self.s, self.target = A, s, target

    def at(self, b: np.ndarray):
        """(objective, softmax(A + b)) at b."""
        return _value_softmax(self.A, b, self.s, self.target, np.empty_like(self.A))

    def gradient(self, state) -> np.ndarray:
        out: np.ndarray = self.s @ state[1]
        return out

    def gram(self, state) -> np.ndarray:
        P = state[1]
        out: np.ndarray = (P * self.s[:, None]).T @ P
        return out

    def softmax(self, state) -> np.ndarray:
        out: np.ndarray = state[1]
        return out


def intercepts_direct(
    A: np.ndarray,
    s: np.ndarray,
    target: np.ndarray,
    b0: np.ndarray,
    iters: int = 50,
    gtol: float | None = None,
    counts: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`intercepts_and_softmax` computed directly: one pass of exponentials over A + b per
    trial point (the fallback where the factored softmax would underflow), the same Newton steps
    and stops (:func:`_newton`); ``counts`` as there, without "factored"."""
    gtol = INTERCEPT_GTOL / 100 if gtol is None else float(gtol)
    A = np.ascontiguousarray(A, dtype=np.float64)
    b = np.asarray(b0, dtype=np.float64) - np.mean(b0)
    out = _newton(_Direct(A, np.asarray(s, dtype=np.float64), np.asarray(target, dtype=np.float64)), b, iters, gtol)
    assert out is not None  # a direct evaluation always answers
    b, P, passes, steps = out
    if counts is not None:
        counts.update(passes=passes + 1, steps=steps)
    return b, P


def solve_intercepts(A: np.ndarray, s: np.ndarray, target: np.ndarray, b0: np.ndarray, iters: int = 50) -> np.ndarray:
    """The intercepts of :func:`intercepts_and_softmax` alone."""
    return intercepts_and_softmax(A, s, target, b0, iters)[0]


@dataclass(frozen=True)
class PublishedPart:
    """What the Maxent check computes over the published samples alone (the same at every site of
    a job): the re-derived feature map, |G|_F, the intercept gap and max |Phi(x)| over the
    published points.  Read-only: one instance may serve several sites of one process."""

    fmap: Any
    grad_norm: float
    intercept_gap: float
    phi_max: float


#: the published part of the checks this process ran (:mod:`msa_fed.privacy.memo`): keyed by a
#: digest of every input, never shared with another process, a refusal never stored
PUBLISHED_MEMO = ProcessMemo(size=4)


def maxent_published_part(
    theta: np.ndarray, mu: float, state, samples: Sequence[np.ndarray], site: str
) -> PublishedPart:
    """The part of :func:`check_maxent` over the published samples (module docstring, steps 1, 3
    and 4): refuses (naming ``site``) a map the samples do not derive or a model without one
    column per site; memoised in this process by a digest of theta, mu, the map's state, the
    samples and the tolerance of the map's re-derivation."""
    theta = np.asarray(theta, dtype=np.float64)
    mu = float(mu)
    Xs = [np.asarray(X, dtype=np.float64) for X in samples]

    def compute() -> PublishedPart:
        p = len(Xs)
        fmap = derive_feature_map(state, Xs, site)
        Phis = [np.asarray(fmap.transform(X), dtype=np.float64) for X in Xs]
        D = Phis[0].shape[1]
        if theta.ndim != 1 or theta.size != p * (D + 1) or not np.all(np.isfinite(theta)):
            _refuse(
                "verify_columns",
                site,
                f"the model must have one column per site of the job ({p}) over the map's features",
            )
        Wb = theta.reshape(p, D + 1)
        W, b = Wb[:, :D], Wb[:, D]
        Phi = np.vstack(Phis)
        s = np.concatenate([np.full(len(P), 1.0 / (p * len(P))) for P in Phis])
        k = np.concatenate([np.full(len(P), j) for j, P in enumerate(Phis)])
        A = Phi @ W.T
        target = np.full(p, 1.0 / p)
        b_hat, R = intercepts_and_softmax(A, s, target, b)
        if not np.abs(s @ R - target).max() <= INTERCEPT_GTOL:  # G below needs the optimal intercepts
            _refuse("verify_optimum", site, "the intercepts of the domain model's weights could not be re-solved")
        b_gap = float(np.abs((b - b.mean()) - b_hat).max())
        R[np.arange(k.size), k] -= 1.0  # softmax(A + b_hat) - Y
        G = ((Phi * s[:, None]).T @ R).T + 2.0 * mu * W  # the weights on Phi's side: n x D, not n x p
        return PublishedPart(fmap, float(np.linalg.norm(G)), b_gap, _row_norm_max(Phi))

    def on_one_thread() -> PublishedPart:  # small products: a second BLAS thread only spins (core/threads.py)
        with one_blas_thread():
            return compute()

    return PUBLISHED_MEMO.get(("maxent", FMAP_RTOL, theta, mu, state, Xs), on_one_thread)


def check_maxent(theta, mu, state, samples: Sequence[np.ndarray], policy: SitePolicy, site: str) -> dict:
    """Verify a Maxent domain model (module docstring); returns the measured values, among them
    ``verify_phi_max`` (R, the radius the site's labelled points are capped at: :class:`NormCappedMap`).

    The part over the published samples is the same at every site (:func:`maxent_published_part`,
    computed once per process for one model); mu's range and the tolerance are this site's own,
    checked at every call.  Nothing here reads the site's labelled points: the decision is the
    same at every site with the same policy."""
    mu = float(mu)
    if not (math.isfinite(mu) and policy.mu_min <= mu <= policy.mu_max):
        _refuse("verify_mu", site, f"mu must lie in the site's range [{policy.mu_min:g}, {policy.mu_max:g}]")
    pub = maxent_published_part(theta, mu, state, samples, site)
    grad_norm, b_gap = pub.grad_norm, pub.intercept_gap
    radius = grad_norm / (2.0 * mu)
    deviation = math.sqrt(2.0) * radius * pub.phi_max
    out = {
        "verify_phi_max": pub.phi_max,
        "verify_grad_norm": grad_norm,
        "verify_w_radius": radius,
        "verify_deviation": deviation,
        "verify_intercept_gap": b_gap,
        "verify_mean_sym_kl_bound": grad_norm**2 / (8.0 * mu),
    }
    if not (deviation <= policy.verify_tolerance and b_gap <= policy.verify_tolerance):
        _refuse(
            "verify_optimum",
            site,
            "the domain model is not the optimum of the public Maxent objective over the job's published samples",
        )
    return out


def _row_norm_max(Phi) -> float:
    Phi = np.asarray(Phi, dtype=np.float64)
    return float(np.sqrt(np.einsum("ij,ij->i", Phi, Phi)).max()) if Phi.size else 0.0


class NormCappedMap:
    """A feature map whose rows are scaled down to norm at most ``cap``: Phi(x) min(1, cap / |Phi(x)|).

    What a site computes Q(k | x) with on its labelled points once a Maxent model is verified
    (``cap``: R, the largest norm over the published points), so that the verification's bound,
    taken over the published points only, holds at every point the site uses.  A published point
    is unchanged (its norm is at most R)."""

    def __init__(self, fmap, cap: float):
        self.fmap = fmap
        self.cap = float(cap)

    def transform(self, X) -> np.ndarray:
        Phi = np.asarray(self.fmap.transform(X), dtype=np.float64)
        norms = np.sqrt(np.einsum("ij,ij->i", Phi, Phi))
        over = norms > self.cap
        if np.any(over):
            Phi = Phi.copy()
            Phi[over] *= (self.cap / norms[over])[:, None]
        return Phi


def capped_to_published(model, verified: dict):
    """``model`` (built from a request the site verified: ``verified`` is what
    :func:`verify_domain_model` returned) with its feature map capped at the published points'
    largest norm (:class:`NormCappedMap`) where the check was a Maxent one; else ``model`` as is."""
    cap = verified.get("verify_phi_max")
    if cap is not None and getattr(model, "feature_map", None) is not None:
        model.feature_map = NormCappedMap(model.feature_map, cap)
    return model


def check_kde_samples(spec_samples, state, samples: Sequence[np.ndarray], policy: SitePolicy, site: str) -> dict:
    """A KDE (GMSA) model: its samples must be the published samples (through the re-derived
    feature map, when there is one), one per site of the job."""
    if len(spec_samples) != len(samples):
        _refuse("verify_columns", site, f"the model must have one density per site of the job ({len(samples)})")
    fmap = None if state is None else derive_feature_map(state, samples, site, balanced=False)
    for got, X in zip(spec_samples, samples):
        want = np.asarray(X, dtype=np.float64) if fmap is None else np.asarray(fmap.transform(X), dtype=np.float64)
        got = np.asarray(got, dtype=np.float64)
        if got.shape != want.shape or not np.allclose(got, want, rtol=FMAP_RTOL, atol=1e-12):
            _refuse("verify_samples", site, "the densities are not built on the job's published samples")
    return {"verify_kde_samples": len(samples)}


def own_qhat(qhat, own_partial: np.ndarray) -> tuple[np.ndarray, dict]:
    """The Qhat a site without DP computes with: the broadcast ``qhat`` floored at the site's
    own exact partial (Qhat(k) is a sum of the sites' non-negative partials, so an honest
    Qhat is at least this site's share; a smaller one would inflate its weights).

    Not a refusal: where another site answers with DP, its noisy partial can pull the
    broadcast below this site's share in an honest run; flooring keeps every w_k summing to at
    most 1 over this site's points either way.  Returns (qhat used, {"qhat_floored": count}).
    """
    q = np.asarray(qhat, dtype=np.float64)
    own = np.asarray(own_partial, dtype=np.float64)
    used = np.maximum(q, own)
    return used, {"qhat_floored": int(np.count_nonzero(used > q))}


def verify_domain_model(spec, samples: Sequence[np.ndarray] | None, policy: SitePolicy, site: str) -> dict:
    """The check :meth:`SiteWorker.set_domain_model` runs (``spec``: a DomainModelSpec); it reads
    public data and the site's policy only.  The site then computes with the model capped by
    :func:`capped_to_published`.

    ``samples``: the published samples of the job's sites, in site order (None: the host has
    none to give, e.g. a custom in-process map's caller, and the policy does not require it).
    """
    if not policy.verify_domain_models:
        return {"verify": "off"}
    if spec.feature_map is None and spec.custom_feature_map is not None:
        # only an in-process caller (the site's own process) may give a custom map (rules.py)
        return {"verify": "custom feature map (in-process caller)"}
    if samples is None:
        _refuse("verify_samples", site, "the site has no access to the job's published samples to verify the model")
    samples = list(samples)
    if int(spec.n_sources) != len(samples):
        _refuse("verify_columns", site, f"the model must have one column per site of the job ({len(samples)})")
    if spec.kind == "maxent":
        if spec.feature_map is None:
            _refuse("verify_feature_map", site, "a Maxent model needs a built-in feature map")
        return check_maxent(spec.theta, spec.mu, spec.feature_map, samples, policy, site)
    if spec.kind == "kde":
        return check_kde_samples(spec.samples, spec.feature_map, samples, policy, site)
    _refuse("verify_columns", site, f"unknown domain model kind {spec.kind!r}")
    return {}
