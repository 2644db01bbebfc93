"""Benchmark of the Maxent domain classifier on CPU and on a CUDA GPU (``ClassifierConfig.device``).

    python benchmarks/bench_classifier_device.py            # needs numpy, scipy, scikit-learn, torch
    python benchmarks/bench_classifier_device.py --quick

Trains ``train_domain_classifier`` (the in-process trainer that the sites' shards also run)
on the same synthetic domains with device="cpu" and, when torch sees a GPU, device="cuda":
L-BFGS (float32 products, float64 sums) and mini-batch SGD, and reports the time, the final
objective, and the largest difference between the CPU and GPU models' probabilities on a
probe set.  Prints a table; writes JSON (after every case, so a cut-off run keeps its rows).
Only ``msa_fed.core`` is imported (no Ray, no gRPC): ``PYTHONPATH=.`` is enough.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from msa_fed.core import domain_classifier as dc  # noqa: E402

from msa_fed.core.domain_classifier import (  # noqa: E402
    ClassifierConfig,
    DomainClassifier,
    balanced_shards,  # noqa: E402
    fit_maxent,
    sum_minibatch_oracle,
    sum_oracle,
)
from msa_fed.core.features import StandardFeatures  # noqa: E402


GPU_BLOCK = dc.GPU_BLOCK_ELEMENTS


def domains(n_total: int, d: int, p: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    means = rng.normal(scale=0.3, size=(p, d))
    return [rng.normal(size=(n_total // p, d)).astype(np.float64) + means[k] for k in range(p)]


def sync(config):
    if config.device == "cuda":
        torch.cuda.synchronize()


def run_case(samples, config: ClassifierConfig):
    """(model, prep seconds, fit seconds, oracle evaluations): prep = the feature map and the
    shards (on the device); fit = the optimiser with its gradient oracle, as the trainer runs it."""
    p = len(samples)
    sync(config)
    t = time.perf_counter()
    fmap = StandardFeatures().fit(np.vstack(samples))
    Phis = [fmap.transform(X) for X in samples]
    shards = balanced_shards(Phis, config)
    sync(config)
    prep = time.perf_counter() - t
    oracle, calls = sum_oracle(shards), [0]

    def counted(theta):
        calls[0] += 1
        return oracle(theta)

    t = time.perf_counter()
    theta, info = fit_maxent(
        counted,
        Phis[0].shape[1],
        p,
        config,
        minibatch_oracle=sum_minibatch_oracle(shards, config.batch_size),
        n_points=max(len(X) for X in samples),
    )
    sync(config)
    fit = time.perf_counter() - t
    return DomainClassifier(fmap, theta, p, config.mu, info), prep, fit, calls[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_classifier_device.json"))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    devices = ["cpu"] + (["cuda"] if cuda else [])
    p, d = 8, 100
    sizes = [20_000] if args.quick else [100_000, 1_000_000, 4_000_000]
    configs = [
        ("lbfgs", ClassifierConfig(mu=1e-3)),
        ("sgd", ClassifierConfig(mu=1e-3, optimizer="sgd", epochs=1 if args.quick else 3, batch_size=1024, lr=0.05)),
    ]
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    print(json.dumps(env), flush=True)
    rows = []
    for n in sizes:
        samples = domains(n, d, p)
        probe = np.vstack([X[:2000] for X in samples])
        for opt, base in configs:
            if opt == "sgd" and n > 1_000_000:
                continue  # SGD's per-step cost does not depend on n
            models = {}
            variants = devices + (["cuda-cpu-blocks"] if cuda and opt == "lbfgs" else [])
            for dev in variants:
                # "cuda-cpu-blocks": the GPU with the CPU's row-block size (what it used before)
                dc.GPU_BLOCK_ELEMENTS = dc.BLOCK_ELEMENTS if dev == "cuda-cpu-blocks" else GPU_BLOCK
                cfg = ClassifierConfig(**{**base.__dict__, "device": dev.split("-")[0]})
                row = {"n": n, "d": d, "p": p, "optimizer": opt, "device": dev}
                try:
                    run_case([X[:1000] for X in samples], cfg)  # warm-up (CUDA context, kernels)
                    model, prep, fit, evals = run_case(samples, cfg)
                    models[dev] = model
                    info = model.info_
                    row.update(
                        seconds=fit,
                        prep_seconds=prep,
                        evaluations=evals,
                        ms_per_evaluation=1e3 * fit / evals if evals and opt == "lbfgs" else None,
                        objective=info.get("objective"),
                        n_iter=info.get("n_iter"),
                    )
                except Exception as exc:  # noqa: BLE001 - recorded, the other cases go on
                    row.update(error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
                print(
                    f"  n={n} {opt} {dev}: "
                    + (
                        f"fit {row['seconds']:.2f} s (prep {row['prep_seconds']:.2f} s), "
                        f"objective {row.get('objective')}"
                        if "seconds" in row
                        else row["error"]
                    ),
                    flush=True,
                )
            dc.GPU_BLOCK_ELEMENTS = GPU_BLOCK
            case_rows = rows[-len(variants) :]
            cpu_row = next((r for r in case_rows if r["device"] == "cpu" and "seconds" in r), None)
            for r in case_rows:
                if r["device"] != "cpu" and r["device"] in models and cpu_row is not None:
                    diff = float(
                        np.abs(models["cpu"].predict_proba(probe) - models[r["device"]].predict_proba(probe)).max()
                    )
                    r.update(max_abs_dproba_vs_cpu=diff, speedup_vs_cpu=cpu_row["seconds"] / r["seconds"])
                    print(f"    {r['device']} vs cpu: {r['speedup_vs_cpu']:.1f}x, max |dQ| {diff:.1e}", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"environment": env, "quick": args.quick, "rows": rows}, indent=2))
    print(
        "\n| n | optimizer | device | fit (s) | ms per full-data evaluation | prep (s) | objective | iterations "
        "| fit vs CPU | max abs dQ vs CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['n']} | {r['optimizer']} | {r['device']} | error: {r['error'][:80]} | | | | | | |")
            continue
        per_eval = f"{r['ms_per_evaluation']:.1f}" if r.get("ms_per_evaluation") else "-"
        print(
            f"| {r['n']} | {r['optimizer']} | {r['device']} | {r['seconds']:.2f} | {per_eval} | {r['prep_seconds']:.2f} | "
            f"{r.get('objective'):.9f} | {r.get('n_iter')} | {r.get('speedup_vs_cpu', 1.0):.1f}x | "
            f"{r.get('max_abs_dproba_vs_cpu', 0.0):.1e} |"
        )
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
