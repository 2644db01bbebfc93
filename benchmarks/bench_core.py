"""Benchmark of msa_fed/core: the DC solve and the domain classifier.

    .venv/bin/python benchmarks/bench_core.py            # full run (about 25 minutes on the shared box)
    .venv/bin/python benchmarks/bench_core.py --quick    # small sizes, to check that it runs

Prints tables and writes benchmarks/results/bench_core.json (``--out`` to change).

1. DC solve, objective Gamma (the paper's), for n labelled points in {1e3, 1e4, 1e5, 1e6} and
   p sites in {2, 4, 8, 16, 32}, both losses, on random problems of the "coupled" family of
   ``tests/core/dc_problems.py`` (site k's inputs around its own centre, predictors accurate
   near their own centre, Q a tempered Gaussian posterior).  The oracle is the in-process one
   (`LocalOracle` over one point set per site, the sums added as the local runtime does).
   Methods: ``auto`` (the default: logit-path homotopy, Newton polish), and where affordable
   (n <= 1e5, p <= 8) the active-set ``newton`` from the uniform point and random restarts, and
   the paper's plain ``dca`` with an iteration cap.  Median wall time of --repeats runs.
2. Target: p = 4, n = 1e5, both losses: the smallest Gamma reachable, from a long run (the
   default solve at tol 1e-15, then Newton to tol 0 and DCA from its point), and the time
   the default solve takes to get within 1e-6 of it (target: under 2 s).
3. Domain classifier, n = 1e5 points, d = 100 features, p = 8 sites: time for msa_fed's
   trainer (in-process shards, L-BFGS, default config) to reach scikit-learn's optimal
   objective within 1e-4 relative, against scikit-learn's LogisticRegression(lbfgs) at its
   default tolerance on the same data (same weights 1 / (p m_k), C = 1 / (2 mu)), as a ratio
   measured in the same run, runs interleaved.  scikit-learn is timed with its default BLAS
   threads and with one BLAS thread (on a loaded machine the default can be much slower).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "core"))

from dc_problems import make_dc_problem
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from msa_fed.core.dc_homotopy import polish_active_set
from msa_fed.core.dc_solver import LocalOracle, _Counter, solve_dc
from msa_fed.core.domain_classifier import ClassifierConfig, balanced_shards, fit_maxent, sum_oracle, unpack

ETA = 1e-2
LOSSES = ("squared", "cross_entropy")


def median(xs):
    return float(np.median(xs)) if xs else float("nan")


# ---------------------------------------------------------------------------- DC solve
def solve_once(oracle, method, **kw):
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = solve_dc(oracle, ETA, objective="gamma", method=method, **kw)
    return time.perf_counter() - t0, res


def dc_case(n, p, loss, repeats, dca_cap, with_reference, seed=0):
    sites = make_dc_problem(p, n, loss, kind="coupled", random_state=seed)
    oracle = LocalOracle(sites)
    row = {"n": n, "p": p, "loss": loss}
    times, res = [], None
    for _ in range(repeats):
        t, res = solve_once(oracle, "auto")
        times.append(t)
    row["auto"] = {
        "time_s": median(times),
        "times_s": times,
        "gamma": res.gamma,
        "converged": res.converged,
        "iterations": res.n_iter,
        "evaluations": res.n_evaluations,
        "used": res.method,
    }
    if with_reference:
        t, r = solve_once(oracle, "newton", max_iter=dca_cap * 3)
        row["newton"] = {
            "time_s": t,
            "gamma": r.gamma,
            "converged": r.converged,
            "iterations": r.n_iter,
            "evaluations": r.n_evaluations,
        }
        t, r = solve_once(oracle, "dca", max_iter=dca_cap, n_restarts=0)
        row["dca"] = {
            "time_s": t,
            "gamma": r.gamma,
            "converged": r.converged,
            "iterations": r.n_iter,
            "evaluations": r.n_evaluations,
            "cap": dca_cap,
        }
    return row


def target_case(loss, repeats, seed=0):
    """p = 4, n = 1e5: smallest Gamma from a long run, then timed default solves."""
    n, p = 100_000, 4
    oracle = LocalOracle(make_dc_problem(p, n, loss, kind="coupled", random_state=seed))
    _, long_run = solve_once(oracle, "auto", tol=1e-15, max_iter=500)
    ev = _Counter(oracle, ETA, None)
    z, g, _, _ = polish_active_set(ev, long_run.z, 0.0, max_iter=50)
    candidates = {"auto_tol_1e-15": long_run.gamma, "newton_to_tol_0": g}
    _, dca = solve_once(oracle, "dca", tol=0.0, max_iter=30, n_restarts=0, z0=z if g < long_run.gamma else long_run.z)
    candidates["dca_from_there"] = dca.gamma
    best = min(candidates.values())
    runs = []
    for _ in range(repeats):
        hit = {}
        t0 = time.perf_counter()

        def callback(it, zz, gamma, t0=t0, hit=hit):
            if "t" not in hit and gamma <= best + 1e-6:
                hit["t"] = time.perf_counter() - t0

        t, res = solve_once(oracle, "auto", callback=callback)
        if "t" not in hit and res.gamma <= best + 1e-6:
            hit["t"] = t
        runs.append(
            {
                "time_s": t,
                "time_to_1e-6_s": hit.get("t", float("nan")),
                "gamma": res.gamma,
                "evaluations": res.n_evaluations,
                "iterations": res.n_iter,
            }
        )
    return {
        "n": n,
        "p": p,
        "loss": loss,
        "smallest_gamma": best,
        "long_runs": candidates,
        "lower_bound": 0.0,
        "time_to_1e-6_s": median([r["time_to_1e-6_s"] for r in runs]),
        "time_s": median([r["time_s"] for r in runs]),
        "runs": runs,
        "within_1e-6": all(r["gamma"] <= best + 1e-6 for r in runs),
        "target_met": all(r["gamma"] <= best + 1e-6 for r in runs) and median([r["time_s"] for r in runs]) < 2.0,
    }


# ---------------------------------------------------------------------------- classifier
def classifier_data(n, d, p, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(n - p, np.ones(p) / p) + 1
    means = rng.normal(scale=0.3, size=(p, d))
    Xs = [rng.normal(size=(m, d)) + means[k] for k, m in enumerate(sizes)]
    return Xs


def objective_fn(Xs, mu):
    """The exact (float64) objective F of msa_fed's classifier = scikit-learn's with the weights."""
    p, d = len(Xs), Xs[0].shape[1]
    exact = sum_oracle(balanced_shards(Xs, ClassifierConfig(mu=mu, dtype="float64")))

    def F(theta):
        loss, _ = exact(theta)
        W, _ = unpack(theta, d, p)
        return loss + mu * float(np.sum(W * W))

    return F


def classifier_bench(n, d, p, repeats, mu=1e-3):
    Xs = classifier_data(n, d, p)
    X = np.vstack(Xs)
    y = np.concatenate([np.full(len(x), k) for k, x in enumerate(Xs)])
    sw = np.concatenate([np.full(len(x), 1.0 / (p * len(x))) for x in Xs])
    C = 1.0 / (2.0 * mu)
    F = objective_fn(Xs, mu)
    t0 = time.perf_counter()
    with threadpool_limits(1):
        ref = LogisticRegression(C=C, tol=1e-12, max_iter=100_000).fit(X, y, sample_weight=sw)
    f_star = F(np.hstack([ref.coef_, ref.intercept_[:, None]]).ravel())
    out = {
        "n": n,
        "d": d,
        "p": p,
        "mu": mu,
        "f_star": f_star,
        "reference_fit_s": time.perf_counter() - t0,
        "sklearn_default": [],
        "sklearn_1thread": [],
        "msa_fed": [],
    }
    for _ in range(repeats):
        for key, limit in (("sklearn_default", None), ("sklearn_1thread", 1)):
            t0 = time.perf_counter()
            with threadpool_limits(limit):
                clf = LogisticRegression(C=C).fit(X, y, sample_weight=sw)
            t = time.perf_counter() - t0
            f = F(np.hstack([clf.coef_, clf.intercept_[:, None]]).ravel())
            out[key].append(
                {"time_s": t, "objective": f, "rel_gap": (f - f_star) / f_star, "iterations": int(np.max(clf.n_iter_))}
            )
        cfg = ClassifierConfig(mu=mu)
        stamps, thetas = [], []
        t0 = time.perf_counter()
        shards = balanced_shards(Xs, cfg)
        oracle = sum_oracle(shards)

        def timed(theta, oracle=oracle, t0=t0, stamps=stamps, thetas=thetas):
            r = oracle(theta)
            stamps.append(time.perf_counter() - t0)
            thetas.append(theta.copy())
            return r

        theta, info = fit_maxent(timed, d, p, cfg)
        total = time.perf_counter() - t0
        gaps = [(F(th) - f_star) / f_star for th in thetas]
        first = next((i for i, g in enumerate(gaps) if g <= 1e-4), None)
        out["msa_fed"].append(
            {
                "time_s": total,
                "time_to_1e-4_s": stamps[first] if first is not None else float("nan"),
                "evaluations": len(stamps),
                "evaluations_to_1e-4": None if first is None else first + 1,
                "rel_gap": (F(theta) - f_star) / f_star,
                "iterations": info["n_iter"],
                "dtype": cfg.dtype,
            }
        )
    med = {k: median([r["time_s"] for r in out[k]]) for k in ("sklearn_default", "sklearn_1thread", "msa_fed")}
    med["msa_fed_to_1e-4"] = median([r["time_to_1e-4_s"] for r in out["msa_fed"]])
    out["median_s"] = med
    out["ratio_to_1e-4_vs_sklearn_default"] = med["msa_fed_to_1e-4"] / med["sklearn_default"]
    out["ratio_to_1e-4_vs_sklearn_1thread"] = med["msa_fed_to_1e-4"] / med["sklearn_1thread"]
    out["ratio_full_vs_sklearn_1thread"] = med["msa_fed"] / med["sklearn_1thread"]
    return out


# ---------------------------------------------------------------------------- report
def fmt(x, spec=".3g"):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def print_dc(rows):
    print("\nDC solve, objective Gamma, eta = 0.01 (median wall time; dca capped)")
    print(
        f"{'loss':<14}{'n':>9}{'p':>4} | {'auto s':>8}{'Gamma':>10}{'evals':>7}{'it':>5} | "
        f"{'newton s':>9}{'Gamma':>10} | {'dca s':>8}{'Gamma':>10}{'it':>5}"
    )
    for r in rows:
        a, nw, dc = r["auto"], r.get("newton"), r.get("dca")
        print(
            f"{r['loss']:<14}{r['n']:>9}{r['p']:>4} | {a['time_s']:>8.3f}{a['gamma']:>10.1e}{a['evaluations']:>7}"
            f"{a['iterations']:>5} | "
            + (f"{nw['time_s']:>9.2f}{nw['gamma']:>10.1e} | " if nw else f"{'-':>9}{'-':>10} | ")
            + (f"{dc['time_s']:>8.2f}{dc['gamma']:>10.1e}{dc['iterations']:>5}" if dc else f"{'-':>8}{'-':>10}{'-':>5}")
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 3, quick 1)")
    ap.add_argument("--skip-dc", action="store_true", help="skip part 1 and 2 (DC solve)")
    ap.add_argument("--skip-dc-grid", action="store_true", help="skip part 1 (the n x p grid), keep the target")
    ap.add_argument("--skip-classifier", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_core.json"))
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "platform": platform.platform(),
        },
        "quick": args.quick,
        "repeats": repeats,
    }
    if not args.skip_dc and not args.skip_dc_grid:
        ns = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000, 1_000_000)
        ps = (2, 4) if args.quick else (2, 4, 8, 16, 32)
        dca_cap = 10 if args.quick else 30
        rows = []
        for loss in LOSSES:
            for n in ns:
                for p in ps:
                    reps = 1 if n >= 1_000_000 else repeats
                    row = dc_case(n, p, loss, reps, dca_cap, with_reference=n <= 100_000 and p <= 8)
                    rows.append(row)
                    print_dc([row])
                    sys.stdout.flush()
        result["dc"] = rows
        print_dc(rows)
    if not args.skip_dc:
        targets = [target_case(loss, max(repeats, 3)) for loss in LOSSES]
        result["dc_target"] = targets
        print("\nTarget p = 4, n = 1e5: default solve within 1e-6 of the smallest Gamma reachable")
        for t in targets:
            print(
                f"  {t['loss']:<14} smallest Gamma {t['smallest_gamma']:.2e} (long runs {t['long_runs']}); "
                f"default solve {t['time_s']:.3f} s (median of {len(t['runs'])}), within 1e-6 after "
                f"{t['time_to_1e-6_s']:.3f} s; target met: {t['target_met']}"
            )
    if not args.skip_classifier:
        n, d, p = (20_000, 50, 8) if args.quick else (100_000, 100, 8)
        c = classifier_bench(n, d, p, repeats)
        result["classifier"] = c
        med = c["median_s"]
        print(f"\nDomain classifier, n = {n}, d = {d}, p = {p}, mu = {c['mu']} (median of {repeats})")
        print(
            f"  scikit-learn lbfgs, default threads : {med['sklearn_default']:.2f} s "
            f"(gap {c['sklearn_default'][0]['rel_gap']:.1e}, {c['sklearn_default'][0]['iterations']} it)"
        )
        print(f"  scikit-learn lbfgs, 1 BLAS thread   : {med['sklearn_1thread']:.2f} s")
        print(
            f"  msa_fed to within 1e-4 of optimum   : {med['msa_fed_to_1e-4']:.2f} s "
            f"({c['msa_fed'][0]['evaluations_to_1e-4']} evaluations)"
        )
        print(
            f"  msa_fed full run (tol 1e-9)         : {med['msa_fed']:.2f} s "
            f"({c['msa_fed'][0]['evaluations']} evaluations, final gap {c['msa_fed'][0]['rel_gap']:.1e})"
        )
        print(f"  ratio (to 1e-4) / sklearn default   : {c['ratio_to_1e-4_vs_sklearn_default']:.2f}")
        print(f"  ratio (to 1e-4) / sklearn 1 thread  : {c['ratio_to_1e-4_vs_sklearn_1thread']:.2f}")
        print(f"  ratio (full run) / sklearn 1 thread : {c['ratio_full_vs_sklearn_1thread']:.2f}")
    result["machine"]["load_average_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
