"""Choosing z from a noisy loss oracle (sites answering with differential privacy).

Every answer costs privacy, so the exact solvers (hundreds of evaluations, gradients) are out:
with DP on, a site answers only the losses L_k(z), with Gaussian noise, and a fixed number of
times per job.  :func:`solve_noisy` spends a small design of evaluations chosen up front (the
vertices of the simplex, its centre, then random points), fits a smooth surrogate of each
L_k(z) by ridge least squares (quadratic in z when there are enough points, else linear plus
squares), which averages the noise over all answers, then spends the rest of its answers in a
neighbourhood of that first choice and refits there (weighted towards it), and returns the minimiser over a dense
candidate set of the simplex of max_k of an upper confidence bound of L_k (the surrogate plus
``ucb`` standard errors, the noise level estimated from the fit's residuals): where the answers
are too noisy to tell the domains apart it stays near the design's centre instead of chasing
noise into a corner.  It always terminates with a point of
the simplex: when a site refuses because its budget is spent, it stops evaluating and fits
what it has.
"""

from __future__ import annotations

import itertools

import numpy as np

from msa_fed.core.dc_solver import DCResult
from msa_fed.errors import PrivacyError


def _features(Z: np.ndarray, full: bool) -> np.ndarray:
    n, p = Z.shape
    cols = [np.ones(n), *Z.T]
    if full:
        cols += [Z[:, i] * Z[:, j] for i, j in itertools.combinations_with_replacement(range(p), 2)]
    else:
        cols += [Z[:, i] ** 2 for i in range(p)]
    return np.column_stack(cols)


def _design(p: int, n: int, rng) -> np.ndarray:
    pts = [np.eye(p)[k] for k in range(p)] + [np.full(p, 1.0 / p)]
    while len(pts) < n:
        pts.append(rng.dirichlet(np.ones(p)))
    return np.array(pts[: max(n, 1)])


def _candidates(p: int, rng, n: int = 20000) -> np.ndarray:
    if p == 2:
        t = np.linspace(0.0, 1.0, 2001)
        return np.column_stack([t, 1 - t])
    return np.vstack([np.eye(p), np.full((1, p), 1.0 / p), rng.dirichlet(np.ones(p), size=n)])


def _ask(oracle, eta, points, Z, Ls) -> bool:
    """Evaluate ``points`` in order; False once a site refuses for budget (what was answered is kept)."""
    for z in points:
        try:
            s = oracle.evaluate(z, eta, ("L",))
        except PrivacyError as exc:
            if exc.rule not in ("dp_budget", "budget"):
                raise
            return False
        Z.append(np.asarray(z, dtype=np.float64))
        Ls.append(np.asarray(s.L, dtype=np.float64))
    return True


def _choose(Z, Ls, C, ridge, ucb, weights=None):
    """Weighted ridge surrogate of each L_k; the candidate minimising max_k of its upper bound."""
    m, p = Z.shape
    full = m >= 1 + p + p * (p + 1) // 2 + 2
    F = _features(Z, full)
    w = np.ones(m) if weights is None else weights
    Fw = F * w[:, None]
    A = np.linalg.inv(F.T @ Fw + ridge * np.eye(F.shape[1]))
    coef = A @ Fw.T @ Ls  # (features, p)
    FC = _features(C, full)
    pred = FC @ coef  # (candidates, p)
    # pessimistic choice: the upper confidence bound of each L_k (noise level estimated from the
    # residuals), so that noise and extrapolation do not pull z to a corner of the simplex
    dof = max(float(w.sum()) - F.shape[1], 1.0)
    sigma = np.sqrt(np.sum(w[:, None] * (Ls - F @ coef) ** 2, axis=0) / dof)  # (p,)
    se = np.sqrt(np.maximum(np.einsum("cf,fg,cg->c", FC, A, FC), 0.0))  # (candidates,)
    worst = (pred + ucb * se[:, None] * sigma[None, :]).max(axis=1)
    best = int(np.argmin(worst))
    return best, pred[best], float(worst[best])


def solve_noisy(
    oracle,
    eta: float,
    *,
    n_evaluations: int = 30,
    ridge: float = 1e-6,
    ucb: float = 2.0,
    local_share: float = 0.4,
    radius: float = 0.3,
    random_state=0,
    callback=None,
) -> DCResult:
    """min over the simplex of max_k (surrogate L_k(z) + ucb * its standard error), from at most
    ``n_evaluations`` noisy answers: a global design, then ``local_share`` of the answers in a
    neighbourhood (``radius``) of the first choice, where a locally weighted surrogate decides."""
    p = int(oracle.n_sources)
    rng = np.random.default_rng(random_state)
    n = int(n_evaluations)
    n_local = int(round(local_share * n)) if n >= 2 * (p + 2) else 0
    Z: list[np.ndarray] = []
    Ls: list[np.ndarray] = []
    more = _ask(oracle, eta, _design(p, n - n_local, rng), Z, Ls)
    if not Z:
        z = np.full(p, 1.0 / p)
        return DCResult(
            z=z,
            gamma=float("nan"),
            losses=np.full(p, np.nan),
            history=[],
            converged=False,
            n_iter=0,
            n_evaluations=0,
            method="dp-surrogate",
        )
    C = _candidates(p, rng)
    best, losses, value = _choose(np.array(Z), np.array(Ls), C, ridge, ucb)
    z = C[best]
    history = [value]
    if more and n_local:
        local = (1 - radius) * z[None, :] + radius * rng.dirichlet(np.ones(p), size=n_local)
        _ask(oracle, eta, local, Z, Ls)
        Za, La = np.array(Z), np.array(Ls)
        weights = np.exp(-np.sum((Za - z) ** 2, axis=1) / (2 * radius**2))
        CL = np.vstack([z[None, :], (1 - radius) * z[None, :] + radius * C])
        best, losses, value = _choose(Za, La, CL, ridge, ucb, weights)
        z = CL[best]
        history.append(value)
    z = np.maximum(z, 0.0)
    z = z / z.sum()
    losses = np.maximum(losses, 0.0)  # estimates of losses, which are >= 0 (the noise is not)
    gamma = float(losses.max() - z @ losses)
    if callback is not None:
        callback(len(history), z, value)
    return DCResult(
        z=z,
        gamma=gamma,
        losses=losses,
        history=history,
        converged=True,
        n_iter=len(history),
        n_evaluations=len(Z),
        method="dp-surrogate",
    )
