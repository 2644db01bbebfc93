"""Cost of running a peer's predictor in a limited worker process (msa_fed.artifacts.isolated)
against in-process onnxruntime, in the same run.

A site runs each peer's predictor once per job, on its unlabelled and labelled rows together
(msa_fed.site.worker: one call of n_u + n_l rows); the combined model's predict at the
coordinator runs it on the caller's batch.  Measured per model and batch size:

- warm call: the session exists (in-process) or is loaded in the worker (isolated); median of
  repeats of one call;
- per job: a fresh in-process session plus one call, against a warm worker that loads the model
  (bytes over the socket, its own session) plus one call: what a job pays;
- worker start: forking a limited worker from the sandbox's helper and its first load (once per
  site process and worker).

    python benchmarks/bench_isolation.py [--quick]   ->  benchmarks/results/bench_isolation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.neural_network import MLPClassifier  # noqa: E402

from msa_fed.artifacts.isolated import IsolationLimits, PredictorPool, isolate  # noqa: E402
from msa_fed.artifacts.loader import _session_for  # noqa: E402
from msa_fed.artifacts.predictors import export_sklearn, load_predictor  # noqa: E402


def _models(d: int, rng):
    X = rng.normal(size=(2000, d))
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int)
    lr = LogisticRegression(max_iter=200).fit(X, y)
    mlp = MLPClassifier(hidden_layer_sizes=(256, 256), max_iter=30, random_state=0).fit(X, y)
    return {"logistic": export_sklearn(lr, n_features=d), "mlp-256x2": export_sklearn(mlp, n_features=d)}


def _median(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "bench_isolation.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = (150, 512, 2000, 10_000, 50_000) if not args.quick else (150, 2000)
    widths = (2, 100) if not args.quick else (2,)
    repeats = 15 if not args.quick else 5
    pool = PredictorPool(IsolationLimits(workers=1))
    rows = []
    t = time.perf_counter()
    first = isolate(
        load_predictor(export_sklearn(LogisticRegression().fit([[0.0], [1.0]], [0, 1]), n_features=1)), "s", pool
    )
    first.predict_proba(np.zeros((1, 1)))
    worker_start = time.perf_counter() - t
    for d in widths:
        for name, onnx in _models(d, rng).items():
            inproc = load_predictor(onnx, kind="probabilities")
            iso = isolate(inproc, "peer", pool)
            for n in batches:
                X = rng.normal(size=(n, d)).astype(np.float32)
                inproc.predict_proba(X)
                iso.predict_proba(X)
                warm_in = _median(lambda h=inproc, X=X: h.predict_proba(X), repeats)
                warm_iso = _median(lambda h=iso, X=X: h.predict_proba(X), repeats)

                def job_in(onnx=onnx, X=X):
                    s, i, o = _session_for(onnx, 1)
                    s.run([o], {i: X})

                def job_iso(iso=iso, X=X):
                    for w in pool._idle:  # the worker forgets the model: the job loads it again
                        w.loaded.discard(iso.sha256)
                    iso.predict_proba(X)

                job_inproc = _median(job_in, max(3, repeats // 3))
                job_isolated = _median(job_iso, max(3, repeats // 3))
                rows.append(
                    {
                        "model": name,
                        "d": d,
                        "rows": n,
                        "warm_inprocess_ms": 1e3 * warm_in,
                        "warm_isolated_ms": 1e3 * warm_iso,
                        "warm_ratio": warm_iso / warm_in,
                        "job_inprocess_ms": 1e3 * job_inproc,
                        "job_isolated_ms": 1e3 * job_isolated,
                        "job_ratio": job_isolated / job_inproc,
                    }
                )
                r = rows[-1]
                print(
                    f"{name:<10} d={d:<4} n={n:<6} warm {r['warm_inprocess_ms']:8.2f} -> "
                    f"{r['warm_isolated_ms']:8.2f} ms (x{r['warm_ratio']:.2f})   per job "
                    f"{r['job_inprocess_ms']:8.2f} -> {r['job_isolated_ms']:8.2f} ms (x{r['job_ratio']:.2f})",
                    flush=True,
                )
    pool.close()
    out = {
        "load": os.getloadavg(),
        "worker_start_s": worker_start,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(
        f"worker start (fork + limits + onnxruntime import + first load): {worker_start:.2f} s; load {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
