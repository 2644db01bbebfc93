"""A global method for Gamma(z) = 0: follow the logit path, then polish with Newton.

Gamma(z) = max_k L_k(z) - z.L(z) vanishes exactly when z is an equilibrium: z is a best
response to the losses it induces, z in argmax_{z'} z'.L(z) (every domain in the support of z
has the largest loss).  Such a z exists (Nash's argument), but local methods started at the
uniform point (Newton, DCA) often stall far from one: with the squared loss the map z -> L(z)
has several equilibria with narrow basins.

The logit (quantal-response) path z(lam) = softmax(lam L(z(lam))) starts at the uniform point
for lam = 0 and, by Browder's fixed-point theorem, a connected branch of it reaches lam ->
infinity, where its points become equilibria: on the path

    Gamma(z) = (max_k y_k - sum_k z_k y_k) / lam <= log(p) / lam,    y = log z.

We trace it by predictor-corrector continuation (pseudo-arclength, so folds where lam turns
back are passed) in the unknowns u = (y, m, log lam) of

    lam (L_k(exp y) - m) - y_k = 0  (k = 1..p),     sum_k exp(y_k) = 1,

with the analytic Jacobian dL.  Step lengths are measured in a norm where y_k weighs
sqrt(p z_k), so that the coordinates that vanish along the path (y_k -> -inf) do not force
short steps; the orientation is kept by the sign of det([J; t]), and a corrector that does not
contract fast is refused (it may be jumping to another sheet near a fold).  Whenever Gamma on
the path has dropped enough, an active-set Newton step on L_k(z) = c (k in the support),
sum z = 1 tries to finish; it converges quadratically once the support is right.  Every
evaluation is one oracle call (L and dL), so the method runs unchanged against sites.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from msa_fed.core.dc_steps import kkt_step, max_step_in_simplex
from msa_fed.core.dc_terms import DCSums, gamma_from_losses

Evaluator = Callable[[np.ndarray, tuple[str, ...]], DCSums]
#: callback(iteration, z, value) after each accepted iterate
Callback = Callable[[int, np.ndarray, float], object]

#: step halvings of one polishing step before it counts as no progress
POLISH_BACKTRACKS = 5


def polish_active_set(
    ev: Evaluator, z: np.ndarray, tol: float, *, max_iter: int = 8, support_tol: float = 1e-4
) -> tuple[np.ndarray, float, np.ndarray, bool]:
    """Newton on L_k(z) = c for k in S = {z_k >= support_tol max z}, sum_S z = 1, z = 0 off S.

    A step that leaves the simplex is cut at the boundary and the coordinate leaves S; steps are
    halved until the spread of the support's losses decreases.  Returns (z, Gamma, L,
    Gamma <= tol); gives up (ok=False) as soon as a step makes no progress.
    """
    S = z >= support_tol * z.max()
    z = np.where(S, z, 0.0)
    z = z / z.sum()
    s = ev(z, ("L", "dL"))
    g = gamma_from_losses(s.array("L"), z)

    def spread(L: np.ndarray, zz: np.ndarray) -> float:
        on = zz > 0
        return float(np.linalg.norm(L[on] - zz[on] @ L[on]))

    for _ in range(max_iter):
        if g <= tol:
            return z, g, s.array("L"), True
        idx = np.flatnonzero(S)
        try:
            L = s.array("L")
            dz = kkt_step(s.array("dL"), L[idx] - z @ L, z, idx)
        except np.linalg.LinAlgError:
            break
        if not np.all(np.isfinite(dz)):
            break
        a_max = max_step_in_simplex(z, dz)
        r0 = spread(s.array("L"), z)
        a, accepted = a_max, False
        for _ in range(POLISH_BACKTRACKS):
            zn = np.maximum(z + a * dz, 0.0)
            zn /= zn.sum()
            sn = ev(zn, ("L", "dL"))
            gn = gamma_from_losses(sn.array("L"), zn)
            if gn <= tol or spread(sn.array("L"), zn) < (1.0 - 1e-4 * a) * r0:
                accepted = True
                break
            a *= 0.5
        if not accepted:
            break
        if a == a_max and a_max < 1.0:
            S &= zn > 0
        z, s, g = zn, sn, gn
    return z, g, s.array("L"), g <= tol


def logit_path_run(
    ev: Evaluator,
    n_sources: int,
    tol: float,
    max_iter: int,
    callback: Callback | None,
    history: list[float],
    *,
    corrector_tol: float = 1e-3,
    max_step: float = 5.0,
    polish_rel: float = 1e-2,
    wmin: float = 1e-6,
) -> tuple[np.ndarray, float, np.ndarray, bool, int]:
    """Trace the logit path from the uniform point; returns (z, Gamma, L, converged, steps).

    max_iter caps the accepted continuation steps.  history gets Gamma at every path point and
    after every polishing attempt (it is not monotone: Gamma may rise along the path).
    corrector_tol : ||H|| accepted on the path (the polish gives the final accuracy).
    max_step : longest predictor step, in the weighted norm below.
    polish_rel : Newton polishing is tried once Gamma < polish_rel * max_k |L_k| (and again
        each time Gamma has fallen by a factor 0.3 since the last try).
    wmin : smallest weight of a coordinate y_k in the step-length norm.
    """
    p = int(n_sources)

    def system(u: np.ndarray) -> tuple[np.ndarray, np.ndarray, DCSums, np.ndarray]:
        """H(u) (p+1,), its Jacobian (p+1, p+2), the sums and z at u."""
        y, m, lam = u[:p], u[p], np.exp(u[p + 1])
        z = np.exp(y)
        s = ev(z, ("L", "dL"))
        H = np.append(lam * (s.array("L") - m) - y, z.sum() - 1.0)
        J = np.zeros((p + 1, p + 2))
        J[:p, :p] = lam * s.array("dL") * z[None, :] - np.eye(p)
        J[:p, p] = -lam
        J[:p, p + 1] = lam * (s.array("L") - m)
        J[p, :p] = z
        return H, J, s, z

    def weights(u: np.ndarray) -> np.ndarray:
        """Weights of the step-length norm: y_k counts with sqrt(p z_k) (a coordinate that
        vanishes along the path, y_k -> -inf linearly in lam, must not shorten the steps)."""
        w = np.ones(p + 2)
        w[:p] = np.clip(np.sqrt(p * np.exp(u[:p])), wmin, 1.0)
        return w

    def correct(
        u: np.ndarray, w: np.ndarray, fix: np.ndarray | None = None, max_newton: int = 4, h: float | None = None
    ) -> tuple[np.ndarray, bool, int, np.ndarray, DCSums, np.ndarray]:
        """Newton back onto the path, each step of least weighted norm; ``fix`` adds the row
        fix.du = 0.  After a predictor step of length h the corrector must stay close (first
        correction <= h / 2) and contract (each correction <= half the previous one): otherwise
        it may be heading for another sheet of the path near a fold, and the step is refused.
        """
        prev = None
        for i in range(max_newton + 1):
            H, J, s, z = system(u)
            if not np.all(np.isfinite(H)):
                return u, False, i, J, s, z
            if np.linalg.norm(H) < corrector_tol:
                return u, True, i, J, s, z
            if i == max_newton:
                break
            if fix is None:  # minimum ||w * du|| solution
                dv = -np.linalg.lstsq(J / w[None, :], H, rcond=None)[0]
                du = dv / w
            else:
                du = -np.linalg.solve(np.vstack([J, fix]), np.append(H, 0.0))
            size = float(np.linalg.norm(w * du))
            if h is not None and ((prev is None and size > 0.5 * h) or (prev is not None and size > 0.5 * prev)):
                return u, False, i, J, s, z
            prev = size
            u = u + du
            if not np.all(np.isfinite(u)) or u[p + 1] > 600.0:
                return u, False, i, J, s, z
        return u, False, max_newton, J, s, z

    def tangent(J: np.ndarray, w: np.ndarray, sign: float | None = None) -> tuple[np.ndarray, float]:
        """Null vector t of J (weighted norm 1) and the sign of det([J; t]).  With ``sign``, t is
        oriented so that the determinant keeps it: the orientation of a regular path never
        changes, however sharp its turns.  Without, t points towards larger lam."""
        t = np.linalg.svd(J)[2][-1]
        t = t / np.linalg.norm(w * t)
        if sign is not None:
            d = np.linalg.det(np.vstack([J, t]))
            return (t if np.sign(d) == sign else -t), sign
        t = t if t[p + 1] > 0 else -t
        return t, np.sign(np.linalg.det(np.vstack([J, t]))) or 1.0

    z0 = np.full(p, 1.0 / p)
    s0 = ev(z0, ("L", "dL"))
    g0 = gamma_from_losses(s0.array("L"), z0)
    history.append(g0)
    best = (g0, z0, s0.array("L"))
    if g0 <= tol:
        return z0, g0, s0.array("L"), True, 0
    # start where z is still uniform to 1%: lam0 (max L - min L) = 1e-2
    L0 = s0.array("L")
    spread = max(float(np.ptp(L0)), 1e-3 * float(np.max(np.abs(L0))), 1e-300)
    lam0 = 1e-2 / spread
    # on the path y_k = lam (L_k - m); at the uniform point m = mean L + log(p) / lam
    u = np.concatenate([np.log(z0), [L0.mean() + np.log(p) / lam0], [np.log(lam0)]])
    fix = np.zeros(p + 2)
    fix[p + 1] = 1.0
    u, ok, _, J, s, z = correct(u, weights(u), fix=fix, max_newton=10)
    if not ok:
        return best[1], best[0], best[2], False, 0
    w = weights(u)
    t, orientation = tangent(J, w)
    h = 1.0
    last_polish = np.inf
    steps = 0
    while steps < max_iter:
        # the step in log(lam) is at most 2 (a factor e^2 on lam)
        h_eff = min(h, 2.0 / max(abs(t[p + 1]), 1e-12))
        un, ok, nit, Jn, sn, zn = correct(u + h_eff * t, w, h=h_eff)
        if not ok:
            h = 0.5 * h_eff
            if h < 1e-8:
                break
            continue
        wn = weights(un)
        tn, _ = tangent(Jn, wn, orientation)
        cos = float((w * t) @ (w * tn)) / (np.linalg.norm(w * tn) + 1e-300)
        if cos < 0.5 and h_eff > 1e-3:  # a turn sharper than 60 degrees: smaller steps
            h = 0.5 * h_eff
            continue
        steps += 1
        u, J, s, z, t, w = un, Jn, sn, zn, tn, wn
        if u[p + 1] < np.log(lam0) - 1.0:  # back at the start: the path is lost
            break
        h = min(h_eff * (2.0 if nit <= 1 else 1.5 if nit == 2 else 1.0 if nit == 3 else 0.6), max_step)
        zz = z / z.sum()
        g = gamma_from_losses(s.array("L"), zz)
        history.append(g)
        if g < best[0]:
            best = (g, zz, s.array("L"))
        if callback is not None:
            callback(steps, zz, g)
        if g <= tol:
            return zz, g, s.array("L"), True, steps
        if g < polish_rel * float(np.max(np.abs(s.array("L")))) and g < 0.3 * last_polish:
            last_polish = g
            zf, gf, Lf, okf = polish_active_set(ev, zz, tol)
            history.append(gf)
            if gf < best[0]:
                best = (gf, zf, Lf)
            if okf:
                if callback is not None:
                    callback(steps, zf, gf)
                return zf, gf, Lf, True, steps
    return best[1], best[0], best[2], best[0] <= tol, steps
