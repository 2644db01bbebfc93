"""Probe: the influence report's leave-one-out re-solves with exact second-order information.

``python benchmarks/probe_influence_second_order.py [--ps 8 16] [--n 2000]``

Not the project's re-solve (that is SLSQP on the L and dL the sites return,
:mod:`msa_fed.core.influence`): an in-process measurement of what a re-solve would need if each
site also returned the Hessian of each domain's loss, d2L[k] = sum_i w_k(i) (a_i a_i^T - b_i b_i^T)
with a_i = w(i) H(i) / J_z(i), b_i = w(i) / K_z(i) (cross-entropy; checked here against finite
differences of dL).  Each step minimises t over the face z_j = 0 subject to the quadratic models
L_k + dL_k d + d^T d2L_k d / 2 <= t (a small problem solved locally, no round), with halving of the
step until max_k L_k falls; every point evaluated counts as one round (its L, dL and d2L asked
together).  On the benchmark's problem (``bench_influence.make_sites``) it prints, per site left
out, the rounds and the end point's max_k L_k against the report's SLSQP re-solve.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_influence import make_sites  # noqa: E402


def hessians(point_sets, z: np.ndarray, eta: float) -> np.ndarray:
    """d2L (p, p, p): the Hessian of each domain's cross-entropy loss at z, summed over the sites."""
    p = z.size
    out = np.zeros((p, p, p))
    for ps in point_sets:
        K = ps.w @ z + eta * ps.pi
        J = ps._WH @ z + (eta / p) * ps._piH
        A, B = ps._WH / J[:, None], ps.w / K[:, None]
        for k in range(p):
            c = ps.w[:, k][:, None]
            out[k] += (A * c).T @ A - (B * c).T @ B
    return out


def sums(point_sets, z: np.ndarray, eta: float) -> tuple[np.ndarray, np.ndarray]:
    parts = [ps.evaluate(z, eta, what=("L", "dL")) for ps in point_sets]
    return sum(s.L for s in parts), sum(s.dL for s in parts)


def resolve(point_sets, eta: float, z0: np.ndarray, j: int, tol: float = 1e-10, max_rounds: int = 60):
    """(z, L, rounds, converged): min over the face z_j = 0 of max_{k != j} L_k from z0."""
    p = z0.size
    keep = np.arange(p) != j
    idx = np.flatnonzero(keep)
    q = idx.size
    z = np.where(keep, z0, 0.0)
    z /= z.sum()
    L, dL = sums(point_sets, z, eta)
    d2L = hessians(point_sets, z, eta)
    rounds, f = 1, float(L[keep].max())
    while rounds < max_rounds:

        def models(x, L=L, dL=dL, d2L=d2L):
            d = np.zeros(p)
            d[idx] = x[:q]
            return x[q] - (L[keep] + dL[keep] @ d + 0.5 * np.einsum("kab,a,b->k", d2L[keep], d, d))

        res = minimize(
            lambda x: x[q],
            np.append(np.zeros(q), f),
            jac=lambda x: np.eye(q + 1)[q],
            method="SLSQP",
            bounds=[(-z[i], 1 - z[i]) for i in idx] + [(None, None)],
            constraints=[{"type": "ineq", "fun": models}, {"type": "eq", "fun": lambda x: x[:q].sum()}],
            options={"ftol": 1e-15, "maxiter": 200},
        )
        d = np.zeros(p)
        d[idx] = res.x[:q]
        predicted = f - float(res.x[q])
        if predicted <= tol:
            return z, L, rounds, True
        alpha = 1.0
        while True:
            z_new = np.clip(z + alpha * d, 0.0, None)
            z_new /= z_new.sum()
            L_new, dL_new = sums(point_sets, z_new, eta)
            rounds += 1
            f_new = float(L_new[keep].max())
            if f_new < f - 1e-4 * alpha * predicted or alpha < 1e-3:
                break
            alpha *= 0.5
        if f_new >= f:
            return z, L, rounds, False
        z, L, dL, f = z_new, L_new, dL_new, f_new
        d2L = hessians(point_sets, z, eta)  # asked in the same round as L and dL at z
    return z, L, rounds, False


def probe(p: int, n: int) -> None:
    import msa_fed.runtime.coordinator as co
    from msa_fed import fit_dmsa

    real = co.influence_table

    def run(oracle, eta, z, losses, names, **kw):
        point_sets = [w._points for w in oracle.backend.workers]  # the local sites' own sums
        z = np.asarray(z, dtype=np.float64)
        # the Hessians against finite differences of dL
        v, h = np.random.default_rng(0).normal(size=p), 1e-6
        v -= v.mean()
        fd = (sums(point_sets, z + h * v, eta)[1] - sums(point_sets, z - h * v, eta)[1]) / (2 * h)
        np.testing.assert_allclose(hessians(point_sets, z, eta) @ v, fd, rtol=1e-4, atol=1e-7)
        cpu = time.process_time()
        table = real(oracle, eta, z, losses, names, **kw)
        cpu = time.process_time() - cpu
        print(f"p={p}: SLSQP re-solves (the report): {table['evaluations']} z in {table['rounds']} rounds, {cpu:.2f} s")
        total, longest = 0, 0
        for j in range(p):
            zj, Lj, rounds, ok = resolve(point_sets, eta, z, j)
            old = float(np.delete(np.asarray(table["loss_without"][j]), j).max())
            new = float(np.delete(Lj, j).max())
            total, longest = total + rounds, max(longest, rounds)
            print(
                f"  without {names[j]}: {rounds} rounds{'' if ok else ' (stopped)'}; max_k L_k {new:.7f} "
                f"(SLSQP {old:.7f}, {new - old:+.1e}); |z - z_SLSQP| {np.abs(zj - table['z_without'][j]).max():.1e}"
            )
        print(f"p={p}: second order: {total} z in {longest} rounds (lockstep)", flush=True)
        raise StopIteration

    co.influence_table = run
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit_dmsa(make_sites(p, n), "classification", influence=True)
    except StopIteration:
        pass
    finally:
        co.influence_table = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args(argv)
    for p in args.ps:
        probe(p, args.n)
    return 0


if __name__ == "__main__":  # pragma: no cover - a script
    raise SystemExit(main())
