"""The verification's intercept solve (msa_fed/privacy/verify.py): passes over the published points
and time, this tree against the former solve, over p = 4 to 64.

    .venv/bin/python benchmarks/bench_verify_newton.py                      # p = 4 8 16 32 64
    .venv/bin/python benchmarks/bench_verify_newton.py --p 32 --repeats 5
    .venv/bin/python benchmarks/bench_verify_newton.py --baseline-rev 4ca008a   # the former solve's commit

Each site re-solves the intercepts b_hat(W) of the received Maxent model (Newton on p numbers,
one pass over the published points per trial point) once per model.  The problem is the one
bench_solver.py's fit builds for n = 1e5 (p sites, 2000 published points each, d = 5, the
standard map), with the coordinator's model: the float32 L-BFGS fit and its float64 polish.
Two starts: the received intercepts (what a site does) and a cold start (b = 0).  For each p:
passes and steps of both solves, the median wall time of ``--repeats`` interleaved runs, the
largest difference of the two solutions and both gradients.  The former solve is
``intercepts_and_softmax`` of ``msa_fed/privacy/verify.py`` at ``--baseline-rev`` (read with
``git show``, loaded as a module of its own); its passes are counted by wrapping its
``_value_softmax``.  Writes ``benchmarks/results/bench_verify_newton.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def former_module(rev: str):
    """msa_fed/privacy/verify.py at ``rev``, loaded under another name."""
    text = subprocess.run(
        ["git", "show", f"{rev}:msa_fed/privacy/verify.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "former_verify.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("former_verify", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["former_verify"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def problem(p: int, m: int = 2000, d: int = 5, seed: int = 0):
    """(A, s, target, received b) of the coordinator's polished model on p published samples."""
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle, train_domain_classifier
    from msa_fed.core.features import make_feature_map

    rng = np.random.default_rng(seed)
    means = rng.normal(size=(p, d))
    U = [rng.normal(size=(m, d)) + means[k] for k in range(p)]
    cfg = ClassifierConfig()
    model = train_domain_classifier(U, make_feature_map("standard", 0), cfg)
    Phis = [np.asarray(model.feature_map.transform(X), dtype=np.float64) for X in U]
    oracle = sum_oracle(balanced_shards(Phis, replace(cfg, dtype="float64")))
    model.theta_, _ = polish_maxent(oracle, model.theta_, model.n_features_, p, cfg.mu, cfg.max_iter)
    D = model.n_features_
    Wb = model.theta_.reshape(p, D + 1)
    A = np.vstack(Phis) @ Wb[:, :D].T
    s = np.concatenate([np.full(len(P), 1.0 / (p * len(P))) for P in Phis])
    return A, s, np.full(p, 1.0 / p), Wb[:, D].copy()


def run_former(mod, A, s, target, b0):
    real = mod._value_softmax
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return real(*args)

    mod._value_softmax = counted
    try:
        t = time.perf_counter()
        b, P = mod.intercepts_and_softmax(A, s, target, b0)
        return b, P, time.perf_counter() - t, {"passes": calls[0]}
    finally:
        mod._value_softmax = real


def run_new(A, s, target, b0):
    from msa_fed.privacy.verify import intercepts_and_softmax

    counts: dict = {}
    t = time.perf_counter()
    b, P = intercepts_and_softmax(A, s, target, b0, counts=counts)
    return b, P, time.perf_counter() - t, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-rev", default="4ca008a", help="the commit whose verify.py is the former solve")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_verify_newton.json"))
    args = ap.parse_args()
    from msa_fed.core.threads import one_blas_thread

    former = former_module(args.baseline_rev)
    rows = []
    for p in args.p:
        t0 = time.perf_counter()
        A, s, target, b_recv = problem(p)
        setup = time.perf_counter() - t0
        for start, b0 in (("received", b_recv), ("cold", np.zeros(p))):
            times: dict = {"former": [], "new": []}
            with one_blas_thread():  # as the site runs it (verify.maxent_published_part)
                for _ in range(args.repeats):  # interleaved: both see the same load
                    bf, Pf, tf, cf = run_former(former, A, s, target, b0)
                    bn, Pn, tn, cn = run_new(A, s, target, b0)
                    times["former"].append(tf)
                    times["new"].append(tn)
            row = {
                "p": p,
                "points": int(A.shape[0]),
                "start": start,
                "former_passes": cf["passes"],
                "new_passes": cn["passes"],
                "new_steps": cn["steps"],
                "former_s": float(np.median(times["former"])),
                "new_s": float(np.median(times["new"])),
                "max_b_difference": float(np.abs(bf - bn).max()),
                "former_gradient": float(np.abs(s @ Pf - target).max()),
                "new_gradient": float(np.abs(s @ Pn - target).max()),
                "received_gradient": float(np.abs(s @ run_new(A, s, target, b_recv)[1] - target).max())
                if start == "cold"
                else None,
                "setup_s": setup,
            }
            rows.append(row)
            print(
                f"p={p:3d} {A.shape[0]:7d} points, {start:8s} start: passes {row['former_passes']:3d} -> "
                f"{row['new_passes']:2d}, {row['former_s'] * 1e3:8.1f} ms -> {row['new_s'] * 1e3:7.1f} ms "
                f"(x{row['former_s'] / row['new_s']:.1f}); |b - b_former| {row['max_b_difference']:.1e}, "
                f"gradient {row['former_gradient']:.1e} / {row['new_gradient']:.1e}",
                flush=True,
            )
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "load": load, "baseline_rev": args.baseline_rev}, indent=1))


if __name__ == "__main__":
    main()
