"""Hostile ONNX models, built as an attacker would, against the real loader and sandbox.

Every refusal must carry only a fixed public reason: no byte of a file, no library text.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from onnx import TensorProto, helper, numpy_helper

from msa_fed.api import SiteData, fit_dmsa
from msa_fed.artifacts import loader
from msa_fed.artifacts.model import load_model
from msa_fed.artifacts.predictors import (
    META_CLASSES,
    META_KIND,
    META_N_FEATURES,
    SANDBOX_MEMORY_BYTES,
    SandboxLimits,
    export_sklearn,
    load_predictor,
)
from msa_fed.artifacts.sandbox import sandbox_self_check
from msa_fed.artifacts.structure import REASONS
from msa_fed.errors import ArtifactError, ConfigError

SECRET = b"ADMINTOKEN-s3cr3t-0123456789abcdef"  # 34 bytes; the attack reads the first 32
PROBA = {META_KIND: "probabilities", META_N_FEATURES: "3", META_CLASSES: "[0, 1, 2, 3]"}


def model_of(
    nodes, inputs, outputs, initializers=(), props=PROBA, functions=(), opsets=(("", 17),), sparse_initializers=()
):
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, list(initializers), sparse_initializer=list(sparse_initializers)
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], functions=list(functions)
    )
    model.ir_version = 8
    helper.set_model_props(model, props)
    return model


def external_int64(location: str, n: int = 4, name: str = "v") -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.INT64, dims=[n])
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=location)
    t.external_data.add(key="length", value=str(8 * n))
    return t


def leaking_sparse(location: str, where: str = "values") -> onnx.SparseTensorProto:
    """A sparse tensor whose values (or indices) are read from ``location``."""
    if where == "values":
        return helper.make_sparse_tensor(
            external_int64(location), numpy_helper.from_array(np.arange(4, dtype=np.int64), "i"), [4]
        )
    values = numpy_helper.from_array(np.arange(4, dtype=np.int64), "v")
    return helper.make_sparse_tensor(values, external_int64(location, name="i"), [1 << 62])


def gather_leak_nodes(location: str, where: str = "values"):
    """The reported attack: the secret's bytes become Gather indices, so onnxruntime's error
    text prints them (8 bytes per index)."""
    return [
        helper.make_node("Constant", [], ["c"], sparse_value=leaking_sparse(location, where)),
        helper.make_node("Gather", ["X", "c"], ["y"], axis=1),
    ]


X_IN = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])
Y_OUT = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])


def main_graph_leak(location):
    return model_of(gather_leak_nodes(location), [X_IN], [Y_OUT])


def indices_leak(location):
    return model_of(gather_leak_nodes(location, "indices"), [X_IN], [Y_OUT])


def subgraph_leak(location):
    branch = helper.make_graph(gather_leak_nodes(location), "then", [], [Y_OUT])
    other = helper.make_graph([helper.make_node("Identity", ["X"], ["y"])], "else", [], [Y_OUT])
    nodes = [
        helper.make_node("ReduceSum", ["X"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other),
    ]
    return model_of(nodes, [X_IN], [Y_OUT], [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])


def calling(f, output=Y_OUT):
    """A model whose graph is one call of the local function ``f`` (X -> y)."""
    return model_of(
        [helper.make_node("leak", ["X"], ["y"], domain="org.local")],
        [X_IN],
        [output],
        functions=[f],
        opsets=(("", 17), ("org.local", 1)),
    )


def function_leak(location):
    f = helper.make_function(
        "org.local", "leak", ["X"], ["y"], gather_leak_nodes(location), [helper.make_opsetid("", 17)]
    )
    return calling(f)


def sparse_initializer_leak(location):
    sp = leaking_sparse(location)
    sp.values.name = "c"
    return model_of([helper.make_node("Gather", ["X", "c"], ["y"], axis=1)], [X_IN], [Y_OUT], sparse_initializers=[sp])


def dense_attribute_leak(location):
    t = external_int64(location)
    return model_of(
        [helper.make_node("Constant", [], ["c"], value=t), helper.make_node("Gather", ["X", "c"], ["y"], axis=1)],
        [X_IN],
        [Y_OUT],
    )


def function_default_leak(location):
    """A function whose attribute default (FunctionProto.attribute_proto) is external."""
    f = helper.make_function(
        "org.local", "leak", ["X"], ["y"], [helper.make_node("Identity", ["X"], ["y"])], [helper.make_opsetid("", 17)]
    )
    default = helper.make_attribute("w", leaking_sparse(location))
    f.attribute_proto.append(default)
    return calling(f, helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]))


def nested_leak(location):
    """The leak inside a function body's If, inside a Loop body of the main graph."""
    inner = subgraph_leak(location).graph
    f = helper.make_function("org.local", "leak", ["X"], ["y"], list(inner.node), [helper.make_opsetid("", 17)])
    f.node.insert(
        0, helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0.0, np.float32)))
    )
    return calling(f)


def ep_context_leak(location):
    """An EPContext node: its ep_cache_context names a file for an execution provider to read."""
    node = helper.make_node(
        "EPContext",
        ["X"],
        ["y"],
        domain="com.microsoft",
        embed_mode=0,
        ep_cache_context=location,
        source="CPUExecutionProvider",
    )
    return model_of([node], [X_IN], [Y_OUT], opsets=(("", 17), ("com.microsoft", 1)))


ATTACKS = [
    ep_context_leak,
    main_graph_leak,
    indices_leak,
    subgraph_leak,
    function_leak,
    sparse_initializer_leak,
    dense_attribute_leak,
    function_default_leak,
    nested_leak,
]


def secret_forms():
    """The secret as raw bytes, text and as the int64 values onnxruntime would print."""
    forms = [SECRET, SECRET.decode(), SECRET[:8].decode()]
    for i in range(0, 32, 8):
        forms.append(str(struct.unpack("<q", SECRET[i : i + 8])[0]))
    return forms


def assert_no_secret(*texts):
    for text in texts:
        raw = text.encode() if isinstance(text, str) else bytes(text)
        for form in secret_forms():
            assert (form if isinstance(form, bytes) else form.encode()) not in raw


@pytest.fixture
def secret_cwd(tmp_path, monkeypatch):
    """A real secret in the working directory (as next to the registry's reg.db)."""
    (tmp_path / "admin.token").write_bytes(SECRET)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_attack_is_real_without_the_loader(secret_cwd):
    """Control: onnxruntime itself, given these bytes, reads the file and prints its bytes."""
    data = main_graph_leak("admin.token").SerializeToString()
    onnx.checker.check_model(onnx.load_model_from_string(data))  # the checker lets it through
    with pytest.raises(Exception) as info:
        ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"X": np.ones((1, 3), np.float32)})
    assert str(struct.unpack("<q", SECRET[:8])[0]) in str(info.value)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_external_data_is_refused_and_leaks_nothing(attack, absolute, secret_cwd, caplog):
    location = str(secret_cwd / "admin.token") if absolute else "admin.token"
    data = attack(location).SerializeToString()
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ArtifactError) as info:
        load_predictor(data)
    err = info.value
    assert err.public_message == REASONS["external_data"]
    assert len(err.incident_id) == 12 and err.incident_id in caplog.text  # the detail is logged under the id
    assert_no_secret(str(err), repr(err), err.public_message, err.detail or "", caplog.text, pickle.dumps(err))


def test_the_second_line_of_defence_refuses_external_data_too(secret_cwd):
    """The process that builds its own session re-checks the structure before onnxruntime sees it."""
    with pytest.raises(ArtifactError, match="external data"):
        loader._session_for(nested_leak("admin.token").SerializeToString(), 1)


def vm_hwm_kb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def wide_model(width: int):
    """A 200-byte model declaring ``width`` features with a symbolic input width."""
    return model_of(
        [helper.make_node("ReduceSum", ["X", "axes"], ["y"], keepdims=1)],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", "d"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")],
        props={META_KIND: "regression", META_N_FEATURES: str(width)},
    ).SerializeToString()


def test_a_huge_declared_width_costs_this_process_nothing():
    data = wide_model(10_000_000)
    assert len(data) < 300
    before = vm_hwm_kb()
    with pytest.raises(ArtifactError) as info:
        load_predictor(data)
    assert info.value.public_message == "declared input width 10000000 exceeds the limit of 100000 features"
    with pytest.raises(ArtifactError, match="exceeds the limit of 100000"):
        load_predictor(data, n_features=10_000_000)  # an expectation does not lift the bound
    # with the bound lifted, the probe array (~480 MB) is built in the sandbox, under its memory limit
    limits = SandboxLimits(memory_bytes=400 * 2**20)
    with pytest.raises(ArtifactError) as info:
        load_predictor(data, max_features=20_000_000, limits=limits)
    assert info.value.public_message == REASONS["memory"]
    assert load_predictor(wide_model(1000), limits=limits).n_features_in_ == 1000  # the same graph, narrow: fits
    assert vm_hwm_kb() - before < 16 * 1024  # this process's peak grew by less than 16 MiB


def test_a_parser_amplification_bomb_is_parsed_only_in_the_sandbox():
    """16 MB of empty NodeProto entries expand to gigabytes when parsed: the caller never parses."""
    base = wide_model(3)
    model = onnx.load_model_from_string(base)
    graph = model.graph.SerializeToString() + b"\x0a\x00" * (8 * 2**20)
    model.ClearField("graph")
    data = model.SerializeToString() + b"\x3a" + _VarintBytes(len(graph)) + graph  # field 7: graph
    before = vm_hwm_kb()
    with pytest.raises(ArtifactError) as info:
        load_predictor(data, max_bytes=64 * 2**20)
    assert info.value.public_message == REASONS["memory"]  # the parse hit the sandbox's limit
    assert vm_hwm_kb() - before < 16 * 1024


def memory_bomb(n_floats: int):
    """Passes the probe, but allocates n_floats float32 (ConstantOfShape) on every run."""
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["big"], value=numpy_helper.from_array(np.array([1.0], np.float32))
        ),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "zero"], ["s0"]),
        helper.make_node("ReduceSum", ["X", "axes"], ["r"], keepdims=1),
        helper.make_node("Add", ["r", "s0"], ["y"]),
    ]
    return model_of(
        nodes,
        [X_IN],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [
            numpy_helper.from_array(np.array([n_floats], np.int64), "shape"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
        props={META_KIND: "regression", META_N_FEATURES: "3"},
    ).SerializeToString()


def test_a_memory_bomb_is_stopped_by_the_sandbox_limit():
    data = memory_bomb(160 * 2**20)  # 640 MiB
    before = vm_hwm_kb()
    with pytest.raises(ArtifactError) as info:
        load_predictor(data, limits=SandboxLimits(memory_bytes=400 * 2**20))
    assert info.value.public_message == REASONS["memory"]
    assert vm_hwm_kb() - before < 16 * 1024
    # control: the same model under a larger limit runs (so it was the limit that stopped it)
    assert load_predictor(data, limits=SandboxLimits(memory_bytes=2 * 2**30)).kind == "regression"
    assert vm_hwm_kb() - before < 16 * 1024
    assert SANDBOX_MEMORY_BYTES == SandboxLimits().memory_bytes  # what a server charges per load


def test_library_error_text_never_reaches_the_public_message(caplog):
    """onnxruntime refuses this model at run time; its text goes to the log, under the incident id."""
    caplog.set_level(logging.WARNING)
    data = model_of(
        [helper.make_node("Gather", ["X", "c"], ["y"], axis=1)],
        [X_IN],
        [Y_OUT],
        [numpy_helper.from_array(np.array([0, 1, 2, 99], np.int64), "c")],
    ).SerializeToString()
    with pytest.raises(ArtifactError) as info:
        load_predictor(data)
    err = info.value
    assert err.public_message == REASONS["probe_failed"]
    public = str(err).replace(err.incident_id, "")  # the random hex id may itself contain "99"
    assert "ONNXRuntimeError" not in public and "99" not in public
    assert "ONNXRuntimeError" in err.detail
    record = next(r for r in caplog.records if err.incident_id in r.getMessage())
    assert "ONNXRuntimeError" in record.getMessage()
    again = pickle.loads(pickle.dumps(err))  # as Ray ships it
    assert (again.public_message, again.incident_id, again.detail) == (err.public_message, err.incident_id, err.detail)


# --------------------------------------------------------------------------- poisoned outputs


def nan_when(low: float, high: float = np.inf):
    """Two-class softmax over (x0, x1, x2), but NaN for every class when low < x0 < high."""
    w = np.array([[1.0, -1.0], [0.5, 0.0], [0.0, 0.5]], np.float32)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["z"]),
        helper.make_node("Softmax", ["z"], ["p"], axis=1),
        helper.make_node("Slice", ["X", "s0", "s1", "s_ax"], ["x0"]),
        helper.make_node("Greater", ["x0", "low"], ["above"]),
        helper.make_node("Less", ["x0", "high"], ["below"]),
        helper.make_node("And", ["above", "below"], ["bad"]),
        helper.make_node("Where", ["bad", "nan", "p"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.array([0], np.int64), "s0"),
        numpy_helper.from_array(np.array([1], np.int64), "s1"),
        numpy_helper.from_array(np.array([1], np.int64), "s_ax"),
        numpy_helper.from_array(np.array(low, np.float32), "low"),
        numpy_helper.from_array(np.array(high, np.float32), "high"),
        numpy_helper.from_array(np.array(np.nan, np.float32), "nan"),
    ]
    return model_of(
        nodes,
        [X_IN],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        inits,
        props={META_KIND: "probabilities", META_N_FEATURES: "3", META_CLASSES: "[0, 1]"},
    ).SerializeToString()


RNG = np.random.default_rng(0)
POISON = 6.0005  # inside the narrow NaN window (6, 6.001) that no probe row hits


def test_nan_beyond_x0_6_is_caught_by_the_probe():
    with pytest.raises(ArtifactError) as info:
        load_predictor(nan_when(6.0))
    assert info.value.public_message == REASONS["nonfinite"]


def test_a_narrow_nan_window_is_caught_with_the_sites_sample():
    data = nan_when(6.0, 6.001)
    assert load_predictor(data).kind == "probabilities"  # the synthetic probe misses the window
    sample = RNG.normal(size=(200, 3))
    sample[17, 0] = POISON
    with pytest.raises(ArtifactError) as info:
        load_predictor(data, sample=sample)
    assert info.value.public_message == REASONS["nonfinite"]
    with pytest.raises(ConfigError, match="sample has 2 columns but n_features=3"):
        load_predictor(data, sample=sample[:, :2], n_features=3)
    with pytest.raises(ArtifactError, match="probe sample has 2 columns but the model declares n_features=3"):
        load_predictor(data, sample=sample[:, :2])


def two_sites(poison_labeled=False, poison_unlabeled=False):
    from sklearn.linear_model import LogisticRegression

    sites = []
    for shift in (-1.0, 1.0):
        Xl = RNG.normal(size=(60, 3)) + shift
        yl = (Xl[:, 0] + 0.3 * RNG.normal(size=60) > shift).astype(int)
        Xu = RNG.normal(size=(80, 3)) + shift
        sites.append((Xl, yl, Xu))
    if poison_labeled:
        sites[0][0][5, 0] = POISON
    if poison_unlabeled:
        sites[0][2][7, 0] = POISON
    bad = load_predictor(nan_when(6.0, 6.001))
    good = load_predictor(export_sklearn(LogisticRegression().fit(sites[1][0], sites[1][1]), 3))
    return [SiteData("a", *sites[0], bad), SiteData("b", *sites[1], good)]


@pytest.mark.parametrize("where", ["labelled", "unlabelled"])
def test_fit_refuses_a_predictor_that_outputs_nan_on_a_sites_points(where):
    sites = two_sites(poison_labeled=where == "labelled", poison_unlabeled=where == "unlabelled")
    with pytest.raises(ConfigError) as info:
        fit_dmsa(sites, mu=0.1)
    msg = str(info.value)
    # site a's own predictor, on a's own points: a ConfigError naming a (no PeerFault: no peer)
    assert msg == f"site 'a''s own predictor: predict_proba returned NaN or inf for some of its {where} points"
    assert "row" not in msg  # which private rows fail is not said to the coordinator


def test_the_combined_model_raises_instead_of_predicting_class_0(tmp_path):
    model = fit_dmsa(two_sites(), mu=0.1)
    X = RNG.normal(size=(5, 3))
    assert model.predict(X).shape == (5,)
    X[3, 0] = POISON
    for m in (model, load_model(model.save(tmp_path / "m"))):
        with pytest.raises(
            ArtifactError, match=r"predictor 0 \(site 'a'\): .*NaN or inf for 1 of 5 rows \(first row 3\)"
        ):
            m.predict(X)
        with pytest.raises(ArtifactError, match=r"predictor 0 \(site 'a'\)"):
            m.predict_proba(X)
    with pytest.raises(ArtifactError, match="NaN or infinite probabilities"):
        model.predictors[0].predict(X)  # the predictor alone does not argmax NaN either


# --------------------------------------------------------------------------- cache and verdicts


def test_a_model_is_sandboxed_once_per_process(monkeypatch):
    calls = []
    real = loader.probe_in_sandbox

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "probe_in_sandbox", counting)
    loader.PROBE_CACHE.clear()
    data = nan_when(6.0, 6.001)
    for _ in range(3):
        load_predictor(data)
    p = load_predictor(data, kind="probabilities", n_features=3)
    pickle.loads(pickle.dumps(p))
    assert len(calls) == 2  # without expectations, with them; the restore (sha256 checked here) hits the cache
    for _ in range(2):
        with pytest.raises(ArtifactError):
            load_predictor(nan_when(6.0))
    assert len(calls) == 4  # refusals are not cached


def test_a_lying_sandbox_verdict_is_refused(monkeypatch):
    """The child ran hostile bytes: its answer is checked like any other input."""
    for verdict in (
        {"ok": True, "kind": "probabilities", "n_features": 3, "classes": [[1], [2]]},
        {"ok": True, "kind": "logits", "n_features": 3},
        {"ok": True, "kind": "regression", "n_features": True},
        {"ok": False, "code": "too_large", "args": {"size": "/etc/passwd contents", "limit": 1}},
        {"ok": False, "code": "no such code", "detail": 5},
        {"ok": False, "code": "memory", "args": {"detail": 1, "code": "x"}, "detail": "a\nFORGED log line"},
        ["not", "a", "dict"],
    ):
        monkeypatch.setattr(loader, "probe_in_sandbox", lambda *a, v=verdict, **k: v)
        loader.PROBE_CACHE.clear()
        with pytest.raises(ArtifactError) as info:
            load_predictor(nan_when(6.0, 6.001))
        assert "passwd" not in str(info.value) and json.dumps(verdict) not in str(info.value)
        assert "\n" not in (info.value.detail or "")  # one log line per incident
    loader.PROBE_CACHE.clear()


@pytest.mark.parametrize("start", ["zygote", "spawn"])
def test_the_sandbox_gives_a_model_nothing_to_reach(start, tmp_path, monkeypatch):
    """Empty working directory, minimal environment, no inherited descriptor, limits set before
    onnxruntime is imported (and before numpy and onnx when the child is a fresh interpreter)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "admin.token").write_bytes(SECRET)
    monkeypatch.setenv("MSA_FED_ADMIN_TOKEN", SECRET.decode())
    with open(tmp_path / "admin.token", "rb") as leaked:  # an inheritable descriptor in this process
        os.set_inheritable(leaked.fileno(), True)
        report = sandbox_self_check(SandboxLimits(memory_bytes=700 * 2**20, cpu_seconds=7, max_files=24), start)
    assert report["ok"] is True
    assert report["cwd_entries"] == []
    assert set(report["env"]) <= {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_ALL", "LC_CTYPE"}
    assert report["fds"] == [0, 1, 2, 3, 4]  # stdin, /dev/null as stdout, stderr, the verdict, the listing itself
    assert report["rlimits"] == {
        "RLIMIT_AS": [700 * 2**20] * 2,
        "RLIMIT_CPU": [7, 8],
        "RLIMIT_FSIZE": [0, 0],
        "RLIMIT_NOFILE": [24, 24],
        "RLIMIT_CORE": [0, 0],
    }
    assert report["modules"] == (["numpy", "onnx"] if start == "zygote" else [])


def test_loads_go_on_when_the_fork_helper_dies():
    from msa_fed.artifacts import zygote

    data = nan_when(6.0, 6.001)
    loader.PROBE_CACHE.clear()
    load_predictor(data)
    helper_proc = zygote._zygote.proc
    helper_proc.kill()
    helper_proc.wait()
    loader.PROBE_CACHE.clear()
    assert load_predictor(data).kind == "probabilities"  # a new helper (or a fresh interpreter) took over
    assert zygote._zygote is None or zygote._zygote.proc.pid != helper_proc.pid
