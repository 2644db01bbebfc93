"""The site policy's overhead on a DC round (p = 8 sites, in process).

One DC round = ``dc_evaluate`` (what = L, dL) at each of the 8 sites.  Baseline: the same sums
computed by each site's point set directly (what the site did before it enforced a policy:
the min_points test and ``PointSet.evaluate``).  Policy: ``SiteWorker.dc_evaluate`` with the
default policy (in-memory ledger and audit log), and with a ledger file and an audit log file
on disk.  Median of interleaved repeats, in one run; n labelled points per site is varied
(50: the round is nearly all overhead; 12 500: the bench_runtime solve size).

    python benchmarks/bench_privacy.py [--rounds 200] [--json benchmarks/results/bench_privacy.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def make_sites(p: int, n: int, policy_kw: dict, seed: int = 0):
    from msa_fed.core.features import StandardFeatures, feature_map_state
    from msa_fed.privacy.policy import SitePolicy
    from msa_fed.runtime import messages as m
    from msa_fed.runtime.site import SiteWorker
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(seed)
    d = 4
    data = []
    for k in range(p):
        X = rng.normal(size=(n, d)) + np.eye(d)[k % d] * 1.5
        y = (X[:, 0] + rng.normal(size=n) > 0).astype(int)
        data.append((X, y))
    preds = []
    for k in range(p):
        X, y = data[k]
        preds.append(LogisticRegression().fit(X, y))
    fmap = StandardFeatures().fit(np.vstack([X for X, _ in data]))
    theta = rng.normal(scale=0.3, size=p * (d + 1))
    spec = m.DomainModelSpec(kind="maxent", n_sources=p, feature_map=feature_map_state(fmap), theta=theta)
    workers = []
    for k, (X, y) in enumerate(data):
        pol = SitePolicy(**{kk: (v.format(k=k) if isinstance(v, str) else v) for kk, v in policy_kw.items()})
        workers.append(SiteWorker(f"s{k}", k, X, y, X, predictors=preds, task="classification", loss="cross_entropy",
                                  classes=np.array([0, 1]), policy=pol))
    parts = [w.set_domain_model(spec) for w in workers]
    qhat = np.sum([r.sums for r in parts], axis=0)
    for w in workers:
        w.set_qhat(m.QhatBroadcast(qhat=qhat, eta=0.01))
    return workers


def main(argv=None):
    from msa_fed.runtime import messages as m

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--sizes", default="50,1000,12500")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    p = 8
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(1)
    zs = rng.dirichlet(np.ones(p), size=args.rounds)
    out = {}
    for n in (int(s) for s in args.sizes.split(",")):
        variants = {
            "default policy (memory ledger + log)": make_sites(p, n, {"dc_evaluations_per_job": 10 ** 9,
                                                                     "dc_evaluations_per_day": 10 ** 9}),
            "ledger + audit log files": make_sites(p, n, {"dc_evaluations_per_job": 10 ** 9,
                                                          "dc_evaluations_per_day": 10 ** 9,
                                                          "ledger": str(tmp / f"l{n}_{{k}}.sqlite"),
                                                          "audit_log": str(tmp / f"a{n}_{{k}}.jsonl")}),
        }
        base_workers = variants["default policy (memory ledger + log)"]

        def baseline(z):
            for w in base_workers:
                w._points.evaluate(z, 0.01, what=("L", "dL"))

        def policy(workers):
            def run(z):
                for w in workers:
                    w.dc_evaluate(m.DCRequest(z=z, eta=0.01, what=("L", "dL")))
            return run

        fns = {"baseline (sums only)": baseline, **{k: policy(v) for k, v in variants.items()}}
        times = {k: [] for k in fns}
        for r in range(args.rounds):
            for k, fn in fns.items():  # interleaved
                t = time.perf_counter()
                fn(zs[r])
                times[k].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        base = med["baseline (sums only)"]
        out[n] = {k: {"median_ms": v * 1e3, "ratio": v / base} for k, v in med.items()}
        for k, v in out[n].items():
            print(f"n={n:>6} per site  {k:<40} {v['median_ms']:8.3f} ms  x{v['ratio']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
