"""Honest federations under the default site policy: nothing refused, accuracy as without it.

``python -m msa_fed.experiments.policy_sweep [--quick] [--json FILE]``

A grid of honest synthetic federations: p sites (domains with Gaussian inputs in 2-D around
centres on a circle: radius 4, "separated", or 1, "overlapping"), each with its own linear
labelling rule and a logistic predictor trained on 500 points of its own, n labelled points per
site and a disjoint published sample of n points.  Each federation is fitted twice with the
default DMSA pipeline: under the default :class:`~msa_fed.privacy.policy.SitePolicy`, and
under a policy without limits (no share bound, no budgets: the plain fit).  Reported per fit:
refused or not (and by which rule), and the accuracy on the worst domain of each fit
(2000 test points per domain); the claim checked is "no refusal, and the worst-domain accuracy
within 0.02 of the plain fit's".
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

PS = (2, 3, 4, 6, 8)
SIZES = (30, 50, 100, 300, 1000)
LAYOUTS = {"separated": 4.0, "overlapping": 1.0}
SEEDS = (0, 1)
QUICK = dict(ps=(2, 4), sizes=(30, 100), layouts=("separated", "overlapping"), seeds=(0,))
N_TEST = 2000
TOLERANCE = 0.02


def no_limits():
    """A policy that never clips nor refuses (the plain fit)."""
    from msa_fed.privacy.policy import SitePolicy

    big = 10**9
    return SitePolicy(
        max_point_share=1.0,
        min_effective_points=1e-9,
        max_sites=1000,
        domain_models_per_job=big,
        dc_evaluations_per_job=big,
        domain_models_per_day=big,
        dc_evaluations_per_day=big,
    )


def federation(p: int, n: int, radius: float, seed: int):
    """(sites, tests): p SiteData with disjoint labelled and published samples; tests
    {name: (X, y)} of N_TEST points per domain."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed import SiteData

    rng = np.random.default_rng([seed, p, n, int(radius * 10)])
    sites, tests = [], {}
    for k in range(p):
        c = radius * np.array([np.cos(2 * np.pi * k / p), np.sin(2 * np.pi * k / p)])
        rule = rng.normal(size=2)

        def draw(m, c=c, rule=rule):
            X = rng.normal(c, 1.0, size=(m, 2))
            y = ((X - c) @ rule + 0.3 * rng.normal(size=m) > 0).astype(int)
            return X, y

        h = LogisticRegression().fit(*draw(500))
        X, y = draw(n)
        Xu, _ = draw(n)
        sites.append(SiteData(f"d{k}", X, y, Xu, h))
        tests[f"d{k}"] = draw(N_TEST)
    return sites, tests


def fit_once(sites, tests, policy, seed: int) -> dict:
    from dataclasses import replace as dc_replace

    from msa_fed import fit_dmsa
    from msa_fed.errors import PrivacyError

    job = [dc_replace(s, policy=policy) for s in sites]
    try:
        model = fit_dmsa(job, "classification", random_state=seed)
    except PrivacyError as exc:
        return {"refused": exc.rule}
    acc = {d: float(np.mean(model.predict(X) == y)) for d, (X, y) in tests.items()}
    return {"refused": None, "worst": min(acc.values()), "accuracy": acc}


def run(ps=PS, sizes=SIZES, layouts=tuple(LAYOUTS), seeds=SEEDS, log=print) -> dict:
    """Every fit of the grid; returns {"fits": [...], "summary": {...}}."""
    from msa_fed.privacy.policy import SitePolicy

    fits = []
    t0 = time.perf_counter()
    for p, n, layout, seed in itertools.product(ps, sizes, layouts, seeds):
        sites, tests = federation(p, n, LAYOUTS[layout], seed)
        default = fit_once(sites, tests, SitePolicy(), seed)
        plain = fit_once(sites, tests, no_limits(), seed)
        row = {"p": p, "n": n, "layout": layout, "seed": seed, "default": default, "plain": plain}
        if default["refused"] is None and plain["refused"] is None:
            row["worst_drop"] = plain["worst"] - default["worst"]
        fits.append(row)
        log(
            f"p={p} n={n:<5} {layout:<11} seed={seed}: "
            + (
                f"refused ({default['refused']})"
                if default["refused"]
                else f"worst {default['worst']:.4f} (plain {plain['worst']:.4f})"
            )
        )
    drops = [f["worst_drop"] for f in fits if "worst_drop" in f]
    summary = {
        "fits": len(fits),
        "refused": sum(1 for f in fits if f["default"]["refused"]),
        "max_worst_drop": max(drops) if drops else None,
        "mean_worst_drop": float(np.mean(drops)) if drops else None,
        "within_tolerance": sum(1 for d in drops if d <= TOLERANCE),
        "seconds": time.perf_counter() - t0,
    }
    return {"fits": fits, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (8 fits)")
    ap.add_argument("--json", help="write every fit and the summary as JSON")
    args = ap.parse_args(argv)
    out = run(**QUICK) if args.quick else run()
    s = out["summary"]
    print(
        f"{s['fits']} fits, {s['refused']} refused under the default policy; worst-domain accuracy "
        f"drop against the plain fit: max {s['max_worst_drop']:.4f}, mean {s['mean_worst_drop']:.4f} "
        f"({s['within_tolerance']} within {TOLERANCE}); {s['seconds']:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if s["refused"] == 0 and s["within_tolerance"] == s["fits"] else 1


if __name__ == "__main__":  # pragma: no cover - a script
    raise SystemExit(main())
