"""Prediction with the combined model against its parts, and the cost of loading a model.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_model.py             # a few minutes
    PYTHONPATH=. .venv/bin/python benchmarks/bench_model.py --quick     # p = 8 only, fewer repeats
    PYTHONPATH=. .venv/bin/python benchmarks/bench_model.py --baseline-tree ../main   # + load_model before
    PYTHONPATH=. .venv/bin/python benchmarks/bench_model.py --load-only --baseline-tree DIR   # part 2 only

Part 1, on n rows (default 1e5), d = 20 inputs, 2 classes, p sites (8 and 32), a saved and
loaded model (what a user of the model holds), for two kinds of site predictor (a logistic
regression and a 64-unit MLP, exported by skl2onnx), all timed in the same run, interleaved,
medians over ``--repeats``:

- ``parts``: the p predictors' ``predict_proba`` one after the other plus the domain model's
  ``predict_log_proba`` (what the combined model cannot do without);
- ``predict_proba``: :meth:`CombinedModel.predict_proba` (the model's own float64 graph);
- ``numpy``: the model part by part in numpy (``_predict_proba_numpy``, how predict_proba
  worked before the graph);
- ``onnx64`` / ``onnx32``: the exported file (``to_onnx``) run by onnxruntime.

Every session runs on one thread (the predictors' default), so ratios compare like with like.

Part 2: ``load_model`` of the demo's model (three sites, standard features, 2-D) and of a p = 8
model (logistic predictors, d = 20; not with ``--quick``), each load in a fresh interpreter:
``import numpy`` + ``import msa_fed`` + ``load_model`` time, the first ``predict_proba``, peak
resident memory, and whether torch / scikit-learn / scipy were imported; with an empty record of
verified predictors (``cold``: the sandbox checks every predictor) and with the record an earlier
load left (``warm``); with ``--baseline-tree DIR`` (a checkout or a copy of another tree's
``msa_fed/``) the same loads of that tree, interleaved in the same run, and the ratios.
``uptime`` before and after.

Prints tables and writes JSON to ``benchmarks/results/bench_model.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def build(p: int, kind: str, d: int, tmp: Path, seed: int = 0):
    """A saved and reloaded combined model over p sites, and its sites' inputs."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    warnings.simplefilter("ignore", ConvergenceWarning)

    from msa_fed.artifacts import load_predictor
    from msa_fed.artifacts.export import export_sklearn
    from msa_fed.artifacts.model import CombinedModel, load_model
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import train_domain_classifier
    from msa_fed.core.features import make_feature_map

    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(p, d))
    Xs = [rng.normal(loc=c, size=(400, d)) for c in centers]
    predictors = []
    for X in Xs:
        y = ((X - X.mean(axis=0)) @ rng.normal(size=d) > 0).astype(int)
        if kind == "mlp":
            h = MLPClassifier(hidden_layer_sizes=(64,), max_iter=50, random_state=seed).fit(X, y)
        else:
            h = LogisticRegression().fit(X, y)
        predictors.append(load_predictor(export_sklearn(h, d), n_features=d, kind="probabilities"))
    dm = train_domain_classifier([X[:200] for X in Xs], make_feature_map("standard"), ClassifierConfig(mu=1e-3))
    Q = dm.predict_proba(np.vstack(Xs))
    model = CombinedModel(
        method="dmsa",
        task="classification",
        site_names=[f"site{k}" for k in range(p)],
        domain_model=dm,
        qhat=Q.mean(axis=0),
        z=rng.dirichlet(np.ones(p)),
        eta=1e-2,
        predictors=predictors,
        n_features=d,
        classes=[0, 1],
    )
    return load_model(model.save(tmp / f"model-{p}-{kind}")), centers


def session(data: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])


def bench_predict(p: int, kind: str, n: int, d: int, repeats: int, tmp: Path) -> dict:
    model, centers = build(p, kind, d, tmp)
    rng = np.random.default_rng(1)
    X = centers[rng.integers(0, p, n)] + rng.normal(size=(n, d))
    X32 = X.astype(np.float32)
    s64, s32 = session(model.to_onnx("float64")), session(model.to_onnx("float32"))

    def parts():
        for h in model.predictors:
            h.predict_proba(X)
        model.domain_model.predict_log_proba(X)

    cases = {
        "parts": parts,
        "predict_proba": lambda: model.predict_proba(X),
        "numpy": lambda: model._predict_proba_numpy(X),
        "onnx64": lambda: s64.run(["probabilities"], {"X": X}),
        "onnx32": lambda: s32.run(["probabilities"], {"X": X32}),
    }
    ref = model._predict_proba_numpy(X)
    diff = {
        "predict_proba": float(np.abs(model.predict_proba(X) - ref).max()),
        "onnx64": float(np.abs(s64.run(["probabilities"], {"X": X})[0] - ref).max()),
        "onnx32": float(np.abs(s32.run(["probabilities"], {"X": X32})[0] - ref).max()),
    }
    for f in cases.values():  # warm up every session
        f()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, f in cases.items():  # interleaved: load changes hit every case alike
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "p": p,
        "predictor": kind,
        "n": n,
        "d": d,
        "seconds": med,
        "ratio_to_parts": {k: med[k] / med["parts"] for k in med},
        "max_abs_diff_from_numpy": diff,
    }


LOAD_SCRIPT = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import numpy as np
import msa_fed
m = msa_fed.load_model(sys.argv[1])
t1, c1 = time.perf_counter(), time.process_time()
m.predict_proba(np.zeros((10, m.n_features_in_)))
t2 = time.perf_counter()
print(json.dumps({
    "load_s": t1 - t0, "first_predict_s": t2 - t1, "load_cpu_s": c1 - c0,
    # VmHWM: this process's peak resident set (ru_maxrss would count the forked parent's pages)
    "peak_rss_mib": [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0] / 1024,
    "imported": sorted(k for k in ("torch", "sklearn", "scipy") if k in sys.modules),
}))
"""


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def demo_model(tmp: Path) -> Path:
    """The demo's model: its federation and predictors, fitted in process (as the demo's job)."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed import SiteData, fit_dmsa
    from msa_fed.experiments.demo_data import SITES, make_federation

    fed = make_federation()
    sites = [
        SiteData(
            n,
            fed[n]["X_labeled"],
            fed[n]["y_labeled"],
            fed[n]["X_unlabeled"],
            LogisticRegression().fit(fed[n]["X_train"], fed[n]["y_train"]),
        )
        for n in SITES
    ]
    return fit_dmsa(sites, "classification").save(tmp / "demo-model")


def bench_load(models: dict[str, Path], trees: dict[str, Path], repeats: int, tmp: Path) -> dict:
    """``load_model`` of each model in a fresh interpreter per load, every (model, tree, record)
    interleaved in each repetition; medians over ``repeats``.

    record "cold": an empty record of verified predictors (``$MSA_FED_VERIFIED_CACHE`` a new
    directory for every load: the sandbox checks every predictor, as on a first load);
    record "warm": the record one earlier load of the same files left.  A tree without the
    record (the baseline) ignores the variable: it is timed once per repetition, as "cold"."""
    variants = [
        (m, t, rec) for m in models for t in trees for rec in ("cold", "warm") if t == "this tree" or rec == "cold"
    ]
    warm_dir = tmp / "verified-warm"
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}

    def one(model: str, tree: str, record: str) -> dict:
        cache = warm_dir if record == "warm" else tmp / f"verified-cold-{time.monotonic_ns()}"
        env = {**os.environ, "PYTHONPATH": str(trees[tree]), "MSA_FED_VERIFIED_CACHE": str(cache)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            [sys.executable, "-c", LOAD_SCRIPT, str(models[model])],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=tmp,  # not a checkout: msa_fed comes from PYTHONPATH
        )
        if proc.returncode != 0:
            raise SystemExit(f"load_model failed under {trees[tree]}: {proc.stderr[-2000:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        # CPU of the whole process tree (the interpreter, the sandbox's helper and its children,
        # all reaped by now): steadier than the wall clock on a shared machine
        result["cpu_s"] = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
        return result

    for model in models:  # fill the warm record (and warm the page cache for every tree)
        for tree in trees:
            one(model, tree, "warm")
    for _ in range(repeats):
        for v in variants:
            runs[v].append(one(*v))
    out: dict = {}
    for (model, tree, record), rs in runs.items():
        out.setdefault(model, {}).setdefault(tree, {})[record] = {
            "tree": str(trees[tree]),
            "load_s": statistics.median(r["load_s"] for r in rs),
            "load_s_all": [round(r["load_s"], 4) for r in rs],
            "first_predict_s": statistics.median(r["first_predict_s"] for r in rs),
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "load_cpu_s": statistics.median(r["load_cpu_s"] for r in rs),
            "load_and_predict_s": statistics.median(r["load_s"] + r["first_predict_s"] for r in rs),
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            "imported": rs[-1]["imported"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=20)
    ap.add_argument("--sites", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--predictors", nargs="+", default=["logistic", "mlp"], choices=["logistic", "mlp"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--load-repeats", type=int, default=5)
    ap.add_argument("--baseline-tree", type=Path, help="another checkout to time load_model against")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--load-only", action="store_true", help="time only load_model (part 2)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_model.json")
    args = ap.parse_args()
    if args.quick:
        args.sites, args.repeats, args.load_repeats = [8], 3, 3
    if args.load_only:
        args.sites = []
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["MSA_FED_VERIFIED_CACHE"] = str(tmp / "verified-this-process")  # not the user's record
        print(f"{'p':>3} {'predictor':<9} {'parts':>8} {'predict_proba':>14} {'numpy':>8} {'onnx64':>8} {'onnx32':>8}")
        for p in args.sites:
            for kind in args.predictors:
                r = bench_predict(p, kind, args.n, args.d, args.repeats, tmp)
                rows.append(r)
                s, q = r["seconds"], r["ratio_to_parts"]
                print(
                    f"{p:>3} {kind:<9} {s['parts'] * 1e3:>6.1f}ms "
                    + " ".join(
                        f"{s[k] * 1e3:>6.1f}ms ({q[k]:.2f}x)" for k in ("predict_proba", "numpy", "onnx64", "onnx32")
                    ),
                    flush=True,
                )
        trees = {"this tree": REPO}
        if args.baseline_tree:
            trees["baseline"] = args.baseline_tree.resolve()
        models = {"demo (p = 3)": demo_model(tmp)}
        if not args.quick:
            build(8, "logistic", args.d, tmp)  # saved as tmp / "model-8-logistic"
            models["p = 8 (logistic, d = 20)"] = tmp / "model-8-logistic"
        load_uptime = [uptime()]
        load = bench_load(models, trees, args.load_repeats, tmp)
        load_uptime.append(uptime())
    print(f"load_model, medians of {args.load_repeats}; uptime before / after: {load_uptime[0]} / {load_uptime[1]}")
    for model, by_tree in load.items():
        for tree, by_record in by_tree.items():
            for record, r in by_record.items():
                print(
                    f"  {model:<24} {tree:<10} record {record:<4}: load {r['load_s']:.3f} s "
                    f"(CPU of the caller {r['load_cpu_s']:.3f} s), "
                    f"load + first predict_proba {r['load_and_predict_s']:.3f} s, CPU of the process tree for both "
                    f"{r['cpu_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, imported {r['imported']}"
                )
        if "baseline" in by_tree:
            base = by_tree["baseline"]["cold"]
            for record in ("cold", "warm"):
                r = by_tree["this tree"][record]
                print(
                    f"  {model:<24} record {record} / baseline: load {r['load_s'] / base['load_s']:.2f}, "
                    f"CPU {r['cpu_s'] / base['cpu_s']:.2f}"
                )
    result = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "repeats": args.repeats,
        "predict": rows,
        "load_model": load,
        "load_uptime": load_uptime,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
