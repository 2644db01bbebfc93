"""Aggregation, table and JSON helpers of the experiments."""

import json

import numpy as np
import pytest

from msa_fed.experiments import report


def test_summarise_matches_numpy():
    rng = np.random.default_rng(0)
    vals = rng.normal(size=(7, 2, 3))
    runs = [{m: {t: vals[r, i, j] for j, t in enumerate("abc")} for i, m in enumerate(("A", "B"))} for r in range(7)]
    out = report.summarise(runs)
    assert list(out) == ["A", "B"] and list(out["A"]) == ["a", "b", "c"]
    np.testing.assert_allclose(out["B"]["c"]["mean"], vals[:, 1, 2].mean())
    np.testing.assert_allclose(out["B"]["c"]["std"], vals[:, 1, 2].std())
    with pytest.raises(ValueError, match="at least one run"):
        report.summarise([])


def test_uniform_mixture_is_the_accuracy_on_an_equal_size_pool():
    rng = np.random.default_rng(1)
    correct = {d: rng.random(500) < p for d, p in (("x", 0.9), ("y", 0.6), ("z", 0.75))}
    per = {d: c.mean() for d, c in correct.items()}
    mix = report.uniform_mixtures(per, {"xy": ("x", "y"), "xyz": ("x", "y", "z")})
    assert mix["xy"] == pytest.approx(np.concatenate([correct["x"], correct["y"]]).mean())
    assert mix["xyz"] == pytest.approx(np.concatenate(list(correct.values())).mean())


def test_table_shows_ours_and_paper_side_by_side():
    res = {"DMSA": {"Doc": {"mean": 0.7123, "std": 0.01}, "NDoc": {"mean": 0.8, "std": 0.0}}}
    text = report.format_table("T", res, ["Doc", "NDoc"], paper={"DMSA": {"Doc": (0.70, 0.008), "NDoc": 0.805}})
    lines = text.splitlines()
    ours = next(l for l in lines if l.startswith("DMSA"))
    paper = next(l for l in lines if l.strip().startswith("paper"))
    assert "71.2±1.0" in ours and "80.0±0.0" in ours
    assert "70.0±0.8" in paper and "80.5" in paper
    mse = report.format_table("T", {"unif": {"K": {"mean": 1.5012, "std": 0.06}}}, ["K"], percent=False, decimals=2)
    assert "1.50±0.06" in mse


def test_json_round_trip_and_schema(tmp_path):
    res = {"DMSA": {"a": {"mean": 0.5, "std": 0.1}}, "by_size": {"50": {"DMSA": {"a": {"mean": 0.4, "std": 0.2}}}}}
    path = report.write_json(tmp_path / "sub" / "r.json", res)
    loaded = json.loads(path.read_text())
    assert loaded == res
    report.check_schema(loaded)
    with pytest.raises(ValueError, match="mean and std"):
        report.check_schema({"DMSA": {"a": {"mean": 0.5}}})
    with pytest.raises(ValueError, match="finite float"):
        report.check_schema({"DMSA": {"a": {"mean": float("nan"), "std": 0.0}}})
    with pytest.raises(ValueError, match="mean and std"):
        report.check_schema({"by_size": {"1": {"DMSA": {"a": {"avg": 1.0}}}}})
