"""The local runtime: the sites are :class:`SiteWorker` objects in this process.

Same code path as the Ray runtime (the coordinator cannot tell the difference); used by
tests, small data and ``fit_dmsa(runtime="local")``.
"""
from __future__ import annotations

from msa_fed.runtime.site import SiteWorker


class LocalSites:
    def __init__(self, site_kwargs: list[dict]):
        self.site_kwargs = site_kwargs
        self.workers: list[SiteWorker] = []
        self.coordinator = None

    def start(self, coordinator):
        self.coordinator = coordinator
        self.workers = [SiteWorker(**kw) for kw in self.site_kwargs]
        return [self.call_one(i, "info", None) for i in range(len(self.workers))]

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        worker = self.workers[i]
        c = self.coordinator
        c.record("to_site", worker.name, method, msg)
        out = getattr(worker, method)(msg)
        c.record("from_site", worker.name, method, out)
        return out

    def call_all(self, method: str, msgs: list):
        return [self.call_one(i, method, msg) for i, msg in enumerate(msgs)]

    def shutdown(self):
        self.workers = []
