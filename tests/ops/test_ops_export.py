"""``msa-fed model export``: stored versions (a registry subprocess on loopback) and model
directories to one ONNX file each, for a model of each experiment's configuration, run with
onnxruntime alone and compared with the model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from ops_helpers import RegistryProcess, cli, issue_tokens
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder

import msa_fed
from msa_fed.experiments import adult, synthetic


def _sites(Xs, ys, make_h):
    """Sites of the first 120 rows labelled, the rest published (without the records that repeat a
    labelled one: categorical rows do)."""
    from msa_fed.privacy.consortium import drop_shared

    return [
        msa_fed.SiteData(f"s{k}", X[:120], y[:120], drop_shared(X[:120], X[120:])[0], make_h().fit(X[:120], y[:120]))
        for k, (X, y) in enumerate(zip(Xs, ys))
    ]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """One small model per configuration: the demo's (standard features), adult's (onehot,
    one-hot pipelines as predictors), synthetic's (rff; threshold) and a regression."""
    from demo_sites import demo_sites

    from msa_fed.experiments.demo_data import SITES

    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("models")
    out = {}
    sites, fed = demo_sites(0, n_test=50)
    out["demo-model"] = (msa_fed.fit_dmsa(sites, "classification"), np.vstack([fed[n]["X_test"] for n in SITES]))
    Xs = [rng.integers(0, 4, size=(300, 4)).astype(float) + (k == 1) for k in range(3)]
    ys = [(X[:, 0] + X[:, 1] > 3 + k).astype(int) for k, X in enumerate(Xs)]
    onehot = lambda: make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression())  # noqa: E731
    out["adult"] = (
        msa_fed.fit_dmsa(_sites(Xs, ys, onehot), "classification", **adult.DMSA_OPTIONS),
        np.vstack(Xs),
    )
    Xs = [rng.normal(loc=(k, -k), size=(300, 2)) for k in range(2)]
    ys = [(X[:, 0] > k - 0.5).astype(int) for k, X in enumerate(Xs)]
    out["synthetic"] = (
        msa_fed.fit_dmsa(_sites(Xs, ys, LogisticRegression), "classification", **synthetic.DMSA_OPTIONS),
        np.vstack(Xs),
    )
    Xs = [rng.normal(loc=2 * k, size=(300, 1)) for k in range(2)]
    ys = [(X[:, 0] > 2 * k).astype(int) for k, X in enumerate(Xs)]
    out["synthetic-threshold"] = (
        msa_fed.fit_dmsa(_sites(Xs, ys, LogisticRegression), "classification", **synthetic.THRESHOLD_OPTIONS),
        np.vstack(Xs),
    )
    Xs = [rng.normal(loc=k, size=(300, 3)) for k in range(3)]
    ys = [X @ np.array([1.0, -k, 0.5]) + k for k, X in enumerate(Xs)]
    out["regression"] = (msa_fed.fit_dmsa(_sites(Xs, ys, LinearRegression), "regression"), np.vstack(Xs))
    return {name: (model.save(root / name), X) for name, (model, X) in out.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    db = tmp / "registry.db"
    tokens = issue_tokens(db, ["a"])
    (tmp / "admin_token").write_text(tokens["admin"] + "\n")
    with RegistryProcess(db) as reg:
        yield reg, tmp


def run_file(path, X, dtype="float64"):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": X.astype(dtype)})[0]


def expected(model_dir, X):
    model = msa_fed.load_model(model_dir)
    return model.predict_proba(X) if model.task == "classification" else model.predict(X)


def in_process(capsys, *args) -> tuple[int, str, str]:
    """``msa-fed ARGS`` through the command line's own entry point, in this process (the
    subprocess runs below cover the process boundary; each one costs seconds of imports)."""
    from msa_fed.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_export_each_stored_version_from_the_registry(served, model_dirs, tmp_path, capsys):
    reg, tmp = served
    conn = ("--registry", reg.address, "--insecure", "--admin-token-file", tmp / "admin_token")
    versions = {}
    for name, (path, _) in model_dirs.items():
        rc, out, err = in_process(capsys, "model", "upload", path, *conn)
        assert rc == 0, err
        versions[name] = int(out.split("version ")[1].split()[0])
    for name, (path, X) in model_dirs.items():
        dest = tmp_path / f"{name}.onnx"
        rc, out, err = in_process(
            capsys, "model", "export", versions[name], "--format", "onnx", "--out", dest, "--json", *conn
        )
        assert rc == 0, err
        summary = json.loads(out)
        assert summary["sha256"] == hashlib.sha256(dest.read_bytes()).hexdigest()
        np.testing.assert_allclose(run_file(dest, X), expected(path, X), rtol=1e-12, atol=1e-6)
        meta = {p.key: p.value for p in onnx.load(str(dest)).metadata_props}
        assert meta["msa_fed.registry_version"] == str(versions[name])
        assert len(meta["msa_fed.registry_sha256"]) == 64
        assert meta["msa_fed.manifest_sha256"] == hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
        assert json.loads(meta["msa_fed.predictor_sha256"]) == dict(
            zip(
                json.loads((path / "manifest.json").read_text())["sites"],
                json.loads((path / "manifest.json").read_text())["predictor_sha256"],
            )
        )
    # latest, float32
    dest = tmp_path / "latest32.onnx"
    rc, out, err = cli("model", "export", "latest", "--out", dest, "--dtype", "float32", *conn)
    assert rc == 0 and "exported to" in out, err
    path, X = model_dirs["regression"]  # uploaded last
    ref = expected(path, X)
    np.testing.assert_allclose(run_file(dest, X, "float32"), ref, rtol=1e-4, atol=1e-4)
    # a version that does not exist: one error line
    rc, out, err = in_process(capsys, "model", "export", "99", "--out", tmp_path / "none.onnx", *conn)
    assert rc == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "none.onnx").exists()


def test_export_a_model_directory_and_user_mistakes(model_dirs, tmp_path, capsys):
    path, X = model_dirs["adult"]
    dest = tmp_path / "adult.onnx"
    rc, out, err = cli("model", "export", path, "--out", dest)
    assert rc == 0 and "onnxruntime reproduces the model" in out, err
    np.testing.assert_allclose(run_file(dest, X), expected(path, X), rtol=1e-12, atol=1e-6)
    for args, message in (
        ((path, "--out", dest), "already exists"),
        (("7", "--out", tmp_path / "x.onnx"), "not a model directory"),
        ((path, "--out", tmp_path / "missing" / "x.onnx"), "does not exist"),
        ((tmp_path, "--out", tmp_path / "y.onnx"), "manifest.json is missing"),
    ):
        rc, out, err = in_process(capsys, "model", "export", *args)
        assert rc == 1 and message in err and "Traceback" not in err, (args, err)
    rc, out, err = in_process(capsys, "model", "export", path, "--out", dest, "--force")
    assert rc == 0, err
