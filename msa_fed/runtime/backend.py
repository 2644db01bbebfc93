"""What a backend is: the one interface between the coordinator and its sites.

A backend runs the sites (in this process: :class:`msa_fed.runtime.local.LocalSites`; as Ray
actors: :class:`msa_fed.runtime.ray_sites.RaySites`; a third backend implements the same
methods) and carries boundary messages (:mod:`msa_fed.boundary.messages`) to them.  It is given
what it needs at :meth:`Backend.start` (the recorder of every crossing, the set-up log to replay
to a restarted site) and never calls back into the coordinator.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from msa_fed.boundary import messages as m


class NullRecorder:
    """A recorder that keeps nothing (when the caller gave none)."""

    def record(self, direction: str, site: str, method: str, message) -> None:
        pass


class SetupLog:
    """The set-up messages the sites have been given, the latest per method, in order.

    The coordinator adds each one before sending it (:meth:`add`); a backend whose site lost its
    state (a restarted actor) sends them again, in order (:meth:`entries`).
    """

    def __init__(self) -> None:
        self._entries: list[tuple[str, Any]] = []

    def add(self, method: str, msg) -> None:
        self._entries = [(mm, x) for mm, x in self._entries if mm != method] + [(method, msg)]

    def get(self, method: str):
        """The last message of ``method``, or None."""
        return next((x for mm, x in self._entries if mm == method), None)

    def entries(self) -> list[tuple[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries = []


@runtime_checkable
class Backend(Protocol):
    """The methods a backend exposes to the coordinator.

    Every ``method`` named below is a public method of :class:`msa_fed.site.worker.SiteWorker`
    (the whole surface of a site); ``msg`` is the request message (or None) and the answers are
    response messages.  Each request and answer is handed to the recorder as
    ``recorder.record("to_site" | "from_site", site name, method, message)``.
    """

    def start(self, recorder, setup_log: SetupLog) -> list[m.SiteInfo]:
        """Start the sites (or, already started, serve a new run) and return their ``info``."""

    def call_all(self, method: str, msgs: list) -> list:
        """``msgs[k]`` to site k, all at once; the answers in site order."""

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        """``msg`` to site ``i``; ``replay``: if the site lost its state, resend the set-up log
        and ask again."""

    def call_shards(self, method: str, msg) -> list:
        """``msg`` to every holder of classifier rows (the sites, then their helpers)."""

    def shutdown(self) -> None:
        """Stop the sites (idempotent)."""

    # Optional: ``trains_in_process`` (a bool property), True where the classifier's shards would
    # all run in the coordinator's process: it then trains on the stacked samples itself.
