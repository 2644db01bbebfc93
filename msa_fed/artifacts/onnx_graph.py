"""The combined model g as one ONNX graph: raw inputs in, class probabilities or the prediction out.

The graph computes what :meth:`msa_fed.CombinedModel.predict_proba` / ``predict`` compute, in
the same order of operations:

1. the feature map Phi (``standard``, ``onehot``, ``threshold`` or ``rff``) and the domain model:
   log Q(k | x) = log softmax(W Phi(x) + b) (Maxent), or the log posterior of the per-domain
   Gaussian KDEs (GMSA);
2. the combination weights a_k(x) = (z_k q_k(x) + eta/p) / (sum_j z_j q_j(x) + eta) with
   q_k = Q(k | x) / Qhat(k), computed from t_k = log z_k + log Q(k | x) - log Qhat(k) as
   (exp(t_k - M) + exp(log(eta/p) - M)) normalised over k, M the row's largest exponent (no
   overflow, no 0/0, z_k = 0 exactly zero);
3. the p frozen predictors, merged in with the names of site k prefixed ``site<k>/`` (each
   converted to the graph's opset when it was written for an older one), fed the input cast to
   float32 as the predictors are in Python;
4. classification: every predictor's probabilities placed in the columns of the union of the
   classes, floored at :data:`msa_fed.core.dc_terms.PROB_FLOOR`, mixed by a_k(x) and
   renormalised; outputs ``probabilities`` (n, c) and ``label`` (n,), the most probable class
   (the first one on ties, as ``numpy.argmax``).  Regression: ``prediction`` (n,) = sum_k
   a_k(x) h_k(x).

``dtype`` is the graph's arithmetic and input type: float64 reproduces the Python model to
rounding (the parity tests hold it to 1e-6), float32 is faster and looser.  The file holds only
standard operator sets (those its predictors use, and ``ai.onnx`` for the rest) and no external
data; ``metadata_props`` carry the model's description and provenance under ``msa_fed.*``.

With ``checks=True`` (the in-process fast path of :class:`msa_fed.CombinedModel`) the graph has a
last output, ``all_ok`` (a bool scalar): whether every predictor's output on every row is finite
and, for probabilities, in [0, 1] with rows summing to 1 (within
:data:`msa_fed.artifacts.outputs.PROBA_ATOL`), the checks the Python path applies to every row it
uses (where one fails, the Python path runs and names the predictor).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from msa_fed.errors import ArtifactError

#: the lowest ai.onnx opset of an exported graph (the reductions take their axes as an input)
MIN_OPSET = 18
FORMAT = "msa_fed.combined_onnx"
FORMAT_VERSION = 1
DTYPES = ("float32", "float64")
#: metadata keys (all prefixed ``msa_fed.``) an exported graph carries
META_PREFIX = "msa_fed."
SITE_PREFIX = "site{k}/"


class _Graph:
    """Nodes and initializers of the glue graph, with fresh names."""

    def __init__(self, np_dtype, onnx_dtype: int) -> None:
        self.nodes: list = []
        self.inits: list = []
        self.np_dtype = np_dtype
        self.onnx_dtype = onnx_dtype
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"msa/{hint}_{self._n}"

    def const(self, value, hint: str, dtype=None) -> str:
        from onnx import numpy_helper

        arr = np.asarray(value, dtype=dtype if dtype is not None else self.np_dtype)
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1, **attrs) -> Any:
        from onnx import helper

        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def axes(self, *axes: int) -> str:
        return self.const(np.array(axes, dtype=np.int64), "axes", dtype=np.int64)


# --------------------------------------------------------------------------- domain model


def _feature_map(g: _Graph, fmap, X: str) -> str:
    """Phi(X) for a built-in feature map (fitted or read from a saved model)."""
    from msa_fed.core.inference import StoredFeatureMap

    if fmap is None:
        return X
    if isinstance(fmap, StoredFeatureMap):
        name, arrays = fmap.name, fmap.arrays
        params = fmap.params
    else:
        from msa_fed.core.features import feature_map_state

        try:
            name, params, arrays = feature_map_state(fmap)
        except ValueError as exc:
            raise ArtifactError(f"cannot export to ONNX: {exc}") from None
    if name == "standard":
        return g.op("Div", [g.op("Sub", [X, g.const(arrays["mean"], "mean")]), g.const(arrays["scale"], "scale")])
    if name == "rff":
        S = g.op("Div", [g.op("Sub", [X, g.const(arrays["mean"], "mean")]), g.const(arrays["scale"], "scale")])
        Z = g.op("Add", [g.op("MatMul", [S, g.const(arrays["weights"], "rff_w")]), g.const(arrays["offset"], "rff_b")])
        factor = np.sqrt(2.0 / int(params["n_components"]))
        return g.op("Mul", [g.const(factor, "rff_scale"), g.op("Cos", [Z])])
    if name == "onehot":
        sizes = np.asarray(arrays["sizes"], dtype=np.int64)
        cols = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
        Xg = g.op("Gather", [X, g.const(cols, "onehot_cols", dtype=np.int64)], axis=1)
        hit = g.op("Equal", [Xg, g.const(arrays["values"], "onehot_values")])
        return g.op("Cast", [hit], to=g.onnx_dtype)
    if name == "threshold":
        x0 = g.op("Gather", [X, g.const(np.array([0], dtype=np.int64), "col0", dtype=np.int64)], axis=1)
        below = g.op("LessOrEqual", [x0, g.const(np.asarray(arrays["thresholds"]).reshape(-1), "thresholds")])
        return g.op("Cast", [below], to=g.onnx_dtype)
    raise ArtifactError(f"cannot export to ONNX: unknown feature map {name!r}")


def _log_domain(g: _Graph, dm, X: str) -> str:
    """log Q(k | x), (n, p)."""
    kind = getattr(type(dm), "kind", None)
    Phi = _feature_map(g, getattr(dm, "feature_map", None), X)
    if kind == "maxent":
        W = np.asarray(dm.coef_, dtype=np.float64)
        b = np.asarray(dm.intercept_, dtype=np.float64)
        scores = g.op("Add", [g.op("MatMul", [Phi, g.const(W.T, "maxent_w")]), g.const(b, "maxent_b")])
        return g.op("LogSoftmax", [scores], axis=1)
    if kind == "kde":
        return _log_kde(g, dm, Phi)
    raise ArtifactError(f"cannot export to ONNX: a domain model of type {type(dm).__name__}")


def _log_kde(g: _Graph, dm, Phi: str) -> str:
    """log D_k(x) - log sum_j D_j(x) for per-domain Gaussian KDEs (as msa_fed.core.density)."""
    cols = []
    for S, h in zip(dm.samples_, dm.bandwidths_):
        B = np.asarray(S, dtype=np.float64)
        n, d = B.shape
        center = B.mean(axis=0)
        B = B - center
        B_sq = np.einsum("ij,ij->i", B, B)
        Q = g.op("Sub", [Phi, g.const(center, "kde_center")])
        Q_sq = g.op("ReduceSum", [g.op("Mul", [Q, Q]), g.axes(1)], keepdims=1)
        D = g.op("Add", [Q_sq, g.const(B_sq[None, :], "kde_bsq")])
        D = g.op("Sub", [D, g.op("MatMul", [Q, g.const(2.0 * B.T, "kde_sample")])])
        D = g.op("Max", [D, g.const(0.0, "zero")])
        hh = float(h)
        L = g.op("ReduceLogSumExp", [g.op("Mul", [D, g.const(-0.5 / (hh * hh), "kde_h")]), g.axes(1)], keepdims=1)
        offset = -np.log(n) - 0.5 * d * np.log(2.0 * np.pi * hh * hh)
        cols.append(g.op("Add", [L, g.const(offset, "kde_norm")]))
    logd = g.op("Concat", cols, axis=1)
    return g.op("Sub", [logd, g.op("ReduceLogSumExp", [logd, g.axes(1)], keepdims=1)])


def _weights(g: _Graph, log_Q: str, qhat, z, eta: float) -> str:
    """a_k(x), (n, p), rows summing to 1 (see the module docstring)."""
    z = np.asarray(z, dtype=np.float64)
    p = z.size
    with np.errstate(divide="ignore"):
        c = np.log(z) - np.log(np.asarray(qhat, dtype=np.float64))
    t = g.op("Add", [log_Q, g.const(c, "log_z_over_qhat")])
    M = g.op("ReduceMax", [t, g.axes(1)], keepdims=1)
    if eta > 0:
        u = g.const(np.log(eta / p), "log_eta_p")
        M = g.op("Max", [M, u])
        num = g.op("Add", [g.op("Exp", [g.op("Sub", [t, M])]), g.op("Exp", [g.op("Sub", [u, M])])])
    else:
        num = g.op("Exp", [g.op("Sub", [t, M])])
    return g.op("Div", [num, g.op("ReduceSum", [num, g.axes(1)], keepdims=1)], hint="weights")


# --------------------------------------------------------------------------- predictors


def _opsets(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in model.opset_import:
        domain = "" if o.domain == "ai.onnx" else o.domain
        out[domain] = max(out.get(domain, 0), int(o.version))
    return out


def _predictor_models(model) -> list:
    """The p predictors as parsed ONNX models (structure checked as on every load)."""
    import onnx

    from msa_fed.artifacts.export import to_onnx
    from msa_fed.artifacts.structure import Refusal, check_structure

    out = []
    for k, h in enumerate(model.predictors):
        data = to_onnx(h, model.n_features_in_)
        m = onnx.load_model_from_string(data)
        try:
            check_structure(m)
        except Refusal as r:
            raise ArtifactError(f"cannot export to ONNX: predictor {k}: {r.code}") from None
        if len(m.graph.input) != 1 or len(m.graph.output) != 1:
            raise ArtifactError(f"cannot export to ONNX: predictor {k} must have one input and one output")
        out.append(m)
    return out


def _at_opset(m, version: int, k: int):
    """``m`` with its ai.onnx opset raised to ``version`` (ops rewritten where their form changed)."""
    from onnx import version_converter

    if _opsets(m).get("", version) == version:
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = version
        return m
    try:
        return version_converter.convert_version(m, version)
    except Exception as exc:  # noqa: BLE001 - the converter raises many types
        raise ArtifactError(
            f"cannot export to ONNX: predictor {k} uses ai.onnx opset {_opsets(m).get('')} and does not convert to "
            f"opset {version} ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


# --------------------------------------------------------------------------- the graph


def build_graph(
    model, dtype: str = "float64", *, checks: bool = False, metadata: dict | None = None, support: bool = False
):
    """The combined model ``model`` (a :class:`msa_fed.CombinedModel`) as an ``onnx.ModelProto``.

    dtype : "float64" or "float32", the input type and the arithmetic of everything but the
        predictors (which run in float32, as they do in Python).
    checks : add the ``all_ok`` output (module docstring).
    support : add the output ``support_pvalue`` (n,) where the model carries a target reference
        (:mod:`msa_fed.artifacts.onnx_support`).
    metadata : extra ``msa_fed.*`` metadata (str values), e.g. the provenance of the model.
    """
    import onnx
    from onnx import TensorProto, compose, helper

    from msa_fed.core.dc_terms import PROB_FLOOR

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    np_dtype = np.float64 if dtype == "float64" else np.float32
    onnx_dtype = TensorProto.DOUBLE if dtype == "float64" else TensorProto.FLOAT
    g = _Graph(np_dtype, onnx_dtype)
    d, p = model.n_features_in_, model.n_sources
    classification = model.task == "classification"

    preds = _predictor_models(model)
    opsets: dict[str, int] = {"": MIN_OPSET}
    for m in preds:
        for domain, version in _opsets(m).items():
            opsets[domain] = max(opsets.get(domain, 0), version)
    preds = [_at_opset(m, opsets[""], k) for k, m in enumerate(preds)]

    X = "X"
    log_Q = _log_domain(g, model.domain_model, X)
    a = _weights(g, log_Q, model.qhat, model.z, model.eta)
    X32 = X if dtype == "float32" else g.op("Cast", [X], hint="X_float32", to=TensorProto.FLOAT)

    pred_nodes, pred_inits, pred_vi, pred_funcs = [], [], [], []
    outs = []
    for k, m in enumerate(preds):
        m = compose.add_prefix(m, SITE_PREFIX.format(k=k))
        graph = m.graph
        in_name, out_name = graph.input[0].name, graph.output[0].name
        init_names = {t.name for t in graph.initializer}
        for node in graph.node:
            node.input[:] = [X32 if i == in_name and i not in init_names else i for i in node.input]
            pred_nodes.append(node)
        if out_name == in_name:  # an identity predictor: its output is its input
            out_name = X32
        pred_inits.extend(graph.initializer)
        pred_vi.extend(graph.value_info)
        pred_funcs.extend(m.functions)
        if graph.sparse_initializer:
            raise ArtifactError(f"cannot export to ONNX: predictor {k} holds sparse initializers")
        outs.append(out_name)

    # The p predictors' outputs are stacked along a new leading axis (contiguous copies; a concat
    # along the columns of n-row tensors copies a few values per row and is several times slower)
    # and combined in the layout (p, n, c).
    ok = ""
    aT = g.op("Transpose", [a], perm=[1, 0])  # (p, n)
    if classification:
        classes = np.asarray(model.classes_)
        c = classes.size
        cols = [np.searchsorted(classes, np.asarray(h.classes_)) for h in model.predictors]
        same = all(col.size == c and np.array_equal(col, np.arange(c)) for col in cols)
        if same:  # every predictor answers the union of the classes, in order
            raw = outs[0] if p == 1 else g.op("Concat", outs, axis=0)  # (p n, c), float32
            P = raw if dtype == "float32" else g.op("Cast", [raw], to=onnx_dtype)
        else:
            blocks = []
            for col, out in zip(cols, outs):
                Pk = out if dtype == "float32" else g.op("Cast", [out], to=onnx_dtype)
                if not (col.size == c and np.array_equal(col, np.arange(c))):
                    sel = np.zeros((col.size, c))
                    sel[np.arange(col.size), col] = 1.0  # into the union's columns; the others 0
                    Pk = g.op("MatMul", [Pk, g.const(sel, "class_columns")])
                blocks.append(Pk)
            P = blocks[0] if p == 1 else g.op("Concat", blocks, axis=0)
        P3 = g.op("Reshape", [P, g.const(np.array([p, -1, c], dtype=np.int64), "shape", dtype=np.int64)])
        if checks:
            ok = _proba_ok(g, P3)
        # a_k(x) repeated over the classes, (p, n, c): an outer product with ones (exact), so that
        # the product below has operands of one shape (broadcasting a trailing axis is slow)
        a_rep = g.op("MatMul", [g.op("Unsqueeze", [aT, g.axes(2)]), g.const(np.ones((1, c)), "ones")])
        floored = g.op("Max", [P3, g.const(PROB_FLOOR, "prob_floor")])
        mix = g.op("ReduceSum", [g.op("Mul", [floored, a_rep]), g.axes(0)], keepdims=0)  # (n, c)
        total = g.op("ReduceSum", [mix, g.axes(1)], keepdims=1)
        g.nodes.append(helper.make_node("Div", [mix, total], ["probabilities"], name="msa/probabilities"))
        idx = g.op("ArgMax", ["probabilities"], axis=1, keepdims=0, select_last_index=0)
        labels = classes.astype(object) if classes.dtype.kind in "US" else classes
        if classes.dtype.kind in "iu":
            labels = classes.astype(np.int64)
        g.nodes.append(
            helper.make_node("Gather", [g.const(labels, "classes", dtype=labels.dtype), idx], ["label"], axis=0)
        )
        label_type = helper.np_dtype_to_tensor_dtype(np.dtype(labels.dtype))
        outputs = [
            helper.make_tensor_value_info("probabilities", onnx_dtype, ["n", int(c)]),
            helper.make_tensor_value_info("label", label_type, ["n"]),
        ]
    else:
        shape = g.const(np.array([1, -1], dtype=np.int64), "shape", dtype=np.int64)
        rows = [g.op("Reshape", [out, shape]) for out in outs]
        H = rows[0] if p == 1 else g.op("Concat", rows, axis=0)  # (p, n)
        if dtype == "float64":
            H = g.op("Cast", [H], to=onnx_dtype)
        if checks:
            ok = _finite(g, H)
        g.nodes.append(
            helper.make_node(
                "ReduceSum", [g.op("Mul", [aT, H]), g.axes(0)], ["prediction"], keepdims=0, name="msa/prediction"
            )
        )
        outputs = [helper.make_tensor_value_info("prediction", onnx_dtype, ["n"])]
    if support:
        from msa_fed.artifacts import onnx_support

        if onnx_support.available(model):
            pvalue = onnx_support.support_nodes(g, model, X, _feature_map)
            g.nodes.append(helper.make_node("Identity", [pvalue], [onnx_support.OUTPUT], name="msa/support"))
            outputs.append(helper.make_tensor_value_info(onnx_support.OUTPUT, onnx_dtype, ["n"]))
    if checks:
        g.nodes.append(helper.make_node("Identity", [ok], ["all_ok"], name="msa/all_ok"))
        outputs.append(helper.make_tensor_value_info("all_ok", TensorProto.BOOL, []))

    # The predictors' nodes come first: the glue reads their outputs (topological order).
    glue_first = [n for n in g.nodes if X32 in n.output]
    rest = [n for n in g.nodes if X32 not in n.output]
    graph = helper.make_graph(
        glue_first + pred_nodes + rest,
        "msa_fed_combined_model",
        [helper.make_tensor_value_info(X, onnx_dtype, ["n", int(d)])],
        outputs,
        initializer=g.inits + pred_inits,
        value_info=pred_vi,
    )
    opset_imports = [helper.make_opsetid(domain, version) for domain, version in sorted(opsets.items())]
    ir = max([helper.find_min_ir_version_for(opset_imports, ignore_unknown=True)] + [m.ir_version for m in preds])
    out = helper.make_model(
        graph, opset_imports=opset_imports, ir_version=ir, producer_name="msa_fed", functions=pred_funcs
    )
    out.doc_string = (
        f"msa_fed combined model ({model.method}, {model.task}, {p} sites): input X ({dtype}, n x {d}); "
        + ("outputs probabilities (n x c) and label (n)" if classification else "output prediction (n)")
    )
    helper.set_model_props(out, _metadata(model, dtype, metadata or {}))
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as exc:
        raise ArtifactError(f"the combined graph does not pass the ONNX checker: {str(exc)[:300]}") from None
    return out


def _finite(g: _Graph, T: str) -> str:
    """A bool scalar: every value of T is finite.  The sum of all values is NaN or infinite when
    one is; a sum of finite float32 values cannot overflow in float64 (in a float32 graph it can,
    which only refuses the fast path)."""
    total = g.op("ReduceSum", [T], keepdims=0)
    return g.op("Equal", [g.op("Sub", [total, total]), g.const(0.0, "zero")])


def _proba_ok(g: _Graph, P3: str) -> str:
    """A bool scalar: every predictor's row in P3 (p, n, c) is finite, in [0, 1] and sums to 1
    within PROBA_ATOL, the checks of :func:`msa_fed.artifacts.outputs.checked_proba` (columns a
    predictor lacks hold exact zeros here, which change neither sums nor ranges)."""
    from msa_fed.artifacts.outputs import PROBA_ATOL

    sums = g.op("ReduceSum", [P3, g.axes(2)], keepdims=0)  # (p, n): each predictor's row sums
    dev = g.op("ReduceMax", [g.op("Abs", [g.op("Sub", [sums, g.const(1.0, "one")])])], keepdims=0)
    ok = g.op("LessOrEqual", [dev, g.const(PROBA_ATOL, "atol")])
    low = g.op("GreaterOrEqual", [g.op("ReduceMin", [P3], keepdims=0), g.const(-PROBA_ATOL, "low")])
    high = g.op("LessOrEqual", [g.op("ReduceMax", [P3], keepdims=0), g.const(1.0 + PROBA_ATOL, "high")])
    return g.op("And", [g.op("And", [_finite(g, P3), ok]), g.op("And", [low, high])])


def _metadata(model, dtype: str, extra: dict) -> dict[str, str]:
    """The model's description and provenance, as ``metadata_props`` (strings; JSON for lists)."""
    from msa_fed import __version__
    from msa_fed.artifacts.export import to_onnx
    from msa_fed.artifacts.loader import sha256_hex

    fmap = getattr(model.domain_model, "feature_map", None)
    fmap_name = getattr(fmap, "name", None) or (type(fmap).__name__ if fmap is not None else None)
    shas = [getattr(h, "sha256", None) or sha256_hex(to_onnx(h, model.n_features_in_)) for h in model.predictors]
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "code_version": __version__,
        "dtype": dtype,
        "method": model.method,
        "task": model.task,
        "n_features": str(model.n_features_in_),
        "sites": json.dumps(model.site_names),
        "z": json.dumps(model.z.tolist()),
        "eta": repr(float(model.eta)),
        "qhat": json.dumps(model.qhat.tolist()),
        "predictor_sha256": json.dumps(dict(zip(model.site_names, shas))),
        "domain_model": json.dumps({"kind": getattr(type(model.domain_model), "kind", None), "feature_map": fmap_name}),
        "inputs": json.dumps({"X": [dtype, "n", model.n_features_in_]}),
    }
    if model.classes_ is not None:
        meta["classes"] = json.dumps(np.asarray(model.classes_).tolist())
    if model.epsilon_by_site:
        meta["epsilon_by_site"] = json.dumps(model.epsilon_by_site)
    meta.update({k: str(v) for k, v in extra.items()})
    return {META_PREFIX + k: v for k, v in meta.items()}


def export_onnx(model, dtype: str = "float64", *, provenance: dict | None = None, support: bool = False) -> bytes:
    """The serialised graph of :func:`build_graph` (one self-contained file's bytes); ``support``:
    with the last output ``support_pvalue`` where the model carries a target reference."""
    return build_graph(model, dtype, metadata=provenance, support=support).SerializeToString()
