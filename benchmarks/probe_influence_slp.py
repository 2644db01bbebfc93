"""Probe: the influence report's leave-one-out re-solves by trust-region sequential linear
programming, and a site's batched sums in one product per batch.

``python benchmarks/probe_influence_slp.py [--ps 4 8 16] [--n 2000] [--slp-then 0 3 6 10] [--batch]``

Not the project's re-solve (that is SLSQP on the L and dL the sites return,
:mod:`msa_fed.core.influence`): an in-process measurement on the benchmark's problem
(``bench_influence.make_sites``), inside a real fit (the fit's own oracle, its sites' sums and
checks), of re-solves that ask nothing new of the sites.  Each SLP iteration evaluates L and dL
at one z and solves the LP

    min t  s.t.  L_k + dL_k . d <= t (k kept),  z + d >= 0 on the face,  sum d = 0,  |d|_inf <= Delta

(``scipy.optimize.linprog``, HiGHS); the step is taken when max_k L_k falls by at least a tenth
of the LP's prediction, Delta halves below a quarter and doubles above three quarters (the step
on the boundary).  Such steps converge fast where the solution has as many active domains as
the face's dimension plus one; ``--slp-then N`` runs N SLP iterations and then the report's
SLSQP re-solve from the SLP point (0: SLP alone, to 60 evaluations).  Per p it prints the z's
evaluated, the longest re-solve (the rounds in lockstep) and the end points' max_k L_k against
the report's, and the number of domains active (within 1e-5 of the top) and of positive z at the
report's end points.

``--batch``: one site's sums at a batch of m z's (``PointSet.evaluate_batch``: z by z) against
one product per batch (dL[k, j] = sum_i w_k(i) w_j(i) (H_j(i) - g(i)) / J(i) split into two
products with the (n, p^2) outer products w_k w_j H_j and w_k w_j, computed once per site), thread
CPU per batch.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_influence import make_sites  # noqa: E402

#: an SLP re-solve ends when the LP predicts a decrease of max_k L_k at most this
SLP_TOL = 1e-11
#: ... or after this many evaluations
SLP_MAX = 60


def slp(face, eta: float, z0: np.ndarray, max_iter: int, delta: float = 0.1) -> np.ndarray:
    """The SLP iterate after ``max_iter`` LPs (or converged) from z0 on ``face`` (the report's
    oracle restricted to z_j = 0)."""
    q = z0.size
    z = z0.copy()
    s = face.evaluate(z, eta, ("L", "dL"))
    L, G, f = s.L, s.dL, float(s.L.max())
    c = np.append(np.zeros(q), 1.0)
    A_ub = np.hstack([np.zeros((q, q)), -np.ones((q, 1))])
    A_eq = np.append(np.ones(q), 0.0)[None]
    for _ in range(max_iter):
        A_ub[:, :q] = G
        bounds = [(max(-zi, -delta), min(1.0 - zi, delta)) for zi in z] + [(None, None)]
        res = linprog(c, A_ub=A_ub, b_ub=-L, A_eq=A_eq, b_eq=[0.0], bounds=bounds, method="highs")
        d, predicted = res.x[:q], f - float(res.x[q])
        if predicted <= SLP_TOL:
            break
        z_new = np.maximum(z + d, 0.0)
        z_new /= z_new.sum()
        s = face.evaluate(z_new, eta, ("L", "dL"))
        f_new = float(s.L.max())
        rho, step = (f - f_new) / predicted, float(np.abs(d).max())
        if rho > 0.1:
            z, L, G, f = z_new, s.L, s.dL, f_new
        if rho < 0.25:
            delta = 0.5 * step
        elif rho > 0.75 and step >= 0.99 * delta:
            delta = min(2.0 * delta, 1.0)
        if delta < 1e-12:
            break
    return z


def probe(p: int, n: int, slp_then: list[int]) -> None:
    import msa_fed.runtime.coordinator as co
    from msa_fed import fit_dmsa
    from msa_fed.core.dc_solver import solve_dc
    from msa_fed.core.influence import RESOLVE_MAX_ITER, CachedOracle, _Face

    def inside(oracle, eta, z, losses, names, **kw):
        table = real(oracle, eta, z, losses, names, **kw)
        z = np.asarray(z, dtype=np.float64)
        ends = []
        for j in range(p):
            L, zj = np.array(table["loss_without"][j]), np.array(table["z_without"][j])
            keep = np.arange(p) != j
            top = L[keep].max()
            ends.append((int(np.sum(L[keep] > top - 1e-5)), int(np.sum(zj[keep] > 1e-8)), top))
        print(
            f"p={p}: the report's SLSQP re-solves: {table['evaluations']} z, {table['rounds']} rounds; "
            f"at their end points (active domains, positive z) of {p - 1}: {[e[:2] for e in ends]}",
            flush=True,
        )
        for n_slp in slp_then:
            total, longest, diffs = 0, 0, []
            for j in range(p):
                keep = np.arange(p) != j
                base = CachedOracle(oracle)
                face = _Face(base, keep)
                start = z[keep] / z[keep].sum()
                if n_slp == 0:
                    zs = slp(face, eta, start, SLP_MAX)
                    top = float(face.evaluate(zs, eta, ("L", "dL")).L.max())
                else:
                    zs = slp(face, eta, start, n_slp)
                    top = solve_dc(
                        face, eta, objective="minmax", n_restarts=0, z0=zs, max_iter=RESOLVE_MAX_ITER, warn=False
                    ).max_loss
                total, longest = total + base.calls, max(longest, base.calls)
                diffs.append(top - ends[j][2])
            label = "SLP alone" if n_slp == 0 else f"{n_slp} SLP steps, then SLSQP"
            print(
                f"  {label}: {total} z, longest {longest}; end max_k L_k minus the report's: "
                f"{min(diffs):+.1e} to {max(diffs):+.1e}",
                flush=True,
            )
        return table

    real = co.influence_table
    co.influence_table = inside
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit_dmsa(make_sites(p, n), "classification", influence=True)
    finally:
        co.influence_table = real


def batch_probe() -> None:
    from msa_fed.core.dc_terms import PointSet
    from msa_fed.core.threads import one_blas_thread

    rng = np.random.default_rng(0)

    def one_product(ps: PointSet, zs: np.ndarray, eta: float, P1: np.ndarray, P2: np.ndarray):
        eta_pi, eta_piH = ps._eta_terms(eta)
        K = ps.w @ zs.T + eta_pi[:, None]
        J = ps._WH @ zs.T + eta_piH[:, None]
        g = J / K
        A = 1.0 / J
        return -(ps.w.T @ np.log(g)).T, (-(A.T @ P1) + (A * g).T @ P2).reshape(-1, ps.w.shape[1], ps.w.shape[1])

    def cpu_ms(f, reps: int = 30) -> float:
        runs = []
        for _ in range(5):
            t = time.thread_time()
            for _ in range(reps):
                f()
            runs.append((time.thread_time() - t) / reps)
        return 1e3 * float(np.median(runs))

    for n in (500, 2000, 8000):
        for p in (4, 8, 16):
            w = rng.random((n, p))
            ps = PointSet(
                w=w / w.sum(), pi=np.full(n, 1.0 / (n * p)), H=0.01 + 0.98 * rng.random((n, p)), loss="cross_entropy"
            )
            P1 = (ps.w[:, :, None] * ps._WH[:, None, :]).reshape(n, p * p)
            P2 = (ps.w[:, :, None] * ps.w[:, None, :]).reshape(n, p * p)
            cells = []
            for m in sorted({2, 4, p}):
                zs = rng.dirichlet(np.ones(p), size=m)
                rows = ps.evaluate_batch(zs, 1e-3, what=("L", "dL"))
                with one_blas_thread():
                    L, dL = one_product(ps, zs, 1e-3, P1, P2)
                    err = float(np.abs(dL - np.stack([r.dL for r in rows])).max() / np.abs(dL).max())
                    a = cpu_ms(lambda ps=ps, zs=zs: ps.evaluate_batch(zs, 1e-3, what=("L", "dL")))
                    b = cpu_ms(lambda ps=ps, zs=zs, P1=P1, P2=P2: one_product(ps, zs, 1e-3, P1, P2))
                cells.append(f"m={m}: {a:.2f} / {b:.2f} ms ({a / b:.2f}x, rel. diff {err:.0e})")
            print(f"n={n} p={p}: z by z / one product: " + "; ".join(cells), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--slp-then", type=int, nargs="*", default=[0, 3, 10])
    ap.add_argument("--batch", action="store_true", help="the site's batched sums only")
    args = ap.parse_args(argv)
    if args.batch:
        batch_probe()
        return 0
    for p in args.ps:
        probe(p, args.n, args.slp_then)
    return 0


if __name__ == "__main__":  # pragma: no cover - a script
    raise SystemExit(main())
