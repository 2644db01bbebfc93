"""``msa-fed experiment {synthetic,adult,sentiment,digits}``: the paper's experiments.

Every experiment goes through the public API (``fit_dmsa`` / ``fit_gmsa``), prints
a table with our numbers and the paper's side by side, and optionally writes JSON
``{"<method>": {"<target>": {"mean": float, "std": float}}}`` and PNG figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from msa_fed.experiments.report import check_schema, format_table, write_json


@dataclass(frozen=True)
class Experiment:
    module: str
    title: str
    default_seeds: int
    quick_seeds: int
    percent: bool  # accuracy (printed in %) or MSE
    decimals: int


EXPERIMENTS = {
    "synthetic": Experiment(
        "synthetic", "Synthetic 1-D domains (paper Figure 3), accuracy at the largest adaptation size", 10, 2, True, 2
    ),
    "adult": Experiment("adult", "UCI Adult, Doc vs NDoc (paper Table 3)", 100, 3, True, 1),
    "sentiment": Experiment("sentiment", "Sentiment regression, test MSE (paper Table 1)", 10, 1, False, 2),
    "digits": Experiment("digits", "Digits (paper Table 2; optdigits in place of SVHN)", 3, 1, True, 1),
    "privacy": Experiment(
        "privacy", "DMSA with differential privacy at the sites, against epsilon per job", 10, 1, False, 3
    ),
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--seeds must be a positive integer; got {value}")
    return value


def register(subparsers) -> None:
    """Add ``experiment <name>`` to the ``msa-fed`` command line."""
    parser = subparsers.add_parser(
        "experiment",
        help="run one of the paper's experiments",
        description="Run one of the paper's experiments through fit_dmsa / fit_gmsa and print our "
        "numbers next to the paper's (docs/RESULTS.md records the full runs).",
    )
    names = parser.add_subparsers(dest="experiment", metavar="NAME", required=True)
    for name, exp in EXPERIMENTS.items():
        p = names.add_parser(name, help=exp.title)
        p.add_argument(
            "--seeds",
            type=_positive_int,
            default=None,
            help=f"number of runs (default {exp.default_seeds}; {exp.quick_seeds} with --quick)",
        )
        p.add_argument(
            "--runtime",
            choices=("local", "ray"),
            default="local",
            help="where fit_dmsa / fit_gmsa run (default: local)",
        )
        p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
        p.add_argument("--plot", metavar="DIR", default=None, help="write PNG figures into DIR")
        p.add_argument("--quick", action="store_true", help="few seeds on a subsample (CI smoke run)")
        p.set_defaults(func=run_experiment)


def run_experiment(args) -> int:
    import importlib

    exp = EXPERIMENTS[args.experiment]
    module = importlib.import_module(f"msa_fed.experiments.{exp.module}")
    seeds = args.seeds or (exp.quick_seeds if args.quick else exp.default_seeds)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = module.run(seeds, runtime=args.runtime, quick=args.quick, plot_dir=args.plot, log=log)
    elapsed = time.perf_counter() - start
    check_schema(results)
    table = {k: v for k, v in results.items() if k != "by_size"}
    notes = [n for n in (getattr(module, "NOTE", ""),) if n]
    notes.append(f"{seeds} seed(s), runtime={args.runtime}{', quick' if args.quick else ''}, {elapsed:.0f} s")
    print(
        format_table(
            exp.title,
            table,
            module.TARGETS,
            paper=module.PAPER,
            percent=exp.percent,
            decimals=exp.decimals,
            notes=notes,
        )
    )
    if "by_size" in results:
        print()
        print(_by_size_table(results["by_size"], exp, getattr(module, "BY_SIZE_METHODS", None)))
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    if args.plot:
        has_figures = hasattr(module, "plot") or hasattr(module, "plot_curve")
        print(f"figures in {args.plot}" if has_figures else "--plot: this experiment has no figures")
    return 0


def _by_size_table(by_size: dict, exp: Experiment, methods=None) -> str:
    """DMSA vs GMSA (or the module's ``BY_SIZE_METHODS``) against the adaptation sample size."""
    sizes = sorted(by_size, key=int)
    first = by_size[sizes[0]]
    methods = [m for m in (methods or ("GMSA", "DMSA", "DMSA-threshold")) if m in first]
    targets = list(first[methods[-1]])
    rows = {f"{m} n={n}": by_size[n][m] for n in sizes for m in methods}
    return format_table(
        "By adaptation sample size per domain", rows, targets, percent=exp.percent, decimals=exp.decimals
    )
