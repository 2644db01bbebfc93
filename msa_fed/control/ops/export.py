"""``msa-fed model export``: a combined model as one portable file.

    msa-fed model export VERSION|latest --format onnx --out model.onnx --registry HOST:PORT ...
    msa-fed model export DIR            --format onnx --out model.onnx

The source is a version stored in the registry (downloaded with the admin token, unpacked and
loaded as ``model download`` does) or a local model directory (what
:meth:`msa_fed.CombinedModel.save` writes).  The file is written only after it was run once
with onnxruntime on a probe batch and found to reproduce the model's own predictions.  Its
metadata holds the model's provenance: the registry version and archive digest (when it came
from the registry), the sha256 of the manifest, of the arrays and of every predictor, z, eta and
the epsilon each site spent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from msa_fed.errors import ArtifactError, ConfigError

FORMATS = ("onnx",)
#: float64 graphs reproduce the model to rounding; float32 graphs within float32 rounding
TOLERANCE = {"float64": 1e-6, "float32": 1e-3}
PROBE_ROWS = 256


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _provenance(model_dir: Path) -> dict:
    """What the model directory says about where it came from (the job that made it), and the
    digests of its files."""
    out = {
        "manifest_sha256": _sha256_file(model_dir / "manifest.json"),
        "arrays_sha256": _sha256_file(model_dir / "arrays.npz"),
    }
    try:
        manifest = json.loads((model_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return out
    for key in ("job", "job_id", "output_version", "created_at", "code_version"):
        value = manifest.get(key) if isinstance(manifest, dict) else None
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            out[f"source_{key}"] = str(value)[:200]
    return out


def _probe(model, n: int = PROBE_ROWS):
    """Rows around the model's feature map's scale (its own inputs: means and categories)."""
    import numpy as np

    rng = np.random.default_rng(0)
    d = model.n_features_in_
    fmap = getattr(model.domain_model, "feature_map", None)
    X = rng.normal(size=(n, d))
    mean, scale = getattr(fmap, "mean_", None), getattr(fmap, "scale_", None)
    if mean is not None and scale is not None:
        X = mean + X * scale
    cats = getattr(fmap, "categories_", None)
    if cats is not None:
        X = np.column_stack([rng.choice(c, size=n) if len(c) else X[:, j] for j, c in enumerate(cats)])
    thresholds = getattr(fmap, "thresholds_", None)
    if thresholds is not None and len(thresholds):
        X[:, 0] = rng.choice(thresholds, size=n) + rng.normal(size=n) * float(np.ptp(thresholds) + 1) / 10
    return X


def verify_export(model, data: bytes, dtype: str) -> float:
    """Run the exported bytes with onnxruntime on a probe batch; the largest difference from the
    model's own predictions (ArtifactError when over :data:`TOLERANCE`)."""
    import numpy as np
    import onnxruntime as ort

    X = _probe(model)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    out = session.run(None, {"X": X.astype(dtype)})[0]
    # the reference: the model part by part in numpy (not its own graph)
    ref = model._predict_proba_numpy(X) if model.task == "classification" else model._predict_numpy(X)
    diff = float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref)))
    if not diff <= TOLERANCE[dtype]:
        raise ArtifactError(
            f"the exported graph differs from the model by {diff:.3g} on a probe batch (tolerance {TOLERANCE[dtype]})"
        )
    return diff


def export_model_dir(
    model_dir, out, *, dtype: str = "float64", provenance: dict | None = None, support: bool = False
) -> dict:
    """Export the model directory ``model_dir`` to the ONNX file ``out``; returns a summary.
    ``support``: with the output ``support_pvalue`` (the model must carry a target reference)."""
    from msa_fed.artifacts.model import load_model
    from msa_fed.artifacts.onnx_support import available

    model_dir, out = Path(model_dir), Path(out)
    model = load_model(model_dir)
    if support and not available(model):
        raise ConfigError("--support: the model carries no site's published sample (no target reference)")
    meta = {**_provenance(model_dir), **(provenance or {})}
    data = model.to_onnx(dtype, provenance=meta, support=support)
    diff = verify_export(model, data, dtype)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "out": str(out),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "dtype": dtype,
        "method": model.method,
        "task": model.task,
        "sites": model.site_names,
        "max_abs_diff": diff,
        "support_output": bool(support),
    }


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (out.is_dir() or not force):
        raise ConfigError(
            f"--out {str(out)!r} already exists" + ("" if out.is_dir() else " (use --force to replace it)")
        )
    if not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")


def _model_export(args) -> int:
    out = Path(args.out)
    _check_out(out, args.force)
    if args.registry:
        from msa_fed.control.ops.cli import download_version
        from msa_fed.control.ops.models import unpack_model

        archive, record = download_version(args, args.source)
        tmp = Path(tempfile.mkdtemp(prefix="msa-fed-export-"))
        try:
            model_dir = unpack_model(archive, tmp / "model")
            summary = export_model_dir(
                model_dir,
                out,
                dtype=args.dtype,
                provenance={"registry_version": record.version, "registry_sha256": record.sha256},
                support=args.support,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        source = f"combined model version {record.version} (sha256 {record.sha256})"
    else:
        path = Path(args.source)
        if not path.is_dir():
            raise ConfigError(
                f"{args.source!r} is not a model directory; to export a version stored in a registry, "
                "give --registry HOST:PORT and the admin token"
            )
        summary = export_model_dir(path, out, dtype=args.dtype, support=args.support)
        source = f"model directory {str(path)!r}"
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{source} exported to {summary['out']} ({summary['bytes']} bytes, sha256 {summary['sha256']}): "
            f"{summary['method']} {summary['task']} over sites {', '.join(summary['sites'])}, {summary['dtype']} "
            f"input X; onnxruntime reproduces the model within {summary['max_abs_diff']:.1e} on a probe batch"
        )
    return 0


def register(subparsers) -> None:
    """Add ``export`` to the ``msa-fed model`` command group (declared by :mod:`msa_fed.cli`)."""
    from msa_fed.clitools import command_group
    from msa_fed.control.ops.cli import connection_options

    model_commands = command_group(subparsers, "model")

    p = model_commands.add_parser(
        "export", help="write a stored version (or a model directory) as one self-contained ONNX file"
    )
    p.add_argument("source", metavar="VERSION|DIR", help="version number or 'latest' (with --registry), or a directory")
    p.add_argument("--format", choices=FORMATS, default="onnx", help="file format (default onnx)")
    p.add_argument("--out", required=True, metavar="FILE", help="file to write")
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="input type and arithmetic of the graph (default float64: the model's own predictions to rounding)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--support", action="store_true", help="add the output support_pvalue (target support p-values, last output)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    connection_options(p, registry_help="registry address (to export a stored version)")
    p.set_defaults(func=_model_export)
