"""Cost of the sandboxed predictor loader: milliseconds per load, in-process checks vs sandbox.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_artifacts.py            # ~1 minute
    PYTHONPATH=. .venv/bin/python benchmarks/bench_artifacts.py --quick    # a few seconds

For each model, in the same run:

- ``in_process``: every check the loader runs (parse, structure, declaration, ONNX checker,
  onnxruntime session, probe batch) called directly in this process, the way the loader
  worked before the sandbox (baseline);
- ``zygote``: :func:`load_predictor` with an empty probe cache, the child forked from the
  pre-imported helper (the default);
- ``spawn``: the same with a fresh interpreter per load (the fallback);
- ``cached``: :func:`load_predictor` again for the same bytes (the in-process cache);
- ``first_predict``: building this process's own onnxruntime session on first use.

Medians over ``--repeats`` loads; prints a table and writes JSON to
``benchmarks/results/bench_artifacts.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from msa_fed.artifacts import loader, sandbox
from msa_fed.artifacts.export import export_sklearn
from msa_fed.artifacts.sandbox import _evaluate
from msa_fed.artifacts.structure import DEFAULT_MAX_FEATURES


def models():
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression, Ridge

    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 20))
    y = (X[:, 0] + X[:, 1] > 0).astype(int)
    Xw = rng.normal(size=(200, 2000))
    return {
        "ridge_d20": export_sklearn(Ridge().fit(X, X[:, 0]), 20),
        "logreg_d20": export_sklearn(LogisticRegression().fit(X, y), 20),
        "forest100_d20": export_sklearn(
            RandomForestClassifier(n_estimators=100, max_depth=8, random_state=0).fit(X, y), 20
        ),
        "logreg_d2000": export_sklearn(LogisticRegression(max_iter=200).fit(Xw, (Xw[:, 0] > 0).astype(int)), 2000),
    }


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    req = {"kind": None, "n_features": None, "max_features": DEFAULT_MAX_FEATURES}
    rows = []
    for name, data in models().items():
        _evaluate(data, req, None)  # warm imports

        def sandboxed(data=data):
            loader.PROBE_CACHE.clear()
            loader.load_predictor(data)

        def spawned(data=data):
            sandbox.SANDBOX_START = "spawn"
            try:
                sandboxed(data)
            finally:
                sandbox.SANDBOX_START = "zygote"

        def first_predict(data=data):
            p = loader.load_predictor(data)
            p._session = None
            p._ensure_session()

        row = {
            "model": name,
            "bytes": len(data),
            "in_process_ms": median_ms(lambda data=data: _evaluate(data, req, None), repeats),
            "zygote_ms": median_ms(sandboxed, repeats),
            "spawn_ms": median_ms(spawned, repeats),
            "cached_ms": median_ms(lambda data=data: loader.load_predictor(data), repeats),
            "first_predict_ms": median_ms(first_predict, repeats),
        }
        rows.append(row)
        print(
            f"{name:>15} {len(data):>9,d} B  in-process {row['in_process_ms']:7.1f} ms"
            f"  zygote {row['zygote_ms']:7.1f} ms"
            f"  spawn {row['spawn_ms']:7.1f} ms  cached {row['cached_ms']:6.2f} ms  first predict session "
            f"{row['first_predict_ms']:6.1f} ms",
            flush=True,
        )
    out = Path(__file__).resolve().parent / "results" / "bench_artifacts.json"
    out.parent.mkdir(exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    out.write_text(
        json.dumps({"machine": platform.platform(), "load_average": load, "repeats": repeats, "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
