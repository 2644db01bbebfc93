"""Probe: the influence report's leave-one-out re-solves on quasi-Newton models, in lockstep.

``python benchmarks/probe_influence_quasi_newton.py [--ps 4 8 16] [--n 2000] [--model MODEL] [--convex]``

Not the project's re-solve (that is SLSQP on the L and dL the sites return,
:mod:`msa_fed.core.influence`): an in-process measurement of re-solves that ask nothing new of the
sites.  Every evaluation returns every domain's loss L_k and its gradient dL[k] (p,), and the p
re-solves (and the full solve before them) evaluate the same functions L_k.  So each re-solve
models L_k at its point as L_k + g_k.d + d'B_k d / 2, B_k from gradients alone.  Models on z
(a trust region in which a coordinate may shrink by the radius's fraction and grow by the radius):

- ``fit``: B_k the symmetric least-squares fit to the secant pairs (z_a - z, dL_a[k] - dL[k]) of
  the 2p evaluated points nearest z, whichever solve evaluated them (:class:`Pool`: the full
  solve's path, recorded during the fit, and every re-solve's evaluations so far), refitted at
  every step;
- ``sr1``: that fit at the re-solve's start, then a symmetric rank-one update of every B_k with
  each of the re-solve's own evaluations (taken or refused);
- ``exact``: each domain's exact Hessian (the sums of ``probe_influence_second_order.py``, not
  available to the coordinator): the same steps with a perfect model, for scale.

Models on u = log z (z = softmax(u) on the face z_j = 0; a max-norm trust region on u), where the
losses are far closer to quadratic (a coordinate's share of the mixture acts through ratios):

- ``u-fit`` (default): the pooled fit at the start mapped to u (chain rule of the softmax), then
  at every step the symmetric least-squares fit to the re-solve's own secant pairs in u (the 2q
  nearest), pulled towards the last model with weight FIT_PRIOR;
- ``u-sr1``: the mapped fit, then symmetric rank-one updates in u;
- ``u-exact``: the exact Hessians mapped to u.

A step minimises the largest model over the face within the trust region (SLSQP on the small
problem at the coordinator, no round); every re-solve takes one step per round and the round's
new points are evaluated together (one round).  A re-solve ends only on a first-order certificate
from L and dL: on z, the decrease the linearised losses allow over the whole face
(:func:`linear_decrease`); on u, a convex combination of the top domains' gradients in u of norm
at most U_CERTIFICATE_TOL, or no decrease of the linearised max within the trust region (an LP);
else after MAX_EVALUATIONS.  So a wrong model costs rounds, never the end point.  On the
benchmark's problem (``bench_influence.make_sites``) it prints, per site left out, the end
point's max_k L_k against the report's SLSQP re-solve, and the z's, rounds and CPU of both (the
coordinator's share: the fits, the model steps and the certificates).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import linprog, minimize

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_influence import make_sites  # noqa: E402

#: a re-solve ends when the step's model predicts a decrease at most this (loss units) ...
PREDICTED_TOL = 1e-9
#: ... and the linearised decrease over the whole face (:func:`linear_decrease`) is at most this
CERTIFICATE_TOL = 1e-6
#: secant pairs in a Hessian fit: the nearest NEAREST_FACTOR * p evaluated points (at least 4)
NEAREST_FACTOR = 2
#: the first trust radius (max-norm on z) and its limits
RADIUS0, RADIUS_MIN, RADIUS_MAX = 0.5, 1e-9, 1.0
#: a step is taken when it lowers max_k L_k by at least this fraction of the model's prediction
ACCEPT = 1e-4
#: evaluations of one re-solve at most (its best point is returned, marked not converged)
MAX_EVALUATIONS = 60
#: the models (the module docstring); ``EXACT``: z -> (p, p, p) for "exact"
MODEL = "u-fit"
EXACT: Callable[[np.ndarray], np.ndarray] | None = None


def sr1(B: np.ndarray, s: np.ndarray, Y: np.ndarray) -> None:
    """Symmetric rank-one updates of every B_k (in place) with the pair (s, Y[k]); skipped where
    the denominator is tiny."""
    for k in range(B.shape[0]):
        r = Y[k] - B[k] @ s
        den = float(r @ s)
        if abs(den) > 1e-8 * float(np.linalg.norm(r) * np.linalg.norm(s)) and abs(den) > 1e-300:
            B[k] += np.outer(r, r) / den


class Pool:
    """Every point evaluated (z, L, dL) by any solve: the secant pairs of the Hessian fits."""

    def __init__(self, p: int) -> None:
        self.p = p
        self._z: list[np.ndarray] = []
        self._dL: list[np.ndarray] = []
        self._Z = np.zeros((0, p))
        self._G = np.zeros((0, p, p))

    def add(self, z: np.ndarray, dL: np.ndarray) -> None:
        self._z.append(np.asarray(z, dtype=np.float64))
        self._dL.append(np.asarray(dL, dtype=np.float64))

    def __len__(self) -> int:
        return len(self._z)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._Z.shape[0] != len(self._z):
            self._Z = np.array(self._z)
            self._G = np.array(self._dL)
        return self._Z, self._G

    def pairs(self, z: np.ndarray, dL: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """(S (m, p), Y (m, p, p)): the m nearest evaluated points' z - z_c and dL - dL_c."""
        Z, G = self._arrays()
        S = Z - z
        d2 = np.einsum("ij,ij->i", S, S)
        far = d2 > 1e-24
        idx = np.flatnonzero(far)
        idx = idx[np.argsort(d2[idx])[:m]]
        return S[idx], G[idx] - dL


def _design(p: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = np.triu_indices(p)
    return rows, cols


def fit_hessians(S: np.ndarray, Y: np.ndarray, prior: np.ndarray | None = None, weight: float = 0.0) -> np.ndarray:
    """(p, p, p): for each domain k the symmetric B_k minimising sum_a |B_k s_a - y_ak|^2 / |s_a|^4
    (least norm), one least-squares problem with a right-hand side per domain."""
    m, p = S.shape
    rows, cols = _design(p)
    nu = rows.size
    A = np.zeros((m, p, nu))
    ar = np.arange(nu)
    A[:, rows, ar] += S[:, cols]
    off = rows != cols
    A[:, cols[off], ar[off]] += S[:, rows[off]]
    scale = 1.0 / np.maximum(np.einsum("ij,ij->i", S, S), np.finfo(float).tiny)
    A *= scale[:, None, None]
    rhs = (Y * scale[:, None, None]).transpose(0, 2, 1).reshape(m * p, p)  # column k: domain k
    A2 = A.reshape(m * p, nu)
    if prior is not None and weight > 0:  # pulled towards the prior: weight * |B - prior|^2 (entries)
        A2 = np.vstack([A2, weight * np.eye(nu)])
        rhs = np.vstack([rhs, weight * prior[:, rows, cols].T])
    sol = np.linalg.lstsq(A2, rhs, rcond=None)[0]  # (nu, p)
    B = np.zeros((p, p, p))
    B[:, rows, cols] = sol.T
    B[:, cols, rows] = sol.T
    return B


def linear_decrease(
    z: np.ndarray, L: np.ndarray, dL: np.ndarray, keep: np.ndarray, radius: float = 1.0
) -> tuple[float, np.ndarray]:
    """(f - min_d max_k (L_k + g_k.d), d): the decrease the linearised losses allow over the face
    (z + d on the face z_j = 0, |d|_max <= radius), k over the kept domains.  0 exactly at a
    first-order stationary point of max_k L_k on the face, > 0 elsewhere (the linearised max is
    convex, so a positive value is a descent direction)."""
    idx = np.flatnonzero(keep)
    q = idx.size
    f = float(L[idx].max())
    G = dL[np.ix_(idx, idx)]
    # variables (d (q), t): min t s.t. G d - t <= f - L, sum d = 0, bounds
    c = np.zeros(q + 1)
    c[q] = 1.0
    A_ub = np.hstack([G, -np.ones((q, 1))])
    b_ub = -(L[idx] - f)
    A_eq = np.append(np.ones(q), 0.0)[None, :]
    zq = z[idx]
    bounds = [(-min(radius, 1.0) * zq[i], min(1.0 - zq[i], radius)) for i in range(q)] + [(None, None)]
    res = linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=[0.0], bounds=bounds, method="highs")
    if res.status != 0:
        return 0.0, np.zeros(z.size)
    d = np.zeros(z.size)
    d[idx] = res.x[:q]
    return max(0.0, -float(res.x[q])), d


def model_step(
    z: np.ndarray, L: np.ndarray, dL: np.ndarray, B: np.ndarray, keep: np.ndarray, radius: float
) -> tuple[np.ndarray, float]:
    """(d, predicted decrease): the step minimising max_k of the quadratic models over the face
    within the trust region (SLSQP on the small epigraph problem, no round)."""
    idx = np.flatnonzero(keep)
    q = idx.size
    f = float(L[idx].max())
    Lk, G, Bk = L[idx] - f, dL[np.ix_(idx, idx)], B[np.ix_(idx, idx, idx)]

    def models(d: np.ndarray) -> np.ndarray:
        return Lk + G @ d + 0.5 * np.einsum("kab,a,b->k", Bk, d, d)

    def cons(x: np.ndarray) -> np.ndarray:
        return x[q] - models(x[:q])

    def cons_jac(x: np.ndarray) -> np.ndarray:
        J = np.empty((q, q + 1))
        J[:, :q] = -(G + np.einsum("kab,b->ka", Bk, x[:q]))
        J[:, q] = 1.0
        return J

    zq = z[idx]
    bounds = [(-min(radius, 1.0) * zq[i], min(1.0 - zq[i], radius)) for i in range(q)] + [(None, None)]
    e = np.zeros(q + 1)
    e[q] = 1.0
    res = minimize(
        lambda x: x[q],
        np.zeros(q + 1),
        jac=lambda x: e,
        method="SLSQP",
        bounds=bounds,
        constraints=[
            {"type": "ineq", "fun": cons, "jac": cons_jac},
            {
                "type": "eq",
                "fun": lambda x: np.array([x[:q].sum()]),
                "jac": lambda x: np.append(np.ones(q), 0.0)[None, :],
            },
        ],
        options={"ftol": 1e-14, "maxiter": 100},
    )
    dq = np.asarray(res.x[:q])
    d = np.zeros(z.size)
    d[idx] = dq
    predicted = -float(models(dq).max())
    return d, predicted


@dataclass
class Resolve:
    """One re-solve: min over the face z_j = 0 of max_{k != j} L_k."""

    j: int
    keep: np.ndarray
    z: np.ndarray
    L: np.ndarray | None = None
    dL: np.ndarray | None = None
    radius: float = RADIUS0
    evaluations: int = 0
    done: bool = False
    converged: bool = False
    trial: np.ndarray | None = None
    predicted: float = 0.0
    log: list[Any] = field(default_factory=list)
    B: np.ndarray | None = None
    own: list[Any] = field(default_factory=list)  # (u, g_u) of the re-solve's own points

    @property
    def f(self) -> float:
        assert self.L is not None
        return float(self.L[self.keep].max())


def _on_face(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.where(keep, np.clip(z, 0.0, None), 0.0)
    return out / out.sum()


def all_without_qn(
    evaluate_batch: Callable[[np.ndarray], list[tuple[np.ndarray, np.ndarray]]],
    z: np.ndarray,
    js: list[int],
    path: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
) -> tuple[dict[int, tuple[np.ndarray, np.ndarray, bool]], int, int]:
    """The re-solves without each site j in ``js`` (z^{-j}, every domain's L there, converged),
    the z's evaluated and the rounds.  ``evaluate_batch(zs)`` -> [(L, dL)] per row (one round);
    ``path``: (z, L, dL) of points already evaluated (the full solve's), for the Hessian fits."""
    z = np.asarray(z, dtype=np.float64)
    p = z.size
    pool = Pool(p)
    memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    for zz, L, dL in path or []:
        pool.add(zz, dL)
        memo[np.asarray(zz, dtype=np.float64).tobytes()] = (np.asarray(L), np.asarray(dL))
    runs = []
    for j in js:
        keep = np.ones(p, bool)
        keep[j] = False
        # on u = log z every coordinate of the face is positive: zeros start at U_FLOOR
        start = _on_face(np.maximum(z, U_FLOOR) if MODEL.startswith("u-") else z, keep)
        runs.append(Resolve(j, keep, start))
    rounds = calls = 0
    while True:
        asks: list[tuple[Resolve, np.ndarray]] = []
        for r in runs:
            if r.done:
                continue
            zt = r.z if r.L is None else r.trial
            assert zt is not None
            asks.append((r, zt))
        if not asks:
            break
        new = {}
        for _, zt in asks:
            key = zt.tobytes()
            if key not in memo:
                new[key] = zt
        if new:
            answers = evaluate_batch(np.array(list(new.values())))
            rounds += 1
            calls += len(new)
            for key, zt, (L, dL) in zip(new, new.values(), answers):
                memo[key] = (np.asarray(L), np.asarray(dL))
                pool.add(zt, dL)
        for r, zt in asks:
            L, dL = memo[zt.tobytes()]
            r.evaluations += 1
            (_advance_u if MODEL.startswith("u-") else _advance)(r, zt, L, dL, pool)
    out = {r.j: (r.z, r.L, r.converged) for r in runs}
    return out, calls, rounds


def _advance(r: Resolve, zt: np.ndarray, L: np.ndarray, dL: np.ndarray, pool: Pool) -> None:
    """Take the answer at the trial point (or the start), then plan the next trial or end."""
    if r.L is None:
        r.L, r.dL = L, dL
    else:
        if MODEL == "sr1" and r.B is not None:
            sr1(r.B, zt - r.z, dL - r.dL)
        f_new = float(L[r.keep].max())
        f = r.f
        step = float(np.max(np.abs(zt - r.z) / np.maximum(np.maximum(r.z, zt), 1e-300)))
        _trust_step(r, zt, L, dL, f, f_new, step, f_new < f - ACCEPT * r.predicted, 0.75, RADIUS_MIN, RADIUS_MAX)
    if r.evaluations >= MAX_EVALUATIONS:
        r.done = True
        return
    plan(r, pool)


def _trust_step(r, zt, L, dL, f, f_new, step, accepted, expand, radius_min, radius_max) -> None:
    """The trial's outcome: accepted, the re-solve moves there; the trust radius grows on a good
    prediction (ratio above ``expand``) and shrinks on a poor one or a rejection."""
    if accepted:
        rho = (f - f_new) / max(r.predicted, 1e-300)
        r.z, r.L, r.dL = zt, L, dL
        if rho > expand and step >= 0.5 * r.radius:
            r.radius = min(2 * r.radius, radius_max)
        elif rho < 0.25:
            r.radius = max(0.5 * step, radius_min)
    else:
        r.radius = max(0.25 * step, radius_min)
    r.log.append((f_new, f, r.predicted, step))


def plan(r: Resolve, pool: Pool) -> None:
    assert r.L is not None and r.dL is not None
    p = r.z.size
    if MODEL == "sr1" and r.B is not None:
        B = r.B
    else:
        S, Y = pool.pairs(r.z, r.dL, max(NEAREST_FACTOR * p, 4))
        B = fit_hessians(S, Y) if len(S) else np.zeros((p, p, p))
        r.B = B
    if MODEL == "exact" and EXACT is not None:
        B = EXACT(r.z)
    d, predicted = model_step(r.z, r.L, r.dL, B, r.keep, r.radius)
    if predicted <= PREDICTED_TOL:
        cert, dlin = linear_decrease(r.z, r.L, r.dL, r.keep)
        if cert <= CERTIFICATE_TOL:
            r.done = r.converged = True
            return
        # the model predicts nothing more but the point is not stationary: a step on the
        # linearised losses within the trust region
        dec, d = linear_decrease(r.z, r.L, r.dL, r.keep, r.radius)
        predicted = dec
    r.trial, r.predicted = _on_face(r.z + d, r.keep), predicted


# ------------------------------------------------------------ models in log coordinates
#: log-coordinate re-solves: the first trust radius on u = log z (max-norm) and its limits
U_RADIUS0, U_RADIUS_MIN, U_RADIUS_MAX = 1.0, 1e-8, 8.0
#: ... and the smallest coordinate on the face (u finite)
U_FLOOR = 1e-12
#: ... the radius doubles after a step to its edge whose decrease is at least this fraction of the prediction
EXPAND = 0.75
#: u-fit: the weight of the last model in the refit (entries)
FIT_PRIOR = 1e-2
#: SLSQP's tolerance on the model step (loss units)
STEP_FTOL = 1e-15
#: u-models: their negative eigenvalues set to 0 before the step (``--convex``)
CONVEX = False
#: ... the certificate: domains within this of the top are active ...
ACTIVE_GAP = 1e-7
#: ... and the smallest norm of a convex combination of their gradients in u at most this
U_CERTIFICATE_TOL = 1e-6


def to_u(z: np.ndarray, B: np.ndarray, G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g_u (K, q), B_u (K, q, q)): gradients and Hessians of the losses in u, z = softmax(u),
    from those in z (G: (K, q) rows dL_k on the face's coordinates; B: (K, q, q))."""
    c = G - (G @ z)[:, None]  # (K, q)
    gu = z[None, :] * c
    Jm = np.diag(z) - np.outer(z, z)
    Bu = np.einsum("ab,kbc,cd->kad", Jm, B, Jm)
    zc = z[None, :] * c  # second-order term of the map: diag(z c) - z z'(c_l + c_m)
    for k in range(G.shape[0]):
        Bu[k] += np.diag(zc[k]) - np.outer(zc[k], z) - np.outer(z, zc[k])
    return gu, Bu


def u_certificate(gu: np.ndarray, L: np.ndarray) -> float:
    """min over convex combinations of the active domains' u-gradients of the norm (NNLS)."""
    from scipy.optimize import nnls

    act = np.flatnonzero(L >= L.max() - ACTIVE_GAP)
    A = np.vstack([gu[act].T, 1e3 * np.ones((1, act.size))])
    b = np.append(np.zeros(gu.shape[1]), 1e3)
    lam = nnls(A, b)[0]
    return float(np.linalg.norm(gu[act].T @ lam))


def u_step(Lk: np.ndarray, gu: np.ndarray, Bu: np.ndarray, radius: float) -> tuple[np.ndarray, float]:
    """(du, predicted): min over |du|_max <= radius, sum du = 0 of max_k of the models in u."""
    K, q = gu.shape

    def models(du: np.ndarray) -> np.ndarray:
        return Lk + gu @ du + 0.5 * np.einsum("kab,a,b->k", Bu, du, du)

    def cons_jac(x: np.ndarray) -> np.ndarray:
        J = np.empty((K, q + 1))
        J[:, :q] = -(gu + np.einsum("kab,b->ka", Bu, x[:q]))
        J[:, q] = 1.0
        return J

    e = np.zeros(q + 1)
    e[q] = 1.0
    res = minimize(
        lambda x: x[q],
        np.zeros(q + 1),
        jac=lambda x: e,
        method="SLSQP",
        bounds=[(-radius, radius)] * q + [(None, None)],
        constraints=[
            {"type": "ineq", "fun": lambda x: x[q] - models(x[:q]), "jac": cons_jac},
            {
                "type": "eq",
                "fun": lambda x: np.array([x[:q].sum()]),
                "jac": lambda x: e[None, :] * 0 + np.append(np.ones(q), 0.0),
            },
        ],
        options={"ftol": STEP_FTOL, "maxiter": 100},
    )
    du = np.asarray(res.x[:q])
    return du, -float(models(du).max())


def u_linear_step(Lk: np.ndarray, gu: np.ndarray, radius: float) -> tuple[np.ndarray, float]:
    """(du, predicted): the step of the linearised losses in u within the trust region (an LP)."""
    K, q = gu.shape
    c = np.zeros(q + 1)
    c[q] = 1.0
    res = linprog(
        c,
        A_ub=np.hstack([gu, -np.ones((K, 1))]),
        b_ub=-Lk,
        A_eq=np.append(np.ones(q), 0.0)[None, :],
        b_eq=[0.0],
        bounds=[(-radius, radius)] * q + [(None, None)],
        method="highs",
    )
    if res.status != 0:
        return np.zeros(q), 0.0
    return np.asarray(res.x[:q]), max(0.0, -float(res.x[q]))


def convex(B: np.ndarray) -> np.ndarray:
    """Each B_k with its negative eigenvalues set to 0 (the step's problem then convex)."""
    w, V = np.linalg.eigh(B)
    return np.einsum("kab,kb,kcb->kac", V, np.clip(w, 0.0, None), V)


def _advance_u(r: Resolve, zt: np.ndarray, L: np.ndarray, dL: np.ndarray, pool: Pool) -> None:
    idx = np.flatnonzero(r.keep)
    if r.L is None:
        r.L, r.dL = L, dL
        r.radius = U_RADIUS0
    else:
        zq_old, zq_new = r.z[idx], zt[idx]
        s_u = np.log(zq_new) - np.log(zq_old)
        s_u -= s_u.mean()
        gu_old = to_u(zq_old, np.zeros((idx.size,) * 3), r.dL[np.ix_(idx, idx)])[0]
        gu_new = to_u(zq_new, np.zeros((idx.size,) * 3), dL[np.ix_(idx, idx)])[0]
        f_new, f = float(L[idx].max()), r.f
        accepted = f_new < f - ACCEPT * r.predicted
        if MODEL == "u-sr1" and r.B is not None:
            sr1(r.B, s_u, gu_new - gu_old)
        if not r.own:
            r.own.append((np.log(zq_old) - np.log(zq_old).mean(), gu_old))
        r.own.append((np.log(zq_new) - np.log(zq_new).mean(), gu_new))
        step = float(np.max(np.abs(s_u)))
        _trust_step(r, zt, L, dL, f, f_new, step, accepted, EXPAND, U_RADIUS_MIN, U_RADIUS_MAX)
    if r.evaluations >= MAX_EVALUATIONS:
        r.done = True
        return
    plan_u(r, pool)


def plan_u(r: Resolve, pool: Pool) -> None:
    assert r.L is not None and r.dL is not None
    idx = np.flatnonzero(r.keep)
    zq = r.z[idx]
    G = r.dL[np.ix_(idx, idx)]
    Lk = r.L[idx] - r.f
    gu, _ = to_u(zq, np.zeros((idx.size,) * 3), G)
    cert = u_certificate(gu, r.L[idx])
    if cert <= U_CERTIFICATE_TOL:
        r.done = r.converged = True
        return
    if MODEL == "u-exact" and EXACT is not None:
        Bz = EXACT(r.z)[np.ix_(idx, idx, idx)]
        _, Bu = to_u(zq, Bz, G)
    else:
        if r.B is None:  # the first model: the pooled secant fit at the start, in u
            S, Y = pool.pairs(r.z, r.dL, max(NEAREST_FACTOR * r.z.size, 4))
            Bz = fit_hessians(S, Y)[np.ix_(idx, idx, idx)] if len(S) else np.zeros((idx.size,) * 3)
            r.B = to_u(zq, Bz, G)[1]
        Bu = r.B
        if MODEL == "u-fit" and len(r.own) >= 2:
            u0 = np.log(zq) - np.log(zq).mean()
            S = np.array([u - u0 for u, _ in r.own])
            Yg = np.array([g - gu for _, g in r.own])
            near = np.einsum("ij,ij->i", S, S) > 1e-24
            S, Yg = S[near], Yg[near]
            order = np.argsort(np.einsum("ij,ij->i", S, S))[: 2 * idx.size]
            if len(order):
                Bu = r.B = fit_hessians(S[order], Yg[order].transpose(0, 1, 2), Bu, FIT_PRIOR)
    du, predicted = u_step(Lk, gu, convex(Bu) if CONVEX else Bu, r.radius)
    if predicted <= PREDICTED_TOL:  # the model sees nothing more, the point not certified
        du, predicted = u_linear_step(Lk, gu, r.radius)
        if predicted <= PREDICTED_TOL:  # no descent of the linearised max (convex): stationary
            r.done = r.converged = True
            return
    u = np.log(zq) + du
    zn = np.exp(u - u.max())
    z = np.zeros(r.z.size)
    z[idx] = np.maximum(zn / zn.sum(), U_FLOOR)
    z /= z.sum()
    if np.array_equal(z, r.z):  # a step that rounds to nothing: no progress is left to make
        r.done = True
        return
    r.trial, r.predicted = z, predicted


def sums(point_sets: list[Any], z: np.ndarray, eta: float) -> tuple[np.ndarray, np.ndarray]:
    parts = [ps.evaluate(z, eta, what=("L", "dL")) for ps in point_sets]
    return sum(s.L for s in parts), sum(s.dL for s in parts)


def probe(p: int, n: int) -> dict[str, Any]:
    """One fit with the report on: the report's SLSQP re-solves, then these, on the same z."""
    import msa_fed.runtime.coordinator as co
    from msa_fed import fit_dmsa
    from msa_fed.core.influence import known_without

    real, real_solve = co.influence_table, co.solve_dc
    path: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    out: dict[str, Any] = {"p": p}

    class Recorded:  # the full solve's evaluations (z, L, dL): the pool's first points
        def __init__(self, oracle: Any) -> None:
            self.oracle, self.n_sources = oracle, oracle.n_sources

        def evaluate(self, z: Any, eta: float, what: Any, global_bound: Any = None) -> Any:
            s = self.oracle.evaluate(z, eta, what, global_bound)
            if s.dL is not None:
                path.append((np.array(z, dtype=np.float64), s.L.copy(), s.dL.copy()))
            return s

        def max_bound(self) -> float:
            return float(self.oracle.max_bound())

    def solve(oracle: Any, eta: float, **kw: Any) -> Any:
        return real_solve(Recorded(oracle), eta, **kw)

    def run(oracle: Any, eta: float, z: Any, losses: Any, names: Any, **kw: Any) -> Any:
        global EXACT
        point_sets = [w._points for w in oracle.backend.workers]  # the local sites' own sums
        z = np.asarray(z, dtype=np.float64)
        if MODEL in ("exact", "u-exact"):
            from probe_influence_second_order import hessians

            EXACT = lambda zz: hessians(point_sets, zz, eta)  # noqa: E731
        cpu = time.process_time()
        table = real(oracle, eta, z, losses, names, **kw)
        out["slsqp_cpu_s"] = time.process_time() - cpu
        out["slsqp_z"], out["slsqp_rounds"] = table["evaluations"], table["rounds"]
        js = [j for j in range(p) if not (kw.get("minmax_point") and known_without(z, losses, j))]
        cpu = time.process_time()
        spent = [0.0]

        def batch(zs: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
            t = time.process_time()
            try:
                return [sums(point_sets, zz, eta) for zz in zs]
            finally:
                spent[0] += time.process_time() - t

        res, calls, rounds = all_without_qn(batch, z, js, path)
        out["qn_cpu_s"] = time.process_time() - cpu  # the sums in process included
        out["qn_model_cpu_s"] = out["qn_cpu_s"] - spent[0]  # the coordinator's side: fits, steps, certificates
        out["qn_z"], out["qn_rounds"], out["path"] = calls, rounds, len(path)
        worst = 0.0
        for j in js:
            zj, Lj, ok = res[j]
            old = np.asarray(table["loss_without"][j])
            fo, fn = float(np.delete(old, j).max()), float(np.delete(Lj, j).max())
            worst = max(worst, float(np.abs(old - Lj).max()))
            print(
                f"  without {names[j]}: {'certified' if ok else 'stopped'}; max_k L_k {fn:.7f} (SLSQP {fo:.7f}, "
                f"{fn - fo:+.1e}); max_k |L_k - L_k(SLSQP)| {np.abs(old - Lj).max():.1e}"
            )
        out["max_loss_diff"] = worst
        print(
            f"p={p}: SLSQP re-solves {out['slsqp_z']} z in {out['slsqp_rounds']} rounds, {out['slsqp_cpu_s']:.2f} s; "
            f"{MODEL} models {calls} z in {rounds} rounds, {out['qn_cpu_s']:.2f} s (the sums in process "
            f"included; models and steps {out['qn_model_cpu_s']:.2f} s; {len(path)} points of the full solve pooled); "
            f"max |loss difference| {worst:.1e}",
            flush=True,
        )
        raise StopIteration

    co.influence_table, co.solve_dc = run, solve
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit_dmsa(make_sites(p, n), "classification", influence=True)
    except StopIteration:
        pass
    finally:
        co.influence_table, co.solve_dc = real, real_solve
    return out


def main(argv: list[str] | None = None) -> int:
    global MODEL
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ps", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--convex", action="store_true", help="u-models: negative curvature set to 0 in the step")
    ap.add_argument("--model", choices=("sr1", "fit", "exact", "u-sr1", "u-fit", "u-exact"), default="u-fit")
    args = ap.parse_args(argv)
    MODEL = args.model
    global CONVEX
    CONVEX = args.convex
    for p in args.ps:
        probe(p, args.n)
    return 0


if __name__ == "__main__":  # pragma: no cover - a script
    raise SystemExit(main())
