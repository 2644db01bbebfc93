"""Several peers' predictors answered in one request to a limited worker (the site's evaluation of
its peers' predictors, the coordinator's combined model): the same outputs as in process, one
round trip, and a hostile predictor among honest ones is the one named.  The combined model never
runs a peer's predictor in this process (its fast ONNX graph would)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.linear_model import LogisticRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostile_predictors import hostile_from_sklearn  # noqa: E402

from msa_fed.artifacts.isolated import IsolationLimits, PredictorPool, answered_together, isolate  # noqa: E402
from msa_fed.artifacts.model import CombinedModel  # noqa: E402
from msa_fed.artifacts.predictors import export_sklearn, load_predictor  # noqa: E402
from msa_fed.core.config import ClassifierConfig  # noqa: E402
from msa_fed.core.domain_classifier import train_domain_classifier  # noqa: E402
from msa_fed.core.features import make_feature_map  # noqa: E402
from msa_fed.errors import PeerFault  # noqa: E402

rng = np.random.default_rng(1)
X = rng.normal(size=(400, 2))
WHOLE = np.round(10 * X)  # the rows a hostile predictor waits for
ESTS = [LogisticRegression().fit(X, (X @ w > 0).astype(int)) for w in ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0])]


class CountingPool(PredictorPool):
    """A real pool that counts its requests to workers."""

    requests = 0

    def _start_chunk(self, items, X, alone=False):
        self.requests += 1
        return super()._start_chunk(items, X, alone)


@pytest.fixture(scope="module")
def pool():
    pool = CountingPool(IsolationLimits(base_s=1.5, per_row_s=1e-3, workers=1))
    yield pool
    pool.close()


def honest(k):
    return load_predictor(export_sklearn(ESTS[k], n_features=2), kind="probabilities")


def hostile(kind, k=0):
    return load_predictor(hostile_from_sklearn(kind, ESTS[k]), kind="probabilities", sample=X)


def test_peers_answered_together_are_their_in_process_outputs_in_one_request(pool):
    own = honest(0)
    inproc = [own, honest(1), honest(2)]
    hs = [own] + [isolate(h, name, pool) for h, name in zip(inproc[1:], ("b", "c"))]
    before = pool.requests
    together = answered_together(hs, WHOLE)
    assert pool.requests == before + 1  # both peers, one request (the models loaded with it)
    assert together[0] is own  # ours runs here, as before
    for h, ref in zip(together, inproc):
        np.testing.assert_array_equal(h.predict_proba(WHOLE), ref.predict_proba(WHOLE))
    assert pool.requests == before + 1  # answered from what the request brought back
    # other rows go through the pool again, and still answer right
    np.testing.assert_array_equal(together[1].predict_proba(X[:7]), inproc[1].predict_proba(X[:7]))
    assert pool.requests == before + 2
    # a copy of the same rows is answered from what it holds; the same shape with one value
    # changed in its last bit is not
    np.testing.assert_array_equal(together[2].predict_proba(np.array(WHOLE)), inproc[2].predict_proba(WHOLE))
    assert pool.requests == before + 2
    moved = np.array(WHOLE, dtype=np.float32)
    moved[5, 1] = np.nextafter(moved[5, 1], np.float32(np.inf))
    np.testing.assert_array_equal(together[2].predict_proba(moved), inproc[2].predict_proba(moved))
    assert pool.requests == before + 3
    # more rows than a chunk: one request per chunk, outputs in row order
    big = rng.normal(size=(70_000, 2))
    before = pool.requests
    together = answered_together(hs, big)
    assert pool.requests == before + 2
    np.testing.assert_array_equal(together[2].predict_proba(big), inproc[2].predict_proba(big))


def test_a_slow_predictor_among_honest_ones_is_the_one_named(pool):
    hs = [isolate(honest(1), "b", pool), isolate(hostile("slow"), "west", pool), isolate(honest(2), "c", pool)]
    before = pool.restarts
    with pytest.raises(PeerFault) as err:
        answered_together(hs, WHOLE)
    assert err.value.site == "west"
    assert str(err.value) == "site 'west''s predictor exceeded 1.9 s on 400 rows"
    assert pool.restarts == before + 1
    # honest peers answer again, in a fresh worker
    np.testing.assert_array_equal(
        answered_together(hs[::2], WHOLE)[1].predict_proba(WHOLE), honest(2).predict_proba(WHOLE)
    )


def test_a_memory_hungry_predictor_after_honest_ones_is_the_one_named(pool):
    hs = [isolate(honest(1), "b", pool), isolate(honest(2), "c", pool), isolate(hostile("mem"), "east", pool)]
    with pytest.raises(
        PeerFault, match=r"^site 'east''s predictor exceeded the memory limit \(1024 MiB\) on 400 rows$"
    ):
        answered_together(hs, WHOLE)


def _combined(predictors):
    dm = train_domain_classifier([X[:200], X[200:] + 1], make_feature_map("standard"), ClassifierConfig())
    return CombinedModel(
        method="dmsa",
        task="classification",
        site_names=["a", "b"],
        domain_model=dm,
        qhat=[0.5, 0.5],
        z=[0.4, 0.6],
        eta=1e-2,
        predictors=predictors,
        n_features=2,
        classes=[0, 1],
    )


def test_the_combined_model_runs_peers_predictors_in_their_workers_not_in_its_graph(pool):
    inproc = _combined([honest(0), honest(1)])
    assert inproc._graph_session() is not None  # the fast path, where every predictor is trusted
    iso = _combined([honest(0), isolate(honest(1), "b", pool)])
    assert iso._graph_session() is None
    before = pool.requests
    np.testing.assert_allclose(iso.predict_proba(WHOLE), inproc.predict_proba(WHOLE), rtol=1e-12, atol=1e-12)
    assert pool.requests == before + 1
    # a peer's predictor that allocates 2 GB on whole-number rows: named, and not in this process
    hostile_model = _combined([honest(0), isolate(hostile("mem"), "b", pool)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PeerFault, match=r"^site 'b''s predictor exceeded the memory limit"):
        hostile_model.predict(WHOLE)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: no 2 GB here


def test_a_site_starts_its_peers_worker_before_the_first_call():
    from msa_fed.artifacts.isolated import prestart

    fresh = PredictorPool(IsolationLimits(workers=2))
    try:
        own, peer = honest(0), isolate(honest(1), "b", fresh)
        prestart([own, peer])
        prestart([own, peer])  # one is enough: already starting
        peer.predict_proba(X)  # waits for the started worker rather than starting another
        assert fresh._count == 1 and len(fresh._idle) == 1 and fresh.restarts == 0
        pid = fresh._idle[0].pid
        assert Path(f"/proc/{pid}").exists()
        answered_together([own, peer], WHOLE)
        assert [w.pid for w in fresh._idle] == [pid]
        prestart([own])  # no isolated predictor: no worker
    finally:
        fresh.close()
    assert fresh._count == 0


def test_a_site_loads_its_peers_models_while_the_job_is_admitted():
    """prestart loads the peers' models into the worker it starts: the first evaluation is one
    request of rows, its answers those of the predictors in process; a hostile model loaded that
    way is still stopped and named at the call; a model whose bytes do not match its sha256 ends
    the worker it was loaded into, quietly, and the call names its owner."""
    from msa_fed.artifacts.isolated import prestart

    fresh = CountingPool(IsolationLimits(base_s=1.5, per_row_s=1e-3, workers=1))
    try:
        own, inproc = honest(0), [honest(1), honest(2)]
        peers = [isolate(h, name, fresh) for h, name in zip(inproc, ("b", "c"))]
        for t in prestart([own, *peers]):
            t.join()
        assert len(fresh._idle) == 1 and fresh._idle[0].loaded == {h.sha256 for h in inproc}
        pid = fresh._idle[0].pid
        together = answered_together([own, *peers], WHOLE)
        assert fresh.requests == 1 and [w.pid for w in fresh._idle] == [pid] and fresh.restarts == 0
        for h, ref in zip(together[1:], inproc):
            np.testing.assert_array_equal(h.predict_proba(WHOLE), ref.predict_proba(WHOLE))
        # a second job's models go into the running worker, next to the first job's
        slow = isolate(hostile("slow"), "west", fresh)
        for t in prestart([peers[0], slow]):
            t.join()
        assert slow.sha256 in fresh._idle[0].loaded and [w.pid for w in fresh._idle] == [pid]
        with pytest.raises(PeerFault, match=r"^site 'west''s predictor exceeded 1.9 s on 400 rows$"):
            answered_together([peers[0], slow], WHOLE)
        assert fresh.restarts == 1
        forged = isolate(honest(1), "forger", fresh)
        forged.sha256 = "0" * 64  # bytes that are not the model this sha256 names
        for t in prestart([forged]):
            t.join()
        assert fresh.restarts == 2 and not fresh._idle and fresh._count == 0
        with pytest.raises(PeerFault, match=r"^site 'forger''s predictor failed on 400 rows$"):
            answered_together([forged], WHOLE)
    finally:
        fresh.close()
    assert fresh._count == 0


def wide_predictor(width: int) -> bytes:
    """An honest 2-class predictor whose peak memory grows with the rows: an (n, width) float32
    product (``width`` * 4 bytes a row), reduced to one logit."""
    W = np.random.default_rng(0).normal(size=(2, width)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["H"]),
        helper.make_node("ReduceMax", ["H"], ["m"], axes=[1], keepdims=1),
        helper.make_node("Mul", ["m", "s"], ["l"]),
        helper.make_node("Neg", ["l"], ["nl"]),
        helper.make_node("Concat", ["nl", "l"], ["logits"], axis=1),
        helper.make_node("Softmax", ["logits"], ["P"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["n", 2])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array([0.01], np.float32), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(
        model, {"msa_fed.kind": "probabilities", "msa_fed.n_features": "2", "msa_fed.classes": "[0, 1]"}
    )
    return model.SerializeToString()


def test_an_honest_predictor_too_big_for_the_limit_on_the_whole_batch_answers_on_halves():
    """16000 rows need a 500 MiB product, over a 512 MiB worker with its libraries: the model runs
    again alone on halves of the rows instead of being blamed; a hostile one still is."""
    h = load_predictor(wide_predictor(8192), kind="probabilities")
    # time limits far above the work (a loaded machine must not turn a chunk into a time-out and
    # a restart): the memory limit is what this test is about
    small = PredictorPool(IsolationLimits(memory_bytes=512 << 20, workers=1, base_s=60.0, per_row_s=1e-2))
    try:
        big = rng.normal(size=(16_000, 2))
        hs = [isolate(honest(1), "b", small), isolate(h, "wide", small)]
        out = answered_together(hs, big)
        assert small.restarts >= 1  # it did run out of memory on the whole batch
        ref = np.concatenate([h.predict_proba(big[a : a + 1000]) for a in range(0, big.shape[0], 1000)])
        np.testing.assert_array_equal(out[1].predict_proba(big), ref)
        np.testing.assert_array_equal(out[0].predict_proba(big), honest(1).predict_proba(big))
        restarts = small.restarts  # the next call sends it rows in chunks that fit: no new failure
        np.testing.assert_array_equal(answered_together(hs, big)[1].predict_proba(big), ref)
        assert small.restarts == restarts
        with pytest.raises(
            PeerFault, match=r"^site 'east''s predictor exceeded the memory limit \(512 MiB\) on 1000 rows$"
        ):
            answered_together([hs[1], isolate(hostile("mem"), "east", small)], np.round(10 * big[:2000]))
    finally:
        small.close()


def test_the_peers_request_goes_out_before_the_own_session_opens_and_is_read_after():
    """The site's own predictor opens its session while its peers' request is with the worker
    (sent, the worker not given back yet); the answers are read after, the same as in process,
    and a slow peer is still stopped at its limit and named, its worker replaced."""
    fresh = CountingPool(IsolationLimits(base_s=1.5, per_row_s=1e-3, workers=1))
    try:
        seen = []

        def new_own(k):
            h = honest(k)
            h._session = None  # as a job's new site worker has it
            opens = h._ensure_session

            def opening():
                seen.append((fresh.requests, len(fresh._idle), fresh._count))
                return opens()

            h._ensure_session = opening
            return h

        own = new_own(0)
        together = answered_together([own, isolate(honest(1), "b", fresh)], WHOLE)
        assert seen == [(1, 0, 1)]  # the request was out, its worker held, when the session opened
        assert own._session is not None and len(fresh._idle) == 1 and fresh.restarts == 0
        np.testing.assert_array_equal(together[1].predict_proba(WHOLE), honest(1).predict_proba(WHOLE))
        own = new_own(2)
        with pytest.raises(PeerFault, match=r"^site 'west''s predictor exceeded 1.9 s on 400 rows$"):
            answered_together([own, isolate(hostile("slow"), "west", fresh)], WHOLE)
        assert own._session is not None and fresh.restarts == 1 and fresh._count == 0 and not fresh._idle
    finally:
        fresh.close()


def test_a_site_process_sends_its_peers_models_with_its_rows_in_one_request():
    """A site process starts its outputs at admission itself (prestart_peers=False): no worker and
    no load before that, then one request carries the peers' models and the rows; the outputs
    are those of every predictor in process."""
    from msa_fed.site.worker import SiteWorker

    fresh = CountingPool(IsolationLimits(base_s=1.5, per_row_s=1e-3, workers=1))
    y = (X[:200, 0] > 0).astype(int)

    def site(predictors, **kw):
        return SiteWorker(
            "a", 0, X[:200], y, X[200:], predictors=predictors, classes=np.array([0, 1]), sites=["a", "b", "c"], **kw
        )

    try:
        peers = [isolate(honest(1), "b", fresh), isolate(honest(2), "c", fresh)]
        worker = site([honest(0), *peers], prestart_peers=False)
        assert fresh._count == 0 and fresh.requests == 0  # nothing started or loaded yet
        worker._start_outputs()
        H = worker._outputs()
        assert fresh.requests == 1 and fresh._count == 1 and fresh.restarts == 0
        assert fresh._idle[0].loaded == {h.sha256 for h in peers}
        np.testing.assert_array_equal(H, site([honest(0), honest(1), honest(2)])._outputs())
    finally:
        fresh.close()
