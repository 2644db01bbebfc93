"""What the own-loss guarantee (solver option ``guarantee``) costs and gains, against the same fit
without it: on the policy sweep's honest federations (its quick grid), the paper's synthetic
experiment and Adult, at their first seeds.

``python benchmarks/bench_guarantee.py [--slack S ...] [--json FILE]``

Per fit: the guarantee's outcome (holds at the min-max point / constrained / infeasible), the
worst domain's test accuracy and max_k L_k (the solver's worst domain loss) with and without it,
the largest excess L_k - own_k - slack left, the largest harm the sites measured (combined - own)
and the extra rounds each site answered (the own-loss request is one more).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np


def _fit(sites, seed, options, slack):
    from msa_fed import fit_dmsa

    opts = dict(options)
    if slack is not None:
        opts["solver_options"] = {"guarantee": slack}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit_dmsa(sites, "classification", random_state=seed, **opts)


def _row(name, sites, tests, seed, options, slacks):
    base = _fit(sites, seed, options, None)
    rows = []
    for slack in slacks:
        model = _fit(sites, seed, options, slack)
        g = model.guarantee or {}

        def worst(m):
            return min(float(np.mean(m.predict(X) == y)) for X, y in tests.values())

        rows.append(
            {
                "problem": name,
                "slack": slack,
                "status": g.get("status"),
                "worst_acc": [worst(base), worst(model)],
                "max_loss": [float(np.max(base.domain_losses)), float(np.max(model.domain_losses))],
                "max_excess": [float(np.max(base.domain_losses - np.asarray(g["own"]) - slack)), max(g["excess"])],
                "max_harm": [max(base.harm.values()), max(model.harm.values())],
                "rounds": [base.info["solver"]["n_evaluations"], model.info["solver"]["n_evaluations"] + 1],
                "suspects": list(model.suspects),
            }
        )
    return rows


def problems():
    from msa_fed.experiments import adult, policy_sweep, synthetic

    q = policy_sweep.QUICK
    for p in q["ps"]:
        for n in q["sizes"]:
            for layout in q["layouts"]:
                sites, tests = policy_sweep.federation(p, n, policy_sweep.LAYOUTS[layout], 0)
                yield f"sweep p={p} n={n} {layout}", sites, tests, 0, {}
    for seed in (0, 1):
        rng = np.random.default_rng([seed, 0])
        from sklearn.linear_model import LogisticRegression

        predictors = [LogisticRegression().fit(*synthetic.sample(d, synthetic.N_TRAIN, rng)) for d in synthetic.DOMAINS]
        tests = {d: synthetic.sample(d, 5000, rng) for d in synthetic.DOMAINS}
        sites = synthetic.adaptation_sites(seed, 200, predictors)
        yield f"synthetic n=200 seed={seed}", sites, tests, seed, synthetic.DMSA_OPTIONS
    data = adult.load_adult()
    predictors = adult.train_predictors(data)
    tests = {d: (data.X_test[m], data.y_test[m]) for d, m in (("Doc", data.doc_test), ("NDoc", ~data.doc_test))}
    for seed in (0, 1):
        yield f"adult seed={seed}", adult.adaptation_sites(data, predictors, seed), tests, seed, adult.DMSA_OPTIONS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slack", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for name, sites, tests, seed, options in problems():
        for r in _row(name, sites, tests, seed, options, args.slack):
            rows.append(r)
            print(
                f"{r['problem']:<32} slack={r['slack']:<4g} {r['status']:<26} worst acc {r['worst_acc'][0]:.4f} -> "
                f"{r['worst_acc'][1]:.4f}  max L {r['max_loss'][0]:.4f} -> {r['max_loss'][1]:.4f}  max excess "
                f"{r['max_excess'][0]:+.4f} -> {r['max_excess'][1]:+.4f}  max harm {r['max_harm'][0]:.4f} -> "
                f"{r['max_harm'][1]:.4f}  rounds {r['rounds'][0]} -> {r['rounds'][1]}  suspects {r['suspects']}",
                flush=True,
            )
    print(f"{len(rows)} comparisons in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
