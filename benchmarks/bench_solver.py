"""Benchmark of the z solve as the sites see it: rounds per fit, time per round, BLAS threads.

    .venv/bin/python benchmarks/bench_solver.py                       # this tree, p = 4, 8, 16
    .venv/bin/python benchmarks/bench_solver.py --baseline ../main    # and another tree, interleaved
    .venv/bin/python benchmarks/bench_solver.py --big                 # also p = 32, n = 1e6 (minutes)
    .venv/bin/python benchmarks/bench_solver.py --skip fit threads sums --problems --experiments
    .venv/bin/python benchmarks/bench_solver.py --skip fit threads sums --seeds 6   # counts per seed
    .venv/bin/python benchmarks/bench_solver.py --baseline ../main --skip fit threads sums --phases  # CPU by part

Every DC evaluation is one round trip to every site and one query charged to each site's
budget, so the number of evaluations per fit is reported next to the time.  Each measurement
runs in a fresh process (``--child``) with the code of the tree named (this one, or
``--baseline``); the trees alternate run by run, so both see the same load; medians are
reported with the ratio baseline / this tree and the load average.

1. ``fit``: ``fit_dmsa`` (local runtime, defaults) on p synthetic sites (n labelled points in
   all, 2000 unlabelled per site, d = 5, logistic predictors): wall time of the fit and of its
   z solve, evaluations, max_k L_k.  In this tree also the exhaustive solve on the same sums
   (every start of ``n_restarts`` run to the end, the former default) and the difference of
   max_k L_k, which must stay within 1e-9.
2. ``threads``: the same fit in this tree with inference and the solve left on the default
   BLAS threads (``msa_fed.core.threads.SMALL_WORK = 0``: only the DC sums on one thread, as
   before) against one thread for both.
3. ``sums``: one evaluation of L and dL (the default solver's request) over n = 1e5 points in
   one set, against the numpy bound: the fastest pass of g_z (two matrix-vector products and a
   division) plus one (p, n) x (n, p) product, the size of dL's; CPU time of one thread, best of
   15 (stable under load).

4. ``--problems``: bench_core's DC problems (``tests/core/dc_problems.py``, "coupled", n = 1e3
   to 1e5, p = 2 to 32, both losses): the default solve against the exhaustive one.
5. ``--experiments``: the paper's experiments (``msa-fed experiment NAME --quick``'s seeds and
   sizes, this tree, in process): every min-max solve next to the exhaustive one on the same
   sums (evaluations, max_k L_k difference).  Needs the data sets (``$MSA_FED_DATA``).

Writes benchmarks/results/bench_solver.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ETA = 1e-2


# ---------------------------------------------------------------------------- children
def make_sites(p: int, n: int, seed: int = 0, d: int = 5, m: int = 2000):
    from sklearn.linear_model import LogisticRegression

    from msa_fed import SiteData
    from msa_fed.privacy.policy import SitePolicy

    # the default site policy serves jobs of at most 16 sites: these sites agree to p of them
    policy = SitePolicy(max_sites=p) if p > SitePolicy().max_sites else None
    rng = np.random.default_rng(seed)
    means, rules = rng.normal(size=(p, d)), rng.normal(size=(p, d))
    sites = []
    for k in range(p):

        def draw(count, k=k):
            X = rng.normal(size=(count, d)) + means[k]
            return X, (X @ rules[k] + 0.5 * rng.normal(size=count) > means[k] @ rules[k]).astype(int)

        Xt, yt = draw(300)
        Xl, yl = draw(n // p)
        sites.append(
            SiteData(
                f"site{k:02d}",
                Xl,
                yl,
                rng.normal(size=(m, d)) + means[k],
                LogisticRegression().fit(Xt, yt),
                policy=policy,
            )
        )
    return sites


def child_fit(p: int, n: int, exhaustive: bool, blas: str, seed: int = 0) -> dict:
    import msa_fed.runtime.coordinator as coordinator
    from msa_fed import fit_dmsa

    if blas == "default":
        from msa_fed.core import threads

        threads.SMALL_WORK = 0
    real = coordinator.solve_dc
    seen: dict = {"exhaustive_s": 0.0, "exhaustive_cpu": 0.0}

    def timed_solve(oracle, eta, **kw):
        t = time.perf_counter()
        res = real(oracle, eta, **kw)
        seen["solve_s"] = time.perf_counter() - t
        if exhaustive:  # every start run to the end, on the same sums (timed apart, left out of the fit)
            t, c = time.perf_counter(), time.process_time()
            opts = {k: v for k, v in kw.items() if k not in ("z0", "n_restarts", "callback")}
            rng = np.random.default_rng(opts.get("random_state", 0))
            q = oracle.n_sources
            starts = [np.full(q, 1.0 / q)] + [rng.dirichlet(np.ones(q)) for _ in range(4)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs = [real(oracle, eta, z0=s, n_restarts=0, **opts) for s in starts]
            seen["exhaustive_max_loss"] = min(r.max_loss for r in runs)
            seen["exhaustive_evaluations"] = sum(r.n_evaluations for r in runs)
            seen["exhaustive_s"] = time.perf_counter() - t
            seen["exhaustive_cpu"] = time.process_time() - c
        return res

    real_influence = getattr(coordinator, "influence_table", None)  # None: a tree without the report

    def timed_influence(*args, **kw):
        t = time.perf_counter()
        table = real_influence(*args, **kw)
        seen["influence_s"] = time.perf_counter() - t
        return table

    coordinator.solve_dc = timed_solve
    if real_influence is not None:
        coordinator.influence_table = timed_influence
    sites = make_sites(p, n, seed=seed)
    fit_dmsa(make_sites(4, 4000, seed=1), "classification")  # warm-up: imports, first calls
    seen["exhaustive_s"] = seen["exhaustive_cpu"] = 0.0
    cpu = time.process_time()
    t = time.perf_counter()
    model = fit_dmsa(sites, "classification")
    fit_s = time.perf_counter() - t - seen["exhaustive_s"]
    cpu = time.process_time() - cpu
    out = {
        "fit_s": fit_s,
        # the process's CPU time over the fit (all threads, the exhaustive solve's left out): less
        # sensitive to the load than the wall time
        "cpu_s": cpu - seen["exhaustive_cpu"],
        "cpu_over_wall": cpu / (fit_s + seen["exhaustive_s"]),
        "solve_s": seen["solve_s"],
        "evaluations": model.info["solver"]["n_evaluations"],
        "max_loss": float(np.max(model.domain_losses)),
        "converged": model.info["solver"]["converged"],
        "runs": [r["iterations"] for r in model.info["solver"]["restarts"]],
    }
    if (model.info.get("influence") or {}).get("evaluations") is not None:
        # the influence report's re-solves (one per site, after the solve): rounds at every site too
        out["influence_s"] = seen["influence_s"]
        out["influence_evaluations"] = model.info["influence"]["evaluations"]
    if exhaustive:
        out["exhaustive_max_loss"] = seen["exhaustive_max_loss"]
        out["exhaustive_evaluations"] = seen["exhaustive_evaluations"]
        out["max_loss_minus_exhaustive"] = out["max_loss"] - out["exhaustive_max_loss"]
    return out


def child_phases(p: int, n: int) -> dict:
    """CPU seconds of one ``fit_dmsa`` (local runtime, defaults) by part: the domain classifier,
    ``prepare_dc`` (the sites' ``set_domain_model``, with the model's verification, and
    ``set_qhat``, with the predictors on the sites' points, those the local runtime evaluates
    for all sites at once included), the solve (the sites' sums and the coordinator's
    plausibility checks), the target reference built at the end (``reference``; where the fit
    defers it, its first use after the fit: ``reference_after_fit``, not part of ``fit``)."""
    import msa_fed.artifacts.target_check as target_check
    import msa_fed.runtime.coordinator as coordinator
    import msa_fed.runtime.local as local
    import msa_fed.runtime.plausibility as plausibility
    from msa_fed import fit_dmsa
    from msa_fed.site.worker import SiteWorker

    cpu: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kw):
            t = time.process_time()
            try:
                return real(*args, **kw)
            finally:
                cpu[label] = cpu.get(label, 0.0) + time.process_time() - t

        setattr(owner, name, wrapper)

    timed(coordinator.Coordinator, "train_domain_model", "classifier")
    timed(coordinator.Coordinator, "prepare_dc", "prepare_dc")
    timed(SiteWorker, "set_domain_model", "set_domain_model")
    timed(SiteWorker, "set_qhat", "set_qhat")
    if hasattr(local.LocalSites, "_stacked_outputs"):  # the sites' predictor calls, made by their host
        timed(local.LocalSites, "_stacked_outputs", "set_qhat")
    timed(coordinator, "solve_dc", "solve")
    timed(SiteWorker, "dc_evaluate", "dc_evaluate")
    timed(plausibility.AnswerChecker, "dc_partials", "plausibility")
    timed(target_check, "build_reference", "reference")
    sites = make_sites(p, n)
    fit_dmsa(make_sites(4, 4000, seed=1), "classification")  # warm-up: imports, first calls
    cpu.clear()
    c, t = time.process_time(), time.perf_counter()
    model = fit_dmsa(sites, "classification")
    cpu["fit"], cpu["fit_wall"] = time.process_time() - c, time.perf_counter() - t
    out = {**cpu, "evaluations": model.info["solver"]["n_evaluations"]}
    # a reference the fit deferred is built on first use (a target check, a save): its CPU apart
    c = time.process_time()
    model.target_reference  # noqa: B018
    out["reference_after_fit"] = time.process_time() - c
    return out


def child_sums(p: int, n: int, loss: str) -> dict:
    from msa_fed.core.dc_terms import PointSet, one_blas_thread

    rng = np.random.default_rng(0)
    Q = rng.dirichlet(np.ones(p), size=n)
    w = Q / Q.sum(axis=0) / p
    H = rng.random((n, p)) * 0.9 + 0.05
    ps = PointSet(w=w, pi=np.full(n, 1.0 / n), H=H, loss=loss, y=rng.random(n) if loss == "squared" else None)
    z = rng.dirichlet(np.ones(p))
    # the bound on the fastest layout for each product (the faster of row- and column-major)
    layouts = [(np.ascontiguousarray(w), np.ascontiguousarray(w * H)), (np.asfortranarray(w), np.asfortranarray(w * H))]
    X = np.ones_like(layouts[0][0])

    def best(f, reps=15):
        ts = []
        for _ in range(reps):
            t = time.thread_time()
            f()
            ts.append(time.thread_time() - t)
        return min(ts)

    with one_blas_thread():
        g_z = min(best(lambda a=a, b=b: (b @ z + 1e-3) / (a @ z + 1e-3)) for a, b in layouts)
        product = min(best(lambda a=a: a.T @ X) for a, _ in layouts)
        one = best(lambda: ps.evaluate(z, ETA, what=("L", "dL")))
    return {"g_z_s": g_z, "product_s": product, "bound_s": g_z + product, "evaluation_s": one}


def core_problems(ns: tuple[int, ...], ps: tuple[int, ...]) -> list[dict]:
    """bench_core's problems (tests/core/dc_problems.py, "coupled", seed 0, eta = 0.01, both
    losses): the default min-max solve against the exhaustive one on the same sums."""
    sys.path.insert(0, str(ROOT / "tests" / "core"))
    from dc_problems import make_dc_problem

    from msa_fed.core.dc_solver import LocalOracle, solve_dc

    rows = []
    for loss in ("cross_entropy", "squared"):
        for n in ns:
            for p in ps:
                oracle = LocalOracle(make_dc_problem(p, n, loss, kind="coupled", random_state=0))
                res = solve_dc(oracle, ETA, warn=False)
                rng = np.random.default_rng(0)
                starts = [np.full(p, 1.0 / p)] + [rng.dirichlet(np.ones(p)) for _ in range(4)]
                runs = [solve_dc(oracle, ETA, z0=s, n_restarts=0, warn=False) for s in starts]
                row = {
                    "loss": loss,
                    "n": n,
                    "p": p,
                    "evaluations": res.n_evaluations,
                    "exhaustive_evaluations": sum(r.n_evaluations for r in runs),
                    "max_loss_minus_exhaustive": res.max_loss - min(r.max_loss for r in runs),
                    "converged": res.converged,
                }
                print(
                    f"bench_core problem {loss:14s} n={n:7d} p={p:3d}: {row['evaluations']} evaluations "
                    f"(exhaustive {row['exhaustive_evaluations']}), max_k L_k - exhaustive "
                    f"{row['max_loss_minus_exhaustive']:.1e}",
                    flush=True,
                )
                rows.append(row)
    return rows


def experiments(names: list[str]) -> dict:
    """The paper's experiments (``--quick`` sizes and seeds, through fit_dmsa): each min-max solve
    next to the exhaustive one on the same sums (needs the data sets, ``$MSA_FED_DATA``)."""
    import importlib

    import msa_fed.runtime.coordinator as coordinator
    from msa_fed.experiments.cli import EXPERIMENTS

    real = coordinator.solve_dc
    out: dict = {}
    for name in names:
        rows: list[dict] = []

        def compare(oracle, eta, rows=rows, **kw):
            res = real(oracle, eta, **kw)
            if kw.get("objective", "minmax") == "minmax":
                q = oracle.n_sources
                opts = {k: v for k, v in kw.items() if k not in ("z0", "n_restarts", "callback")}
                rng = np.random.default_rng(opts.get("random_state", 0))
                starts = [np.full(q, 1.0 / q)] + [rng.dirichlet(np.ones(q)) for _ in range(4)]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    runs = [real(oracle, eta, z0=s, n_restarts=0, **opts) for s in starts]
                rows.append(
                    {
                        "p": q,
                        "evaluations": res.n_evaluations,
                        "exhaustive_evaluations": sum(r.n_evaluations for r in runs),
                        "max_loss_minus_exhaustive": res.max_loss - min(r.max_loss for r in runs),
                        "converged": res.converged,
                    }
                )
            return res

        coordinator.solve_dc = compare
        try:
            exp = EXPERIMENTS[name]
            module = importlib.import_module(f"msa_fed.experiments.{exp.module}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module.run(exp.quick_seeds, runtime="local", quick=True, plot_dir=None, log=lambda msg: None)
        finally:
            coordinator.solve_dc = real
        out[name] = rows
        print(
            f"experiment {name}: {len(rows)} solves, evaluations {[r['evaluations'] for r in rows]} "
            f"(exhaustive {[r['exhaustive_evaluations'] for r in rows]}), largest max_k L_k - exhaustive "
            f"{max(r['max_loss_minus_exhaustive'] for r in rows):.1e}",
            flush=True,
        )
    return out


# ---------------------------------------------------------------------------- driver
def run_child(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} in {tree} failed:\n{done.stderr[-3000:]}")
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


#: the influence report's share of a fit (absent in a tree without the report)
INFLUENCE = ("influence_s", "influence_evaluations")


def median(rows: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rows]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="another tree (e.g. ../main) measured the same way, interleaved")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big", action="store_true", help="also p = 32, n = 1e6 (this tree; the baseline once)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["fit", "threads", "sums"])
    ap.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="also the fits of p = 4, 8, 16 (n = 1e5) on this many seeds of the sites' generator (this tree): "
        "evaluations against the bounds 15/20/30 and max_k L_k against the exhaustive solve",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also the CPU time of each part of the fit (p = 16, n = 1e5; with --big also p = 32, n = 1e6), "
        "each tree in turn",
    )
    ap.add_argument("--problems", action="store_true", help="also bench_core's problems against the exhaustive solve")
    ap.add_argument(
        "--experiments",
        nargs="*",
        default=None,
        help="also the paper's experiments (quick): each solve against the exhaustive one (default: all four)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_solver.json"))
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "fit":
            res = child_fit(int(rest[0]), int(float(rest[1])), rest[2] == "1", rest[3], *map(int, rest[4:5]))
        elif kind == "phases":
            res = child_phases(int(rest[0]), int(float(rest[1])))
        else:
            res = child_sums(int(rest[0]), int(float(rest[1])), rest[2])
        print(json.dumps(res))
        return 0
    trees = {"this": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    result: dict = {
        "load_average_at_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "trees": {k: str(v) for k, v in trees.items()},
    }
    cases = [(4, 100_000), (8, 100_000), (16, 100_000)] + ([(32, 1_000_000)] if args.big else [])
    if "fit" not in args.skip:
        rows = []
        for p, n in cases:
            runs: dict[str, list[dict]] = {k: [] for k in trees}
            reps = 1 if n >= 1_000_000 else args.repeats
            for r in range(reps):
                for name, tree in trees.items():
                    if name == "baseline" and n >= 1_000_000 and r > 0:
                        continue
                    runs[name].append(
                        run_child(tree, ["fit", str(p), str(n), "1" if name == "this" and r == 0 else "0", "one"])
                    )
            row = {"p": p, "n": n, "runs": runs, "load_average": os.getloadavg()}
            for name, rs in runs.items():
                keys = ("fit_s", "cpu_s", "solve_s", "evaluations", "max_loss", "cpu_over_wall")
                row[name] = {k: median(rs, k) for k in keys + tuple(k for k in INFLUENCE if k in rs[0])}
            ex = runs["this"][0]
            row["this"].update({k: ex[k] for k in ("exhaustive_evaluations", "max_loss_minus_exhaustive")})
            line = (
                f"p={p:3d} n={n:8d} | this: fit {row['this']['fit_s']:.3f} s (CPU {row['this']['cpu_s']:.3f} s), "
                f"solve {row['this']['solve_s']:.3f} s, "
                f"{row['this']['evaluations']:.0f} evaluations (exhaustive {ex['exhaustive_evaluations']}, "
                f"max_k L_k - exhaustive {ex['max_loss_minus_exhaustive']:.1e})"
            )
            if "influence_s" in row["this"]:
                line += (
                    f" | influence report {row['this']['influence_s']:.3f} s, "
                    f"{row['this']['influence_evaluations']:.0f} evaluations"
                )
            if "baseline" in runs:
                b = row["baseline"]
                row["ratio_fit"] = b["fit_s"] / row["this"]["fit_s"]
                row["ratio_cpu"] = b["cpu_s"] / row["this"]["cpu_s"]
                row["ratio_solve"] = b["solve_s"] / row["this"]["solve_s"]
                line += (
                    f" | baseline: fit {b['fit_s']:.3f} s (CPU {b['cpu_s']:.3f} s), "
                    f"{b['evaluations']:.0f} evaluations | "
                    f"fit {row['ratio_fit']:.1f}x (CPU {row['ratio_cpu']:.1f}x), "
                    f"solve {row['ratio_solve']:.1f}x faster"
                )
            print(line + f" | load {row['load_average'][0]:.1f}", flush=True)
            rows.append(row)
        result["fit"] = rows
    if "threads" not in args.skip:
        runs = {"one": [], "default": []}
        for _ in range(max(args.repeats, 5)):
            for blas in runs:
                runs[blas].append(run_child(ROOT, ["fit", "16", "100000", "0", blas]))
        th = {blas: {k: median(rs, k) for k in ("fit_s", "solve_s", "cpu_over_wall")} for blas, rs in runs.items()}
        th["ratio_fit"] = th["default"]["fit_s"] / th["one"]["fit_s"]
        th["load_average"] = os.getloadavg()
        th["runs"] = runs
        result["threads"] = th
        print(
            f"p=16 n=1e5 fit, one BLAS thread for solve and inference: {th['one']['fit_s']:.3f} s "
            f"(CPU/wall {th['one']['cpu_over_wall']:.2f}); default threads there: {th['default']['fit_s']:.3f} s "
            f"(CPU/wall {th['default']['cpu_over_wall']:.2f}); ratio {th['ratio_fit']:.2f} "
            f"| load {th['load_average'][0]:.1f}",
            flush=True,
        )
    if "sums" not in args.skip:
        rows = []
        for p in (4, 8, 16, 32):
            for loss in ("cross_entropy", "squared"):
                row = {"p": p, "n": 100_000, "loss": loss}
                for name, tree in trees.items():
                    row[name] = run_child(tree, ["sums", str(p), "100000", loss])
                    row[name]["over_bound"] = row[name]["evaluation_s"] / row[name]["bound_s"]
                line = (
                    f"sums p={p:3d} {loss:14s} bound {1e3 * row['this']['bound_s']:6.2f} ms | this "
                    f"{1e3 * row['this']['evaluation_s']:6.2f} ms ({row['this']['over_bound']:.2f}x)"
                )
                if "baseline" in row:
                    row["ratio"] = row["baseline"]["evaluation_s"] / row["this"]["evaluation_s"]
                    line += (
                        f" | baseline {1e3 * row['baseline']['evaluation_s']:6.2f} ms "
                        f"({row['baseline']['evaluation_s'] / row['this']['bound_s']:.2f}x) "
                        f"| {row['ratio']:.2f}x faster"
                    )
                print(line, flush=True)
                rows.append(row)
        result["sums"] = rows
    if args.seeds:
        rows = []
        for p, bound in ((4, 15), (8, 20), (16, 30)):
            for seed in range(args.seeds):
                r = run_child(ROOT, ["fit", str(p), "100000", "1", "one", str(seed)])
                rows.append({"p": p, "seed": seed, "bound": bound, **r})
                print(
                    f"p={p:3d} seed={seed}: {r['evaluations']} evaluations (bound {bound}; exhaustive "
                    f"{r['exhaustive_evaluations']}), max_k L_k - exhaustive {r['max_loss_minus_exhaustive']:.1e}"
                    + (f"; influence report {r['influence_evaluations']} evaluations" if "influence_s" in r else ""),
                    flush=True,
                )
        result["seeds"] = rows
    if args.phases:
        rows = []
        for p, n in [(16, 100_000)] + ([(32, 1_000_000)] if args.big else []):
            for _ in range(1 if n >= 1_000_000 else args.repeats):
                for name, tree in trees.items():
                    row = {"p": p, "n": n, "tree": name, **run_child(tree, ["phases", str(p), str(n)])}
                    row["load_average"] = os.getloadavg()
                    rows.append(row)
                    parts = ", ".join(
                        f"{k} {row[k]:.3f}"
                        for k in ("classifier", "set_domain_model", "set_qhat", "solve", "dc_evaluate", "plausibility")
                    )
                    print(
                        f"phases p={p:3d} n={n:8d} {name}: CPU {row['fit']:.3f} s (wall {row['fit_wall']:.3f} s): "
                        f"{parts} | load {row['load_average'][0]:.1f}",
                        flush=True,
                    )
        result["phases"] = rows
    if args.problems:
        sys.path.insert(0, str(ROOT))
        result["problems"] = core_problems((1_000, 10_000, 100_000), (2, 4, 8, 16, 32))
    if args.experiments is not None:
        sys.path.insert(0, str(ROOT))
        result["experiments"] = experiments(args.experiments or ["synthetic", "adult", "sentiment", "digits"])
    result["load_average_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
