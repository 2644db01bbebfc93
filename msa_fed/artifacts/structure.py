"""Checks of an untrusted ONNX predictor that need no onnxruntime: structure, declaration, probe.

These run inside the sandbox process (:mod:`msa_fed.artifacts.sandbox`) on hostile bytes, and
again in a process that builds its own onnxruntime session from bytes the sandbox accepted.
A refusal is a :class:`Refusal`: a reason ``code`` from :data:`REASONS`, typed arguments
(numbers, or words from a fixed vocabulary) and a free-text ``detail`` for the server's log.
Only :func:`public_message` turns a code into client-visible text, so nothing read by a
library, and no byte of any file, can reach the party that sent the model.

The declaration lives in the ONNX model's ``metadata_props``:

- ``msa_fed.kind``: ``"regression"`` (one value per row) or ``"probabilities"`` (one
  probability per class per row);
- ``msa_fed.n_features``: the input width d;
- ``msa_fed.classes``: JSON list of the class labels (probabilities only), in the column order
  of the output.
"""

from __future__ import annotations

import json
import math
import re

KIND_REGRESSION = "regression"
KIND_PROBABILITIES = "probabilities"
KINDS = (KIND_REGRESSION, KIND_PROBABILITIES)

META_KIND = "msa_fed.kind"
META_N_FEATURES = "msa_fed.n_features"
META_CLASSES = "msa_fed.classes"

# Operator domains an artifact may use: standard ONNX, ONNX-ML and onnxruntime's built-in
# contrib ops.  Anything else would need a custom-op library.
ALLOWED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
DEFAULT_MAX_FEATURES = 100_000  # widest declared input accepted unless the caller says more
MAX_CLASSES = 10_000
PROBA_ATOL = 1e-3  # float32 probabilities: rows sum to 1 within this

# Probe batch: PROBE_ROWS_PER_SCALE standard-normal rows at each scale (so a predictor is run
# on large magnitudes too), fewer when the width is large so that the batch stays within
# PROBE_MAX_BYTES; then the caller's sample rows (at most PROBE_MAX_SAMPLE_ROWS).
PROBE_SCALES = (0.1, 1.0, 3.0, 10.0, 100.0, 1e4)
PROBE_ROWS_PER_SCALE = 48
PROBE_MAX_BYTES = 32 * 2**20
PROBE_MAX_SAMPLE_ROWS = 2048
PROBE_SEED = 0

# Client-visible reasons.  Arguments are formatted only after _safe_args has kept numbers and
# words of a fixed vocabulary: a model's own strings (names, domains) go to ``detail`` only.
REASONS = {
    "not_bytes": "model must be bytes",
    "empty": "model is empty",
    "too_large": "model is {size} bytes; the limit is {limit}",
    "sha256": "model sha256 is {digest}; expected {expected}",
    "foreign": (
        "artifact is {what}, not an ONNX model; only ONNX is accepted because loading other formats can run code"
    ),
    "not_onnx": "model is not a valid ONNX model (truncated or corrupt)",
    "no_graph": "model is not a valid ONNX model: it has no graph",
    "external_data": "model uses external data; only self-contained models are accepted",
    "domain": "model uses an operator domain outside the allowed ones (standard ONNX, ai.onnx.ml, com.microsoft)",
    "training_info": "model carries training information; only inference graphs are accepted",
    "checker": "model fails the ONNX checker",
    "no_kind": "model declares no msa_fed.kind; export it with msa_fed.artifacts.export_sklearn or export_torch",
    "bad_kind": "model declares an msa_fed.kind other than 'regression' or 'probabilities'",
    "kind_mismatch": "model declares kind={kind!r} but {expected!r} was expected",
    "no_width": "model declares no msa_fed.n_features",
    "bad_width": "model declares msa_fed.n_features that is not a positive integer",
    "too_wide": "declared input width {width} exceeds the limit of {limit} features",
    "width_mismatch": "model declares n_features={width} but {expected} was expected",
    "no_classes": "model declares kind='probabilities' but no msa_fed.classes",
    "bad_classes": "model msa_fed.classes must be a JSON list of 2 to {limit} distinct scalar labels of one type",
    "n_inputs": "model must have exactly one input; it has {count}",
    "no_output": "model has no output",
    "input_dtype": "model input must be float32",
    "input_rank": "model input must have rank 2 (n_samples, n_features); it has rank {rank}",
    "input_width": "model input width is {width} but it declares n_features={declared}",
    "sample": "probe sample has {cols} columns but the model declares n_features={width}",
    "ort_load": "onnxruntime cannot load the model",
    "probe_failed": "model failed the probe",
    "output_dtype": "model output must be a float tensor (export classifiers with zipmap=False)",
    "nonfinite": "model outputs NaN or infinity on the probe",
    "regression_shape": "a regression model must output shape (n,) or (n, 1)",
    "proba_shape": "a probabilities model must output shape (n, n_classes >= 2)",
    "classes_count": "model declares {declared} classes but outputs {outputs} columns",
    "proba_range": "model probabilities fall outside [0, 1] on the probe",
    "proba_sum": "model probabilities do not sum to 1 on the probe (off by {worst:.3g})",
    "timeout": "model exceeded the sandbox time limit",
    "cpu": "model exceeded the sandbox CPU-time limit",
    "memory": "model exceeded the sandbox memory limit",
    "sandbox": "model failed the probe (the sandbox process ended without a verdict)",
}
FOREIGN_FORMATS = ("a Python pickle", "a zip archive (torch.save or joblib?)", "a NumPy .npy file")
_WORDS = frozenset(KINDS) | frozenset(FOREIGN_FORMATS)  # the only strings a reason may show


class Refusal(Exception):
    """An artifact check failed: ``code`` (a key of REASONS), ``args`` and a log-only ``detail``."""

    def __init__(self, code: str, detail: str = "", /, **args):
        super().__init__(code)
        self.code = code
        self.args_ = args
        self.detail = detail


def _safe_args(args) -> dict:
    out = {}
    for key, value in (args or {}).items():
        if isinstance(value, bool) or not isinstance(key, str):
            continue
        if (
            (isinstance(value, int) and abs(value) < 10**18)
            or isinstance(value, float)
            or (isinstance(value, str) and (value in _WORDS or re.fullmatch(r"[0-9a-f]{64}", value)))
        ):
            out[key] = value
    return out


def public_message(code, args=None) -> str:
    """The client-visible text of reason ``code``; unknown codes and missing args give a generic reason."""
    template = REASONS.get(code) if isinstance(code, str) else None
    if template is None:
        return REASONS["probe_failed"]
    try:
        return template.format(**_safe_args(args))
    except (KeyError, ValueError, IndexError):
        return template.split("{", 1)[0].rstrip(" =:;(") if "{" in template else template


def _name(s: str) -> str:
    """A model-supplied name for the log: repr, at most 60 characters."""
    return repr(s[:60] + ("..." if len(s) > 60 else ""))


# --------------------------------------------------------------------------- structure


def _external(t) -> bool:
    """True when TensorProto ``t`` points at data outside the model (EXTERNAL = 1)."""
    return t.data_location == 1 or len(t.external_data) > 0


def _attribute_tensors(attr):
    """Every TensorProto an AttributeProto carries, sparse values and indices included."""
    if attr.HasField("t"):
        yield attr.t
    yield from attr.tensors
    sparse = ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors)
    for s in sparse:
        yield s.values
        yield s.indices


def _attribute_graphs(attr):
    if attr.HasField("g"):
        yield attr.g
    yield from attr.graphs


# Operators whose attributes name a file for an execution provider to read (EPContext's
# ep_cache_context): refused like external data, whatever the providers in use.
FILE_OPERATORS = frozenset({("com.microsoft", "EPContext")})


def _walk_nodes(nodes, where: str, local_domains: set):
    """Check a list of NodeProto; yield the subgraphs they hold."""
    for node in nodes:
        if node.domain not in ALLOWED_DOMAINS and node.domain not in local_domains:
            raise Refusal("domain", f"node {_name(node.name)} in {where} uses domain {_name(node.domain)}")
        if (node.domain, node.op_type) in FILE_OPERATORS:
            raise Refusal("external_data", f"node {_name(node.name)} in {where} is a {node.op_type}")
        for attr in node.attribute:
            for t in _attribute_tensors(attr):
                if _external(t):
                    raise Refusal(
                        "external_data", f"attribute {_name(attr.name)} of node {_name(node.name)} in {where}"
                    )
            yield from _attribute_graphs(attr)


def _check_graph(graph, where: str, local_domains: set) -> None:
    """Check ``graph`` and, recursively, every subgraph of its nodes (If / Loop / Scan bodies)."""
    stack = [(graph, where)]
    while stack:
        g, w = stack.pop()
        w = f"{w}/{_name(g.name)}"
        for t in g.initializer:
            if _external(t):
                raise Refusal("external_data", f"initializer {_name(t.name)} in {w}")
        for s in g.sparse_initializer:
            if _external(s.values) or _external(s.indices):
                raise Refusal("external_data", f"sparse initializer {_name(s.values.name)} in {w}")
        stack.extend((sub, w) for sub in _walk_nodes(g.node, w, local_domains))


def check_structure(model) -> None:
    """Refuse external data anywhere, unknown operator domains and training information.

    Walks the main graph, every subgraph, every function body (nodes and default attributes)
    and every tensor-bearing attribute (t, tensors, sparse_tensor, sparse_tensors: values and
    indices).  Raises :class:`Refusal`.
    """
    local_domains = {f.domain for f in model.functions}
    for opset in model.opset_import:
        if opset.domain not in ALLOWED_DOMAINS and opset.domain not in local_domains:
            raise Refusal("domain", f"opset import of domain {_name(opset.domain)}")
    if len(model.training_info) > 0:
        raise Refusal("training_info", f"{len(model.training_info)} training_info entries")
    _check_graph(model.graph, "graph", local_domains)
    for f in model.functions:
        where = f"function {_name(f.domain)}.{_name(f.name)}"
        for opset in f.opset_import:
            if opset.domain not in ALLOWED_DOMAINS and opset.domain not in local_domains:
                raise Refusal("domain", f"{where} imports domain {_name(opset.domain)}")
        for attr in f.attribute_proto:  # default values of the function's attributes
            for t in _attribute_tensors(attr):
                if _external(t):
                    raise Refusal("external_data", f"default of attribute {_name(attr.name)} of {where}")
            for sub in _attribute_graphs(attr):
                _check_graph(sub, where, local_domains)
        for sub in _walk_nodes(f.node, where, local_domains):
            _check_graph(sub, where, local_domains)


# --------------------------------------------------------------------------- declaration


def _classes_ok(classes) -> bool:
    """2 to MAX_CLASSES distinct labels, all str, all bool, or all finite numbers."""
    if not isinstance(classes, list) or not 2 <= len(classes) <= MAX_CLASSES:
        return False
    strings = all(isinstance(c, str) and len(c) <= 256 for c in classes)
    bools = all(isinstance(c, bool) for c in classes)
    numbers = all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in classes)
    return (strings or bools or numbers) and len(set(classes)) == len(classes)


def read_declaration(model, kind, n_features, max_features: int) -> tuple[str, int, list | None]:
    """(kind, n_features, classes) declared by ``model``; ``kind`` / ``n_features`` stand in for
    a declaration an ONNX file lacks entirely.  Refuses a width over ``max_features`` before
    anything is built for it."""
    props = {p.key: p.value for p in model.metadata_props}
    declared_here = META_KIND in props  # an msa_fed export: the whole declaration must be present
    d_kind = props.get(META_KIND, kind)
    if d_kind is None:
        raise Refusal("no_kind")
    if d_kind not in KINDS:
        raise Refusal("bad_kind", f"kind {_name(str(d_kind))}")
    raw_width = props.get(META_N_FEATURES)
    if raw_width is None:
        if n_features is None or declared_here:
            raise Refusal("no_width")
        d_width = int(n_features)
    else:
        if not re.fullmatch(r"[0-9]{1,18}", raw_width):
            raise Refusal("bad_width", f"n_features {_name(raw_width)}")
        d_width = int(raw_width)
    if d_width < 1:
        raise Refusal("bad_width", f"n_features {d_width}")
    if d_width > max_features:
        raise Refusal("too_wide", width=d_width, limit=int(max_features))
    classes = None
    if d_kind == KIND_PROBABILITIES and declared_here and META_CLASSES not in props:
        raise Refusal("no_classes")
    if d_kind == KIND_PROBABILITIES and META_CLASSES in props:
        raw = props[META_CLASSES]
        try:
            classes = json.loads(raw) if len(raw) <= 1 << 20 else None
        except (ValueError, RecursionError) as exc:
            raise Refusal("bad_classes", f"not JSON: {exc}", limit=MAX_CLASSES) from None
        if not _classes_ok(classes):
            raise Refusal("bad_classes", f"classes {_name(raw)}", limit=MAX_CLASSES)
    return d_kind, d_width, classes


def check_expectations(d_kind: str, d_width: int, kind, n_features, max_features: int) -> None:
    """The declaration against the caller's expectations (None: no expectation)."""
    if d_width > max_features:
        raise Refusal("too_wide", width=d_width, limit=int(max_features))
    if kind is not None and kind != d_kind:
        raise Refusal("kind_mismatch", kind=d_kind, expected=kind)
    if n_features is not None and int(n_features) != d_width:
        raise Refusal("width_mismatch", width=d_width, expected=int(n_features))


def check_io(model, d_width: int) -> None:
    """One float32 input of rank 2 whose fixed width, if any, is the declared one; an output."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise Refusal("n_inputs", count=len(inputs))
    if len(model.graph.output) < 1:
        raise Refusal("no_output")
    tensor_type = inputs[0].type.tensor_type
    if not inputs[0].type.HasField("tensor_type") or tensor_type.elem_type != 1:  # FLOAT
        raise Refusal("input_dtype", f"elem_type {tensor_type.elem_type}")
    dims = tensor_type.shape.dim
    if len(dims) != 2:
        raise Refusal("input_rank", rank=len(dims))
    if dims[1].HasField("dim_value") and dims[1].dim_value != d_width:
        raise Refusal("input_width", width=int(dims[1].dim_value), declared=d_width)


# --------------------------------------------------------------------------- probe


def probe_rows(d_width: int) -> int:
    """Rows per scale of the synthetic probe for width ``d_width`` (at least 2)."""
    per_row = 4 * d_width * len(PROBE_SCALES)
    return max(2, min(PROBE_ROWS_PER_SCALE, PROBE_MAX_BYTES // per_row))


def make_probe(d_width: int, sample=None):
    """The probe batch (float32, (n, d_width)): normal rows at every scale, then ``sample``'s rows."""
    import numpy as np

    rows = probe_rows(d_width)
    rng = np.random.default_rng(PROBE_SEED)
    blocks = [(rng.standard_normal((rows, d_width), dtype=np.float32) * np.float32(s)) for s in PROBE_SCALES]
    if sample is not None and len(sample):
        blocks.append(np.asarray(sample[:PROBE_MAX_SAMPLE_ROWS], dtype=np.float32))
    return np.concatenate(blocks, axis=0)


def check_outputs(out, d_kind: str, n_rows: int, classes) -> list | None:
    """Check the probe output; return the classes (default 0..c-1 for an undeclared file)."""
    import numpy as np

    if not isinstance(out, np.ndarray) or out.dtype.kind != "f":
        raise Refusal("output_dtype", f"output {type(out).__name__} {getattr(out, 'dtype', '')}")
    if d_kind == KIND_REGRESSION:
        if out.shape not in ((n_rows,), (n_rows, 1)):
            raise Refusal("regression_shape", f"shape {out.shape} for n={n_rows}")
    elif out.ndim != 2 or out.shape[0] != n_rows or out.shape[1] < 2:
        raise Refusal("proba_shape", f"shape {out.shape} for n={n_rows}")
    finite = np.isfinite(out)
    if not finite.all():
        bad = np.flatnonzero(~finite.reshape(n_rows, -1).all(axis=1))
        raise Refusal("nonfinite", f"{bad.size} of {n_rows} probe rows, first row {int(bad[0])}")
    if d_kind == KIND_REGRESSION:
        return None
    if classes is None:
        classes = list(range(out.shape[1]))
    if len(classes) != out.shape[1]:
        raise Refusal("classes_count", declared=len(classes), outputs=int(out.shape[1]))
    if out.min() < -1e-6 or out.max() > 1 + 1e-6:
        raise Refusal("proba_range", f"min {float(out.min())}, max {float(out.max())}")
    worst = float(np.max(np.abs(out.astype(np.float64).sum(axis=1) - 1.0)))
    if worst > PROBA_ATOL:
        raise Refusal("proba_sum", worst=worst)
    return classes


def open_session(data: bytes, intra_op_threads: int, *, memory_arena: bool = True):
    """(session, input name, output name) of ONNX bytes that a sandbox accepted, their structure
    checked again here (raises :class:`Refusal` on a structure rule, the library's own errors
    otherwise: the caller words them).  ``memory_arena`` False: a run's buffers are returned when
    it ends (a worker holding several peers' models keeps none of one model's peak for the next)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load_model_from_string(data)
    check_structure(model)
    del model
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(intra_op_threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4
    if not memory_arena:
        options.enable_cpu_mem_arena = False
    options.add_session_config_entry("session.load_model_format", "ONNX")
    session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    return session, session.get_inputs()[0].name, session.get_outputs()[0].name
