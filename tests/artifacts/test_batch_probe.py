"""Several models checked in one sandboxed child: the same verdict for each as one by one.

A hostile model in the batch is refused with its own verdict and changes nobody else's; a model
that ends the child sends the models it did not reach to a child of their own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.linear_model import LinearRegression, LogisticRegression

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_hostile_models import (  # noqa: E402
    ATTACKS,
    META_KIND,
    META_N_FEATURES,
    X_IN,
    memory_bomb,
    model_of,
    nan_when,
    wide_model,
)

from msa_fed.api import SiteData, fit_dmsa  # noqa: E402
from msa_fed.artifacts import loader, sandbox  # noqa: E402
from msa_fed.artifacts.model import load_model  # noqa: E402
from msa_fed.artifacts.predictors import SandboxLimits, export_sklearn  # noqa: E402
from msa_fed.artifacts.sandbox import ProbeItem, probe_batch_in_sandbox, probe_in_sandbox  # noqa: E402
from msa_fed.artifacts.structure import REASONS  # noqa: E402

RNG = np.random.default_rng(7)
X3 = RNG.normal(size=(120, 3))
LIMITS = SandboxLimits(memory_bytes=400 * 2**20)


def honest_classifier(c: float = 1.0) -> ProbeItem:
    y = (X3[:, 0] + 0.5 * X3[:, 1] > 0).astype(int) + (X3[:, 2] > 1)
    return ProbeItem(export_sklearn(LogisticRegression(C=c).fit(X3, y), 3), "probabilities", 3)


def honest_regressor() -> ProbeItem:
    return ProbeItem(export_sklearn(LinearRegression().fit(X3, X3 @ [1.0, -2.0, 0.5]), 3), "regression", 3)


def cpu_bomb(layers: int = 1500, width: int = 1024) -> bytes:
    """A valid regression model whose probe costs minutes of CPU: ``layers`` (width x width) products."""
    nodes = [helper.make_node("MatMul", ["X", "W0"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("ReduceSum", [f"h{layers}", "axes"], ["y"], keepdims=1))
    rng = np.random.default_rng(0)
    return model_of(
        nodes,
        [X_IN],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [
            numpy_helper.from_array(rng.normal(size=(3, width)).astype(np.float32), "W0"),
            numpy_helper.from_array((rng.normal(size=(width, width)) / width**0.5).astype(np.float32), "W"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
        props={META_KIND: "regression", META_N_FEATURES: "3"},
    ).SerializeToString()


def single(item: ProbeItem, limits: SandboxLimits) -> dict:
    return probe_in_sandbox(
        item.data, kind=item.kind, n_features=item.n_features, max_features=item.max_features, limits=limits
    )


def same(verdict: dict) -> dict:
    """A verdict without what depends on the process (its peak memory, a library's free text)."""
    out = {k: v for k, v in verdict.items() if k not in ("maxrss_kb", "cpu_s")}
    if not out["ok"]:
        out.pop("detail")
    return out


@pytest.fixture
def rechecked(monkeypatch):
    """The indices (by model bytes) of the models the batch sent to a child of their own."""
    seen: list[bytes] = []
    real = sandbox.probe_in_sandbox

    def counting(data, **kwargs):
        seen.append(bytes(data))
        return real(data, **kwargs)

    monkeypatch.setattr(sandbox, "probe_in_sandbox", counting)
    return seen


@pytest.mark.parametrize("start", ["zygote", "spawn"])
def test_batch_verdicts_equal_the_single_verdicts(start, monkeypatch, rechecked):
    monkeypatch.setattr(sandbox, "SANDBOX_START", start)
    items = [
        honest_classifier(),
        ProbeItem(ATTACKS[1]("secret.txt").SerializeToString()),  # external data
        honest_regressor(),
        ProbeItem(memory_bomb(160 * 2**20)),  # 640 MiB per run: over the 400 MiB limit
        ProbeItem(nan_when(6.0)),
        ProbeItem(wide_model(10_000_000), max_features=20_000_000),  # a 480 MB probe array
        ProbeItem(b"\x08\x07" + b"\xff" * 40),  # not ONNX
        honest_classifier(0.01),
        ProbeItem(ATTACKS[0]("secret.txt").SerializeToString()),  # an EP-context node
    ]
    batch = probe_batch_in_sandbox(items, LIMITS)
    del rechecked[:]
    singles = [single(it, LIMITS) for it in items]
    assert [same(v) for v in batch] == [same(v) for v in singles]
    assert [v["ok"] for v in batch] == [True, False, True, False, False, False, False, True, False]
    assert [v["code"] for v in batch if not v["ok"]] == [
        "external_data",
        "memory",
        "nonfinite",
        "memory",
        "not_onnx",
        singles[8]["code"],
    ]
    assert singles[8]["code"] in REASONS and singles[8]["code"] != "sandbox"
    assert batch[0]["classes"] == [0, 1, 2] and batch[2]["kind"] == "regression"


def test_a_hostile_model_first_in_the_batch_changes_no_other_verdict(rechecked):
    bomb, a, nan, b = (
        ProbeItem(memory_bomb(160 * 2**20)),
        honest_classifier(),
        ProbeItem(nan_when(6.0)),
        honest_regressor(),
    )
    verdicts = probe_batch_in_sandbox([bomb, a, nan, b], LIMITS)
    assert [v["ok"] for v in verdicts] == [False, True, False, True]
    assert verdicts[0]["code"] == "memory" and verdicts[2]["code"] == "nonfinite"
    # the honest models were accepted in the child the bomb ran in first (no second child for them);
    # the bomb's verdict is a single load's (first in the child); a later refusal is checked alone
    assert rechecked == [nan.data]
    assert same(verdicts[1]) == same(single(a, LIMITS)) and same(verdicts[3]) == same(single(b, LIMITS))


def test_a_model_that_kills_the_child_sends_the_rest_to_their_own(rechecked):
    limits = SandboxLimits(cpu_seconds=2)
    a, bomb, b = honest_classifier(), ProbeItem(cpu_bomb()), honest_regressor()
    verdicts = probe_batch_in_sandbox([a, bomb, b], limits)
    assert [v["ok"] for v in verdicts] == [True, False, True]
    assert verdicts[1]["code"] == "cpu"
    assert rechecked == [bomb.data, b.data] or rechecked == [b.data, bomb.data]  # side by side
    assert same(verdicts[0]) == same(single(a, limits)) and same(verdicts[2]) == same(single(b, limits))
    assert same(single(bomb, limits)) == same(verdicts[1])
    del rechecked[:]
    # first in the batch, the model that ends the child gets the verdict a single load gives it
    verdicts = probe_batch_in_sandbox([bomb, a], limits)
    assert [same(v) for v in verdicts] == [{"ok": False, "code": "cpu", "args": {}}, same(single(a, limits))]
    assert rechecked[0] == a.data


def test_each_model_of_a_batch_gets_its_own_cpu_seconds(rechecked):
    """The CPU limit is per model, as one by one: three models that each need under half the limit
    alone (child start included) but more than the limit together all pass one batch in one child.

    The models are sized on this machine (CPU per layer measured first), so a slower or loaded
    machine changes the layer count, not the verdict."""
    limit = 3
    limits = SandboxLimits(cpu_seconds=limit)
    generous = SandboxLimits(cpu_seconds=60)
    base = single(ProbeItem(cpu_bomb(layers=1)), generous)["cpu_s"]
    forty = single(ProbeItem(cpu_bomb(layers=41)), generous)["cpu_s"]
    per_layer = max((forty - base) / 40, 1e-4)
    layers = int(0.45 * limit / per_layer)
    slow = [ProbeItem(cpu_bomb(layers=layers + k)) for k in (0, 3, 6)]
    alone = [single(it, limits) for it in slow]
    assert all(v["ok"] for v in alone), alone
    del rechecked[:]
    verdicts = probe_batch_in_sandbox(slow, limits)
    assert all(v["ok"] for v in verdicts), verdicts
    assert verdicts[-1]["cpu_s"] > limit, (verdicts, alone)  # one limit for the child would have ended it
    assert rechecked == []  # all three passed in the batch's one child


def test_load_model_checks_its_predictors_in_one_child(tmp_path, monkeypatch):
    sites = []
    for k, shift in enumerate((-1.0, 0.0, 1.0)):
        Xl = RNG.normal(size=(40, 3)) + shift
        yl = (Xl[:, 0] > shift).astype(int)
        h = export_sklearn(LogisticRegression(C=0.5 + k).fit(Xl, yl), 3)
        sites.append(SiteData(f"s{k}", Xl, yl, RNG.normal(size=(50, 3)) + shift, loader.load_predictor(h)))
    model = fit_dmsa(sites, mu=0.1)
    path = model.save(tmp_path / "m")
    children = []
    real = sandbox._run_child

    def counting(payload, req, *args, **kwargs):
        children.append(len(req.get("batch") or [None]))
        return real(payload, req, *args, **kwargs)

    monkeypatch.setattr(sandbox, "_run_child", counting)
    monkeypatch.setenv("MSA_FED_VERIFIED_CACHE", str(tmp_path / "verified"))  # an empty record
    loader.PROBE_CACHE.clear()
    loaded = load_model(path)
    assert children == [3]  # one child for the three predictors
    X = RNG.normal(size=(20, 3))
    np.testing.assert_allclose(loaded.predict_proba(X), model.predict_proba(X), atol=1e-12)
    load_model(path)
    assert children == [3]  # verdicts are cached in this process
