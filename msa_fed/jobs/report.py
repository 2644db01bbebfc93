"""A combined model's report as one self-contained HTML file.

    msa-fed model report VERSION --out report.html --registry HOST:PORT --admin-token-file F

The page shows z and the per-site losses L_k(z) (with max_k L_k, the worst mixture's loss),
the DC solver's and the domain classifier's convergence, the sites with the sha256 of their
predictors, and per site the requests its policy refused and the approval its operator gave;
the plots are matplotlib PNGs embedded as base64, so the file needs no network and no other
file.  ``write_report(model, path)`` does the same from Python.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

import numpy as np

from msa_fed.artifacts import privacy_view as view
from msa_fed.jobs.operations import solver_objective

SOLVED_FOR = {
    "minmax": "min over z of max_k L_k(z)",
    "gamma": "min over z of Gamma(z)",
    "regret": "min over z of max_k (L_k(z) - b_k), b_k site k's best loss",
}


def _figure_png(draw, width: float = 5.5, height: float = 3.2) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    try:
        draw(ax)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _bars(names, values, ylabel, title, line=None, line_label=None):
    def draw(ax):
        ax.bar(range(len(values)), values, color="#3b6ea8")
        ax.set_xticks(range(len(values)), names, rotation=30 if len(names) > 6 else 0)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if line is not None:
            ax.axhline(line, color="#c0392b", linestyle="--", label=line_label)
            ax.legend(loc="lower right")
        ax.grid(axis="y", alpha=0.3)

    return draw


def _curve(values, xlabel, ylabel, title):
    def draw(ax):
        if len(values):
            ax.plot(np.arange(1, len(values) + 1), values, marker="o", markersize=3, color="#2e7d32")
        else:
            ax.text(0.5, 0.5, "no iterations recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)

    return draw


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _row(*cells, head=False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"


def report_html(model, record=None, manifest: dict | None = None, target=None) -> str:
    """The report page of ``model`` (a :class:`~msa_fed.CombinedModel`); ``record`` is its registry
    record (a ``CombinedModelRecord``) when it came from the registry, ``manifest`` the stored manifest;
    ``target``: a target sample (n, d): the page gets its section (mixture, predicted loss, support)."""
    manifest = manifest if manifest is not None else model.manifest()
    names = list(model.site_names)
    info = model.info if isinstance(model.info, dict) else {}
    solver = info.get("solver") or {}
    classifier = info.get("classifier") or {}
    eps = getattr(model, "epsilon_by_site", None) or {}
    raw = model.domain_losses if model.domain_losses is not None else np.full(len(names), np.nan)
    # the losses the sites measured on their own data (DP: noisy ones marked ~), else the solver's
    losses, loss_cells, measured = view.reported_losses(info, raw, eps)
    estimates = " (measured at each site)" if measured else " (DP estimates)" if view.dp_on(eps) else ""
    plots = [
        _img(_figure_png(_bars(names, model.z, "z_k", "mixture weights z")), "mixture weights z"),
        _img(
            _figure_png(
                _bars(
                    names,
                    losses,
                    "L_k(z)",
                    "loss of g_z on each site's distribution" + estimates,
                    line=float(np.nanmax(losses)),
                    line_label="max_k L_k(z)",
                )
            ),
            "per-site losses",
        ),
        _img(
            _figure_png(
                _curve(model.history, "iteration", "objective", f"z solver ({solver.get('method', '?')}){estimates}")
            ),
            "solver convergence",
        ),
        _img(
            _figure_png(
                _curve(
                    classifier.get("history") or [],
                    "iteration" if classifier.get("optimizer") != "sgd" else "epoch",
                    "loss",
                    f"domain classifier ({classifier.get('optimizer', '?')})",
                )
            ),
            "classifier convergence",
        ),
    ]
    job = info.get("job") or {}
    shas = manifest.get("predictor_sha256") or [""] * len(names)
    n_lab, n_unl = info.get("n_labeled") or [""] * len(names), info.get("n_unlabeled") or [""] * len(names)
    site_rows = [_row("site", "z_k", "L_k(z)", "labelled points", "unlabelled points", "predictor sha256", head=True)]
    for k, name in enumerate(names):
        site_rows.append(
            _row(
                name,
                f"{model.z[k]:.4f}",
                loss_cells[k],
                n_lab[k] if k < len(n_lab) else "",
                n_unl[k] if k < len(n_unl) else "",
                shas[k] if k < len(shas) else "",
            )
        )
    facts = [
        ("method / task", f"{model.method} / {model.task}"),
        ("eta", f"{model.eta:g}"),
        ("max_k L_k(z): the worst site's loss", view.worst_text(losses, loss_cells)),
        ("Gamma(z): worst site's loss minus the z-weighted average (0: no site worse off)", f"{model.gamma:.4g}"),
        ("z solved for", SOLVED_FOR.get(solver_objective(model.info) or "", "?")),
        (
            "solver",
            (
                f"{solver.get('method', '?')}, {solver.get('n_iter', '?')} iterations (best run), "
                f"{solver.get('n_evaluations', '?')} loss evaluations, converged: "
                f"{solver.get('converged', '?')}"
            ),
        ),
        (
            "classifier",
            (
                f"{classifier.get('optimizer', '?')}, {classifier.get('n_iter', '?')} iterations, objective "
                f"{classifier.get('objective', float('nan')):.6g}"
            ),
        ),
        ("classes", json.dumps(manifest.get("classes"))),
        (
            "job",
            f"{job.get('job', '-')} (id {job.get('job_id', '-')}, output version {job.get('output_version') or '-'})",
        ),
        ("code version", manifest.get("code_version", "-")),
    ]
    shown = view.epsilon_line(names, eps)
    if shown is not None:
        note = view.MEASURED_NOTE if measured else view.ESTIMATE_NOTE
        facts.append(("differential privacy", f"epsilon spent by site: {shown}; {note}"))
    if record is not None:
        facts = [
            ("registry version", str(record.version)),
            ("model sha256", record.sha256),
            (
                "stored",
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.created_at)) + f" by {record.created_by}",
            ),
        ] + facts
    influence_html = (
        _influence_html(info.get("influence"))
        + _verdicts_html(view.site_check_of(info))
        + _consortium_html(info.get("consortium"), names)
    )
    target_html = ""
    if target is not None:
        from msa_fed.jobs.target import target_html as section

        target_html = section(model.check_target(target))
    title = f"msa_fed combined model {record.version}" if record is not None else "msa_fed combined model"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; font-size: 14px; }}
th {{ background: #eef2f7; }}
.plots img {{ margin: 6px; border: 1px solid #ddd; }}
code {{ font-size: 13px; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>g(x) = &Sigma;<sub>k</sub> (z<sub>k</sub> q<sub>k</sub>(x) + &eta;/p) h<sub>k</sub>(x) /
(&Sigma;<sub>k</sub> z<sub>k</sub> q<sub>k</sub>(x) + &eta;), over {len(names)} sites.</p>
<table>{"".join(_row(k, v) for k, v in facts)}</table>
<h2>Sites</h2>
<table>{"".join(site_rows)}</table>
{influence_html}
{target_html}
<h2>Plots</h2>
<div class="plots">{"".join(plots)}</div>
</body></html>
"""


def _influence_html(table) -> str:
    """The influence report: each site's loss with all sites and without each other site."""
    if not isinstance(table, dict) or not table.get("sites"):
        return "<h2>Influence</h2><p>not computed (differential privacy on at a site, or an older model)</p>"
    names = table["sites"]
    rows = [_row("without", *names, head=True), _row("(none)", *(f"{x:.4f}" for x in table["loss_with"]))]
    for j, n in enumerate(names):
        rows.append(_row(n, *(f"{x:.4f}" for x in table["loss_without"][j])))
    notes = []
    for n in names:
        other, rel = table["worst"][n]
        flag = " &mdash; <b>FLAGGED</b>" if n in table["flagged"] else ""
        notes.append(
            f"<li>including {html.escape(n)} changes {html.escape(other)}'s loss by {100 * rel:+.1f}%{flag}</li>"
        )
    return (
        "<h2>Influence</h2><p>Each site's loss L_k with every site in the mixture (first row) and "
        "with z re-solved without the site of each row. A site whose inclusion raises another's "
        f"loss by more than {100 * table['margin']:.0f}% is flagged.</p>"
        f"<table>{''.join(rows)}</table><ul>{''.join(notes)}</ul>"
    )


def _verdicts_html(check) -> str:
    """Each site's verdict on the model, in words (msa_fed/core/harm.py)."""
    if check is None:
        return "<h2>The sites' verdicts</h2><p>not measured (an older model, or a site's policy refused)</p>"
    from msa_fed.core.harm import harm_lines

    lines = harm_lines(check)
    items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in lines[1:])
    return f"<h2>The sites' verdicts</h2><p>{html.escape(lines[0])}</p><ul>{items}</ul>"


def _utc(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return "?"


def _consortium_html(kept, names) -> str:
    """Per site, the requests of the job its policy refused (request, rule, the site's words, how
    often, when) and the approval its operator gave (who, when), as the job saw them."""
    head = "<h2>Refusals and approvals</h2>"
    if not isinstance(kept, dict):
        return head + "<p>not recorded (a model made before the job kept them)</p>"
    refusals = [r for r in kept.get("refusals") or [] if isinstance(r, dict)]
    approvals = [a for a in kept.get("approvals") or [] if isinstance(a, dict)]
    rows = [_row("site", "approval", "refused requests", head=True)]
    for name in names:
        given = [
            f"admitted by {a.get('by', '?')} at {_utc(a.get('admitted_at'))} (the job waited from "
            f"{_utc(a.get('waited_since'))})"
            for a in approvals
            if a.get("site") == name
        ]
        refused = [
            f"{r.get('request', '?')} (rule {r.get('rule', '?')}): {r.get('detail', '')}; "
            f"{int(r.get('count', 1))} time(s), first {_utc(r.get('first'))}, last {_utc(r.get('last'))}"
            for r in refusals
            if r.get("site") == name
        ]
        rows.append(_row(name, "; ".join(given) or "none needed", " | ".join(refused) or "none"))
    if not refusals and not approvals:
        note = "No site refused a request of this job, and none waited for its operator's approval."
    else:
        note = (
            f"{len(refusals)} kind(s) of refusal and {len(approvals)} approval(s), as the job saw them "
            "(each site's audit log has every request it answered or refused)."
        )
    return f"{head}<p>{html.escape(note)}</p><table>{''.join(rows)}</table>"


def write_report(model, path, record=None, manifest: dict | None = None, target=None) -> Path:
    path = Path(path)
    path.write_text(report_html(model, record, manifest, target), encoding="utf-8")
    return path


def _report_command(args) -> int:
    import tempfile

    from msa_fed.artifacts.model import load_model
    from msa_fed.control.ops.cli import connect_factory
    from msa_fed.control.ops.models import unpack_model
    from msa_fed.control.ops.service import manifest_of
    from msa_fed.errors import ConfigError

    out = Path(args.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    target = None
    if args.target:
        from msa_fed.jobs.target import read_target_data

        target = read_target_data(args.target, "--target")
    with connect_factory(args)() as client:
        data, record = client.download_combined_model(args.version or None)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(unpack_model(data, Path(tmp) / "model"))
    if target is not None and target.shape[1] != model.n_features_in_:
        raise ConfigError(f"--target has {target.shape[1]} columns; the model expects {model.n_features_in_}")
    write_report(model, out, record, manifest_of(record) or None, target)
    print(f"report of combined model version {record.version} written to {out}")
    return 0


def register_cli(subparsers) -> None:
    """Add ``msa-fed model report``."""
    from msa_fed.clitools import command_group
    from msa_fed.control.ops.cli import _version, connection_options

    model = command_group(subparsers, "model")
    p = model.add_parser("report", help="an HTML report of a version: z, losses, convergence, sites and sha256")
    p.add_argument("version", type=_version, metavar="VERSION", help="version number or 'latest'")
    p.add_argument("--out", required=True, metavar="FILE.html", help="where to write the report")
    p.add_argument("--target", metavar="X.npy|X.csv", help="a target sample: adds its mixture, loss and support")
    connection_options(p)
    p.set_defaults(func=_report_command)
