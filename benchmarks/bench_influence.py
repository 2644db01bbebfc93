"""The influence report's cost against the same fit without it, p = 4, 8, 16 (local runtime).

``python benchmarks/bench_influence.py [--ps 4 8 16] [--n 2000] [--repeats 3] [--baseline TREE] [--json FILE]``

Per p: the fit's CPU seconds (this process: the sites run in it) with ``influence=False`` and with
``influence=True``, interleaved, medians over the repeats; and the DC rounds each site answered
(one ``dc_evaluate`` request per site per round) in the solve and in the report.  Reported as
ratios against the fit without the report, measured in the same run.

With ``--baseline TREE`` (another checkout, e.g. the main branch) every repeat runs one process on
this tree and one on TREE (``msa_fed`` imported from there), in turns, each with a warm-up fit and
then, per p, the fit without and with the report; the rows give both trees' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np


def make_sites(p: int, n: int, seed: int = 0):
    """p honest sites on a circle (radius 3), their own logistic predictors."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed import SiteData

    rng = np.random.default_rng([seed, p, n])
    out = []
    for k in range(p):
        c = 3.0 * np.array([np.cos(2 * np.pi * k / p), np.sin(2 * np.pi * k / p)])
        rule = rng.normal(size=2)

        def draw(m, c=c, rule=rule):
            X = rng.normal(c, 1.0, size=(m, 2))
            return X, ((X - c) @ rule + 0.3 * rng.normal(size=m) > 0).astype(int)

        h = LogisticRegression().fit(*draw(500))
        X, y = draw(n)
        Xu, _ = draw(n)
        out.append(SiteData(f"s{k}", X, y, Xu, h))
    return out


def one_fit(p: int, n: int, influence: bool) -> dict:
    from msa_fed import fit_dmsa
    from msa_fed.runtime.local import LocalSites

    sites = make_sites(p, n)
    rounds = {"dc_evaluate": 0}
    real = LocalSites.call_all

    def counting(self, method, msgs):
        if method in rounds:
            rounds[method] += 1
        return real(self, method, msgs)

    LocalSites.call_all = counting
    try:
        cpu, t = time.process_time(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = fit_dmsa(sites, "classification", influence=influence)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - t
    finally:
        LocalSites.call_all = real
    table = model.info.get("influence") or {}
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "rounds": rounds["dc_evaluate"],
        "solve_rounds": model.info["solver"]["n_evaluations"],
        "report_evaluations": table.get("evaluations"),
    }


def one_process(root: str, ps: list[int], n: int) -> dict:
    """One repeat in a fresh process with ``msa_fed`` from ``root``: a warm-up fit, then per p the
    fit without and with the report (the rows of :func:`one_fit`)."""
    env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", *map(str, ps), "--n", str(n)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def summarise(p: int, off: list[dict], on: list[dict]) -> dict:
    med = {
        k: {f: float(np.median([r[f] for r in rows])) for f in ("cpu_s", "wall_s", "rounds")}
        for k, rows in (("off", off), ("on", on))
    }
    return {
        "p": p,
        "cpu_off_s": med["off"]["cpu_s"],
        "cpu_on_s": med["on"]["cpu_s"],
        "cpu_ratio": med["on"]["cpu_s"] / med["off"]["cpu_s"],
        "rounds_off": med["off"]["rounds"],
        "rounds_on": med["on"]["rounds"],
        "report_rounds_over_solve": (med["on"]["rounds"] - med["off"]["rounds"]) / max(med["off"]["rounds"], 1),
        "report_evaluations": on[-1]["report_evaluations"],
    }


def line(row: dict, label: str = "") -> str:
    return (
        f"{label}p={row['p']:<3} CPU {row['cpu_off_s']:.2f} s without the report, {row['cpu_on_s']:.2f} s with it "
        f"({row['cpu_ratio']:.2f}x); rounds {row['rounds_off']:.0f} -> {row['rounds_on']:.0f} (the report's "
        f"{row['report_rounds_over_solve']:.2f}x the solve's; {row['report_evaluations']} z evaluated)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout: its fits in turns with this tree's")
    ap.add_argument("--one", type=int, nargs="*", help=argparse.SUPPRESS)  # a repeat, in its own process
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.one is not None:
        one_fit(4, 500, True)  # warm-up: imports, first calls
        rows = {}
        for p in args.one:
            rows[p] = {"off": one_fit(p, args.n, False), "on": one_fit(p, args.n, True)}
        print(json.dumps(rows))
        return 0
    if args.baseline:
        here = str(Path(__file__).resolve().parents[1])
        runs: dict[str, list[dict]] = {"this tree": [], "baseline": []}
        for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
            runs["this tree"].append(one_process(here, args.ps, args.n))
            runs["baseline"].append(one_process(args.baseline, args.ps, args.n))
        out = {}
        for p in args.ps:
            out[p] = {}
            for label, reps in runs.items():
                row = summarise(p, [r[p]["off"] for r in reps], [r[p]["on"] for r in reps])
                out[p][label] = row
                print(line(row, f"{label:<10} "), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return 0
    one_fit(4, 500, True)  # warm-up: imports, first calls
    out = {}
    for p in args.ps:
        off, on = [], []
        for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
            off.append(one_fit(p, args.n, False))
            on.append(one_fit(p, args.n, True))
        out[p] = row = summarise(p, off, on)
        print(line(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover - a script
    raise SystemExit(main())
