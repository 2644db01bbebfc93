"""The quick versions of the paper's experiments, end to end through ``msa-fed experiment``.

Each runs the real pipeline (real data, real fit_dmsa / fit_gmsa) on a subsample and checks
the output contract (JSON schema, targets, figures) and properties that must hold however
the random draws fall.
"""

import json

import numpy as np
import pytest

from msa_fed.cli import main
from msa_fed.experiments import adult, digits, report, sentiment, synthetic

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    rc = main(["experiment", name, "--quick", "--json", str(out), *extra])
    assert rc == 0
    res = json.loads(out.read_text())
    report.check_schema(res)
    return res


def _mean(res, method, target):
    return res[method][target]["mean"]


def test_synthetic_quick(tmp_path, capsys):
    res = _run(tmp_path, "synthetic", "--plot", str(tmp_path / "fig"))
    table = capsys.readouterr().out
    assert "DMSA" in table and "paper" in table and "standard deviation" in table
    assert set(res) == {"h_D1", "h_D2", "unif", "GMSA", "DMSA", "DMSA-threshold", "by_size"}
    assert set(res["by_size"]) == {str(n) for n in synthetic.QUICK_SIZES}
    for method in ("DMSA", "GMSA"):
        assert list(res[method]) == list(synthetic.TARGETS)
    # the top-level numbers are those of the largest size
    assert res["DMSA"] == res["by_size"]["1000"]["DMSA"]
    # DMSA is accurate on both domains and beats every fixed predictor on their mixture
    assert _mean(res, "DMSA", "D1") >= 0.97 and _mean(res, "DMSA", "D2") >= 0.97
    mix = "D1-D2"
    for fixed in ("unif", "h_D1", "h_D2"):
        assert _mean(res, "DMSA", mix) > _mean(res, fixed, mix) + 0.05
    # a uniform mixture's accuracy is the mean of the domains' accuracies
    for method in ("h_D1", "unif", "DMSA"):
        assert _mean(res, method, mix) == pytest.approx((_mean(res, method, "D1") + _mean(res, method, "D2")) / 2)
    for png in ("synthetic_fig2_densities.png", "synthetic_fig3_accuracy.png"):
        assert (tmp_path / "fig" / png).read_bytes()[:8] == PNG_MAGIC


def test_adult_quick(tmp_path):
    res = _run(tmp_path, "adult")
    assert set(res) == {"h_Doc", "h_NDoc", "unif", "GMSA", "DMSA"}
    for method, by_target in res.items():
        assert list(by_target) == list(adult.TARGETS)
        assert by_target["Doc-NDoc"]["mean"] == pytest.approx(
            (by_target["Doc"]["mean"] + by_target["NDoc"]["mean"]) / 2
        )
    # the frozen predictors do not depend on the run: zero spread
    assert res["h_Doc"]["NDoc"]["std"] == 0.0 and res["unif"]["Doc"]["std"] == 0.0
    # each h_k is best on its own domain; DMSA beats the uniform combination on the mixture
    assert _mean(res, "h_Doc", "Doc") > _mean(res, "h_NDoc", "Doc")
    assert _mean(res, "h_NDoc", "NDoc") > _mean(res, "h_Doc", "NDoc")
    assert _mean(res, "DMSA", "Doc-NDoc") > _mean(res, "unif", "Doc-NDoc")


def test_sentiment_quick(tmp_path):
    res = _run(tmp_path, "sentiment")
    assert set(res) == {"K", "D", "B", "E", "unif", "GMSA", "DMSA"}
    for method, by_target in res.items():
        assert list(by_target) == list(sentiment.TARGETS)
        vals = np.array([by_target[t]["mean"] for t in "KDBE"])
        assert np.all(vals > 0) and np.all(vals < 16)  # ratings lie in [1, 5]
        assert by_target["KDBE"]["mean"] == pytest.approx(vals.mean())
    # the uniform combination's MSE is at most the average MSE of the single sources (convexity)
    single = np.mean([_mean(res, l, "KDBE") for l in "KDBE"])
    assert _mean(res, "unif", "KDBE") <= single


def test_digits_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_FED_CACHE", str(tmp_path / "cache"))
    res = _run(tmp_path, "digits", "--plot", str(tmp_path / "fig"))
    assert set(res) == {"CNN-o", "CNN-m", "CNN-u", "unif", "joint", "GMSA", "DMSA", "by_size"}
    assert set(res["by_size"]) == {str(m) for m in digits.QUICK["curve"]}
    for method in ("CNN-m", "DMSA"):
        assert list(res[method]) == list(digits.TARGETS)
    # each CNN is best on its own domain among the three single-domain CNNs
    for dom, letter in digits.LETTER.items():
        own = _mean(res, f"CNN-{letter}", dom)
        assert all(own > _mean(res, f"CNN-{o}", dom) for o in digits.LETTER.values() if o != letter)
    assert _mean(res, "DMSA", "mean") > _mean(res, "unif", "mean")
    assert (tmp_path / "fig" / "digits_sample_efficiency.png").read_bytes()[:8] == PNG_MAGIC
    assert list((tmp_path / "cache" / "digits").glob("*.pt"))  # weights cached outside the repo
