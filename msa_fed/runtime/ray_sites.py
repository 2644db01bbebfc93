"""The Ray runtime: one actor per site, pinned to the site's node when the cluster has one.

A node that carries the custom resource ``site:<name>`` is that site's machine; the site's
actor asks for a sliver of that resource, so Ray can only place it there and the data never
leaves the institution.  Without such a resource (a laptop, a test) actors go anywhere.

Failures are translated once, here: a site that raised one of the library's errors re-raises
it; a site that restarted (``max_restarts``) gets its state replayed and the call retried; a
site that stays down fails the run with a :class:`msa_fed.errors.SiteError` naming it.
"""
from __future__ import annotations

import logging
import os
import time

from msa_fed.errors import MsaFedError, SiteError
from msa_fed.runtime.site import SiteStateLost, SiteWorker

SITE_RESOURCE_PREFIX = "site:"
#: the share of a site node's ``site:<name>`` resource one actor takes (several may share it)
SITE_RESOURCE_SHARE = 0.01


def ensure_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs):
    """Attach to ``address`` / ``RAY_ADDRESS`` if given, else start a local Ray (once)."""
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    kwargs.update(init_kwargs)
    if address is None and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(address=address, **kwargs)
    return ray


class RaySites:
    """Backend of :class:`msa_fed.runtime.coordinator.Coordinator` with Ray actors."""

    def __init__(self, site_kwargs: list[dict], *, num_cpus: float = 0.5, max_restarts: int = 3,
                 address: str | None = None, retry_timeout_s: float = 60.0, worker_cls=None,
                 init_kwargs: dict | None = None):
        self.site_kwargs = site_kwargs
        self.num_cpus = num_cpus
        self.max_restarts = max_restarts
        self.address = address
        self.retry_timeout_s = retry_timeout_s
        self.worker_cls = worker_cls or SiteWorker  # the job uses a subclass that loads data on its node
        self.init_kwargs = init_kwargs or {}
        self.actors = []
        self.names = [kw["name"] for kw in site_kwargs]
        self.coordinator = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, coordinator):
        ray = ensure_ray(self.address, **self.init_kwargs)
        self.coordinator = coordinator
        resources = ray.cluster_resources()
        self.actors = []
        for kw in self.site_kwargs:
            key = SITE_RESOURCE_PREFIX + kw["name"]
            opts = dict(num_cpus=self.num_cpus, max_restarts=self.max_restarts,
                        max_task_retries=self.max_restarts)
            if key in resources:
                opts["resources"] = {key: SITE_RESOURCE_SHARE}
            cls = ray.remote(**opts)(self.worker_cls)
            self.actors.append(cls.remote(**kw))
        return self.call_all("info", [None] * len(self.actors))

    def shutdown(self):
        if not self.actors:
            return
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []

    # ------------------------------------------------------------------ calls
    def _get(self, i: int, ref, method: str, msg, replay: bool):
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        name = self.names[i]
        deadline = time.monotonic() + self.retry_timeout_s
        while True:
            try:
                return ray.get(ref)
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                if isinstance(cause, SiteStateLost) and replay:
                    self.coordinator.replay_setup(i)
                    ref = getattr(self.actors[i], method).remote(msg)
                    continue
                if isinstance(cause, (MsaFedError, ValueError, TypeError)):
                    raise cause from None
                raise SiteError(name, f"{type(cause).__name__}: {cause}") from None
            except RayActorError as exc:
                # restarting actors answer RayActorError until they are back; retry until the deadline
                if time.monotonic() > deadline or _permanently_dead(exc):
                    raise SiteError(name, "the site's actor died and could not be restarted "
                                          f"({type(exc).__name__})") from None
                time.sleep(0.2)
                ref = getattr(self.actors[i], method).remote(msg)

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        c = self.coordinator
        c.record("to_site", self.names[i], method, msg)
        out = self._get(i, getattr(self.actors[i], method).remote(msg), method, msg, replay)
        c.record("from_site", self.names[i], method, out)
        return out

    def call_all(self, method: str, msgs: list):
        c = self.coordinator
        refs = []
        for i, msg in enumerate(msgs):
            c.record("to_site", self.names[i], method, msg)
            refs.append(getattr(self.actors[i], method).remote(msg))
        outs = []
        for i, (ref, msg) in enumerate(zip(refs, msgs)):
            out = self._get(i, ref, method, msg, replay=True)
            c.record("from_site", self.names[i], method, out)
            outs.append(out)
        return outs


def _permanently_dead(exc) -> bool:
    text = str(exc).lower()
    return ("ray.kill" in text or "no_restart" in text or "max_restarts" in text
            or "exceeded" in text or "restart" in text and "will not be" in text)
