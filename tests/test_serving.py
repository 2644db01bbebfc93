"""The serving examples of deploy/serving run an exported model where msa_fed is not installed.

A plain virtual environment (no system site-packages) gets onnxruntime and numpy from pip's
configured index and nothing else; deploy/serving/serve_onnx.py runs there as a real HTTP
server on a free loopback port and answers batches that must equal ``predict_proba``.  The same
file runs from Node.js with onnxruntime-node when npm can install it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import msa_fed

SERVING = Path(__file__).resolve().parents[1] / "deploy" / "serving"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def clean_env() -> dict:
    """The environment without anything that would let a child import this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    return env


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The demo federation's model (small), saved and exported in float64 and float32."""
    from demo_sites import demo_sites

    from msa_fed.experiments.demo_data import SITES

    sites, fed = demo_sites(3, n_unlabeled=300, n_test=200)
    tmp = tmp_path_factory.mktemp("served")
    model = msa_fed.load_model(msa_fed.fit_dmsa(sites, "classification", random_state=3).save(tmp / "model"))
    X = np.vstack([fed[n]["X_test"][:100] for n in SITES])
    (tmp / "model64.onnx").write_bytes(model.to_onnx("float64"))
    (tmp / "model32.onnx").write_bytes(model.to_onnx("float32"))
    return model, X, tmp


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    """A plain venv with onnxruntime and numpy only (pip's configured index and wheel cache).
    The venv gets no pip of its own: this interpreter's pip installs into it (``pip --python``),
    which spares the venv's ensurepip (most of the fixture's time on a loaded machine), and
    ``--no-compile`` leaves the bytecode to the first import."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120, env=clean_env())
    python = venv / "bin" / "python"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--disable-pip-version-check",
            "-q",
            "--no-compile",
            "onnxruntime",
            "numpy",
        ],
        capture_output=True,
        text=True,
        timeout=480,
        env=clean_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import importlib.util as u, json; "
            "print(json.dumps({m: u.find_spec(m) is not None for m in ('onnxruntime', 'numpy', 'torch', 'msa_fed', "
            "'sklearn', 'onnx')}))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    found = json.loads(probe.stdout)
    assert found == {
        "onnxruntime": True,
        "numpy": True,
        "torch": False,
        "msa_fed": False,
        "sklearn": False,
        "onnx": False,
    }
    return python


def post(url: str, body: bytes, headers=None):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_service_in_a_clean_venv_answers_like_predict_proba(clean_venv, exported):
    model, X, tmp = exported
    proc = subprocess.Popen(
        [str(clean_venv), "-I", str(SERVING / "serve_onnx.py"), str(tmp / "model64.onnx"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=tmp,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[-1]
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        with urllib.request.urlopen(url + "/metadata", timeout=30) as resp:
            meta = json.loads(resp.read())
        assert meta["input"]["width"] == 2 and meta["outputs"] == ["probabilities", "label"]
        assert meta["msa_fed"]["msa_fed.sites"] == model.site_names
        assert meta["msa_fed"]["msa_fed.predictor_sha256"] == {
            n: h.sha256 for n, h in zip(model.site_names, model.predictors)
        }

        status, answer = post(url + "/predict", json.dumps({"X": X.tolist()}).encode())
        assert status == 200
        np.testing.assert_allclose(np.array(answer["probabilities"]), model.predict_proba(X), rtol=1e-12, atol=1e-9)
        assert answer["label"] == model.predict(X).tolist()

        # hostile or broken requests: a fixed reason, never library text; the service keeps serving
        for body, code in (
            (b"{not json", 400),
            (b"[" * 100_000, 400),  # nesting deeper than the parser's recursion limit
            (json.dumps({"X": [[1.0, 2.0, 3.0]]}).encode(), 400),
            (json.dumps({"X": [[1.0, "nan"]]}).encode(), 400),
            (b'{"X": [[1.0, NaN]]}', 400),
            (json.dumps({"rows": []}).encode(), 400),
            (json.dumps({"X": [[0.0, 0.0]] * 100_001}).encode(), 413),
        ):
            status, answer = post(url + "/predict", body)
            assert status == code and set(answer) == {"error"}, (body[:40], status, answer)
            assert "Traceback" not in answer["error"] and "onnxruntime" not in answer["error"]
        status, answer = post(url + "/predict", json.dumps({"X": X[:3].tolist()}).encode())
        assert status == 200 and len(answer["label"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode is not None


def test_plaintext_off_loopback_is_refused(clean_venv, exported):
    _, _, tmp = exported
    out = subprocess.run(
        [str(clean_venv), "-I", str(SERVING / "serve_onnx.py"), str(tmp / "model64.onnx"), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode == 2 and "loopback only" in out.stderr


def test_node_runs_the_exported_file(exported, tmp_path):
    model, X, tmp = exported
    npm, node = shutil.which("npm"), shutil.which("node")
    if not (npm and node):
        pytest.skip("node and npm are not installed on this machine")
    env = {**clean_env(), "ONNXRUNTIME_NODE_INSTALL": "skip", "npm_config_update_notifier": "false"}
    (tmp_path / "package.json").write_text('{"name": "msa-fed-serving-test", "private": true}')
    install = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "onnxruntime-node"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if install.returncode != 0:
        pytest.skip(f"npm could not install onnxruntime-node here: {install.stderr.strip()[-300:]}")
    shutil.copy(SERVING / "predict.js", tmp_path / "predict.js")
    (tmp_path / "batch.json").write_text(json.dumps({"X": X.tolist()}))
    for name, extra, atol in (("model64.onnx", [], 1e-9), ("model32.onnx", ["--float32"], 1e-5)):
        run = subprocess.run(
            [node, "predict.js", str(tmp / name), "batch.json", *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        answer = json.loads(run.stdout)
        np.testing.assert_allclose(np.array(answer["probabilities"]), model.predict_proba(X), rtol=0, atol=atol)
        agree = np.mean(np.array(answer["label"]) == model.predict(X))
        assert agree == 1.0 if not extra else agree > 0.99
