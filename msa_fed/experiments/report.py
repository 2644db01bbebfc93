"""Result aggregation, the side-by-side table printer and the JSON writer.

Results are nested dictionaries ``{method: {target: {"mean": float, "std": float}}}``;
that is exactly the JSON an experiment writes with ``--json``.  Accuracies are
stored as fractions in [0, 1] and printed as percentages like the paper's tables;
mean squared errors are stored and printed as they are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

Results = dict  # {method: {target: {"mean": float, "std": float}}}


def summarise(runs: Sequence[Mapping[str, Mapping[str, float]]]) -> Results:
    """Mean and (population) std over runs of ``{method: {target: value}}`` dictionaries.

    Every run must hold the same methods and targets; the order of the first run is kept.
    """
    if not runs:
        raise ValueError("runs must hold at least one run; got 0")
    out: Results = {}
    for method, targets in runs[0].items():
        out[method] = {}
        for target in targets:
            vals = np.array([float(r[method][target]) for r in runs])
            out[method][target] = {"mean": float(vals.mean()), "std": float(vals.std())}
    return out


def uniform_mixtures(per_domain: Mapping[str, float], mixtures: Mapping[str, Sequence[str]]) -> dict:
    """Value on each uniform mixture of domains: the mean of the per-domain values.

    For accuracy or a mean loss, the value on the uniform mixture D = (1/|S|) sum_{k in S} D_k
    is exactly the average of the per-domain values.
    """
    return {name: float(np.mean([per_domain[d] for d in doms])) for name, doms in mixtures.items()}


def _cell(stat, percent: bool, decimals: int) -> str:
    if stat is None:
        return "-"
    if isinstance(stat, Mapping):
        mean, std = stat["mean"], stat.get("std")
    elif isinstance(stat, (tuple, list)):
        mean, std = stat
    else:
        mean, std = stat, None
    scale = 100.0 if percent else 1.0
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    text = f"{mean * scale:.{decimals}f}"
    if std is not None:
        text += f"±{std * scale:.{decimals}f}"
    return text


def format_table(
    title: str,
    results: Results,
    targets: Sequence[str],
    *,
    paper: Mapping | None = None,
    percent: bool = True,
    decimals: int = 1,
    notes: Sequence[str] = (),
) -> str:
    """A plain-text table: one row per method with our mean±std, and under it the paper's row.

    ``paper`` maps method -> target -> value (a float, a (mean, std) pair or None),
    in the same units as ``results`` (fractions for accuracy).
    """
    header = ["method"] + list(targets)
    rows = []
    for method, by_target in results.items():
        rows.append([method] + [_cell(by_target.get(t), percent, decimals) for t in targets])
        if paper and method in paper:
            rows.append(["  paper"] + [_cell(paper[method].get(t), percent, decimals) for t in targets])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)

    def fmt(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [title, line, fmt(header), line] + [fmt(r) for r in rows] + [line]
    unit = "accuracy in %" if percent else "mean squared error"
    out.append(f"({unit}; mean±std over runs; 'paper' rows are the published numbers)")
    out.extend(notes)
    return "\n".join(out)


def write_json(path: str | Path, results: Mapping) -> Path:
    """Write results as indented JSON (keys in insertion order); returns the path."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def check_schema(results: Mapping, extra_sections: Sequence[str] = ("by_size",)) -> None:
    """Raise ValueError unless ``results`` is ``{method: {target: {"mean": float, "std": float}}}``.

    Sections named in ``extra_sections`` (e.g. ``by_size``) map a key to a nested results
    dictionary of the same schema and are checked recursively.
    """
    for method, targets in results.items():
        if method in extra_sections:
            for key, sub in targets.items():
                check_schema(sub, ())
            continue
        if not isinstance(targets, Mapping) or not targets:
            raise ValueError(f"results[{method!r}] must be a non-empty mapping of targets")
        for target, stat in targets.items():
            if set(stat) != {"mean", "std"}:
                raise ValueError(f"results[{method!r}][{target!r}] must have keys mean and std; got {sorted(stat)}")
            for k in ("mean", "std"):
                if not isinstance(stat[k], float) or not math.isfinite(stat[k]):
                    raise ValueError(f"results[{method!r}][{target!r}][{k!r}] must be a finite float; got {stat[k]!r}")
