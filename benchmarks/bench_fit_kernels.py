"""The domain classifier and prediction against their kernels: scikit-learn, the fit's CPU in p, the parts.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_fit_kernels.py --baseline /work/main   # minutes
    PYTHONPATH=. .venv/bin/python benchmarks/bench_fit_kernels.py --only sklearn predict  # this tree only
    PYTHONPATH=. .venv/bin/python benchmarks/bench_fit_kernels.py --only phases --repeats 1   # fit CPU in p

Every measurement runs in a fresh process (``--child``) with the code of the tree named (this
one or ``--baseline``); runs alternate between the trees and the cases, so that each sees the
same load; medians over ``--repeats`` runs (CPU time of the process, which the load of a shared
machine inflates less than the wall time), ratios against the baseline measured in the same run.

1. ``classifier``: the domain classifier of ``fit_dmsa`` (local runtime, defaults) on the sites of
   ``bench_solver.py`` (p sites, 2000 unlabelled points each, d = 5, standard features, so
   D = 5): CPU seconds of ``Coordinator.train_domain_model`` (training to the public optimum the
   sites verify), for p in ``--ps``; also the whole fit's CPU (``fit``) where ``--fit`` is given.
2. ``sklearn``: the same sites' classifier problem (balanced weights 1 / (p m_k),
   C = 1 / (2 mu)) solved by scikit-learn's ``LogisticRegression`` (lbfgs, multinomial, one BLAS
   thread) at ``tol`` 1e-10, the projected-gradient stop that msa_fed's exact fit uses, and at its
   default 1e-4; msa_fed's in-process trainer (``train_domain_classifier(exact=True)``) on the
   same arrays.  Objective gaps are against the smallest objective any of them reached.
3. ``phases``: the whole fit's CPU in p (``fit_dmsa``, local runtime, defaults, n = 1e5 labelled
   points, the sites above) by part, for p in ``--ps``: the domain classifier, the sites'
   ``set_domain_model`` (with its verification) and ``set_qhat`` (the predictors on the sites'
   points), the solve (the sites' DC sums and the coordinator's plausibility checks of their
   answers), the target reference built at the end of the fit (``reference``: the combined
   model's probabilities and the nearest-neighbour distances on up to 1000 published rows per
   site) and the rest (the sites' set-up, the model's assembly) -- ``bench_solver.py``'s
   ``phases`` child, one fresh process per run.
4. ``predict``: ``CombinedModel.predict_proba`` against its parts (the p predictors'
   ``predict_proba`` one after the other plus the domain model's ``predict_log_proba``) at
   p = 8, 1e5 rows (``bench_model.build``: d = 20, logistic predictors, saved and loaded).

Writes benchmarks/results/bench_fit_kernels.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MU = 1e-3


def _sites(p: int, n: int = 100_000, seed: int = 0):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_solver import make_sites

    return make_sites(p, n, seed=seed)


def child_classifier(p: int, whole_fit: bool) -> dict:
    import msa_fed.runtime.coordinator as coordinator
    from msa_fed import fit_dmsa

    sites = _sites(p)
    fit_dmsa(_sites(4, 4000, seed=1), "classification")  # warm-up: imports, first calls
    seen: dict = {}
    real = coordinator.Coordinator.train_domain_model

    class Done(Exception):
        pass

    def timed(self, progress):
        c, t = time.process_time(), time.perf_counter()
        model = real(self, progress)
        seen.update(cpu_s=time.process_time() - c, wall_s=time.perf_counter() - t)
        # the objective of the returned theta, in float64 (code that both trees have)
        from dataclasses import replace

        from msa_fed.core.domain_classifier import _regularise, balanced_shards, sum_oracle

        Phis = [model.feature_map.transform(r.X) for r in self.call_all("unlabeled_sample", None)]
        oracle = sum_oracle(balanced_shards(Phis, replace(self.config.classifier, dtype="float64")))
        loss, _ = oracle(model.theta_)
        seen["objective"] = loss + _regularise(model.theta_, model.mu, model.n_features_, self.p)[0]
        if not whole_fit:
            raise Done
        return model

    coordinator.Coordinator.train_domain_model = timed
    c = time.process_time()
    try:
        fit_dmsa(sites, "classification")
        seen["fit_cpu_s"] = time.process_time() - c
    except Done:
        pass
    return seen


def child_sklearn(p: int, which: str) -> dict:
    import warnings

    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import (
        _regularise,
        balanced_weights,
        fit_feature_map,
        stacked_shard,
        sum_oracle,
        train_domain_classifier,
    )
    from msa_fed.core.features import StandardFeatures

    U = [s.X_unlabeled for s in _sites(p)]
    fmap = fit_feature_map(StandardFeatures(), U)
    Phis = [fmap.transform(X) for X in U]
    D = Phis[0].shape[1]
    exact = sum_oracle([stacked_shard(Phis)])

    def F(theta):
        loss, _ = exact(theta)
        return loss + _regularise(theta, MU, D, p)[0]

    # warm-up (imports, first calls) on a small problem of the same shape
    small = [X[:200] for X in U]
    train_domain_classifier(small, StandardFeatures(), ClassifierConfig(mu=MU), exact=True)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LogisticRegression(C=1.0 / (2.0 * MU)).fit(np.vstack(small), np.repeat(np.arange(p), 200))
    c = time.process_time()
    trace: list[tuple[float, float]] = []  # (CPU seconds so far, objective) per L-BFGS iteration
    if which == "msa_fed":
        model = train_domain_classifier(
            U,
            StandardFeatures(),
            ClassifierConfig(mu=MU),
            exact=True,
            progress=lambda i, f: trace.append((time.process_time() - c, float(f))),
        )
        theta, iters = model.theta_, model.info_["n_iter"]
    else:
        X = np.vstack(Phis)
        y = np.concatenate([np.full(len(P), k) for k, P in enumerate(Phis)])
        with threadpool_limits(1), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clf = LogisticRegression(C=1.0 / (2.0 * MU), tol=float(which), max_iter=10_000)
            clf.fit(X, y, sample_weight=balanced_weights(Phis))
        theta, iters = np.hstack([clf.coef_, clf.intercept_[:, None]]).ravel(), int(np.max(clf.n_iter_))
    cpu = time.process_time() - c
    return {"cpu_s": cpu, "objective": F(theta), "iterations": iters, "trace": trace}


def child_predict() -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_model import build

    with tempfile.TemporaryDirectory() as tmp:
        model, centers = build(8, "logistic", 20, Path(tmp))
        rng = np.random.default_rng(1)
        X = centers[rng.integers(0, 8, 100_000)] + rng.normal(size=(100_000, 20))

        def parts():
            for h in model.predictors:
                h.predict_proba(X)
            model.domain_model.predict_log_proba(X)

        out = model.predict_proba(X)
        diff = float(np.abs(out - model._predict_proba_numpy(X)).max())
        parts()
        times: dict[str, list[float]] = {"parts": [], "predict_proba": []}
        for _ in range(7):
            for name, f in (("parts", parts), ("predict_proba", lambda: model.predict_proba(X))):
                c = time.process_time()
                f()
                times[name].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "ratio": med["predict_proba"] / med["parts"], "max_abs_diff_from_numpy": diff}


def child_phases(p: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_solver import child_phases as phases

    out: dict = phases(p, 100_000)
    return out


#: the parts of ``phases`` (keys of bench_solver's child), in the order of the fit
PHASES = ("classifier", "set_domain_model", "set_qhat", "dc_evaluate", "plausibility")


def run_child(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} in {tree} failed:\n{done.stderr[-3000:]}")
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="another tree (e.g. /work/main), interleaved")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ps", type=int, nargs="*", default=[4, 8, 16, 32, 64])
    ap.add_argument("--big-repeats", type=int, default=1, help="runs at p >= 32 (each is tens of seconds)")
    ap.add_argument("--fit", action="store_true", help="time the whole fit too (verification and solve included)")
    ap.add_argument("--only", nargs="*", default=["classifier", "sklearn", "predict"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_fit_kernels.json"))
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "classifier":
            res = child_classifier(int(rest[0]), rest[1] == "1")
        elif kind == "sklearn":
            res = child_sklearn(int(rest[0]), rest[1])
        elif kind == "phases":
            res = child_phases(int(rest[0]))
        else:
            res = child_predict()
        print(json.dumps(res))
        return 0
    trees = {"this": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    result: dict = {
        "load_average_at_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "trees": {k: str(v) for k, v in trees.items()},
    }
    if "classifier" in args.only:
        rows = []
        for p in args.ps:
            reps = args.repeats if p < 32 else args.big_repeats
            runs: dict[str, list[dict]] = {k: [] for k in trees}
            for _ in range(reps):
                for name, tree in trees.items():
                    runs[name].append(run_child(tree, ["classifier", str(p), "1" if args.fit else "0"]))
            row: dict = {"p": p, "runs": runs, "load_average": os.getloadavg()}
            for name, rs in runs.items():
                row[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            line = f"classifier p={p:3d}: this {row['this']['cpu_s']:.2f} s CPU"
            if args.fit:
                line += f" (fit {row['this']['fit_cpu_s']:.2f} s)"
            if "baseline" in trees:
                b = row["baseline"]
                row["ratio_cpu"] = b["cpu_s"] / row["this"]["cpu_s"]
                line += f" | baseline {b['cpu_s']:.2f} s: {row['ratio_cpu']:.2f}x less CPU"
                if args.fit:
                    line += f" (fit {b['fit_cpu_s']:.2f} s)"
                line += f" | objective this - baseline {row['this']['objective'] - b['objective']:.1e}"
            print(line + f" | load {row['load_average'][0]:.1f}", flush=True)
            rows.append(row)
        result["classifier"] = rows
    if "sklearn" in args.only:
        rows = []
        for p in args.ps:
            reps = args.repeats if p < 32 else args.big_repeats
            cases = ["msa_fed", "1e-10", "1e-4"]
            runs = {c: [] for c in cases}
            for _ in range(reps):
                for c in cases:
                    runs[c].append(run_child(ROOT, ["sklearn", str(p), c]))
            row = {"p": p, "runs": runs, "load_average": os.getloadavg()}
            best = min(r["objective"] for rs in runs.values() for r in rs)
            for c, rs in runs.items():
                row[c] = {
                    "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                    "gap": max(r["objective"] for r in rs) - best,
                }
            for tol in ("1e-10", "1e-4"):
                # msa_fed's CPU time until its objective first reached scikit-learn's at that tol
                target = max(r["objective"] for r in runs[tol])
                reach = [next((t for t, f in r["trace"] if f <= target), r["cpu_s"]) for r in runs["msa_fed"]]
                row["msa_fed"][f"cpu_to_{tol}_s"] = statistics.median(reach)
                row[f"ratio_to_{tol}"] = row["msa_fed"][f"cpu_to_{tol}_s"] / row[tol]["cpu_s"]
            row["ratio_full_vs_1e-10"] = row["msa_fed"]["cpu_s"] / row["1e-10"]["cpu_s"]
            print(
                f"sklearn p={p:3d}: msa_fed exact {row['msa_fed']['cpu_s']:.2f} s (gap {row['msa_fed']['gap']:.1e}, "
                f"{row['ratio_full_vs_1e-10']:.2f}x sklearn 1e-10) | sklearn tol 1e-10 {row['1e-10']['cpu_s']:.2f} s "
                f"(gap {row['1e-10']['gap']:.1e}), msa_fed to that objective {row['msa_fed']['cpu_to_1e-10_s']:.2f} s: "
                f"{row['ratio_to_1e-10']:.2f}x | tol 1e-4 {row['1e-4']['cpu_s']:.2f} s (gap {row['1e-4']['gap']:.1e}), "
                f"msa_fed to it {row['msa_fed']['cpu_to_1e-4_s']:.2f} s: {row['ratio_to_1e-4']:.2f}x "
                f"| load {row['load_average'][0]:.1f}",
                flush=True,
            )
            rows.append(row)
        result["sklearn"] = rows
    if "phases" in args.only:
        rows = []
        for p in args.ps:
            reps = args.repeats if p < 32 else args.big_repeats
            runs = {k: [] for k in trees}
            for _ in range(reps):
                for name, tree in trees.items():
                    runs[name].append(run_child(tree, ["phases", str(p)]))
            row = {"p": p, "runs": runs, "load_average": os.getloadavg()}
            line = f"fit p={p:3d} n=1e5"
            for name, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                # the solver's own CPU (SLSQP, its bookkeeping), and what is left of the fit
                med["solver"] = med["solve"] - med["dc_evaluate"] - med["plausibility"]
                med.setdefault("reference", 0.0)
                med.setdefault("reference_after_fit", 0.0)
                med["rest"] = med["fit"] - sum(med[k] for k in PHASES) - med["solver"] - med["reference"]
                row[name] = med
                parts = ", ".join(f"{k} {med[k]:.2f}" for k in (*PHASES, "solver", "reference", "rest"))
                line += (
                    f" | {name}: fit CPU {med['fit']:.2f} s ({parts}; {med['evaluations']:.0f} evaluations;"
                    f" the reference's first use after the fit {med['reference_after_fit']:.2f})"
                )
            print(line + f" | load {row['load_average'][0]:.1f}", flush=True)
            rows.append(row)
        result["phases"] = rows
    if "predict" in args.only:
        runs = {k: [] for k in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                runs[name].append(run_child(tree, ["predict"]))
        result["predict"] = {"runs": runs, "load_average": os.getloadavg()}
        for name, rs in runs.items():
            ratios = sorted(r["ratio"] for r in rs)
            print(
                f"predict p=8 n=1e5 {name}: predict_proba / parts median {statistics.median(ratios):.2f} "
                f"(runs {', '.join(f'{x:.2f}' for x in ratios)}), max diff from numpy "
                f"{max(r['max_abs_diff_from_numpy'] for r in rs):.1e}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
