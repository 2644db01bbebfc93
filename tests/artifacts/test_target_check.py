"""A combined model's target checks: what the file carries, the policy that keeps a site's sample
out of it, hostile files, and the answers on the demo federation (three 2-D Gaussian sites)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import msa_fed
from msa_fed.artifacts.model import load_model
from msa_fed.errors import ArtifactError
from msa_fed.experiments.demo_data import CENTERS, SITES
from msa_fed.privacy.policy import SitePolicy, policy_from_mapping, tighten


@pytest.fixture(scope="module")
def demo_model(demo_model_dir):
    return load_model(demo_model_dir[0])


def mixture_sample(lam, n, rng):
    counts = rng.multinomial(n, lam)
    return np.vstack([rng.normal(CENTERS[s], 1.0, (c, 2)) for s, c in zip(SITES, counts)])


def test_the_demo_model_estimates_its_target_and_flags_what_no_site_has(demo_model):
    rng = np.random.default_rng(0)
    lam = np.array([0.6, 0.3, 0.1])
    X = mixture_sample(lam, 2000, rng)
    # overlapping sites (unit Gaussians 2 to 2.8 apart): argmax counts (BBSE) lose more than EM
    for method, tolerance in (("em", 0.08), ("bbse", 0.15)):
        mix = demo_model.estimate_mixture(X, method=method, n_boot=50)
        assert np.abs(mix.estimate.lam - lam).sum() < tolerance, (method, mix.estimate.lam)
        d = mix.as_dict()
        assert list(d["weights"]) == list(SITES) and d["method"] == method
        assert all(d["low"][s] <= d["weights"][s] <= d["high"][s] for s in SITES)
    far = rng.normal((12.0, -12.0), 0.5, (40, 2))  # nowhere near any site
    report = demo_model.check_target(np.vstack([X, far]), alpha=0.01, n_boot=50, top=5)
    assert report.mixture.method == "bbse"  # the default where every site carries its sample
    assert report.out_of_support is not None
    assert set(report.atypical) <= set(range(2000, 2040)) and len(report.atypical) == 5
    flagged = report.pvalue <= 0.01
    assert flagged[2000:].all()
    assert flagged[:2000].mean() <= 0.02
    # the predicted loss is the mixture of the site losses at lambda-hat
    assert report.loss.loss == pytest.approx(float(report.mixture.estimate.lam @ demo_model.domain_losses))
    assert report.loss.low <= report.loss.loss <= report.loss.high
    words = "\n".join(report.lines())
    assert "out of support at alpha=0.01" in words and "north" in words
    json.dumps(report.as_dict())  # plain JSON


def test_target_checks_survive_save_and_load(demo_model, tmp_path):
    path = demo_model.save(tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["target"]["score"] == "knn_distance"
    assert all(manifest["target"]["sites"][s]["available"] for s in SITES)
    loaded = load_model(path)
    X = mixture_sample([0.2, 0.5, 0.3], 500, np.random.default_rng(1))
    np.testing.assert_array_equal(loaded.support(X).pvalue, demo_model.support(X).pvalue)
    a = loaded.check_target(X, n_boot=30).as_dict()
    b = demo_model.check_target(X, n_boot=30).as_dict()
    assert a == b


def test_a_site_whose_policy_keeps_its_sample_out_has_nothing_in_the_file(demo_federation, tmp_path):
    sites, _ = demo_federation
    closed = [replace(sites[0], policy=SitePolicy(model_carries_sample=False)), *sites[1:]]
    model = msa_fed.fit_dmsa(closed, task="classification")
    ref = model.target_reference
    assert ref.available == [False, True, True] and ref.reference[0].shape[0] == 0 and ref.confusion is None
    path = model.save(tmp_path / "m")
    with np.load(path / "arrays.npz") as npz:
        keys = set(npz.files)
    assert "target.reference.0" not in keys and "target.calibration.0" not in keys and "target.confusion" not in keys
    assert {"target.reference.1", "target.reference.2"} <= keys
    assert json.loads((path / "manifest.json").read_text())["target"]["sites"]["north"] == {
        "available": False,
        "n_reference": 0,
        "n_calibration": 0,
    }
    loaded = load_model(path)
    X = mixture_sample([0.4, 0.3, 0.3], 600, np.random.default_rng(2))
    sup = loaded.support(X)
    assert sup.unavailable == ["north"] and np.isnan(sup.per_site[:, 0]).all()
    assert not np.isnan(sup.per_site[:, 1:]).any()
    with pytest.raises(ValueError, match=r"bbse.*\['north'\]"):
        loaded.estimate_mixture(X, method="bbse")
    report = loaded.check_target(X, n_boot=30)  # EM needs nothing of the samples: the default here
    assert report.unavailable == ["north"] and report.mixture.method == "em"
    assert any("unavailable for site(s) north" in line for line in report.lines())


def test_the_policy_key_reads_from_the_file_and_a_job_may_only_turn_it_off():
    policy = policy_from_mapping({"limits": {"model_carries_sample": False}})
    assert policy.model_carries_sample is False
    assert tighten(policy, {"model_carries_sample": True}).model_carries_sample is False
    assert tighten(SitePolicy(), {"model_carries_sample": False}).model_carries_sample is False
    with pytest.raises(msa_fed.errors.ConfigError, match="model_carries_sample"):
        policy_from_mapping({"limits": {"model_carries_sample": "no"}})


def _tamper(path, **arrays):
    with np.load(path / "arrays.npz") as npz:
        data = {k: npz[k] for k in npz.files}
    data.update(arrays)
    np.savez(path / "arrays.npz", **data)


@pytest.mark.parametrize(
    "arrays",
    [
        {"target.calibration.1": np.array([0.1, np.nan])},
        {"target.reference.2": np.zeros((50, 3))},
        {"target.reference.0": np.zeros((2, 2))},  # fewer rows than the neighbour rank
        {"target.confusion": np.eye(2)},
        {"target.loss_sd": np.array([-1.0, 0.0, 0.0])},
    ],
)
def test_a_malformed_target_reference_is_refused_at_load(demo_model, tmp_path, arrays):
    path = demo_model.save(tmp_path / "m")
    _tamper(path, **arrays)
    with pytest.raises(ArtifactError, match="target"):
        load_model(path)


def test_a_manifest_without_its_target_arrays_is_refused(demo_model, tmp_path):
    path = demo_model.save(tmp_path / "m")
    with np.load(path / "arrays.npz") as npz:
        data = {k: npz[k] for k in npz.files if k != "target.calibration.1"}
    np.savez(path / "arrays.npz", **data)
    with pytest.raises(ArtifactError, match="target reference is malformed"):
        load_model(path)


def test_a_model_without_a_target_reference_still_loads_and_says_so(demo_model, tmp_path):
    path = demo_model.save(tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["target"]  # a model saved before target checks existed
    (path / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_model(path)
    assert loaded.target_reference is None
    X = mixture_sample([0.3, 0.3, 0.4], 300, np.random.default_rng(3))
    report = loaded.check_target(X, n_boot=20)
    assert report.pvalue is None and any("support: unavailable" in line for line in report.lines())
    with pytest.raises(ValueError, match="no target reference"):
        loaded.support(X)


def test_bad_target_samples_get_one_clear_error(demo_model):
    with pytest.raises(ValueError, match="the model expects 2"):
        demo_model.check_target(np.zeros((5, 3)))
    with pytest.raises(ValueError, match="NaN"):
        demo_model.support(np.full((5, 2), np.nan))
    with pytest.raises(ValueError, match="no rows"):
        demo_model.estimate_mixture(np.zeros((0, 2)))
    with pytest.raises(ValueError, match="method must be one of"):
        demo_model.estimate_mixture(np.zeros((5, 2)), method="magic")
    with pytest.raises(ValueError, match="alpha"):
        demo_model.check_target(np.zeros((5, 2)), alpha=1.5)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_exported_onnx_file_carries_the_support_pvalues(demo_model, dtype):
    import onnxruntime as ort

    rng = np.random.default_rng(4)
    X = np.vstack([mixture_sample([0.3, 0.3, 0.4], 400, rng), rng.normal((9.0, 9.0), 1.0, (20, 2))])
    session = ort.InferenceSession(demo_model.to_onnx(dtype, support=True), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == ["probabilities", "label", "support_pvalue"]
    probs, _, pvalue = session.run(None, {"X": X.astype(dtype)})
    ref = demo_model.support(X).pvalue
    if dtype == "float64":
        np.testing.assert_allclose(pvalue, ref, rtol=0, atol=1e-12)
    else:  # float32 distances can tie differently with a calibration score: one step of 1/(m+1) at most
        step = 1.0 / (demo_model.target_reference.calibration[0].size + 1)
        assert np.max(np.abs(pvalue - ref)) <= step + 1e-6 and np.mean(np.abs(pvalue - ref) < 1e-6) > 0.98
    np.testing.assert_allclose(probs, demo_model.predict_proba(X), atol=1e-6 if dtype == "float64" else 1e-3)
    # without the flag the file is the prediction graph as before
    plain = ort.InferenceSession(demo_model.to_onnx(dtype), providers=["CPUExecutionProvider"])
    assert [o.name for o in plain.get_outputs()] == ["probabilities", "label"]


def test_a_site_kept_out_is_left_out_of_the_onnx_support_too(demo_federation):
    import onnxruntime as ort

    sites, _ = demo_federation
    closed = [replace(sites[0], policy=SitePolicy(model_carries_sample=False)), *sites[1:]]
    model = msa_fed.fit_dmsa(closed, task="classification")
    data = model.to_onnx("float64", support=True)
    X = mixture_sample([0.4, 0.3, 0.3], 200, np.random.default_rng(5))
    (pvalue,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(["support_pvalue"], {"X": X})
    np.testing.assert_allclose(pvalue, model.support(X).pvalue, atol=1e-12)
    # north's published rows are not in the file: none of them appears among its initializers
    import onnx

    graph = onnx.load_from_string(data).graph
    north = np.asarray(sites[0].X_unlabeled)
    fmap = model.domain_model.feature_map
    north_features = fmap.transform(north)
    for t in graph.initializer:
        if t.name.startswith("msa/support_ref"):
            R = onnx.numpy_helper.to_array(t).T
            assert not np.isclose(R[:, None, :], north_features[None, :5, :]).all(axis=2).any()


# ------------------------------------------------------------------ categorical inputs
def categorical_site_rows(rng, n, group):
    """Five categorical columns: the site's group, three skewed 5-value columns, a 40-value tail."""
    skewed = rng.choice(5, size=(n, 3), p=[0.4, 0.3, 0.15, 0.1, 0.05])
    tail = rng.zipf(1.8, size=n).clip(max=40)
    return np.column_stack([np.full(n, group), skewed, tail]).astype(float)


@pytest.fixture(scope="module")
def categorical_federation():
    """Three sites that differ in one categorical column (a one-hot domain model) and a fourth
    group none of them has; each site's predictor is a one-hot logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder

    from msa_fed.privacy.consortium import drop_shared

    rng = np.random.default_rng(40)
    sites = []
    for group in range(3):
        X = categorical_site_rows(rng, 800, group)
        y = (rng.random(800) < 0.2 + 0.15 * X[:, 1]).astype(int)
        h = make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression()).fit(X[:300], y[:300])
        published, _ = drop_shared(X[300:400], X[400:])  # rows equal to a labelled one stay home
        sites.append(msa_fed.SiteData(f"g{group}", X[300:400], y[300:400], published, h))
    model = msa_fed.fit_dmsa(sites, task="classification", features="onehot")
    inside = np.vstack([categorical_site_rows(rng, 400, g) for g in range(3)])
    return model, inside, categorical_site_rows(rng, 400, 3)


def test_categorical_inputs_get_the_rarity_score_and_flag_a_group_no_site_has(categorical_federation, tmp_path):
    model, inside, outside = categorical_federation
    ref = model.target_reference
    assert ref.score == "category_rarity" and all(ref.available)
    # the left-out group's rows sit in the one-hot map as all zeros in the group block: nearer to
    # every reference row than another site's group; the rarity score puts them beyond them all
    assert model.support(inside).pvalue.__le__(0.01).mean() <= 0.015
    assert model.support(outside).pvalue.__le__(0.01).mean() > 0.9
    # ties broken at random, from a seed: the same p-values again, other ones with another seed
    again = model.support(inside).pvalue
    np.testing.assert_array_equal(again, model.support(inside).pvalue)
    assert not np.array_equal(again, model.support(inside, random_state=1).pvalue)
    # counted against the point, ties give p-values no smaller
    assert np.all(model.support(inside, randomize_ties=False).pvalue >= again - 1e-15)
    path = model.save(tmp_path / "cat")
    assert json.loads((path / "manifest.json").read_text())["target"]["score"] == "category_rarity"
    loaded = load_model(path)
    np.testing.assert_array_equal(loaded.support(outside).pvalue, model.support(outside).pvalue)


def test_the_onnx_support_of_categorical_inputs_is_the_tie_counting_pvalue(categorical_federation):
    import onnxruntime as ort

    model, inside, outside = categorical_federation
    X = np.vstack([inside[::4], outside[:50]])
    for dtype in ("float64", "float32"):
        session = ort.InferenceSession(model.to_onnx(dtype, support=True), providers=["CPUExecutionProvider"])
        (pvalue,) = session.run(["support_pvalue"], {"X": X.astype(dtype)})
        np.testing.assert_allclose(pvalue, model.support(X, randomize_ties=False).pvalue, atol=1e-6)


def test_an_unknown_support_score_in_a_file_is_refused(demo_model, tmp_path):
    path = demo_model.save(tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["target"]["score"] = "x" * 100
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="target reference is malformed"):
        load_model(path)


def _reference_as_before(model, ref):
    """The confusion matrix and the loss spreads as the reference computed them before it shared
    the domain model's answer: the domain model on each site's rows, then the whole model's
    predict_proba on all of them."""
    from msa_fed.core.target import confusion_matrix

    confusion = confusion_matrix([model.domain_proba(R) for R in ref.reference]) if all(ref.available) else None
    P = np.clip(model.predict_proba(np.vstack(ref.reference)), 1e-300, 1.0)
    loss = -np.log(P)
    m1, m2 = np.sum(P * loss, axis=1), np.sum(P * loss * loss, axis=1)

    def spread(a, b):
        if a.size == 0:  # a site kept out of the reference: no rows, no spread
            return float("nan")
        return float(np.sqrt(max(float(b.mean() - a.mean() ** 2), 0.0)))

    edges = np.cumsum([0] + [R.shape[0] for R in ref.reference])
    sd = [max(spread(m1[a:b], m2[a:b]), spread(m1, m2)) for a, b in zip(edges[:-1], edges[1:])]
    return confusion, np.array(sd)


def test_the_reference_shares_the_domain_models_answer_with_the_same_numbers(demo_federation, demo_model):
    """build_reference runs the domain model once over the reference rows (confusion matrix and
    the model's predictions from the same log Q): the numbers are those of the separate calls,
    on the numpy path (the in-memory model's scikit-learn predictors) and on the graph's."""
    from msa_fed.artifacts.target_check import build_reference

    sites, fed = demo_federation
    fitted = msa_fed.fit_dmsa(sites, task="classification")
    samples = [fed[s]["X_unlabeled"] for s in SITES]
    for model in (fitted, demo_model):
        ref = build_reference(model, samples, [True] * len(SITES), n_reference=150)
        assert all(ref.available) and sum(R.shape[0] for R in ref.reference) == 150 * len(SITES)
        confusion, sd = _reference_as_before(model, ref)
        np.testing.assert_array_equal(ref.confusion, confusion)
        np.testing.assert_allclose(ref.loss_sd, sd, rtol=1e-12, atol=1e-12)
    # the numpy path given log Q equals its own call, and predictors' answers written in place
    # equal the model's answer part by part
    X = np.vstack(samples)
    log_Q = fitted.domain_model.predict_log_proba(X)
    np.testing.assert_allclose(
        fitted._predict_proba_numpy(X, log_Q), fitted._predict_proba_numpy(X), rtol=1e-12, atol=1e-15
    )
    from msa_fed.core.combination import combine_proba

    parts = np.stack([fitted._proba_of(k, X) for k in range(fitted.n_sources)], axis=1)
    np.testing.assert_array_equal(fitted._predict_proba_numpy(X), combine_proba(fitted.combination_weights(X), parts))


def test_a_reference_with_a_site_kept_out_has_no_confusion_but_the_spreads_of_the_others(demo_federation):
    from msa_fed.artifacts.target_check import build_reference

    sites, fed = demo_federation
    model = msa_fed.fit_dmsa(sites, task="classification")
    samples = [fed[s]["X_unlabeled"] for s in SITES]
    ref = build_reference(model, samples, [True, False, True], n_reference=150)
    assert ref.confusion is None and ref.available == [True, False, True]
    _, sd = _reference_as_before(model, ref)
    assert np.isnan(ref.loss_sd[1])
    np.testing.assert_allclose(ref.loss_sd[[0, 2]], sd[[0, 2]], rtol=1e-12, atol=1e-12)


def test_a_fit_builds_its_reference_on_first_use_with_the_numbers_built_at_its_end(demo_federation, tmp_path):
    """The reference is deferred by the fit (built on first use, not by the fit): its numbers are
    those a build at the end of the fit gives, bit for bit, after the model has predicted; a
    pickle and a save carry it built."""
    import pickle

    from msa_fed.artifacts import target_check
    from msa_fed.artifacts.model import CombinedModel

    sites, fed = demo_federation
    builds: list = []
    at_the_end: list = []
    real_defer = CombinedModel.defer_target_reference

    def counted(*args, **kw):
        builds.append(args)
        return real_build(*args, **kw)

    def defer_and_build_now(self, build):
        at_the_end.append(build())  # what the fit built before it deferred the reference
        real_defer(self, build)

    real_build = target_check.build_reference
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CombinedModel, "defer_target_reference", defer_and_build_now)
        mp.setattr(target_check, "build_reference", counted)
        model = msa_fed.fit_dmsa(sites, task="classification")
        assert len(builds) == 1 and len(at_the_end) == 1  # the eager build of this test only
        X = fed["north"]["X_test"]
        model.predict_proba(X)
        assert "_target_build" in model.__dict__  # not built by predicting
        ref, eager = model.target_reference, at_the_end[0]
        assert len(builds) == 2 and "_target_build" not in model.__dict__
        assert model.target_reference is ref and len(builds) == 2  # built once
    assert ref.available == eager.available == [True] * len(SITES)
    for k in range(len(SITES)):
        np.testing.assert_array_equal(ref.reference[k], eager.reference[k])
        np.testing.assert_array_equal(ref.calibration[k], eager.calibration[k])
    np.testing.assert_array_equal(ref.confusion, eager.confusion)
    np.testing.assert_array_equal(ref.loss_sd, eager.loss_sd)
    np.testing.assert_array_equal(ref.scale, eager.scale)
    # a pickled model and a saved one carry it built (the builder does not travel)
    again = msa_fed.fit_dmsa(sites, task="classification")
    state = again.__getstate__()
    assert "_target_build" not in state and "_target_lock" not in state
    copied = pickle.loads(pickle.dumps(again))
    np.testing.assert_array_equal(copied.target_reference.calibration[0], ref.calibration[0])
    np.testing.assert_array_equal(copied.target_reference.loss_sd, ref.loss_sd)
    saved = load_model(msa_fed.fit_dmsa(sites, task="classification").save(tmp_path / "m"))
    np.testing.assert_array_equal(saved.target_reference.calibration[1], ref.calibration[1])
    np.testing.assert_allclose(saved.support(X).pvalue, model.support(X).pvalue)
    # set by hand, a reference replaces the builder
    fresh = again
    fresh.target_reference = None
    assert fresh.target_reference is None and "_target_build" not in fresh.__dict__
    # a build that fails is tried again at the next read; readers in other threads wait for the
    # one build and get its reference; a read from within the build finds none yet
    import threading
    import time

    calls: list = []
    inner: list = []
    go = threading.Event()

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first build fails")
        inner.append(fresh.target_reference)
        go.wait(10)  # the other readers arrive while it runs
        return ref

    fresh.defer_target_reference(flaky)
    with pytest.raises(RuntimeError, match="first build fails"):
        _ = fresh.target_reference
    seen: list = []
    readers = [threading.Thread(target=lambda: seen.append(fresh.target_reference)) for _ in range(3)]
    for t in readers:
        t.start()
    time.sleep(0.2)
    go.set()
    for t in readers:
        t.join(10)
    assert len(calls) == 2 and inner == [None] and len(seen) == 3 and all(r is ref for r in seen)
    assert fresh.target_reference is ref


def test_a_fit_with_an_isolated_peer_predictor_builds_its_reference_before_it_returns(demo_federation, monkeypatch):
    """An isolated predictor runs in a worker of the job: the fit builds the reference while
    it is there (not deferred), with the same numbers as a deferred build."""
    import msa_fed.runtime.coordinator as coordinator
    from msa_fed.artifacts import target_check

    sites, _ = demo_federation
    deferred = msa_fed.fit_dmsa(sites, task="classification")
    builds: list = []
    real_build = target_check.build_reference
    monkeypatch.setattr(target_check, "build_reference", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    peer = sites[1].predictor
    monkeypatch.setattr(coordinator, "is_isolated", lambda h: h is peer)
    model = msa_fed.fit_dmsa(sites, task="classification")
    assert builds == [1] and "_target_build" not in model.__dict__  # built by the fit
    ref, other = model.target_reference, deferred.target_reference
    assert builds == [1]
    np.testing.assert_array_equal(ref.loss_sd, other.loss_sd)
    for k in range(len(SITES)):
        np.testing.assert_array_equal(ref.calibration[k], other.calibration[k])
