"""Target checks on known truth: EM and BBSE side by side, the predicted loss's coverage and the
support score's false and true alarms (see :mod:`msa_fed.experiments.target`).

    MSA_FED_DATA=../shared/data PYTHONPATH=. .venv/bin/python benchmarks/bench_target.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_target.py --cases synthetic demo

For each case: one fitted model, 10 random mixtures (lambda ~ Dirichlet(1)), 2000 target points
each; prints mean |lambda-hat - lambda|_1 per estimator, how many of the 10 true losses lie in
the predicted interval, the fraction of in-support target points flagged at alpha = 0.01, and
the fraction of a left-out domain's points flagged.  ``--independent``: each draw fits its own
model (seed + i), so that the coverage count is a count of independent trials.  Writes
benchmarks/results/bench_target.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from msa_fed.experiments import target as T

CASES = ("synthetic", "demo", "adult", "adult_groups")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--independent",
        action="store_true",
        help="each draw fits its own model from seed + i (independent trials of the interval's coverage)",
    )
    args = ap.parse_args()
    out: dict = {}
    for case in args.cases:
        t = time.perf_counter()
        if case == "adult_groups":
            res = {}
            for g in T.ADULT_GROUPS:
                model, X_out, X_in = T.adult_left_out(g, seed=args.seed)
                res[g] = {
                    "left_out_flagged": T.flagged_rate(model, X_out),
                    "in_support_flagged": T.flagged_rate(model, X_in),
                }
                print(
                    f"adult, {g} left out: {100 * res[g]['left_out_flagged']:.1f}% of its test rows flagged "
                    f"({100 * res[g]['in_support_flagged']:.2f}% of the other groups' test rows)",
                    flush=True,
                )
            out[case] = res
            continue
        make = getattr(T, f"{case}_case")
        if args.independent:
            res = T.run_independent(make, draws=args.draws, seed=args.seed)
            res["left_out"] = {}
        else:
            model, samplers, losses, left_out = make(args.seed)
            res = T.run_draws(model, samplers, losses, draws=args.draws, seed=args.seed)
            res["left_out"] = {name: T.flagged_rate(model, X) for name, X in left_out.items()}
        res["seconds"] = time.perf_counter() - t
        out[case + ("_independent" if args.independent else "")] = res
        s = res["summary"]
        for m in ("em", "bbse"):
            print(
                f"{case} {m}: mean L1 {s[m]['mean_l1']:.4f}, loss in interval {s[m]['covered']}/{args.draws} "
                f"({s[m]['covered_with_pool_error']}/{args.draws} counting the pool's error; "
                f"mean width {s[m]['mean_width']:.3f}), "
                f"{s[m]['median_seconds']:.2f} s per estimate (bootstrap included)",
                flush=True,
            )
        print(
            f"{case}: support p-values {s['support_median_seconds']:.2f} s per 2000 points; "
            f"in-support flagged {100 * s['flagged_in_support']:.2f}% (worst draw "
            f"{100 * s['flagged_in_support_max']:.2f}%); left out: {res['left_out']}",
            flush=True,
        )
    path = Path(__file__).parent / "results" / "bench_target.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**previous, **out}, indent=1))  # the cases run now replace theirs
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
