"""The local runtime: the sites are :class:`SiteWorker` objects in this process.

Same code path as the Ray runtime, with one exception: with one worker per site the
coordinator trains the L-BFGS domain classifier itself on the stacked published samples
(:attr:`LocalSites.trains_in_process`), since the sites' shards would run one after another in
this process anyway.  Used by tests, small data and ``fit_dmsa(runtime="local")``.
``workers_per_site > 1`` splits each site's classifier shard over in-process
:class:`ShardWorker` helpers exactly as the Ray runtime does over actors (see
:mod:`msa_fed.site.shards`).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from msa_fed.artifacts.isolated import is_isolated
from msa_fed.boundary import messages as m
from msa_fed.core.threads import blas_threads_for
from msa_fed.runtime.backend import NullRecorder, SetupLog
from msa_fed.site.published import ShardWorker
from msa_fed.site.shards import split_rows
from msa_fed.site.worker import PositiveClass, SiteWorker

#: rows of the stacked input on which a binary logistic regression's outputs computed here
#: (:func:`binary_logistic_positive`) are compared with its own ``predict_proba``, bit for bit
CHECK_ROWS = 8


class LocalSites:
    """A :class:`msa_fed.runtime.backend.Backend` with in-process sites."""

    def __init__(
        self,
        site_kwargs: list[dict],
        *,
        workers_per_site: int = 1,
        worker_cls=SiteWorker,
        sharded: bool = False,
        stack_predictors: bool = True,
    ):
        split_rows(0, workers_per_site)  # validates
        self.site_kwargs = site_kwargs
        self.workers_per_site = int(workers_per_site)
        self.sharded = bool(sharded)  # train over the sites' shards as distributed sites do
        self.worker_cls = worker_cls
        # the in-process predictors evaluated once over all sites' rows (_stacked_outputs)
        self.stack_predictors = bool(stack_predictors)
        self.workers: list = []
        self.helpers: list[tuple[int, ShardWorker]] = []  # (site index, helper)
        self.recorder = NullRecorder()

    @property
    def trains_in_process(self) -> bool:
        """True: the coordinator trains the classifier itself on the stacked published samples
        (:func:`msa_fed.core.domain_classifier.stacked_shard`): the sites' shards would run in
        this process one after another.  False with ``workers_per_site > 1`` or ``sharded``, which
        ask for the data-parallel path (it mirrors the Ray runtime's, and the federated runtime's on
        large published samples: a reference for them to 1e-9)."""
        return self.workers_per_site == 1 and not self.sharded

    def start(self, recorder=None, setup_log: SetupLog | None = None):
        self.recorder = recorder if recorder is not None else NullRecorder()
        self.workers = [self.worker_cls(**kw) for kw in self.site_kwargs]
        infos = [self.call_one(i, "info", None) for i in range(len(self.workers))]
        self.helpers = []
        for i, info in enumerate(infos):
            for start, stop in split_rows(info.n_unlabeled, self.workers_per_site)[1:]:
                helper = ShardWorker(info.name, i, start, stop, info.n_unlabeled)
                helper.load_rows(self.call_one(i, "unlabeled_rows", m.RowRange(start, stop)))
                self.helpers.append((i, helper))
        return infos

    def _call(self, worker, method: str, msg):
        self.recorder.record("to_site", worker.name, method, msg)
        out = worker.handle(method, msg)  # the site's one entry point (msa_fed/site/methods.py)
        self.recorder.record("from_site", worker.name, method, out)
        return out

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        if method == "setup_shard":  # the site keeps only its first row block
            msg = replace(msg, workers_per_site=self.workers_per_site)
        return self._call(self.workers[i], method, msg)

    def call_all(self, method: str, msgs: list):
        if method == "set_qhat" and self.stack_predictors:
            self._stacked_outputs()
        return [self.call_one(i, method, msg) for i, msg in enumerate(msgs)]

    def _stacked_outputs(self) -> None:
        """Each predictor that runs in this process evaluated once over every site's rows stacked,
        each site handed its slice (:meth:`SiteWorker._hand_outputs`), before the sites first
        evaluate their predictors (``set_qhat``): p calls instead of p per site, each of which
        pays the predictor's own per-call overhead (scikit-learn's input validation: most of
        ``set_qhat`` at p = 64).

        Why this is allowed here (docs/DESIGN.md section 5: the local runtime runs the sites in one
        process, the caller's): these predictors are the caller's own objects, already called on
        every site's rows in this one process; a predictor's outputs on a row depend on that row
        only (the contract of ``predict`` / ``predict_proba``), so each site's numbers are those of
        its own call (tested bit for bit); and each site still checks its slice as it checks its
        own call's answer (its errors name the same predictor and sample, re-run on that site's
        rows).  A peer's isolated predictor (msa_fed.artifacts.isolated) is left to each site:
        every site asks it on its own rows, as in the federated topology, where no predictor sees
        two sites' rows in one call.  A predictor whose stacked call fails or answers rows it was
        not asked is left to the sites too (each then calls it as before).  A scikit-learn logistic
        regression of two classes is not called but computed here as its ``predict_proba`` computes
        it (:func:`binary_logistic_positive`, checked against its own call): its second column p
        alone is handed (:class:`PositiveClass`), into one block for all such models."""
        workers = [w for w in self.workers if isinstance(w, SiteWorker) and w._H is None]
        if len(workers) < 2:
            return
        rows = [w._predictor_rows() for w in workers]
        uses: dict[int, tuple[object, str, list[tuple[int, int]]]] = {}  # id -> (h, method, [(site, k)])
        for i, w in enumerate(workers):
            method = "predict" if w.task == "regression" else "predict_proba"
            for k, h in enumerate(w.predictors):
                if is_isolated(h) or not hasattr(h, method):
                    continue
                entry = uses.setdefault(id(h), (h, method, []))
                if entry[1] == method:
                    entry[2].append((i, k))
        handed: list[dict[int, np.ndarray | PositiveClass]] = [{} for _ in workers]
        stacked: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        positive: dict[tuple[int, ...], np.ndarray] = {}  # the binary logistic models' block per stack
        jobs = []
        for h, method, where in uses.values():
            sites = tuple(sorted({i for i, _ in where}))
            if len(sites) < 2 or any(rows[i].shape[1] != rows[sites[0]].shape[1] for i in sites):
                continue
            if sites not in stacked:
                X = np.concatenate([rows[i] for i in sites])
                stacked[sites] = (X, np.cumsum([0] + [rows[i].shape[0] for i in sites]))
            jobs.append((h, method, where, sites))
        # the binary logistic models over each stack: their second column alone, into one block
        by_stack: dict[tuple[int, ...], list[object]] = {}
        for h, method, _, sites in jobs:
            if method == "predict_proba" and _binary_logistic(h, stacked[sites][0].shape[1]):
                by_stack.setdefault(sites, []).append(h)
        placed: dict[int, tuple[tuple[int, ...], int]] = {}  # id(h) -> (stack, column)
        for sites, models in by_stack.items():
            X = stacked[sites][0]
            if not np.isfinite(X).all():  # its own call refuses such rows: the sites call it
                continue
            block = positive[sites] = np.empty((X.shape[0], len(models)), order="F")
            with blas_threads_for(X.size):
                for j, h in enumerate(models):
                    if binary_logistic_positive(h, X, block[:, j]):
                        placed[id(h)] = (sites, j)
        for h, method, where, sites in jobs:
            X, offsets = stacked[sites]
            at = {site: j for j, site in enumerate(sites)}
            if id(h) in placed:
                column = positive[sites][:, placed[id(h)][1]]
                for i, k in where:
                    a, b = offsets[at[i]], offsets[at[i] + 1]
                    handed[i][k] = PositiveClass(column[a:b])
                continue
            try:
                with blas_threads_for(X.size * max(1, len(getattr(h, "classes_", ())))):
                    out = getattr(h, method)(X)
            except Exception:  # noqa: BLE001 - each site calls it itself and reports what it does
                continue
            if not isinstance(out, np.ndarray) or out.ndim < 1 or out.shape[0] != X.shape[0]:
                continue
            for i, k in where:
                a, b = offsets[at[i]], offsets[at[i] + 1]
                handed[i][k] = out[a:b]
        for w, X, given in zip(workers, rows, handed):
            if given:
                w._hand_outputs(X, given)

    def call_shards(self, method: str, msg) -> list:
        """``msg`` to every holder of classifier rows (sites, then helpers); their answers."""
        outs = self.call_all(method, [msg] * len(self.workers))
        outs += [self._call(helper, method, msg) for _, helper in self.helpers]
        return outs

    def share_samples(self, samples) -> None:
        """Give every site the job's published samples (it verifies domain models against them).

        The host's own copy of published material, not a request of the coordinator's: it is not
        one of the boundary messages and is not recorded."""
        msg = m.PublishedSamples(tuple(samples))
        for worker in self.workers:
            worker.set_published(msg)

    def shutdown(self):
        self.workers = []
        self.helpers = []


def _binary_logistic(h, n_features: int) -> bool:
    """Whether ``h`` is a fitted scikit-learn ``LogisticRegression`` of two classes, exactly (its
    class, not a subclass, with no method of its own replaced), with dense float64 coefficients
    over ``n_features`` inputs and no feature names: a model whose ``predict_proba`` is
    [1 - p, p] with p the logistic function of X @ coef_.T + intercept_."""
    module = sys.modules.get("sklearn.linear_model")  # not imported: no such model exists here
    cls = getattr(module, "LogisticRegression", None)
    if cls is None or type(h) is not cls:
        return False
    own = vars(h)
    if any(name in own for name in ("predict_proba", "decision_function", "predict_log_proba")):
        return False
    if "feature_names_in_" in own or np.asarray(getattr(h, "classes_", ())).size != 2:
        return False
    coef, intercept = own.get("coef_"), own.get("intercept_")
    return (
        type(coef) is np.ndarray
        and type(intercept) is np.ndarray
        and coef.dtype == np.float64
        and intercept.dtype == np.float64
        and coef.shape == (1, n_features)
        and intercept.shape == (1,)
    )


def binary_logistic_positive(h, X: np.ndarray, out: np.ndarray) -> bool:
    """The second column of a binary logistic model's ``predict_proba(X)`` (:func:`_binary_logistic`;
    X finite float64) written into ``out`` (n,): the products and the logistic function its own
    call computes (scikit-learn's ``decision_function``, then ``expit``), without the call's input
    validation and the (n, 2) array it stacks.  The model's own ``predict_proba`` on the first
    :data:`CHECK_ROWS` rows must give the same numbers bit for bit (its first column 1 - p): if it
    does not (another version's arithmetic), False and the model is called as any other."""
    from scipy.special import expit

    scores = X @ h.coef_.T + h.intercept_
    expit(scores.reshape(-1), out=out)
    try:
        ref = np.asarray(h.predict_proba(X[:CHECK_ROWS]))
    except Exception:  # noqa: BLE001 - its stacked call is made and judged as any other's
        return False
    p = out[:CHECK_ROWS]
    return ref.shape == (p.size, 2) and np.array_equal(ref[:, 1], p) and np.array_equal(ref[:, 0], 1 - p)
