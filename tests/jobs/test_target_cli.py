"""``msa-fed model check-target`` on a saved demo model, and the HTML report's target section."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_runner import run_cli

from msa_fed.artifacts.model import load_model
from msa_fed.experiments.demo_data import CENTERS
from msa_fed.jobs.report import report_html


@pytest.fixture(scope="module")
def target_files(tmp_path_factory):
    rng = np.random.default_rng(0)
    X = np.vstack([rng.normal(CENTERS["north"], 1.0, (300, 2)), rng.normal(CENTERS["west"], 1.0, (100, 2))])
    X = np.vstack([X, [[40.0, 40.0], [-30.0, 35.0]]])  # rows 400 and 401: far from every site
    d = tmp_path_factory.mktemp("target")
    np.save(d / "X.npy", X)
    np.savetxt(d / "X.csv", X, delimiter=",", header="x1,x2", comments="")
    return d, X


@pytest.mark.parametrize("name", ["X.npy", "X.csv"])
def test_check_target_prints_the_report_and_writes_json(demo_model_dir, target_files, name):
    model_dir, _ = demo_model_dir
    d, X = target_files
    out = d / f"{name}.json"
    rc, stdout, stderr = run_cli("model", "check-target", model_dir, "--data", d / name, "--json", out, "--top", 3)
    assert rc == 0, stderr
    assert "target sample: 402 points" in stdout and "mixture over the sites (bbse" in stdout
    assert "most atypical points (row index): 400" in stdout or "most atypical points (row index): 401" in stdout
    report = json.loads(out.read_text())
    w = report["mixture"]["weights"]
    assert w["north"] > 0.6 and w["east"] < 0.1  # 300 north, 100 west, no east
    assert {a["index"] for a in report["support"]["most_atypical"][:2]} == {400, 401}
    assert report["support"]["n_out_of_support"] >= 2
    direct = load_model(model_dir).check_target(X, top=3).as_dict()
    assert report == direct


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "missing.npy"], "no such file"),
        (["--data", "{d}/X.npy", "--alpha", "2"], "--alpha must be in (0, 1)"),
        (["--data", "{d}/bad.npy"], "the model expects 2"),
        (["--data", "{d}/X.txt"], "give a .npy or .csv file"),
        (["--data", "{d}/words.csv"], "cannot be read"),
    ],
)
def test_check_target_mistakes_get_one_error_line(demo_model_dir, target_files, args, message):
    model_dir, _ = demo_model_dir
    d, _ = target_files
    np.save(d / "bad.npy", np.zeros((4, 3)))
    (d / "X.txt").write_text("1,2\n")
    (d / "words.csv").write_text("a,b\nc,d\n")
    rc, stdout, stderr = run_cli("model", "check-target", model_dir, *[a.format(d=d) for a in args])
    assert rc != 0 and "Traceback" not in stderr
    assert stderr.startswith("error: ") and message in stderr, stderr


def test_check_target_needs_a_model_directory_without_a_registry(target_files, tmp_path):
    d, _ = target_files
    rc, _, stderr = run_cli("model", "check-target", tmp_path / "nothing", "--data", d / "X.npy")
    assert rc != 0 and "is not a model directory" in stderr


def test_the_html_report_has_a_target_section_when_given_a_sample(demo_model_dir, target_files):
    model = load_model(demo_model_dir[0])
    _, X = target_files
    page = report_html(model, target=X)
    assert "<h2>Target sample</h2>" in page and "402 unlabelled target points" in page
    assert "Out of support at &alpha; = 0.01" in page
    assert "<h2>Target sample</h2>" not in report_html(model)


def test_model_export_support_writes_the_pvalue_output(demo_model_dir, target_files, tmp_path):
    import onnxruntime as ort

    model_dir, _ = demo_model_dir
    _, X = target_files
    out = tmp_path / "m.onnx"
    rc, stdout, stderr = run_cli("model", "export", model_dir, "--out", out, "--support", "--json")
    assert rc == 0, stderr
    assert json.loads(stdout)["support_output"] is True
    session = ort.InferenceSession(out.read_bytes(), providers=["CPUExecutionProvider"])
    (pvalue,) = session.run(["support_pvalue"], {"X": X})
    np.testing.assert_allclose(pvalue, load_model(model_dir).support(X).pvalue, atol=1e-12)
    assert pvalue[400] < 0.01 and pvalue[401] < 0.01
