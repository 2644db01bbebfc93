"""Slow, obviously correct formulas of DESIGN.md sections 2 and 3, for the core tests.

Written from the design document term by term (one loop over the sources, explicit c_k(i) =
w_k(i) + eta pi_i), independently of the blocked implementation in ``msa_fed.core.dc_terms``.
"""

from __future__ import annotations

import numpy as np

from msa_fed.core.dc_terms import PointSet


def pooled(point_sets: list[PointSet]) -> PointSet:
    """One PointSet with the points of all sets (the sums are the same)."""
    ps0 = point_sets[0]
    y = None if ps0.loss != "squared" else np.concatenate([ps.y for ps in point_sets])
    return PointSet(
        w=np.vstack([ps.w for ps in point_sets]),
        pi=np.concatenate([ps.pi for ps in point_sets]),
        H=np.vstack([ps.H for ps in point_sets]),
        y=y,
        loss=ps0.loss,
    )


def reference_terms(ps: PointSet, z, eta: float, global_bound: float | None = None) -> dict:
    """L_k, u_k, v_k at one z, each an ndarray (p,)."""
    z = np.asarray(z, dtype=float)
    w, pi, H = ps.w, ps.pi, ps.H
    p = w.shape[1]
    K = eta * pi.copy()
    J = np.zeros_like(pi)
    for k in range(p):
        K += z[k] * w[:, k]
        J += (z[k] * w[:, k] + eta * pi / p) * H[:, k]
    g = J / K
    if ps.loss == "squared":
        loss = (g - ps.y) ** 2
        M = np.max((H - ps.y[:, None]) ** 2, axis=1) if global_bound is None else np.full_like(pi, global_bound)
    else:
        loss = -np.log(g)
    L, u, v = np.zeros(p), np.zeros(p), np.zeros(p)
    for k in range(p):
        c = w[:, k] + eta * pi
        L[k] = np.sum(w[:, k] * loss)
        if ps.loss == "squared":
            u[k] = np.sum(c * (loss - 2.0 * M * np.log(K)))
            v[k] = np.sum(K * loss) - 2.0 * np.sum(c * M * np.log(K))
        else:
            u[k] = -np.sum(c * np.log(J))
            v[k] = -np.sum(c * np.log(K)) + np.sum(K * np.log(K / J))
    return {"L": L, "u": u, "v": v}


def losses_on_grid(ps: PointSet, Z: np.ndarray, eta: float) -> np.ndarray:
    """L_k(z) for every row z of Z (G, p), vectorised over the grid: ndarray (G, p)."""
    p = ps.w.shape[1]
    K = ps.w @ Z.T + eta * ps.pi[:, None]  # (n, G)
    J = (ps.w * ps.H) @ Z.T + (eta / p) * (ps.pi * ps.H.sum(1))[:, None]  # (n, G)
    g = J / K
    loss = (g - ps.y[:, None]) ** 2 if ps.loss == "squared" else -np.log(g)
    return (ps.w.T @ loss).T


def gamma_on_grid(ps: PointSet, Z: np.ndarray, eta: float) -> np.ndarray:
    """Gamma(z) for every row of Z: ndarray (G,)."""
    L = losses_on_grid(ps, Z, eta)
    return L.max(axis=1) - np.einsum("gk,gk->g", Z, L)
