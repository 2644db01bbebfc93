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

from dataclasses import replace

from msa_fed.boundary import messages as m
from msa_fed.runtime.backend import NullRecorder, SetupLog
from msa_fed.site.published import ShardWorker
from msa_fed.site.shards import split_rows
from msa_fed.site.worker import SiteWorker


class LocalSites:
    """A :class:`msa_fed.runtime.backend.Backend` with in-process sites."""

    def __init__(
        self, site_kwargs: list[dict], *, workers_per_site: int = 1, worker_cls=SiteWorker, sharded: bool = False
    ):
        split_rows(0, workers_per_site)  # validates
        self.site_kwargs = site_kwargs
        self.workers_per_site = int(workers_per_site)
        self.sharded = bool(sharded)  # train over the sites' shards as distributed sites do
        self.worker_cls = worker_cls
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
        return [self.call_one(i, method, msg) for i, msg in enumerate(msgs)]

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
