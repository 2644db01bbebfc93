"""The record of verified predictors: a second load of the same bytes runs no sandbox; anything
changed, forged or out of place is checked again, in the sandbox, as on a first load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from msa_fed.artifacts import loader, sandbox, verified_cache
from msa_fed.artifacts.model import load_model
from msa_fed.artifacts.sandbox import SandboxLimits
from msa_fed.artifacts.verified_cache import ENV, VerifiedCache
from msa_fed.errors import ArtifactError


@pytest.fixture
def record(tmp_path, monkeypatch):
    """An empty record for this test, this process's verdict cache emptied (a new process)."""
    path = tmp_path / "verified"
    monkeypatch.setenv(ENV, str(path))
    loader.PROBE_CACHE.clear()
    yield path
    loader.PROBE_CACHE.clear()


@pytest.fixture
def children(monkeypatch):
    """The sandboxed children started (the number of models each one checked) and helper starts."""
    seen: dict[str, list] = {"children": [], "warm_up": []}
    real_run, real_warm = sandbox._run_child, sandbox.warm_up

    def run(payload, req, *args, **kwargs):
        seen["children"].append(len(req.get("batch") or [None]))
        return real_run(payload, req, *args, **kwargs)

    def warm():
        seen["warm_up"].append(1)
        real_warm()

    monkeypatch.setattr(sandbox, "_run_child", run)
    monkeypatch.setattr(sandbox, "warm_up", warm)
    return seen


def copy_model(demo_model_dir, tmp_path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(demo_model_dir[0], path)
    return path


def not_summing_to_one(d: int = 2) -> bytes:
    """A two-class 'probabilities' model whose rows do not sum to 1 (sigmoid of each logit)."""
    w = numpy_helper.from_array(np.array([[1.0, -1.0], [0.5, 0.25]], np.float32)[:d], "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["z"]), helper.make_node("Sigmoid", ["z"], ["y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def swap_predictor(path: Path, k: int, data: bytes) -> None:
    """Replace predictor k and its digest in the manifest (what whoever writes the directory can do)."""
    (path / "predictors" / f"{k}.onnx").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["predictor_sha256"][k] = loader.sha256_hex(data)
    (path / "manifest.json").write_text(json.dumps(manifest))


def entry_name(data: bytes, n_features: int = 2) -> tuple[str, dict]:
    """The file name and key of ``data``'s verdict as load_model looks it up."""
    key = verified_cache.entry_key(
        loader.sha256_hex(data),
        "probabilities",
        n_features,
        loader.DEFAULT_MAX_FEATURES,
        None,
        None,
        SandboxLimits(),
    )
    return verified_cache._name(key), key


def test_a_second_load_of_the_same_files_runs_no_sandbox(demo_model_dir, record, children):
    X = demo_model_dir[1][:50]
    first = load_model(demo_model_dir[0])
    assert children == {"children": [3], "warm_up": [1]}
    assert sorted(os.listdir(record)) == sorted(
        entry_name((demo_model_dir[0] / "predictors" / f"{k}.onnx").read_bytes())[0] for k in range(3)
    )
    assert os.stat(record).st_mode & 0o777 == 0o700
    assert all(os.stat(record / name).st_mode & 0o777 == 0o600 for name in os.listdir(record))
    loader.PROBE_CACHE.clear()  # as in a new process
    second = load_model(demo_model_dir[0])
    assert children == {"children": [3], "warm_up": [1]}  # no child, no helper started
    np.testing.assert_array_equal(second.predict_proba(X), first.predict_proba(X))


def test_a_new_process_loads_from_the_record_without_starting_the_sandbox(demo_model_dir, record):
    load_model(demo_model_dir[0])
    script = (
        "import sys, msa_fed; from msa_fed.artifacts import zygote; "
        "m = msa_fed.load_model(sys.argv[1]); print(m.n_sources, zygote._zygote is None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(demo_model_dir[0])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, ENV: str(record)},
        check=True,
    )
    assert out.stdout.split() == ["3", "True"]


def test_a_changed_predictor_is_checked_again(demo_model_dir, tmp_path, record, children):
    path = copy_model(demo_model_dir, tmp_path)
    load_model(path)
    assert children["children"] == [3]
    # a hostile file in place of predictor 1, the manifest's digest updated to match
    swap_predictor(path, 1, not_summing_to_one())
    loader.PROBE_CACHE.clear()
    with pytest.raises(ArtifactError, match="sum to 1"):
        load_model(path)
    assert children["children"] == [3, 1]  # only the changed file, in a child of its own
    # the same change without the manifest's digest: refused before any verdict is looked up
    (path / "predictors" / "2.onnx").write_bytes((path / "predictors" / "0.onnx").read_bytes())
    with pytest.raises(ArtifactError, match="sha256"):
        load_model(path)
    assert children["children"] == [3, 1]


@pytest.mark.parametrize("forgery", ["renamed", "linked", "symlink", "writable by others", "fifo", "torn"])
def test_a_forged_entry_is_not_trusted(forgery, demo_model_dir, tmp_path, record, children):
    """The record holds the honest model's verdicts; an entry put under the hostile file's name
    in any of these ways does not let the hostile file past the sandbox."""
    path = copy_model(demo_model_dir, tmp_path)
    load_model(path)
    honest = record / entry_name((path / "predictors" / "1.onnx").read_bytes())[0]
    bad = not_summing_to_one()
    name, key = entry_name(bad)
    target = record / name
    forged = json.dumps({"key": key, "verdict": json.loads(honest.read_text())["verdict"]})
    if forgery == "renamed":  # another model's entry moved under this name
        os.replace(honest, target)
    elif forgery == "linked":
        os.link(honest, target)
    elif forgery == "symlink":  # a link to a well-formed entry elsewhere
        (tmp_path / "elsewhere.json").write_text(forged)
        os.symlink(tmp_path / "elsewhere.json", target)
    elif forgery == "writable by others":
        target.write_text(forged)
        os.chmod(target, 0o666)
    elif forgery == "fifo":  # opening it for reading would block: the load must not hang
        os.mkfifo(target)
    else:
        target.write_text(forged[: len(forged) // 2])
    swap_predictor(path, 1, bad)
    loader.PROBE_CACHE.clear()
    with pytest.raises(ArtifactError, match="sum to 1"):
        load_model(path)
    assert children["children"] == [3, 1]


def test_a_directory_others_can_write_is_not_used(demo_model_dir, record, children, caplog):
    record.mkdir(mode=0o700)
    os.chmod(record, 0o777)
    with caplog.at_level(logging.WARNING, "msa_fed.artifacts"):
        load_model(demo_model_dir[0])
    assert os.listdir(record) == []  # nothing written
    assert "not used" in caplog.text
    name, key = entry_name((demo_model_dir[0] / "predictors" / "0.onnx").read_bytes())
    os.chmod(record, 0o700)
    (record / name).write_text(json.dumps({"key": key, "verdict": {"ok": True}}))
    os.chmod(record, 0o777)
    assert VerifiedCache(record).get(key) is None
    os.chmod(record, 0o700)
    assert VerifiedCache(record).get(key) == {"ok": True}


def test_the_key_holds_the_checking_code_and_the_limits(demo_model_dir, record, children, monkeypatch):
    load_model(demo_model_dir[0])
    loader.PROBE_CACHE.clear()
    monkeypatch.setattr(verified_cache, "_stack", "another version of the checks or of onnxruntime")
    load_model(demo_model_dir[0])
    assert children["children"] == [3, 3]
    datas = [(demo_model_dir[0] / "predictors" / f"{k}.onnx").read_bytes() for k in range(3)]
    loader.PROBE_CACHE.clear()
    cache = VerifiedCache(record)
    loader.load_predictors(datas, n_features=2, kind="probabilities", verified=cache)
    assert children["children"] == [3, 3]  # the same limits: from the record
    loader.PROBE_CACHE.clear()
    limits = SandboxLimits(memory_bytes=900 * 2**20)
    loader.load_predictors(datas, n_features=2, kind="probabilities", verified=cache, limits=limits)
    assert children["children"] == [3, 3, 3]


def test_the_record_off_or_out_of_reach(demo_model_dir, tmp_path, monkeypatch, children):
    monkeypatch.setenv(ENV, "off")
    for _ in range(2):
        loader.PROBE_CACHE.clear()
        load_model(demo_model_dir[0])
    assert children["children"] == [3, 3]
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv(ENV, str(tmp_path / "a file" / "verified"))  # cannot be created
    loader.PROBE_CACHE.clear()
    assert load_model(demo_model_dir[0]).n_sources == 3
    assert children["children"] == [3, 3, 3]
    loader.PROBE_CACHE.clear()


def test_the_stack_digest_follows_the_installed_libraries(tmp_path, monkeypatch):
    """An upgraded onnxruntime (or numpy, onnx, protobuf) is a new key: its verdicts are new."""
    import importlib.machinery
    import importlib.util

    site = tmp_path / "site-packages"
    for pkg in verified_cache.PACKAGES:
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
    for dist in ("numpy-2.0.0", "onnx-1.17.0", "onnxruntime-1.20.0", "protobuf-5.0.0"):
        (site / f"{dist}.dist-info").mkdir()
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: importlib.machinery.ModuleSpec(name, None, origin=str(site / name / "__init__.py")),
    )

    def digest() -> str:
        monkeypatch.setattr(verified_cache, "_stack", None)
        return verified_cache.stack_digest()

    before = digest()
    assert digest() == before
    (site / "requests-2.32.0.dist-info").mkdir()  # another library: the same checks
    assert digest() == before
    (site / "onnxruntime-1.20.0.dist-info").rename(site / "onnxruntime-1.21.0.dist-info")
    upgraded = digest()
    assert upgraded != before
    (site / "protobuf-5.0.0.dist-info").rename(site / "protobuf-5.1.0.dist-info")
    assert digest() not in (before, upgraded)
