"""A peer's predictor runs in a limited worker process at every call: the same outputs as in
process for an honest one; a slow or memory-hungry one fails the call in one line naming its
owner, within its time limit, without growing this process, and its worker is replaced."""

from __future__ import annotations

import pickle
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, LogisticRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostile_predictors import hostile_from_sklearn  # noqa: E402

from msa_fed.artifacts.isolated import IsolationLimits, PredictorPool, isolate  # noqa: E402
from msa_fed.artifacts.predictors import export_sklearn, load_predictor  # noqa: E402
from msa_fed.errors import PeerFault  # noqa: E402

rng = np.random.default_rng(0)
X = rng.normal(size=(500, 2))
Y = (X[:, 0] > 0).astype(int)
WHOLE = np.round(10 * X)  # the rows a hostile predictor waits for
EST = LogisticRegression().fit(X, Y)


@pytest.fixture(scope="module")
def pool():
    pool = PredictorPool(IsolationLimits(base_s=1.5, per_row_s=1e-3, workers=2))
    yield pool
    pool.close()


def hostile(kind):
    return load_predictor(hostile_from_sklearn(kind, EST), kind="probabilities", sample=X)


def test_an_honest_predictor_answers_as_in_process(pool):
    h = load_predictor(export_sklearn(EST, n_features=2), kind="probabilities")
    iso = isolate(h, "b", pool)
    np.testing.assert_allclose(iso.predict_proba(WHOLE), h.predict_proba(WHOLE), rtol=0, atol=0)
    np.testing.assert_array_equal(iso.predict(X), h.predict(X))
    assert iso.classes_.tolist() == h.classes_.tolist() and iso.sha256 == h.sha256
    r = load_predictor(export_sklearn(LinearRegression().fit(X, X[:, 0]), n_features=2), kind="regression")
    np.testing.assert_allclose(isolate(r, "b", pool).predict(X), r.predict(X), rtol=0, atol=0)
    big = rng.normal(size=(70_000, 2))  # more than one chunk
    np.testing.assert_allclose(iso.predict_proba(big), h.predict_proba(big), rtol=0, atol=0)
    # a copy (Ray, saving the model) carries the bytes only
    assert pickle.loads(pickle.dumps(iso)).sha256 == h.sha256


def test_the_hostile_predictors_pass_the_probe_and_behave_on_it(pool):
    for kind in ("slow", "mem", "flip"):
        iso = isolate(hostile(kind), "b", pool)
        np.testing.assert_allclose(iso.predict_proba(X), EST.predict_proba(X), atol=1e-5)


def test_a_slow_predictor_is_stopped_at_its_limit_and_named(pool):
    iso = isolate(hostile("slow"), "west", pool)
    before = pool.restarts
    with pytest.raises(PeerFault) as err:
        iso.predict_proba(np.round(10 * rng.normal(size=(512, 2))))
    assert err.value.site == "west"
    assert str(err.value) == "site 'west''s predictor exceeded 2.01 s on 512 rows"
    assert pool.restarts == before + 1  # the worker past its limit was killed and replaced
    np.testing.assert_allclose(iso.predict_proba(X), EST.predict_proba(X), atol=1e-5)  # a fresh worker


def test_a_memory_hungry_predictor_is_stopped_outside_this_process(pool):
    iso = isolate(hostile("mem"), "west", pool)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(
        PeerFault, match=r"^site 'west''s predictor exceeded the memory limit \(1024 MiB\) on 500 rows$"
    ):
        iso.predict_proba(WHOLE)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: no 2 GB here


def test_a_flip_predictor_breaks_no_limit_it_is_the_influence_reports_job(pool):
    P = isolate(hostile("flip"), "west", pool).predict_proba(WHOLE)
    assert np.mean(P.argmax(axis=1) == (WHOLE[:, 0] > 0)) < 0.05  # confident and wrong
    assert np.median(P.max(axis=1)) > 0.99


def test_the_worker_runs_with_its_limits(pool):
    from msa_fed.artifacts.isolated import _Worker

    w = _Worker(IsolationLimits(memory_bytes=768 << 20))
    try:
        for _ in range(200):  # the worker sets its limits first thing after the fork
            limits = Path(f"/proc/{w.pid}/limits").read_text()
            line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
            if "unlimited" not in line:
                break
            time.sleep(0.05)
        assert line.split()[3] == str(768 << 20)
        fsize = next(x for x in limits.splitlines() if x.startswith("Max file size"))
        assert fsize.split()[3] == "0"
        assert Path(f"/proc/{w.pid}/cwd").resolve() != Path.cwd().resolve()
    finally:
        w.kill()
