"""The two steps the DC solvers share: the active-set Newton (KKT) step and the SLSQP epigraph
problem over the simplex.

Active-set Newton step
    On a support S the equilibrium conditions are L_k(z) = c (k in S), sum_S z = 1, z = 0 off S.
    Linearised at z: dL_SS dz_S - dc = -r_S, sum_S dz = 1 - sum_S z, where r is the residual
    the caller chooses (L itself, or L minus its mean).  Used by ``method="newton"``
    (:mod:`msa_fed.core.dc_solver`) and by the polish of the logit path
    (:mod:`msa_fed.core.dc_homotopy`).

Epigraph problem
    min over (z, t) of t  s.t.  f_k(z) <= t for every k,  z in the simplex,  solved by SLSQP
    with the analytic Jacobian of f.  DCA solves it with f = the convexified Gamma terms at
    every iteration; ``objective="minmax"`` solves it once with f = L.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.optimize import OptimizeResult, minimize

#: Tikhonov term added to the KKT matrix of ``method="newton"`` (keeps a singular dL_SS solvable)
KKT_RIDGE = 1e-12


def kkt_step(
    dL: np.ndarray,
    residual: np.ndarray,
    z: np.ndarray,
    support: np.ndarray,
    *,
    ridge: float = 0.0,
    lstsq_fallback: bool = False,
) -> np.ndarray:
    """The Newton direction dz (p,) on ``support`` (zero elsewhere).

    Parameters
    ----------
    dL : ndarray of shape (p, p), dL_k/dz_j at z.
    residual : ndarray of shape (m,), r_S: the step solves dL_SS dz_S - dc = -r_S.
    z : ndarray of shape (p,), the current point.
    support : ndarray of shape (m,), the indices S.
    ridge : added to the diagonal of the (m + 1, m + 1) KKT matrix when > 0.
    lstsq_fallback : on a singular matrix use the least-squares solution instead of raising
        ``numpy.linalg.LinAlgError``.

    The second unknown of the system, c + dc, is not returned (it is not an increment of z).
    """
    m = support.size
    A = np.zeros((m + 1, m + 1))
    A[:m, :m] = dL[np.ix_(support, support)]
    A[:m, m] = -1.0
    A[m, :m] = 1.0
    rhs = np.append(-residual, 1.0 - z[support].sum())
    try:
        sol = np.linalg.solve(A + ridge * np.eye(m + 1) if ridge > 0 else A, rhs)
    except np.linalg.LinAlgError:
        if not lstsq_fallback:
            raise
        sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
    dz = np.zeros(z.size)
    dz[support] = sol[:m]
    return dz


def max_step_in_simplex(z: np.ndarray, dz: np.ndarray) -> float:
    """The largest alpha <= 1 with z + alpha dz >= 0."""
    neg = dz < 0
    if not neg.any():
        return 1.0
    return min(1.0, float(np.min(-z[neg] / dz[neg])))


def epigraph_slsqp(
    x0: np.ndarray,
    f: Callable[[np.ndarray], np.ndarray],
    f_jac: Callable[[np.ndarray], np.ndarray],
    *,
    maxiter: int,
    ftol: float,
    callback: Callable[[np.ndarray], object] | None = None,
    on_point: Callable[[np.ndarray], object] | None = None,
) -> OptimizeResult:
    """min t  s.t.  f(z) <= t componentwise,  z in the simplex;  x = (z, t) of shape (p + 1,).

    f(z) has shape (m,) and f_jac(z) shape (m, p) (m = p: the losses; more: the own-loss
    guarantee's penalised terms, :mod:`msa_fed.core.dc_solver`).  ``x0`` is the start (z0, t0); ``callback``
    is SLSQP's, called with x after each iteration; ``on_point`` is called with every x at which
    SLSQP evaluates the constraints, before f (an exception it raises ends the solve).  Returns
    scipy's result (``x``, ``success``); z = x[:p] may leave the simplex by rounding (project it).
    """
    p = x0.size - 1

    def cons(x: np.ndarray) -> np.ndarray:
        if on_point is not None:
            on_point(x)
        slack: np.ndarray = x[p] - f(x[:p])
        return slack

    def cons_jac(x: np.ndarray) -> np.ndarray:
        fj = f_jac(x[:p])
        jac = np.empty((fj.shape[0], p + 1))
        jac[:, :p] = -fj
        jac[:, p] = 1.0
        return jac

    result: OptimizeResult = minimize(
        lambda x: x[p],
        x0,
        jac=lambda x: np.eye(p + 1)[p],
        method="SLSQP",
        bounds=[(0.0, 1.0)] * p + [(None, None)],
        callback=callback,
        constraints=[
            {"type": "ineq", "fun": cons, "jac": cons_jac},
            {"type": "eq", "fun": lambda x: x[:p].sum() - 1.0, "jac": lambda x: np.append(np.ones(p), 0.0)},
        ],
        options={"maxiter": maxiter, "ftol": ftol},
    )
    return result
