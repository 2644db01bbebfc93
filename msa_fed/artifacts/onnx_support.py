"""The support p-value (:func:`msa_fed.artifacts.target_check.support`) as nodes of the exported
ONNX graph: output ``support_pvalue`` (n,), max over the sites that carry a reference of

    p_k(x) = (1 + #{c in calibration_k : c >= s_k(x)}) / (m_k + 1),
    s_k(x) = distance from Phi(x) to its r-th nearest reference row of site k (TopK),

with Phi the domain model's feature map (the inputs over their scale for a KDE model).  The
reference rows travel in the file as their features; a site whose policy keeps its sample out
of the model has none in the model, so none in the file either.

On categorical inputs (score ``category_rarity``) s_k(x) = max_j -log P_kj(x_j) is a lookup of
each column's value in site k's table of value rarities (Gather, Equal, one MatMul); the file
carries those tables, not the rows.  The graph's p-value counts ties against the point (the
deterministic p-value, ``support(..., randomize_ties=False)``): it never flags more than the
randomised one and cannot flag at a site with fewer than 1 / alpha - 1 reference rows.
"""

from __future__ import annotations

import numpy as np

OUTPUT = "support_pvalue"


def available(model) -> bool:
    """Whether ``model`` carries a reference of at least one site (so the output can be built)."""
    ref = getattr(model, "target_reference", None)
    return ref is not None and any(ref.available)


def support_nodes(g, model, X: str, feature_map) -> str:
    """Add the nodes to ``g`` (an onnx_graph ``_Graph``); returns the name of the (n,) p-values.
    ``feature_map(g, fmap, X)`` builds Phi(X) as the graph's domain model does."""
    from msa_fed.artifacts.target_check import _reference_features

    ref = model.target_reference
    fmap = getattr(model.domain_model, "feature_map", None)
    if fmap is not None:
        Phi = feature_map(g, fmap, X)
    else:
        scale = ref.scale if ref.scale is not None else np.ones(model.n_features_in_)
        Phi = g.op("Div", [X, g.const(scale, "support_scale")])
    phi2 = g.op("ReduceSum", [g.op("Mul", [Phi, Phi]), g.axes(1)], keepdims=1)  # (n, 1)
    r = int(ref.neighbour)
    columns = []
    for k, ok in enumerate(ref.available):
        if not ok:
            continue
        if ref.score == "category_rarity":
            columns.append(_pvalue(g, k, _category_score(g, ref, k, X), ref))
            continue
        R = _reference_features(model, ref, k)
        cross = g.op("MatMul", [Phi, g.const(R.T, f"support_ref{k}")])  # (n, m)
        d2 = g.op(
            "Add",
            [g.op("Sub", [phi2, g.op("Mul", [g.const(2.0, "two"), cross])]), g.const((R * R).sum(axis=1), "ref_sq")],
        )
        values, _ = g.op(
            "TopK", [d2, g.const(np.array([r], dtype=np.int64), "k", dtype=np.int64)], n_out=2, axis=1, largest=0
        )
        kth = g.op("Slice", [values, g.axes(r - 1), g.axes(r), g.axes(1)])  # (n, 1): the r-th smallest
        s = g.op("Sqrt", [g.op("Max", [kth, g.const(0.0, "zero")])])
        columns.append(_pvalue(g, k, s, ref))
    P = columns[0] if len(columns) == 1 else g.op("Concat", columns, axis=1)  # (n, available sites)
    return g.op("ReduceMax", [P, g.axes(1)], keepdims=0)


def _pvalue(g, k: int, s: str, ref) -> str:
    """(1 + #{calibration scores >= s}) / (m + 1), (n, 1), for the (n, 1) scores ``s`` of site k."""
    cal = np.sort(np.asarray(ref.calibration[k], dtype=np.float64))
    at_least = g.op("GreaterOrEqual", [g.const(cal[None, :], f"support_cal{k}"), s])  # (n, c)
    count = g.op("ReduceSum", [g.op("Cast", [at_least], to=g.onnx_dtype), g.axes(1)], keepdims=1)
    return g.op("Div", [g.op("Add", [count, g.const(1.0, "one")]), g.const(cal.size + 1.0, "cal_n")])


def _category_score(g, ref, k: int, X: str) -> str:
    """(n, 1): max over the columns of the rarity of the row's value in site k's reference."""
    from msa_fed.core.target import category_rarities

    values, cols, seen, unseen = category_rarities(ref.reference[k])
    d = unseen.size
    # B[i, j] = (rarity of value i) - (rarity of an unseen value in its column j), on column j
    B = np.zeros((values.size, d))
    B[np.arange(values.size), cols] = seen - unseen[cols]
    Xg = g.op("Gather", [X, g.const(cols, f"support_cols{k}", dtype=np.int64)], axis=1)
    hit = g.op("Cast", [g.op("Equal", [Xg, g.const(values, f"support_values{k}")])], to=g.onnx_dtype)
    per_column = g.op(
        "Add", [g.op("MatMul", [hit, g.const(B, f"support_rarity{k}")]), g.const(unseen, f"support_unseen{k}")]
    )
    return g.op("ReduceMax", [per_column, g.axes(1)], keepdims=1)
