"""Export of frozen predictors to ONNX bytes that declare what they are (see structure.py).

The graph has one float32 input of shape (n, d) and one output: shape (n,) or (n, 1) for
regression, (n, n_classes) for probabilities; ``metadata_props`` carry msa_fed.kind,
msa_fed.n_features and (probabilities) msa_fed.classes.
"""

from __future__ import annotations

import io
import json
import warnings

import numpy as np

from msa_fed.artifacts.structure import (
    KIND_PROBABILITIES,
    KIND_REGRESSION,
    KINDS,
    META_CLASSES,
    META_KIND,
    META_N_FEATURES,
)
from msa_fed.errors import ArtifactError, ConfigError


def _set_metadata(model, kind: str, n_features: int, classes: list | None) -> bytes:
    """Write the msa_fed declaration into ``model.metadata_props``; return the bytes."""
    import onnx

    props = {p.key: p.value for p in model.metadata_props}
    props[META_KIND] = kind
    props[META_N_FEATURES] = str(int(n_features))
    if classes is not None:
        props[META_CLASSES] = json.dumps(classes)
    else:
        props.pop(META_CLASSES, None)
    onnx.helper.set_model_props(model, props)
    return model.SerializeToString()


def _check_n_features(n_features) -> int:
    if isinstance(n_features, bool) or not isinstance(n_features, (int, np.integer)) or n_features < 1:
        raise ConfigError(f"n_features must be a positive integer; got {n_features!r}")
    return int(n_features)


def _plain_classes(classes) -> list:
    """Class labels as JSON-serialisable Python scalars."""
    out = np.asarray(classes).tolist()
    if not isinstance(out, list) or not out:
        raise ConfigError(f"classes must be a non-empty 1-D sequence; got {classes!r}")
    for c in out:
        if not isinstance(c, (str, int, float, bool)):
            raise ConfigError(f"class labels must be str, int, float or bool; got {c!r}")
    return out


def export_sklearn(model, n_features: int) -> bytes:
    """Export a fitted scikit-learn estimator (or pipeline) to ONNX bytes with skl2onnx.

    Parameters
    ----------
    model : fitted estimator; a classifier exports its class probabilities
        (output of shape (n, n_classes), no ZipMap), a regressor its values
        (shape (n, 1)).
    n_features : int, the input width d.
    """
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.base import is_classifier, is_regressor

    n_features = _check_n_features(n_features)
    fitted_width = getattr(model, "n_features_in_", None)
    if fitted_width is not None and int(fitted_width) != n_features:
        raise ConfigError(
            f"n_features={n_features} does not match the model, which was fitted on {fitted_width} features"
        )
    if is_classifier(model):
        kind, classes = KIND_PROBABILITIES, _plain_classes(model.classes_)
        options = {"zipmap": False}
    elif is_regressor(model):
        kind, classes, options = KIND_REGRESSION, None, None
    else:
        raise ConfigError(f"model must be a scikit-learn classifier or regressor; got {type(model).__name__}")
    try:
        onx = convert_sklearn(model, initial_types=[("X", FloatTensorType([None, n_features]))], options=options)
    except Exception as exc:  # skl2onnx raises many types for unsupported models
        raise ArtifactError(f"skl2onnx could not convert {type(model).__name__}: {exc}") from exc
    if kind == KIND_PROBABILITIES:
        # Keep only the probability tensor: outputs are (label, probabilities).
        keep = [o for o in onx.graph.output if o.type.tensor_type.elem_type == 1 and "prob" in o.name]
        if len(keep) != 1:
            raise ArtifactError(f"could not find the probability output among {[o.name for o in onx.graph.output]}")
        del onx.graph.output[:]
        onx.graph.output.extend(keep)
    elif len(onx.graph.output) != 1:
        raise ArtifactError("a regression predictor must have exactly one output")
    return _set_metadata(onx, kind, n_features, classes)


def export_torch(module, n_features: int, kind: str, classes=None) -> bytes:
    """Export a torch module to ONNX bytes (torch.onnx, TorchScript exporter).

    Parameters
    ----------
    module : torch.nn.Module mapping a float32 tensor (n, d) to (n,) or (n, 1)
        for ``kind="regression"``, or to probabilities (n, n_classes) for
        ``kind="probabilities"`` (end the module with a softmax).
    n_features : int, the input width d.
    kind : "regression" or "probabilities".
    classes : labels of the probability columns; default ``0..n_classes-1``.
    """
    import onnx
    import torch

    n_features = _check_n_features(n_features)
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {KINDS}; got {kind!r}")
    was_training = module.training
    module.eval()
    try:
        dummy = torch.zeros(2, n_features, dtype=torch.float32)
        with torch.no_grad():
            out = module(dummy)
        if kind == KIND_REGRESSION:
            if not (out.dim() == 1 or (out.dim() == 2 and out.shape[1] == 1)):
                raise ConfigError(f"a regression module must output shape (n,) or (n, 1); got {tuple(out.shape)}")
            classes = None
        else:
            if out.dim() != 2:
                raise ConfigError(f"a probabilities module must output shape (n, n_classes); got {tuple(out.shape)}")
            n_classes = int(out.shape[1])
            classes = list(range(n_classes)) if classes is None else _plain_classes(classes)
            if len(classes) != n_classes:
                raise ConfigError(f"classes has {len(classes)} labels but the module outputs {n_classes} columns")
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (dummy,),
                buf,  # type: ignore[arg-type]  # torch.onnx.export writes to a file-like object too
                dynamo=False,
                input_names=["X"],
                output_names=["y"],
                dynamic_axes={"X": {0: "n"}, "y": {0: "n"}},
            )
    finally:
        module.train(was_training)
    return _set_metadata(onnx.load_model_from_string(buf.getvalue()), kind, n_features, classes)


def to_onnx(predictor, n_features: int, *, kind: str | None = None, classes=None) -> bytes:
    """ONNX bytes of ``predictor``: an :class:`OnnxPredictor`, a scikit-learn estimator or a torch module.

    ``kind`` (and optionally ``classes``) are required for torch modules only.
    """
    from msa_fed.artifacts.loader import OnnxPredictor

    if isinstance(predictor, OnnxPredictor):
        if predictor.n_features_in_ != n_features:
            raise ConfigError(f"n_features={n_features} but the predictor takes {predictor.n_features_in_} features")
        return predictor.data
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(predictor, torch.nn.Module):
        if kind is None:
            raise ConfigError("kind is required to export a torch module ('regression' or 'probabilities')")
        return export_torch(predictor, n_features, kind, classes)
    if hasattr(predictor, "fit") and hasattr(predictor, "get_params"):
        return export_sklearn(predictor, n_features)
    raise ConfigError(
        f"cannot export {type(predictor).__name__} to ONNX; expected an OnnxPredictor, "
        "a scikit-learn estimator or a torch.nn.Module"
    )
