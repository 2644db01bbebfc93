"""Benchmark of GMSA's KDE bandwidth search: msa_fed's brute-force exact KDE against
scikit-learn's GridSearchCV over KernelDensity (what msa_fed used before), same grid, folds
and data; the chosen bandwidths are compared.

    .venv/bin/python benchmarks/bench_kde.py            # ~5 minutes (scikit-learn is the slow part)
    .venv/bin/python benchmarks/bench_kde.py --quick    # small sizes

Prints a table and writes benchmarks/results/bench_kde.json.  Data: sparse count vectors like
the sentiment experiment's (Poisson counts, many zeros) and dense Gaussians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import GridSearchCV, KFold
from sklearn.neighbors import KernelDensity

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from msa_fed.core.density import select_bandwidth  # noqa: E402


def reference_select(X, n_grid=20, cv=5, random_state=0) -> float:
    scale = float(np.mean(np.std(X, axis=0))) or 1.0
    grid = scale * np.logspace(-3.0, 0.5, n_grid)
    search = GridSearchCV(
        KernelDensity(kernel="gaussian"),
        {"bandwidth": grid},
        cv=KFold(cv, shuffle=True, random_state=random_state),
        n_jobs=1,
    )
    return float(search.fit(X).best_params_["bandwidth"])


def data(kind: str, n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "counts":
        return rng.poisson(0.05, size=(n, d)).astype(np.float64)
    return rng.normal(size=(n, d)) + (rng.random(n) < 0.3)[:, None] * 2.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_kde.json"))
    args = ap.parse_args(argv)
    cases = (
        [("gauss", 500, 5), ("gauss", 1000, 50), ("counts", 500, 2192)]
        if args.quick
        else [
            ("gauss", 1000, 5),
            ("gauss", 2000, 50),
            ("counts", 1000, 500),
            ("counts", 1000, 2192),
            ("counts", 2000, 2192),
        ]
    )
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for kind, n, d in cases:
        X = data(kind, n, d)
        t = time.perf_counter()
        ours = select_bandwidth(X)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        ref = reference_select(X)
        t_ref = time.perf_counter() - t
        rows.append(
            {
                "data": kind,
                "n": n,
                "d": d,
                "msa_fed_s": t_ours,
                "sklearn_s": t_ref,
                "speedup": t_ref / t_ours,
                "bandwidth_msa_fed": ours,
                "bandwidth_sklearn": ref,
                "same_bandwidth": bool(np.isclose(ours, ref, rtol=1e-12)),
            }
        )
        print(
            f"  {kind} n={n} d={d}: msa_fed {t_ours:.2f} s, scikit-learn {t_ref:.2f} s ({t_ref / t_ours:.0f}x); "
            f"bandwidth {ours:.4g} vs {ref:.4g}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "quick": args.quick, "rows": rows},
            indent=2,
        )
    )
    print("\n| data | n | d | msa_fed (s) | scikit-learn (s) | speed-up | same bandwidth |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['data']} | {r['n']} | {r['d']} | {r['msa_fed_s']:.2f} | {r['sklearn_s']:.2f} | "
            f"{r['speedup']:.0f}x | {'yes' if r['same_bandwidth'] else 'no'} |"
        )
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
