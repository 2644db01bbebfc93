"""Frozen predictors as ONNX artifacts: export, and a loader that never runs author code.

A site publishes its predictor h_k as ONNX bytes (DESIGN.md section 6).  The
artifact declares, in the ONNX model's ``metadata_props``:

- ``msa_fed.kind``: ``"regression"`` (one value per row) or ``"probabilities"``
  (one probability per class per row);
- ``msa_fed.n_features``: the input width d;
- ``msa_fed.classes``: JSON list of the class labels (probabilities only), in the
  column order of the output.

The graph has one float32 input of shape (n, d) and one output: shape (n,) or
(n, 1) for regression, (n, n_classes) for probabilities.

:func:`load_predictor` accepts bytes from anyone.  It checks, in order: size,
sha256, that the bytes are ONNX (a pickle or a zip is named as such and
refused), that no tensor points at external files, that only the standard
operator domains are used, that the declaration matches what the caller
expects, then runs a probe batch with onnxruntime and checks the output shape,
finiteness and, for probabilities, that every row lies in [0, 1] and sums to 1.
Any failure raises :class:`msa_fed.errors.ArtifactError` saying why.
"""
from __future__ import annotations

import hashlib
import io
import json
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from msa_fed.core.dc_terms import PROBA_ATOL
from msa_fed.errors import ArtifactError, ConfigError

KIND_REGRESSION = "regression"
KIND_PROBABILITIES = "probabilities"
KINDS = (KIND_REGRESSION, KIND_PROBABILITIES)

META_KIND = "msa_fed.kind"
META_N_FEATURES = "msa_fed.n_features"
META_CLASSES = "msa_fed.classes"

DEFAULT_MAX_BYTES = 64 * 2**20
# Operator domains an artifact may use: standard ONNX, ONNX-ML and onnxruntime's
# built-in contrib ops.  Anything else would need a custom-op library.
ALLOWED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
PROBE_ROWS = 16
PROBE_SEED = 0
PROBE_TIMEOUT_S = 10.0


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- export


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
    from sklearn.base import is_classifier, is_regressor
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

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
        onx = convert_sklearn(
            model, initial_types=[("X", FloatTensorType([None, n_features]))], options=options
        )
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
                module, (dummy,), buf, dynamo=False, input_names=["X"], output_names=["y"],
                dynamic_axes={"X": {0: "n"}, "y": {0: "n"}},
            )
    finally:
        module.train(was_training)
    return _set_metadata(onnx.load_model_from_string(buf.getvalue()), kind, n_features, classes)


def to_onnx(predictor, n_features: int, *, kind: str | None = None, classes=None) -> bytes:
    """ONNX bytes of ``predictor``: an :class:`OnnxPredictor`, a scikit-learn estimator or a torch module.

    ``kind`` (and optionally ``classes``) are required for torch modules only.
    """
    if isinstance(predictor, OnnxPredictor):
        if predictor.n_features_in_ != n_features:
            raise ConfigError(f"n_features={n_features} but the predictor takes {predictor.n_features_in_} features")
        return predictor.data
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
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


# --------------------------------------------------------------------------- loading


class OnnxPredictor:
    """A verified ONNX predictor run by onnxruntime (thread-safe).

    Attributes: ``kind``, ``n_features_in_``, ``sha256``, ``data`` (the ONNX
    bytes).  :class:`OnnxClassifier` adds ``classes_`` and ``predict_proba``.
    Pickling stores only the bytes; unpickling verifies them again.
    """

    def __init__(self, data: bytes, session, kind: str, n_features: int, input_name: str,
                 output_name: str, intra_op_threads: int, sha256: str | None = None):
        self.data = data
        self.sha256 = sha256 or sha256_hex(data)
        self.kind = kind
        self.n_features_in_ = n_features
        self._session = session
        self._input_name = input_name
        self._output_name = output_name
        self._intra_op_threads = intra_op_threads

    def __reduce__(self):
        return (_restore, (self.data, self.sha256, self._intra_op_threads))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, n_features={self.n_features_in_}, sha256={self.sha256[:12]}...)"

    def _validate(self, X) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"X must have shape (n_samples, {self.n_features_in_}); got {X.shape}")
        return X

    def _run(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self._session.run([self._output_name], {self._input_name: X})[0])

    def predict(self, X) -> np.ndarray:
        """Predictions for ``X`` (n, d): values (n,) float64."""
        X = self._validate(X)
        if X.shape[0] == 0:
            return np.zeros(0)
        return self._run(X).reshape(X.shape[0]).astype(np.float64)


class OnnxRegressor(OnnxPredictor):
    """An :class:`OnnxPredictor` of kind ``"regression"``."""


class OnnxClassifier(OnnxPredictor):
    """An :class:`OnnxPredictor` of kind ``"probabilities"``: ``classes_`` and ``predict_proba``."""

    def __init__(self, *args, classes: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.classes_ = np.asarray(classes)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities for ``X`` (n, d): array (n, n_classes) float64, columns in ``classes_`` order."""
        X = self._validate(X)
        if X.shape[0] == 0:
            return np.zeros((0, len(self.classes_)))
        return self._run(X).astype(np.float64)

    def predict(self, X) -> np.ndarray:
        """Most probable class label of each row of ``X`` (n, d): array (n,)."""
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]


def _restore(data: bytes, sha256: str, intra_op_threads: int) -> OnnxPredictor:
    return load_predictor(data, expected_sha256=sha256, intra_op_threads=intra_op_threads)


def _sniff_foreign_format(data: bytes) -> str | None:
    """Name a well-known non-ONNX format, or None."""
    if data[:1] == b"\x80" and len(data) > 1 and 1 <= data[1] <= 5:
        return "a Python pickle"
    if data[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save or joblib?)"
    if data[:6] == b"\x93NUMPY":
        return "a NumPy .npy file"
    return None


def _all_graphs(graph):
    """``graph`` and every subgraph held by node attributes (If / Loop / Scan bodies)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _all_graphs(attr.g)
            for g in attr.graphs:
                yield from _all_graphs(g)


def _check_structure(model) -> None:
    """Refuse external tensor data (it would read server files) and unknown operator domains."""
    import onnx

    local_domains = {f.domain for f in model.functions}
    for opset in model.opset_import:
        if opset.domain not in ALLOWED_DOMAINS and opset.domain not in local_domains:
            raise ArtifactError(f"artifact uses operator domain {opset.domain!r}; allowed: {sorted(ALLOWED_DOMAINS)}")
    graphs = list(_all_graphs(model.graph))
    for f in model.functions:
        for node in f.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    graphs.extend(_all_graphs(attr.g))
    for graph in graphs:
        tensors = list(graph.initializer) + [s.values for s in graph.sparse_initializer]
        for node in graph.node:
            if node.domain not in ALLOWED_DOMAINS and node.domain not in local_domains:
                raise ArtifactError(f"artifact node {node.name!r} uses operator domain {node.domain!r}")
            for attr in node.attribute:
                if attr.HasField("t"):
                    tensors.append(attr.t)
                tensors.extend(attr.tensors)
        for t in tensors:
            if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0:
                raise ArtifactError(f"artifact tensor {t.name!r} refers to external data; only self-contained models are accepted")


def _declared(model, kind, n_features) -> tuple[str, int, list | None]:
    """(kind, n_features, classes) from the metadata, checked against the caller's expectations."""
    props = {p.key: p.value for p in model.metadata_props}
    d_kind = props.get(META_KIND, kind)
    if d_kind is None:
        raise ArtifactError(f"artifact declares no {META_KIND}; export it with msa_fed.artifacts.export_sklearn or export_torch")
    if d_kind not in KINDS:
        raise ArtifactError(f"artifact declares {META_KIND}={d_kind!r}; expected one of {KINDS}")
    if kind is not None and kind != d_kind:
        raise ArtifactError(f"artifact declares kind={d_kind!r} but {kind!r} was expected")
    declared_here = META_KIND in props  # an msa_fed export: the whole declaration must be present
    raw_width = props.get(META_N_FEATURES)
    if raw_width is None:
        if n_features is None or declared_here:
            raise ArtifactError(f"artifact declares no {META_N_FEATURES}")
        d_width = int(n_features)
    else:
        try:
            d_width = int(raw_width)
        except ValueError:
            raise ArtifactError(f"artifact declares {META_N_FEATURES}={raw_width!r}; expected a positive integer") from None
    if d_width < 1 or d_width > 10_000_000:
        raise ArtifactError(f"artifact declares n_features={d_width}; expected a positive integer")
    if n_features is not None and int(n_features) != d_width:
        raise ArtifactError(f"artifact declares n_features={d_width} but {n_features} was expected")
    classes = None
    if d_kind == KIND_PROBABILITIES and declared_here and META_CLASSES not in props:
        raise ArtifactError(f"artifact declares kind='probabilities' but no {META_CLASSES}")
    if d_kind == KIND_PROBABILITIES and META_CLASSES in props:
        try:
            classes = json.loads(props[META_CLASSES])
        except ValueError:
            raise ArtifactError(f"artifact {META_CLASSES} is not valid JSON") from None
        if not isinstance(classes, list) or len(classes) < 2 or not all(
            isinstance(c, (str, int, float, bool)) for c in classes
        ):
            raise ArtifactError(f"artifact {META_CLASSES} must be a JSON list of at least 2 scalar labels")
    return d_kind, d_width, classes


def _run_probe(session, input_name: str, output_name: str, probe: np.ndarray):
    """Run the probe batch, terminating it after PROBE_TIMEOUT_S (a hostile graph could loop)."""
    import onnxruntime as ort

    run_options = ort.RunOptions()
    fired = threading.Event()

    def terminate():
        fired.set()
        run_options.terminate = True

    timer = threading.Timer(PROBE_TIMEOUT_S, terminate)
    timer.start()
    try:
        return session.run([output_name], {input_name: probe}, run_options)[0]
    except Exception as exc:
        if fired.is_set():
            raise ArtifactError(f"artifact did not finish a probe batch of {len(probe)} rows within {PROBE_TIMEOUT_S:g} s") from None
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(f"artifact failed on a probe batch: {first_line}") from None
    finally:
        timer.cancel()


def load_predictor(
    data: bytes,
    *,
    expected_sha256: str | None = None,
    n_features: int | None = None,
    kind: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    intra_op_threads: int = 1,
) -> OnnxPredictor:
    """Verify ONNX bytes and return a ready :class:`OnnxPredictor` (see the module docstring).

    ``n_features`` and ``kind`` are expectations: a mismatch with the
    declaration is an error.  They also stand in for the declaration when an
    ONNX file carries none.  Raises :class:`ArtifactError`.
    """
    import onnx
    import onnxruntime as ort
    from google.protobuf.message import DecodeError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArtifactError(f"artifact must be bytes; got {type(data).__name__}")
    data = bytes(data)
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"kind must be one of {KINDS}; got {kind!r}")
    if not data:
        raise ArtifactError("artifact is empty")
    if len(data) > max_bytes:
        raise ArtifactError(f"artifact is {len(data)} bytes; the limit is {max_bytes}")
    digest = sha256_hex(data)
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ArtifactError(f"artifact sha256 is {digest}; expected {expected_sha256}")
    foreign = _sniff_foreign_format(data)
    if foreign is not None:
        raise ArtifactError(f"artifact is {foreign}, not an ONNX model; only ONNX is accepted because loading other formats can run code")
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"artifact is not a valid ONNX model (truncated or corrupt): {exc}") from None
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise ArtifactError("artifact is not a valid ONNX model: it has no graph")
    _check_structure(model)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ArtifactError(f"artifact is not a valid ONNX model: {str(exc).splitlines()[0]}") from None
    d_kind, d_width, classes = _declared(model, kind, n_features)

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ArtifactError(f"artifact must have exactly one input; it has {len(inputs)}")
    if len(model.graph.output) < 1:
        raise ArtifactError("artifact has no output")
    tensor_type = inputs[0].type.tensor_type
    if tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise ArtifactError(f"artifact input must be float32; got {onnx.TensorProto.DataType.Name(tensor_type.elem_type)}")
    dims = tensor_type.shape.dim
    if len(dims) != 2:
        raise ArtifactError(f"artifact input must have rank 2 (n_samples, n_features); it has rank {len(dims)}")
    if dims[1].HasField("dim_value") and dims[1].dim_value != d_width:
        raise ArtifactError(f"artifact input width is {dims[1].dim_value} but it declares n_features={d_width}")

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(intra_op_threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4  # failures become ArtifactError; keep stderr quiet
    options.add_session_config_entry("session.load_model_format", "ONNX")
    try:
        session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ArtifactError(f"onnxruntime cannot load the artifact: {str(exc).splitlines()[0]}") from None
    input_name = session.get_inputs()[0].name
    output_name = session.get_outputs()[0].name

    probe = np.random.default_rng(PROBE_SEED).normal(size=(PROBE_ROWS, d_width)).astype(np.float32)
    out = _run_probe(session, input_name, output_name, probe)
    if not isinstance(out, np.ndarray) or out.dtype.kind != "f":
        raise ArtifactError("artifact output must be a float tensor (export classifiers with zipmap=False)")
    if not np.all(np.isfinite(out)):
        raise ArtifactError("artifact output contains NaN or infinity on a probe batch")
    if d_kind == KIND_REGRESSION:
        if out.shape not in ((PROBE_ROWS,), (PROBE_ROWS, 1)):
            raise ArtifactError(f"a regression artifact must output shape (n,) or (n, 1); got {out.shape} for n={PROBE_ROWS}")
        return OnnxRegressor(data, session, d_kind, d_width, input_name, output_name, intra_op_threads, digest)
    if out.ndim != 2 or out.shape[0] != PROBE_ROWS or out.shape[1] < 2:
        raise ArtifactError(f"a probabilities artifact must output shape (n, n_classes >= 2); got {out.shape} for n={PROBE_ROWS}")
    if classes is None:
        classes = list(range(out.shape[1]))
    if len(classes) != out.shape[1]:
        raise ArtifactError(f"artifact declares {len(classes)} classes but outputs {out.shape[1]} columns")
    if out.min() < -1e-6 or out.max() > 1 + 1e-6:
        raise ArtifactError("artifact probabilities fall outside [0, 1] on a probe batch")
    worst = float(np.max(np.abs(out.astype(np.float64).sum(axis=1) - 1.0)))
    if worst > PROBA_ATOL:
        raise ArtifactError(f"artifact probabilities do not sum to 1 on a probe batch (off by {worst:.3g})")
    return OnnxClassifier(data, session, d_kind, d_width, input_name, output_name, intra_op_threads, digest,
                          classes=classes)


def load_predictor_file(path, **kwargs: Any) -> OnnxPredictor:
    """:func:`load_predictor` on the bytes of ``path`` (refuses files over ``max_bytes`` before reading)."""
    path = Path(path)
    max_bytes = kwargs.get("max_bytes", DEFAULT_MAX_BYTES)
    size = path.stat().st_size
    if size > max_bytes:
        raise ArtifactError(f"artifact {str(path)!r} is {size} bytes; the limit is {max_bytes}")
    return load_predictor(path.read_bytes(), **kwargs)
