"""``msa-fed model check-target``: what a combined model says about a target population.

    msa-fed model check-target MODEL_DIR --data X.npy [--alpha 0.01] [--json report.json]
    msa-fed model check-target VERSION --registry HOST:PORT --data X.csv ...

prints the target's estimated mixture over the sites, the predicted loss, the fraction of the
points out of every site's support and the most atypical rows, and writes the same as JSON
(:mod:`msa_fed.artifacts.target_check`).  :func:`target_html` is the section the HTML report
(``msa-fed model report --target X.npy``) shows.
"""

from __future__ import annotations

import html
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from msa_fed.errors import ConfigError

#: the largest target file read (a CSV is parsed as text: its size is bounded first)
MAX_BYTES = 1 << 30


def read_target_data(path: str, flag: str = "--data") -> np.ndarray:
    """The 2-D float array of a .npy file (no pickle) or a numeric .csv (an optional header row)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{flag} {path!r}: no such file")
    if p.stat().st_size > MAX_BYTES:
        raise ConfigError(f"{flag} {path!r} is larger than {MAX_BYTES} bytes")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            X = np.load(p, allow_pickle=False)
        elif suffix == ".csv":
            with open(p, encoding="utf-8") as fh:
                first = fh.readline()
            try:
                [float(v) for v in first.split(",")]
                skip = 0
            except ValueError:
                skip = 1  # a header row
            X = np.loadtxt(p, delimiter=",", skiprows=skip, ndmin=2, dtype=np.float64)
        else:
            raise ConfigError(f"{flag} {path!r}: give a .npy or .csv file")
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path!r} cannot be read ({' '.join(str(exc).split())[:200]})") from None
    if X.dtype.kind not in "fiub":
        raise ConfigError(f"{flag} {path!r} must hold numbers; its dtype is {X.dtype}")
    X = X.astype(np.float64)
    if X.ndim == 1:
        X = X[:, None]
    if X.ndim != 2 or X.shape[0] == 0:
        raise ConfigError(f"{flag} {path!r} must hold a non-empty 2-D array (rows, features); its shape is {X.shape}")
    return X


def target_html(report) -> str:
    """The HTML report's section for a :class:`~msa_fed.artifacts.target_check.TargetReport`."""
    d = report.as_dict()
    mix = d["mixture"]
    pct = int(round(100 * mix["level"]))
    rows = ["<tr><th>site</th><th>weight</th><th>interval</th></tr>"]
    for s in report.sites:
        rows.append(
            f"<tr><td>{html.escape(s)}</td><td>{mix['weights'][s]:.3f}</td>"
            f"<td>[{mix['low'][s]:.3f}, {mix['high'][s]:.3f}]</td></tr>"
        )
    parts = [
        "<h2>Target sample</h2>",
        f"<p>{report.n_points} unlabelled target points. Mixture over the sites estimated by "
        f"{html.escape(mix['method'])} ({pct}% bootstrap intervals); it assumes the target is a mixture of "
        "the sites' input distributions, which the support check below tests.</p>",
        f"<table>{''.join(rows)}</table>",
    ]
    loss = d["predicted_loss"]
    if loss is not None:
        parts.append(
            f"<p>Predicted loss on the target: <b>{loss['loss']:.4g}</b> [{loss['low']:.4g}, {loss['high']:.4g}] "
            f"({html.escape(loss['standard_errors'])}).</p>"
        )
    sup = d["support"]
    if sup["fraction_out_of_support"] is None:
        parts.append("<p>Support: unavailable (the model carries no target reference).</p>")
    else:
        parts.append(
            f"<p>Out of support at &alpha; = {sup['alpha']:g}: <b>{sup['n_out_of_support']}</b> of "
            f"{report.n_points} points ({100 * sup['fraction_out_of_support']:.1f}%; about "
            f"{100 * sup['alpha']:g}% expected by chance).</p>"
        )
        if sup["most_atypical"]:
            shown = ", ".join(f"{a['index']} (p = {a['pvalue']:.3g})" for a in sup["most_atypical"])
            parts.append(f"<p>Most atypical rows: {html.escape(shown)}</p>")
    for note in d["notes"]:
        parts.append(f"<p>{html.escape(note)}</p>")
    return "\n".join(parts)


def _load(args):
    """The model named by ``args.model``: a directory, or a registry version with --registry."""
    from msa_fed.artifacts.model import load_model

    if not args.registry:
        path = Path(args.model)
        if not path.is_dir():
            raise ConfigError(
                f"{args.model!r} is not a model directory; to check a version stored in a registry, "
                "give --registry HOST:PORT and the admin token"
            )
        return load_model(path)
    from msa_fed.control.ops.cli import download_version
    from msa_fed.control.ops.models import unpack_model

    archive, _ = download_version(args, args.model)
    tmp = Path(tempfile.mkdtemp(prefix="msa-fed-target-"))
    try:
        return load_model(unpack_model(archive, tmp / "model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_target(args) -> int:
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha must be in (0, 1); got {args.alpha}")
    if args.json and not Path(args.json).parent.is_dir():
        raise ConfigError(f"--json {args.json!r}: folder {str(Path(args.json).parent)!r} does not exist")
    X = read_target_data(args.data)
    model = _load(args)
    if X.shape[1] != model.n_features_in_:
        raise ConfigError(f"--data {args.data!r} has {X.shape[1]} columns; the model expects {model.n_features_in_}")
    try:
        report = model.check_target(X, alpha=args.alpha, method=args.method, top=args.top)
    except ValueError as exc:  # e.g. bbse asked of a model that carries no confusion matrix
        raise ConfigError(str(exc)) from None
    for line in report.lines():
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
        print(f"report written to {args.json}")
    return 0


def register(subparsers) -> None:
    """Add ``check-target`` to the ``msa-fed model`` command group."""
    from msa_fed.artifacts.target_check import METHODS
    from msa_fed.clitools import command_group
    from msa_fed.control.ops.cli import connection_options

    model_commands = command_group(subparsers, "model", "combined models stored in the registry")
    p = model_commands.add_parser(
        "check-target",
        help="a target sample's mixture over the sites, predicted loss and points out of support",
    )
    p.add_argument("model", metavar="DIR|VERSION", help="model directory, or version / 'latest' with --registry")
    p.add_argument("--data", required=True, metavar="X.npy|X.csv", help="unlabelled target inputs (rows x features)")
    p.add_argument("--alpha", type=float, default=0.01, help="false-alarm rate of the support check (default 0.01)")
    p.add_argument("--method", choices=METHODS, default=None, help="mixture estimator (default: the model's best)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="most atypical rows to list (default 10)")
    p.add_argument("--json", metavar="F", help="also write the report as JSON to F")
    connection_options(p, registry_help="registry address (to check a stored version)")
    p.set_defaults(func=_check_target)
