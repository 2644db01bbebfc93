"""The combined model as one ONNX graph: the exported file alone reproduces the model.

Every feature map (standard, onehot, threshold, rff), both tasks, the Maxent and the KDE domain
models; random and adversarial inputs (large magnitudes, exact ties on categories and
thresholds, tied class probabilities, a domain with a near-zero Qhat, z with a zero weight,
eta = 0).  The reference is the model computed part by part in numpy (``_predict_*_numpy``);
the in-process fast path (the model's own graph) is held to the same reference, and to the
numpy path's errors when a predictor misbehaves.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from sklearn.linear_model import LinearRegression, LogisticRegression

from msa_fed.artifacts import load_predictor
from msa_fed.artifacts.export import export_sklearn
from msa_fed.artifacts.loader import OnnxClassifier
from msa_fed.artifacts.model import CombinedModel, load_model
from msa_fed.artifacts.structure import check_structure
from msa_fed.core.config import ClassifierConfig
from msa_fed.core.density import KDEDomainModel
from msa_fed.core.domain_classifier import train_domain_classifier
from msa_fed.core.features import make_feature_map
from msa_fed.core.inference import StoredFeatureMap, StoredMaxent
from msa_fed.errors import ArtifactError

FEATURE_MAPS = ("standard", "onehot", "threshold", "rff")
TASKS = ("classification", "regression")
P = 3


def site_inputs(fmap: str, rng, n: int = 150) -> list[np.ndarray]:
    """Each site's inputs, shaped for the feature map (1-D for threshold, categories for onehot)."""
    if fmap == "threshold":
        return [rng.normal(loc=2.0 * k, size=(n, 1)) for k in range(P)]
    if fmap == "onehot":
        return [rng.integers(0, 3 + k, size=(n, 3)).astype(np.float64) + 0.5 * k for k in range(P)]
    return [rng.normal(loc=(1.5 * k, -k, 0.5 * k), size=(n, 3)) for k in range(P)]


def labels(X: np.ndarray) -> np.ndarray:
    s = X.sum(axis=1)
    return np.digitize(s, np.quantile(s, [1 / 3, 2 / 3]))  # three classes


def build(fmap: str, task: str, *, kde: bool = False, seed: int = 0, eta: float = 1e-2, z=None, qhat=None):
    """A combined model built in-process from real fits (small data: a second or two)."""
    rng = np.random.default_rng(seed)
    Xs = site_inputs(fmap, rng)
    d = Xs[0].shape[1]
    spec = ("rff", {"n_components": 40, "gamma": 0.5}) if fmap == "rff" else fmap
    if kde:
        dm = KDEDomainModel(bandwidth=[0.7, 0.9, 1.1], feature_map=make_feature_map(spec)).fit(Xs)
    else:
        dm = train_domain_classifier(Xs, make_feature_map(spec, random_state=seed), ClassifierConfig(mu=1e-3))
    predictors = []
    for k, X in enumerate(Xs):
        if task == "classification":
            y = labels(X + rng.normal(size=X.shape))
            if k == 1:  # this site never saw class 2: its columns are a subset of the union
                keep = y != 2
                X, y = X[keep], y[keep]
            h = LogisticRegression(max_iter=500).fit(X, y)
            kind = "probabilities"
        else:
            h = LinearRegression().fit(X, X @ rng.normal(size=d) + k)
            kind = "regression"
        predictors.append(load_predictor(export_sklearn(h, d), n_features=d, kind=kind))
    pooled = np.vstack(Xs)
    Q = np.exp(dm.predict_log_proba(pooled))
    return CombinedModel(
        method="gmsa" if kde else "dmsa",
        task=task,
        site_names=["north", "east", "west"],
        domain_model=dm,
        qhat=Q.mean(axis=0) if qhat is None else qhat,
        z=rng.dirichlet(np.ones(P)) if z is None else z,
        eta=eta,
        predictors=predictors,
        n_features=d,
        classes=[0, 1, 2] if task == "classification" else None,
        epsilon_by_site={"north": 1.5, "east": 0.0, "west": 2.0},
    ), pooled


def reference(model, X):
    """The model part by part in numpy."""
    return model._predict_proba_numpy(X) if model.task == "classification" else model._predict_numpy(X)


def run_graph(data: bytes, X, dtype="float64"):
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(None, {"X": np.asarray(X, dtype=dtype)})


def adversarial(fmap: str, model, pooled, rng) -> np.ndarray:
    """Large magnitudes, exact category and threshold values (ties of <= and ==), duplicates."""
    d = model.n_features_in_
    rows = [pooled[:20], pooled[:5]]  # duplicated rows
    rows += [rng.normal(size=(10, d)) * s for s in (1e3, 1e6, 1e12)]
    fm = model.domain_model.feature_map
    if fmap == "threshold":
        rows.append(fm.thresholds_[:, None])  # x exactly at every threshold
        rows.append(np.nextafter(fm.thresholds_, np.inf)[:, None])
    if fmap == "onehot":
        rows.append(np.column_stack([c[rng.integers(0, c.size, 30)] for c in fm.categories_]))
        rows.append(np.column_stack([c[rng.integers(0, c.size, 30)] + 1e-9 for c in fm.categories_]))  # unseen
    return np.vstack(rows)


@pytest.fixture(scope="module")
def models():
    return {(f, t): build(f, t) for f in FEATURE_MAPS for t in TASKS}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("fmap", FEATURE_MAPS)
def test_exported_graph_reproduces_the_model_float64(models, fmap, task, tmp_path):
    model, pooled = models[fmap, task]
    rng = np.random.default_rng(1)
    X = np.vstack([pooled + rng.normal(size=pooled.shape), adversarial(fmap, model, pooled, rng)])
    ref = reference(model, X)
    data = model.to_onnx("float64")
    out = run_graph(data, X)
    np.testing.assert_allclose(out[0], ref, rtol=1e-12, atol=1e-6)
    if task == "classification":
        np.testing.assert_array_equal(out[1], model.classes_[np.argmax(ref, axis=1)])
        assert out[0].shape == (X.shape[0], 3)
    else:
        assert out[0].shape == (X.shape[0],)
    # the in-process fast path (the model's own graph with checks) and the model after a save/load
    fast = model.predict_proba(X) if task == "classification" else model.predict(X)
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-9)
    loaded = load_model(model.save(tmp_path / "m"))
    assert isinstance(loaded.domain_model, StoredMaxent)
    assert isinstance(loaded.domain_model.feature_map, StoredFeatureMap)
    again = loaded.predict_proba(X) if task == "classification" else loaded.predict(X)
    np.testing.assert_allclose(again, ref, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(run_graph(loaded.to_onnx("float64"), X)[0], ref, rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("task", TASKS)
def test_standard_map_folded_into_the_classifier_weights(models, task, tmp_path, monkeypatch):
    """The standard map's (x - mean) / scale is folded into W and b: the graph's first use of X
    is the product (and the predictors' float32 cast), and every answer is the former graph's
    (the map as its own two passes) within 1e-9, adversarial rows included, saved or not."""
    from msa_fed.artifacts import onnx_graph

    model, pooled = models["standard", task]
    rng = np.random.default_rng(2)
    X = np.vstack([pooled + rng.normal(size=pooled.shape), adversarial("standard", model, pooled, rng)])
    loaded = load_model(model.save(tmp_path / "m"))
    folded = [run_graph(m.to_onnx("float64"), X)[0] for m in (model, loaded)]
    graph = onnx.load_model_from_string(model.to_onnx("float64")).graph
    assert {n.op_type for n in graph.node if "X" in n.input} == {"MatMul", "Cast"}
    monkeypatch.setattr(onnx_graph, "_standard_arrays", lambda fmap: None)  # the former graph
    for m, out in zip((model, loaded), folded):
        former = run_graph(m.to_onnx("float64"), X)[0]
        np.testing.assert_allclose(out, former, rtol=0, atol=1e-9)
        np.testing.assert_allclose(out, reference(m, X), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("fmap", FEATURE_MAPS)
def test_exported_graph_float32_is_close(models, fmap, task):
    model, pooled = models[fmap, task]
    X = pooled + np.random.default_rng(2).normal(size=pooled.shape)
    if fmap == "onehot":
        X = pooled  # float32 keeps these categories exact
    ref = reference(model, X)
    out = run_graph(model.to_onnx("float32"), X, "float32")
    assert out[0].dtype == np.float32
    scale = 1.0 if task == "classification" else max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(out[0], ref, rtol=0, atol=1e-4 * scale)
    if task == "classification":
        assert np.mean(out[1] == model.classes_[np.argmax(ref, axis=1)]) > 0.99


@pytest.mark.parametrize("task", TASKS)
def test_kde_domain_model_exports(task):
    model, pooled = build("standard", task, kde=True)
    rng = np.random.default_rng(3)
    X = np.vstack([pooled[::3] + rng.normal(size=pooled[::3].shape), rng.normal(size=(10, 3)) * 50])
    ref = reference(model, X)
    np.testing.assert_allclose(run_graph(model.to_onnx("float64"), X)[0], ref, rtol=1e-12, atol=1e-6)
    # in process, a KDE model predicts in numpy (the graph would hold every distance at once)
    assert model._graph_session() is None
    np.testing.assert_array_equal(model.predict(X), model.predict(X))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_near_zero_qhat_zero_z_and_eta_zero(dtype):
    """A domain whose Qhat is 1e-300 (its q_k is astronomically large wherever Q(k|x) is not tiny),
    a site with z = 0, and eta = 0: the log-space weights neither overflow nor divide 0 by 0."""
    base, pooled = build("standard", "classification", seed=4)
    for qhat, z, eta in (
        ([1e-300, 0.5, 0.5], [0.2, 0.3, 0.5], 1e-2),
        ([1e-300, 0.5, 0.5], [0.0, 0.5, 0.5], 0.0),
        ([0.3, 0.3, 0.4], [0.0, 0.0, 1.0], 0.0),
    ):
        model = CombinedModel(
            method="dmsa",
            task="classification",
            site_names=base.site_names,
            domain_model=base.domain_model,
            qhat=qhat,
            z=z,
            eta=eta,
            predictors=base.predictors,
            n_features=3,
            classes=[0, 1, 2],
        )
        X = np.vstack([pooled, np.random.default_rng(5).normal(size=(50, 3)) * 30])
        ref = reference(model, X)
        out = run_graph(model.to_onnx(dtype), X, dtype)[0]
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6 if dtype == "float64" else 1e-4)
        np.testing.assert_allclose(model.predict_proba(X), ref, rtol=1e-12, atol=1e-9)


def test_tied_probabilities_give_the_first_class(tmp_path):
    """Predictors that answer exactly 1/2 everywhere: the label is the first class, as numpy.argmax."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(200, 2))
    flat = LogisticRegression().fit(X, (X[:, 0] > 0).astype(int))
    flat.coef_[:] = 0.0
    flat.intercept_[:] = 0.0
    h = load_predictor(export_sklearn(flat, 2), n_features=2, kind="probabilities")
    dm = train_domain_classifier([X[:100], X[100:] + 1], make_feature_map("standard"), ClassifierConfig())
    model = CombinedModel(
        method="dmsa",
        task="classification",
        site_names=["a", "b"],
        domain_model=dm,
        qhat=[0.5, 0.5],
        z=[0.5, 0.5],
        eta=1e-2,
        predictors=[h, h],
        n_features=2,
        classes=[0, 1],
    )
    probs, label = run_graph(model.to_onnx("float64"), X)
    assert np.all(probs == 0.5)
    assert np.all(label == 0) and np.all(model.predict(X) == 0)


def with_predictors(model, predictors, classes):
    """A 3-feature DMSA classifier: ``model``'s domain model, Qhat and z over other ``predictors``."""
    return CombinedModel(
        method="dmsa",
        task="classification",
        site_names=model.site_names,
        domain_model=model.domain_model,
        qhat=model.qhat,
        z=model.z,
        eta=model.eta,
        predictors=predictors,
        n_features=3,
        classes=classes,
    )


def test_string_labels_and_metadata(models, tmp_path):
    model, pooled = models["standard", "classification"]
    named = CombinedModel(
        method=model.method,
        task=model.task,
        site_names=model.site_names,
        domain_model=model.domain_model,
        qhat=model.qhat,
        z=model.z,
        eta=model.eta,
        predictors=model.predictors,
        n_features=3,
        classes=[0, 1, 2],
        epsilon_by_site=model.epsilon_by_site,
    )
    data = named.to_onnx("float64", provenance={"registry_version": 7})
    m = onnx.load_from_string(data)
    check_structure(m)  # standard operator domains, no external data anywhere
    onnx.checker.check_model(m, full_check=True)
    assert {o.domain for o in m.opset_import} <= {"", "ai.onnx.ml"}
    for t in m.graph.initializer:
        assert t.data_location == onnx.TensorProto.DEFAULT and not t.external_data
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["msa_fed.registry_version"] == "7"
    assert json.loads(meta["msa_fed.predictor_sha256"]) == {
        n: h.sha256 for n, h in zip(model.site_names, model.predictors)
    }
    assert json.loads(meta["msa_fed.z"]) == model.z.tolist() and float(meta["msa_fed.eta"]) == model.eta
    assert json.loads(meta["msa_fed.epsilon_by_site"]) == {"north": 1.5, "east": 0.0, "west": 2.0}
    assert json.loads(meta["msa_fed.classes"]) == [0, 1, 2]
    # every predictor's nodes are there, prefixed by its site index
    names = {n.name for n in m.graph.node}
    assert all(any(name.startswith(f"site{k}/") for name in names) for k in range(P))
    # string class labels come out as strings
    h_names = []
    for h in model.predictors:
        h_names.append(
            OnnxClassifier(h.data, h.kind, h.n_features_in_, sha256=h.sha256, classes=[str(c) for c in h.classes_])
        )
    lettered = with_predictors(model, h_names, ["0", "1", "2"])
    label = run_graph(lettered.to_onnx("float64"), pooled)[1]
    assert label.dtype == object and list(label) == list(lettered.predict(pooled))


def test_a_misbehaving_predictor_is_caught_on_the_fast_path(models):
    """A predictor that answers NaN on some rows (never seen at load time): the graph's checks
    send the call to the numpy path, whose error names the predictor; other rows are served."""
    from onnx import TensorProto, helper

    model, pooled = models["standard", "classification"]
    # probabilities [1 - s, s] with s = sigmoid(x0), NaN where x0 > 6 (log of a negative number)
    x0 = helper.make_node("Slice", ["X", "zero", "one", "one"], ["x0"])
    nodes = [
        x0,
        helper.make_node("Sigmoid", ["x0"], ["s"]),
        helper.make_node("Sub", ["one_f", "s"], ["r"]),
        helper.make_node("Sub", ["six", "x0"], ["m"]),
        helper.make_node("Sqrt", ["m"], ["sq"]),  # NaN where x0 > 6
        helper.make_node("Mul", ["sq", "zero_f"], ["nan_or_zero"]),
        helper.make_node("Add", ["s", "nan_or_zero"], ["s2"]),
        helper.make_node("Concat", ["r", "s2"], ["probabilities"], axis=1),
    ]
    inits = [
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("one_f", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("six", TensorProto.FLOAT, [], [6.0]),
    ]
    graph = helper.make_graph(
        nodes,
        "bad",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 2])],
        initializer=inits,
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8).SerializeToString()
    bad = OnnxClassifier(data, "probabilities", 3, classes=[0, 1])
    mixed = with_predictors(model, [model.predictors[0], bad, model.predictors[2]], [0, 1, 2])
    ok_rows = np.clip(pooled, -5, 5)
    np.testing.assert_allclose(mixed.predict_proba(ok_rows), reference(mixed, ok_rows), rtol=1e-12, atol=1e-9)
    assert mixed._graph_session() is not None
    X = ok_rows.copy()
    X[7, 0] = 8.0
    with pytest.raises(ArtifactError, match=r"predictor 1 \(site 'east'\).*NaN or inf.*first row 7"):
        mixed.predict_proba(X)


def test_stored_feature_maps_and_maxent_match_the_training_classes(models):
    """load_model's numpy-only objects compute exactly what the training classes compute."""
    for fmap in FEATURE_MAPS:
        model, pooled = models[fmap, "classification"]
        dm = model.domain_model
        from msa_fed.core.features import feature_map_state

        name, params, arrays = feature_map_state(dm.feature_map)
        stored = StoredFeatureMap(name, params, arrays)
        X = np.vstack([pooled, pooled * 1e3])
        assert np.array_equal(stored.transform(X), dm.feature_map.transform(X))
        sm = StoredMaxent(stored, dm.theta_, dm.n_sources, dm.mu)
        assert np.array_equal(sm.predict_log_proba(X), dm.predict_log_proba(X))


def test_load_model_needs_neither_torch_nor_scikit_learn(models, tmp_path):
    model, pooled = models["rff", "classification"]
    path = model.save(tmp_path / "m")
    np.save(tmp_path / "X.npy", pooled)
    code = (
        "import sys, numpy as np, msa_fed\n"
        f"m = msa_fed.load_model({str(path)!r})\n"
        f"P = m.predict_proba(np.load({str(tmp_path / 'X.npy')!r}))\n"
        "print(sys.stdin.read() == '', P.shape, sorted(k for k in ('torch', 'sklearn', 'scipy') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, input="")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"True ({pooled.shape[0]}, 3) []", out.stdout
