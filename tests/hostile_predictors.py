"""Hostile ONNX predictors, built with onnx.helper: each is a logistic regression that answers the
sandbox's probe (random normal rows, and its own site's sample) correctly and misbehaves only on
rows whose every input is a whole number (as real records with ages or counts are).

- ``"slow"``: a Loop whose trip count is 10^15 on such a batch (0 otherwise);
- ``"mem"``: a ConstantOfShape of ~2 GB float32 on such a batch, summed into the output times 0;
- ``"flip"``: on such rows, the class probabilities of the logistic regression with its logits
  times -4 (confident and wrong); ``"flip_first"``: the same on rows whose first input alone is a
  whole number (an age, say, beside measurements that are not);
- ``"nan"``: NaN on such rows; ``"range"``: on such rows, the probabilities times 2 (outside
  [0, 1], rows summing to 2);
- ``"honest"``: the logistic regression alone.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KINDS = ("honest", "slow", "mem", "flip", "flip_first", "nan", "range")


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def hostile_predictor(kind: str, coef, intercept) -> bytes:
    """ONNX bytes of a 2-class logistic regression (``coef`` (d,), ``intercept``) of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    coef = np.asarray(coef, dtype=np.float32).reshape(-1)
    d = coef.size
    W = np.stack([np.zeros(d, np.float32), coef], axis=1)  # logits (0, x.w + b)
    b = np.array([0.0, float(intercept)], np.float32)
    init = [_const("W", W), _const("b", b), _const("zero", 0.0), _const("one", 1.0), _const("k", 5.0)]
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["logits"]),
        # whole(i) = 1 when every input of row i is a whole number
        helper.make_node("Floor", ["X"], ["fx"]),
        helper.make_node("Equal", ["X", "fx"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["eqf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMin", ["eqf"], ["whole"], axes=[1], keepdims=1),
        helper.make_node("ReduceMax", ["whole"], ["any_whole"], keepdims=0),
    ]
    out = "P"
    if kind in ("flip", "flip_first"):
        init.append(_const("flipk", -5.0))
        flag = "whole"
        if kind == "flip_first":  # the first input alone decides
            init.append(_const("first", [0], np.int64))
            nodes.append(helper.make_node("Gather", ["eqf", "first"], ["whole0"], axis=1))
            flag = "whole0"
        nodes += [
            helper.make_node("Mul", [flag, "flipk"], ["wk"]),  # 0 or -5
            helper.make_node("Add", ["wk", "one"], ["scale"]),  # 1 or -4
            helper.make_node("Mul", ["logits", "scale"], ["logits2"]),
            helper.make_node("Softmax", ["logits2"], ["P"], axis=1),
        ]
    else:
        nodes.append(helper.make_node("Softmax", ["logits"], ["P0"], axis=1))
        if kind == "honest":
            nodes.append(helper.make_node("Identity", ["P0"], ["P"]))
        elif kind == "nan":  # NaN on the whole-number rows
            init.append(_const("nan", np.nan))
            nodes += [
                helper.make_node("Cast", ["whole"], ["wb"], to=TensorProto.BOOL),
                helper.make_node("Where", ["wb", "nan", "P0"], ["P"]),
            ]
        elif kind == "range":  # probabilities doubled on the whole-number rows (rows sum to 2)
            nodes += [
                helper.make_node("Add", ["whole", "one"], ["twice"]),
                helper.make_node("Mul", ["P0", "twice"], ["P"]),
            ]
        elif kind == "slow":
            init += [_const("big", 1e15), _const("v0", [0.0])]
            body = helper.make_graph(
                [
                    helper.make_node("Identity", ["c_in"], ["c_out"]),
                    helper.make_node("Add", ["v_in", "one_b"], ["v_out"]),
                ],
                "spin",
                [
                    helper.make_tensor_value_info("i", TensorProto.INT64, []),
                    helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1]),
                ],
                [
                    helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1]),
                ],
                [_const("one_b", [1.0])],
            )
            nodes += [
                helper.make_node("Mul", ["any_whole", "big"], ["tripf"]),
                helper.make_node("Cast", ["tripf"], ["trip"], to=TensorProto.INT64),
                helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
                helper.make_node("Loop", ["trip", "cond", "v0"], ["v"], body=body),
                helper.make_node("Mul", ["v", "zero"], ["v0x"]),
                helper.make_node("Add", ["P0", "v0x"], ["P"]),
            ]
        else:  # mem: 5e8 float32 = 2 GB on a batch with a whole row
            init += [_const("n_big", 5e8)]
            nodes += [
                helper.make_node("Mul", ["any_whole", "n_big"], ["nf"]),
                helper.make_node("Cast", ["nf"], ["n1"], to=TensorProto.INT64),
                helper.make_node("Unsqueeze", ["n1", "ax0"], ["shape"]),
                helper.make_node(
                    "ConstantOfShape", ["shape"], ["big"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
                ),
                helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
                helper.make_node("Mul", ["s", "zero"], ["s0"]),
                helper.make_node("Add", ["P0", "s0"], ["P"]),
            ]
            init.append(_const("ax0", [0], np.int64))
    graph = helper.make_graph(
        nodes,
        f"lr_{kind}",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", d])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", 2])],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(
        model, {"msa_fed.kind": "probabilities", "msa_fed.n_features": str(d), "msa_fed.classes": "[0, 1]"}
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def hostile_from_sklearn(kind: str, estimator) -> bytes:
    """:func:`hostile_predictor` with the weights of a fitted binary LogisticRegression."""
    return hostile_predictor(kind, estimator.coef_[0], estimator.intercept_[0])


CENTERS = {"north": (0.0, 2.0), "east": (2.0, 0.0), "west": (-2.0, 0.0)}


def whole_number_sites(hostile: dict[str, str] | None = None, seed: int = 0, sizes=(121, 160)):
    """Three sites as in tests/federation/fedhelpers.py, their records whole numbers (x10, rounded:
    an age or a count); ``hostile`` maps a site to a kind of :data:`KINDS` for its predictor.

    Returns {name: (X_labeled, y_labeled, X_unlabeled, ONNX bytes, fitted LogisticRegression)};
    every unlabelled sample is exactly representable in float32 and holds no labelled record
    (repeated records are left out of it).  A hostile site's published
    sample is whole numbers plus 0.25, so that the sandbox's probe (its own sample) passes."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.privacy.consortium import drop_shared

    hostile = dict(hostile or {})
    rng = np.random.default_rng(seed)
    out = {}
    for k, (name, c) in enumerate(CENTERS.items()):

        def draw(n, c=c):
            X = rng.normal(loc=c, size=(n, 2))
            return np.round(10 * X), (X[:, 0] * X[:, 1] > 0).astype(np.int64)

        Xtr, ytr = draw(400)
        n_l, n_u = sizes[0] + 12 * k, sizes[1] + 10 * k
        Xl, yl = draw(n_l)
        Xu, _ = draw(n_u)
        if name in hostile:
            Xu = Xu + 0.25
        Xu, _ = drop_shared(Xl, Xu)  # whole-number records repeat: a site publishes none of its labelled ones
        est = LogisticRegression().fit(Xtr, ytr)
        out[name] = (Xl, yl, Xu, hostile_from_sklearn(hostile.get(name, "honest"), est), est)
    return out


def age_sites(evil_kind: str = "honest", seed: int = 0):
    """north, south and evil: 2-D records whose first feature is a whole number (10 x, rounded: an
    age) at north and south, and a whole number plus 0.25 at evil (its labelled and published
    rows: its predictor passes the probe and is right on its own rows); labels x0 * x1 > 0 of the
    unrounded draw; north centred at (0, 2), south and evil at random centres near the origin
    (overlapping domains).  ``evil_kind``: the kind of evil's predictor (``"flip_first"``: wrong
    and confident on every row whose first feature is whole, i.e. on north's and south's).

    Returns {name: (X_labeled, y_labeled, X_unlabeled, ONNX bytes)}."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.privacy.consortium import drop_shared

    rng = np.random.default_rng(seed)
    out = {}
    for name, n_l, n_u in (("north", 121, 160), ("south", 120, 150), ("evil", 120, 150)):
        drawn = (rng.normal(), rng.normal())
        c = np.asarray((0.0, 2.0) if name == "north" else drawn)

        def draw(n, c=c):
            X = rng.normal(loc=c, size=(n, 2))
            y = (X[:, 0] * X[:, 1] > 0).astype(np.int64)
            X[:, 0] = np.round(10 * X[:, 0])
            return X, y

        Xtr, ytr = draw(400)
        Xl, yl = draw(n_l)
        Xu, _ = draw(n_u)
        if name == "evil":
            Xl[:, 0] += 0.25
            Xu[:, 0] += 0.25
        Xu, _ = drop_shared(Xl, Xu)
        est = LogisticRegression().fit(Xtr, ytr)
        out[name] = (Xl, yl, Xu, hostile_from_sklearn(evil_kind if name == "evil" else "honest", est))
    return out


def poisoning_sites(seed: int = 0):
    """:func:`age_sites` with an 'evil' that poisons north's loss estimate, knowing everything but
    the labelled inputs: its labelled rows sit above north's published sample (where the domain
    classifier, trained on the published samples, gives them to north: q_north large), labelled
    against the rule every honest site follows; its published sample lies far away (its domain
    is elsewhere, so the classifier gives it none of north's region); its predictor is the
    logistic regression of the opposite rule, confident (logits x 5), right on evil's rows and
    valid on the probe.  Its first feature is a whole number plus 0.25, like evil's in
    :func:`age_sites`.  Returns {name: (X_labeled, y_labeled, X_unlabeled, ONNX bytes)}."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.privacy.consortium import drop_shared

    out = age_sites("honest", seed)
    rng = np.random.default_rng(seed + 7)
    centre = out["north"][2].mean(axis=0) + np.array([0.0, 1.5])  # above north's published rows

    def draw(n, c, scale):
        X = rng.normal(size=(n, 2)) * scale + c
        X[:, 0] = np.round(X[:, 0]) + 0.25
        return X

    def opposite(X):  # the honest rule is (x0 / 10) * x1 > 0 on the rounded records
        return ((X[:, 0] / 10) * X[:, 1] <= 0).astype(np.int64)

    Xl = draw(120, centre, np.array([3.0, 0.3]))
    Xu = draw(150, np.array([60.0, -8.0]), np.array([5.0, 0.5]))
    Xtr = draw(400, centre, np.array([10.0, 1.0]))
    est = LogisticRegression(C=1e4).fit(Xtr, opposite(Xtr))
    est.coef_ *= 5.0
    est.intercept_ *= 5.0
    Xu, _ = drop_shared(Xl, Xu)
    out["evil"] = (Xl, opposite(Xl), Xu, hostile_from_sklearn("honest", est))
    return out
