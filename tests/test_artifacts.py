"""Frozen ONNX predictors: export matches the source model; the loader refuses everything else."""

from __future__ import annotations

import io
import json
import pickle
import threading

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from msa_fed.artifacts import loader, sandbox
from msa_fed.artifacts.predictors import (
    META_CLASSES,
    META_KIND,
    META_N_FEATURES,
    OnnxPredictor,
    SandboxLimits,
    export_sklearn,
    export_torch,
    load_predictor,
    load_predictor_file,
    sha256_hex,
    to_onnx,
)
from msa_fed.errors import ArtifactError, ConfigError

RNG = np.random.default_rng(0)
X = RNG.normal(size=(120, 4))
Y_CLASS = np.array(["low", "mid", "high"])[(X[:, 0] + 0.5 * X[:, 1] > 0).astype(int) + (X[:, 2] > 1).astype(int)]
Y_REG = X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * RNG.normal(size=120)


def graph_model(nodes, inputs, outputs, initializers=(), props=None, opset=17):
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    model.ir_version = 8
    if props is not None:
        helper.set_model_props(model, props)
    return model


def linear(d=3, props="default", dtype=TensorProto.FLOAT, width=None, out_cols=1):
    """y = X @ W with W (d, out_cols); the declaration defaults to regression of width d."""
    w = np.ones((d, out_cols), dtype=np.float32 if dtype == TensorProto.FLOAT else np.float64)
    props = {META_KIND: "regression", META_N_FEATURES: str(d)} if props == "default" else props
    return graph_model(
        [helper.make_node("MatMul", ["X", "W"], ["y"])],
        [helper.make_tensor_value_info("X", dtype, ["n", width or d])],
        [helper.make_tensor_value_info("y", dtype, ["n", out_cols])],
        [numpy_helper.from_array(w, "W")],
        props,
    )


def errors_with(data, match, **kwargs):
    with pytest.raises(ArtifactError, match=match):
        load_predictor(data, **kwargs)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_pipeline(StandardScaler(), LogisticRegression()),
        lambda: RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0),
    ],
)
def test_sklearn_classifier_round_trip(make):
    model = make().fit(X, Y_CLASS)
    data = export_sklearn(model, 4)
    p = load_predictor(data, n_features=4, kind="probabilities")
    assert p.kind == "probabilities" and p.n_features_in_ == 4 and p.sha256 == sha256_hex(data)
    assert list(p.classes_) == list(model.classes_)
    np.testing.assert_allclose(p.predict_proba(X), model.predict_proba(X), atol=1e-5)
    assert (p.predict(X) == model.predict(X)).mean() > 0.99  # argmax ties may differ in float32
    props = {e.key: e.value for e in onnx.load_model_from_string(data).metadata_props}
    assert props[META_KIND] == "probabilities" and props[META_N_FEATURES] == "4"
    assert json.loads(props[META_CLASSES]) == list(model.classes_)
    assert len(onnx.load_model_from_string(data).graph.output) == 1


@pytest.mark.parametrize("model", [Ridge(alpha=0.1), GradientBoostingRegressor(n_estimators=10, random_state=0)])
def test_sklearn_regressor_round_trip(model):
    model.fit(X, Y_REG)
    p = load_predictor(export_sklearn(model, 4), kind="regression")
    out = p.predict(X)
    assert out.shape == (120,) and out.dtype == np.float64
    np.testing.assert_allclose(out, model.predict(X), rtol=1e-4, atol=1e-4)
    assert not hasattr(p, "predict_proba") and not hasattr(p, "classes_")


def test_torch_round_trip():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.Softmax(dim=1))
    net.train()
    p = load_predictor(export_torch(net, 4, "probabilities", classes=[10, 20, 30]))
    assert net.training  # the caller's mode is restored
    with torch.no_grad():
        expected = net(torch.tensor(X, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(p.predict_proba(X), expected, atol=1e-6)
    assert list(p.classes_) == [10, 20, 30]
    np.testing.assert_array_equal(p.predict(X), np.array([10, 20, 30])[expected.argmax(axis=1)])

    reg = torch.nn.Linear(4, 1)
    r = load_predictor(export_torch(reg, 4, "regression"))
    with torch.no_grad():
        np.testing.assert_allclose(r.predict(X), reg(torch.tensor(X, dtype=torch.float32)).numpy().ravel(), atol=1e-5)


def test_export_errors_name_the_problem():
    with pytest.raises(ConfigError, match="n_features=3 does not match"):
        export_sklearn(Ridge().fit(X, Y_REG), 3)
    with pytest.raises(ConfigError, match="n_features must be a positive integer"):
        export_sklearn(Ridge().fit(X, Y_REG), 0)
    with pytest.raises(ConfigError, match="classes has 2 labels"):
        export_torch(
            torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(dim=1)), 4, "probabilities", classes=[0, 1]
        )
    with pytest.raises(ConfigError, match="kind must be one of"):
        export_torch(torch.nn.Linear(4, 1), 4, "logits")
    with pytest.raises(ConfigError, match="regression module must output"):
        export_torch(torch.nn.Linear(4, 2), 4, "regression")


def test_to_onnx_dispatch():
    ridge = Ridge().fit(X, Y_REG)
    p = load_predictor(to_onnx(ridge, 4))
    assert to_onnx(p, 4) == p.data
    with pytest.raises(ConfigError, match="n_features=5"):
        to_onnx(p, 5)
    net = torch.nn.Linear(4, 1)
    assert load_predictor(to_onnx(net, 4, kind="regression")).kind == "regression"
    with pytest.raises(ConfigError, match="kind is required"):
        to_onnx(net, 4)
    with pytest.raises(ConfigError, match="cannot export"):
        to_onnx(object(), 4)


# --------------------------------------------------------------------------- loader


def test_pickles_zips_and_foreign_files_are_refused():
    errors_with(pickle.dumps(Ridge().fit(X, Y_REG)), "Python pickle")
    errors_with(pickle.dumps([1, 2, 3], protocol=2), "Python pickle")
    buf = io.BytesIO()
    torch.save(torch.nn.Linear(4, 1).state_dict(), buf)
    errors_with(buf.getvalue(), "zip archive")
    buf = io.BytesIO()
    np.save(buf, np.ones(3))
    errors_with(buf.getvalue(), "NumPy")
    errors_with(b"", "empty")
    errors_with(b"#!/bin/sh\nrm -rf /\n", "not a valid ONNX model")


def test_every_truncation_is_refused():
    for data in (linear().SerializeToString(), export_sklearn(LogisticRegression().fit(X, Y_CLASS), 4)):
        load_predictor(data)  # the whole file is fine
        # each refusal costs a sandbox start-up: 24 cuts spread over the file, and its last bytes
        cuts = sorted(set(np.linspace(0, len(data) - 1, 24).astype(int)) | set(range(len(data) - 4, len(data))))
        for cut in cuts:
            with pytest.raises(ArtifactError):
                load_predictor(data[:cut])


def test_checksum_size_and_expectations():
    data = linear().SerializeToString()
    errors_with(data, "sha256 is", expected_sha256="0" * 64)
    assert load_predictor(data, expected_sha256=sha256_hex(data).upper()).sha256 == sha256_hex(data)
    errors_with(data, f"is {len(data)} bytes; the limit is 10", max_bytes=10)
    errors_with(data, "declares n_features=3 but 4 was expected", n_features=4)
    errors_with(data, "declares kind='regression' but 'probabilities' was expected", kind="probabilities")


def test_declaration_must_match_the_graph():
    errors_with(
        linear(props={META_KIND: "regression", META_N_FEATURES: "3"}, width=5).SerializeToString(), "input width is 5"
    )
    errors_with(linear(props={META_KIND: "regression", META_N_FEATURES: "x"}).SerializeToString(), "positive integer")
    errors_with(linear(props={META_KIND: "logits", META_N_FEATURES: "3"}).SerializeToString(), "other than .regression")
    errors_with(linear(props={META_KIND: "regression"}).SerializeToString(), "declares no msa_fed.n_features")
    errors_with(linear(out_cols=2).SerializeToString(), r"must output shape \(n,\) or \(n, 1\)")
    errors_with(linear(dtype=TensorProto.DOUBLE).SerializeToString(), "input must be float32")
    # an ONNX file without any declaration: refused, unless the caller declares it
    bare = linear(props={}).SerializeToString()
    errors_with(bare, "declares no msa_fed.kind")
    assert load_predictor(bare, kind="regression", n_features=3).predict(np.ones((2, 3))).tolist() == [3.0, 3.0]


def softmax_model(d=3, c=2, softmax=True, classes="default", scale=1.0):
    w = RNG.normal(size=(d, c)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["z"])]
    nodes.append(
        helper.make_node("Softmax", ["z"], ["p0"], axis=1) if softmax else helper.make_node("Identity", ["z"], ["p0"])
    )
    nodes.append(helper.make_node("Mul", ["p0", "s"], ["p"]))
    props = {META_KIND: "probabilities", META_N_FEATURES: str(d)}
    if classes is not None:
        props[META_CLASSES] = json.dumps(list(range(c)) if classes == "default" else classes)
    return graph_model(
        nodes,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", d])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", c])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(scale, np.float32), "s")],
        props,
    ).SerializeToString()


def test_probabilities_are_checked_on_a_probe_batch():
    assert load_predictor(softmax_model()).kind == "probabilities"
    errors_with(softmax_model(softmax=False), "(outside \\[0, 1\\]|do not sum to 1)")
    errors_with(softmax_model(scale=0.9), "do not sum to 1")
    errors_with(softmax_model(c=1), "list of 2 to 10000 distinct scalar labels")
    errors_with(softmax_model(classes=["a", "b", "c"]), "declares 3 classes but outputs 2")
    errors_with(softmax_model(classes=None), "no msa_fed.classes")
    errors_with(softmax_model(classes=[[1], [2]]), "scalar labels")


def test_non_finite_and_non_tensor_outputs_are_refused():
    nan_model = graph_model(
        [helper.make_node("Div", ["X", "Z"], ["q"]), helper.make_node("ReduceSum", ["q", "axes"], ["y"], keepdims=1)],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [
            numpy_helper.from_array(np.zeros(2, np.float32), "Z"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
        {META_KIND: "regression", META_N_FEATURES: "2"},
    )
    errors_with(nan_model.SerializeToString(), "NaN or infinity")
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    zipmapped = convert_sklearn(LogisticRegression().fit(X, Y_CLASS), initial_types=[("X", FloatTensorType([None, 4]))])
    helper.set_model_props(
        zipmapped, {META_KIND: "probabilities", META_N_FEATURES: "4", META_CLASSES: '["high", "low", "mid"]'}
    )
    errors_with(zipmapped.SerializeToString(), "float tensor")


def test_external_data_and_unknown_domains_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = linear()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="weights.bin")
    (tmp_path / "weights.bin").write_bytes(np.ones(3, np.float32).tobytes())  # would be read if allowed
    with pytest.raises(ArtifactError, match="model uses external data"):
        load_predictor(model.SerializeToString())
    custom = graph_model(
        [helper.make_node("Evil", ["X"], ["y"], domain="org.attacker")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        props={META_KIND: "regression", META_N_FEATURES: "3"},
    )
    custom.opset_import.append(helper.make_opsetid("org.attacker", 1))
    errors_with(custom.SerializeToString(), "operator domain outside the allowed ones")


@pytest.mark.parametrize("start", ["zygote", "spawn"])
def test_a_graph_that_never_ends_is_stopped(start, monkeypatch):
    monkeypatch.setattr(sandbox, "SANDBOX_START", start)
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Add", ["a_in", "one"], ["a_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("a_in", TensorProto.FLOAT, ["n", 1]),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("a_out", TensorProto.FLOAT, ["n", 1]),
        ],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    looping = graph_model(
        [
            helper.make_node("ReduceSum", ["X", "axes"], ["s"], keepdims=1),
            helper.make_node("Loop", ["M", "c", "s"], ["y"], body=body),
        ],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [
            numpy_helper.from_array(np.array(10**15, np.int64), "M"),
            numpy_helper.from_array(np.array(True), "c"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
        {META_KIND: "regression", META_N_FEATURES: "2"},
    )
    # the sandbox's CPU-time limit ends it (the wall clock is far away)
    errors_with(looping.SerializeToString(), "CPU-time limit", limits=SandboxLimits(cpu_seconds=2, timeout_s=120))
    # the wall clock ends it when the CPU limit is far away
    errors_with(looping.SerializeToString(), "sandbox time limit", limits=SandboxLimits(cpu_seconds=600, timeout_s=3))


@settings(max_examples=20, deadline=None)  # each example starts a sandbox
@given(st.binary(max_size=2048))
def test_random_bytes_raise_only_artifact_error(data):
    with pytest.raises(ArtifactError):
        load_predictor(data)


# --------------------------------------------------------------------------- predictor object


def test_pickling_keeps_only_bytes_and_reverifies():
    p = load_predictor(export_sklearn(LogisticRegression().fit(X, Y_CLASS), 4))
    q = pickle.loads(pickle.dumps(p))
    assert isinstance(q, OnnxPredictor) and q.sha256 == p.sha256
    np.testing.assert_array_equal(q.predict_proba(X), p.predict_proba(X))
    tampered = bytearray(p.data)
    tampered[-1] ^= 1
    with pytest.raises(ArtifactError, match="sha256"):
        loader._restore(bytes(tampered), p.sha256, 1)


def test_input_validation_and_empty_batches():
    p = load_predictor(export_sklearn(LogisticRegression().fit(X, Y_CLASS), 4))
    with pytest.raises(ValueError, match=r"X must have shape \(n_samples, 4\); got \(3, 5\)"):
        p.predict_proba(np.zeros((3, 5)))
    with pytest.raises(ValueError):
        p.predict(np.zeros(4))
    assert p.predict_proba(np.zeros((0, 4))).shape == (0, 3)
    r = load_predictor(linear().SerializeToString())
    assert r.predict(np.zeros((0, 3))).shape == (0,)


def test_concurrent_predictions_match_serial():
    p = load_predictor(export_sklearn(RandomForestClassifier(n_estimators=5, random_state=0).fit(X, Y_CLASS), 4))
    batches = [RNG.normal(size=(200, 4)) for _ in range(8)]
    serial = [p.predict_proba(b) for b in batches]
    results = [None] * len(batches)

    def work(i):
        for _ in range(5):
            results[i] = p.predict_proba(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, expected in zip(results, serial):
        np.testing.assert_array_equal(got, expected)


def test_load_predictor_file(tmp_path):
    data = linear().SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    assert load_predictor_file(path, n_features=3).sha256 == sha256_hex(data)
    with pytest.raises(ArtifactError, match="the limit is 10"):
        load_predictor_file(path, max_bytes=10)


def test_concurrent_first_loads_each_get_their_own_verdict():
    """Threads loading different models at once (as a registry does) each get their model's answer."""
    good = [linear(d=d).SerializeToString() for d in range(2, 8)]
    bad = [softmax_model(scale=0.5), b"\x80\x04not onnx"]
    loader.PROBE_CACHE.clear()
    results: dict = {}

    def work(i, data):
        try:
            results[i] = load_predictor(data).n_features_in_
        except ArtifactError as exc:
            results[i] = exc.public_message

    threads = [threading.Thread(target=work, args=(i, data)) for i, data in enumerate(good + bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(good))] == list(range(2, 8))
    assert "do not sum to 1" in results[len(good)] and "Python pickle" in results[len(good) + 1]
