"""The Ray runtime: one actor per site, pinned to the site's node when the cluster has one.

A node that carries the custom resource ``site:<name>`` is that site's machine; the site's
actor asks for a sliver of that resource, so Ray can only place it there and the data never
leaves the institution.  Without any ``site:`` resource (a laptop, a test) actors go anywhere;
with some, every site must have its node.  ``workers_per_site > 1`` adds helper actors
(:class:`msa_fed.runtime.site.ShardWorker`) on each site's node, each holding a block of the
site's unlabelled rows for data-parallel classifier training.

Failures are translated once, here, from Ray 2.x's exception types
(``ray/exceptions.py``): an error raised by the site's own code (``RayTaskError``) is re-raised
as the library error it is, anything else becomes a :class:`SiteError` naming the site;
``ActorUnavailableError`` means the actor is restarting (Ray: "temporarily unavailable"), so
the call is retried and, once the restarted worker reports that it lost its state, the
coordinator replays the setup; ``ActorDiedError`` (or any ``RayActorError``) is final when the
GCS actor table says the actor is ``DEAD`` (killed with ``no_restart``, restarts exhausted,
constructor failed): the run fails with a :class:`SiteError` naming the site and Ray's cause.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import numpy as np

from msa_fed.errors import ConfigError, MsaFedError, SiteError
from msa_fed.runtime import messages as m
from msa_fed.runtime import wire
from msa_fed.runtime.channel import CHANNEL_METHODS, ChannelClient, ChannelError, check_mode, make_identity
from msa_fed.runtime.shards import split_rows
from msa_fed.runtime.site import ShardWorker, SiteStateLost, SiteWorker

SITE_RESOURCE_PREFIX = "site:"
#: the share of a site node's ``site:<name>`` resource one actor takes (several may share it)
SITE_RESOURCE_SHARE = 0.01
#: constructor arrays above this size are put in the object store once (Ray inlines smaller ones)
LARGE_ARG_BYTES = 100 * 1024
#: pause between retries of a call to a restarting actor
RETRY_PAUSE_S = 0.1
#: after a data channel could not be opened, the calls go through Ray for this long before a
#: retry, doubling with each failure in a row up to CHANNEL_RETRY_MAX_S (a firewalled site
#: costs a connect time-out per retry, not per round)
CHANNEL_RETRY_S = 5.0
CHANNEL_RETRY_MAX_S = 600.0

log = logging.getLogger(__name__)


def ensure_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs):
    """Attach to ``address`` / ``RAY_ADDRESS`` if given, else start a new local Ray (once).

    ``address="local"`` is passed explicitly in the second case: a bare ``ray.init()`` would
    attach to any Ray that happens to run on this machine (it reads /tmp/ray).
    """
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    kwargs.update(init_kwargs)
    if address == "local" and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(address=address, **kwargs)
    return ray


def actor_status(handle) -> tuple[str | None, str]:
    """(state, death cause) of an actor from the GCS actor table; (None, "") if unknown.

    state is one of DEPENDENCIES_UNREADY, PENDING_CREATION, ALIVE, RESTARTING, DEAD.  The GCS
    table is read directly (``ray._private.state``), which needs no dashboard.
    """
    try:
        from ray._private import state as ray_state

        info = ray_state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - any failure here just means "unknown"
        return None, ""
    if not info:
        return None, ""
    cause = ""
    try:
        death = info.get("DeathCause")
        for fld in ("actor_died_error_context", "creation_task_failure_context"):
            if death is not None and death.HasField(fld):
                ctx = getattr(death, fld)
                cause = getattr(ctx, "error_message", "") or getattr(ctx, "formatted_exception_string", "")
                break
    except Exception:  # noqa: BLE001
        pass
    return info.get("State"), _last_line(cause)


def _cpu_share(share: float) -> float:
    """A CPU reservation Ray can always honour: at most 1, at most ``share`` (half of what is
    free, so a second backend never waits for a warm first one), 0 when that is a crumb."""
    share = min(1.0, float(share))
    return 0.0 if share < 0.01 else float(np.floor(share * 1e4) / 1e4)


def _original_error(site: str, text: str) -> str:
    """The last "pkg.ErrorType: message" line of a remote traceback, for a SiteError message."""
    found = ""
    for line in str(text).splitlines():
        head, sep, rest = line.strip().partition(": ")
        if sep and head.replace(".", "").replace("_", "").isalnum() and head[:1].isalpha() \
                and not head.startswith("ray.") and head.split(".")[-1][:1].isupper():
            found = f"{head.split('.')[-1]}: {rest}"
    prefix = f"SiteError: site {site!r}: "
    return found[len(prefix):] if found.startswith(prefix) else (found or _last_line(text))


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class _Endpoint:
    """One actor the coordinator talks to: a site (index < p) or a helper of site ``site``."""

    def __init__(self, name: str, site: int, handle, rows: tuple[int, int] | None = None):
        self.name, self.site, self.handle, self.rows = name, site, handle, rows
        self.channel: ChannelClient | None = None
        self.channel_retry_at = 0.0
        self.channel_failures = 0  # failed opens in a row

    @property
    def helper(self) -> bool:
        return self.rows is not None


class RaySites:
    """Backend of :class:`msa_fed.runtime.coordinator.Coordinator` with Ray actors.

    num_cpus : CPUs each actor reserves; None: an even share of half the site's node (or of
        half the local machine's free CPUs), at most 1, so that actors of a second backend never
        wait for a warm first one (Ray gives actors with fractional CPUs one BLAS/torch thread).
    max_restarts : restarts of a crashed actor before the site is declared dead.
    retry_timeout_s : how long a call waits for a restarting actor.
    start_timeout_s : how long start-up waits for Ray to place and start the actors.
    workers_per_site : actors per site for classifier training (1: the site's own actor).
    worker_cls : the site class (a :class:`SiteWorker` or subclass) made remote.
    data_channel : how the per-round calls (DC evaluations, SGD steps) travel
        (:mod:`msa_fed.runtime.channel`): "tls" (default; a direct mutual-TLS connection to each
        site actor, certificates exchanged through Ray), "plain" (no TLS; only when every actor
        runs on the coordinator's node, over loopback) or "off" (every call through Ray).
    init_kwargs : extra keyword arguments of ``ray.init`` when a local Ray is started.
    """

    def __init__(self, site_kwargs: list[dict], *, num_cpus: float | None = None, max_restarts: int = 3,
                 address: str | None = None, retry_timeout_s: float = 120.0, start_timeout_s: float = 300.0,
                 workers_per_site: int = 1, worker_cls=SiteWorker, init_kwargs: dict | None = None,
                 data_channel: str = "tls"):
        split_rows(0, workers_per_site)  # validates
        self.data_channel = check_mode(data_channel)
        self._identity = None  # the coordinator's ephemeral (certificate, key) for the channel
        if num_cpus is not None and not num_cpus >= 0:
            raise ValueError(f"num_cpus must be a number >= 0 or None; got {num_cpus!r}")
        if int(max_restarts) < 0:
            raise ValueError(f"max_restarts must be >= 0; got {max_restarts!r}")
        self.site_kwargs = site_kwargs
        self.num_cpus = num_cpus
        self.max_restarts = int(max_restarts)
        self.address = address
        self.retry_timeout_s = float(retry_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.workers_per_site = int(workers_per_site)
        self.worker_cls = worker_cls
        self.init_kwargs = init_kwargs or {}
        self.names = [kw["name"] for kw in site_kwargs]
        self.sites: list[_Endpoint] = []
        self.helpers: list[_Endpoint] = []
        self.coordinator = None
        self._helper_setup = None      # the last ShardSetup, replayed to a restarted helper
        self._placement_cache = None   # actor options per site
        self._arg_refs: list[dict] = []

    @property
    def actors(self) -> list:
        """The sites' actor handles, in site order."""
        return [e.handle for e in self.sites]

    @property
    def helper_actors(self) -> list:
        return [e.handle for e in self.helpers]

    # ------------------------------------------------------------------ lifecycle
    def _placement(self, ray) -> list[dict]:
        """Actor options per site: the site's resource when pinned, and a CPU share."""
        resources = ray.cluster_resources()
        free_cpus = ray.available_resources().get("CPU", 0.0)
        pinned = any(k.startswith(SITE_RESOURCE_PREFIX) for k in resources)
        # a node may carry several sites' resources (the demo: one machine standing in for all);
        # the CPU share is then split among this run's sites on that node
        node_cpus, node_sites = {}, {}
        ours = {SITE_RESOURCE_PREFIX + name for name in self.names}
        for node in ray.nodes():
            if node.get("Alive"):
                keys = [k for k in node.get("Resources", {}) if k in ours]
                for key in keys:
                    node_cpus[key] = node["Resources"].get("CPU", 0.0)
                    node_sites[key] = len(keys)
        out = []
        per_site = self.workers_per_site
        n_actors = len(self.names) * per_site
        for name in self.names:
            key = SITE_RESOURCE_PREFIX + name
            opts = dict(max_restarts=self.max_restarts, max_task_retries=self.max_restarts)
            if pinned:
                if key not in resources:
                    raise SiteError(name, f"no Ray node carries the resource {key!r} (the cluster has site "
                                          "resources, so every site needs its node)")
                opts["resources"] = {key: SITE_RESOURCE_SHARE}
                share = 0.5 * node_cpus.get(key, 1.0) / (node_sites.get(key, 1) * per_site)
            else:
                share = 0.5 * free_cpus / n_actors
            opts["num_cpus"] = self.num_cpus if self.num_cpus is not None else _cpu_share(share)
            out.append(opts)
        return out

    def start(self, coordinator):
        """Start the actors, or, when they run already (a warm backend), serve a new coordinator."""
        self.coordinator = coordinator
        if self.sites:
            return self.call_all("info", [None] * len(self.sites))
        ray = ensure_ray(self.address, **self.init_kwargs)
        placement = self._placement_cache = self._placement(ray)
        site_cls = ray.remote(self.worker_cls)
        # large constructor arguments (in-process data) go to the object store; holding their
        # references for the backend's life keeps them there for actor restarts
        self._arg_refs = [{k: ray.put(v) if isinstance(v, np.ndarray) and v.nbytes > LARGE_ARG_BYTES else v
                           for k, v in kw.items()} for kw in self.site_kwargs]
        self.sites = [_Endpoint(name, i, site_cls.options(**opts).remote(**kw))
                      for i, (name, kw, opts) in enumerate(zip(self.names, self._arg_refs, placement))]
        self.helpers = []
        try:
            infos = self._gather(self.sites, "info", [None] * len(self.sites), timeout=self.start_timeout_s)
            if self.workers_per_site > 1:
                helper_cls = ray.remote(ShardWorker)
                for i, info in enumerate(infos):
                    for start, stop in split_rows(info.n_unlabeled, self.workers_per_site)[1:]:
                        handle = helper_cls.options(**placement[i]).remote(info.name, i, start, stop, info.n_unlabeled)
                        self.helpers.append(_Endpoint(info.name, i, handle, rows=(start, stop)))
                for e, ref in [(e, self._load_rows(e)) for e in self.helpers]:
                    self._get(e, ref, lambda e=e: self._load_rows(e), "load_rows", replay=False)
        except BaseException:
            self.shutdown()
            raise
        return infos

    def _load_rows(self, e: _Endpoint):
        """Have site e.site send helper e its rows, by reference: they go from the site's actor
        to the helper on the same node, never through the coordinator."""
        req = m.RowRange(*e.rows)
        self.coordinator.record("to_site", e.name, "unlabeled_rows", req)
        return e.handle.load_rows.remote(self.sites[e.site].handle.unlabeled_rows.remote(req))

    def shutdown(self):
        """Kill every actor (no restart).  A local Ray started by :func:`ensure_ray` keeps running
        for the next run of this process."""
        import ray

        for e in self.sites + self.helpers:
            self._drop_channel(e)
            try:
                ray.kill(e.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.sites, self.helpers, self._arg_refs = [], [], []

    # ------------------------------------------------------------------ calls
    def _outgoing(self, e: _Endpoint, method: str, msg):
        if method == "setup_shard" and not e.helper:  # the site keeps only its first row block
            return replace(msg, workers_per_site=self.workers_per_site)
        return msg

    def _recover(self, e: _Endpoint, method: str):
        """Give a restarted actor back the state it lost."""
        if not e.helper:
            self.coordinator.replay_setup(e.site)
            return
        self._get(e, self._load_rows(e), lambda: self._load_rows(e), "load_rows", replay=False)
        if method != "setup_shard" and self._helper_setup is not None:
            msg = self._helper_setup
            self._get(e, e.handle.setup_shard.remote(msg), lambda: e.handle.setup_shard.remote(msg),
                      "setup_shard", replay=False)

    def _get(self, e: _Endpoint, ref, resubmit, method: str, replay: bool, wait_s: float | None = None):
        """The answer of ``ref``; ``resubmit()`` sends the same call again (after a restart).

        wait_s : how long to wait at most (default ``retry_timeout_s``); then a SiteError."""
        import ray
        from ray.exceptions import (ActorDiedError, GetTimeoutError, ObjectLostError, RayActorError, RayTaskError,
                                    UnserializableException)

        deadline = time.monotonic() + (self.retry_timeout_s if wait_s is None else max(0.0, wait_s))
        while True:
            try:
                return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:  # a node lost or stuck: Ray may wait for it for ever, the job does not
                state, _ = actor_status(e.handle)
                raise SiteError(e.name, f"no answer to {method} within {self.retry_timeout_s:g} s "
                                        f"(site_timeout_s; the site's actor is {state or 'in an unknown state'})") from None
            except RayTaskError as exc:  # raised by the site's own code
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                if isinstance(cause, SiteStateLost) and replay and time.monotonic() < deadline:
                    self._recover(e, method)
                    ref = resubmit()
                    continue
                if isinstance(cause, MsaFedError):
                    raise cause from None
                raise SiteError(e.name, f"{method} failed: {type(cause).__name__}: {cause}") from None
            except UnserializableException as exc:  # an exception class Ray could not rebuild here
                raise SiteError(e.name, _original_error(e.name, str(exc))) from None
            except (RayActorError, ObjectLostError) as exc:
                state, why = actor_status(e.handle)
                init_failed = isinstance(exc, RayActorError) and exc.actor_init_failed
                if init_failed or state == "DEAD" or (state is None and isinstance(exc, ActorDiedError)):
                    if init_failed:
                        raise SiteError(e.name, "the site's actor failed to start: "
                                                + _original_error(e.name, why or str(exc))) from None
                    detail = why or _last_line(str(exc)) or type(exc).__name__
                    raise SiteError(e.name, f"the site's actor died and will not be restarted: {detail}") from None
                if time.monotonic() > deadline:
                    raise SiteError(e.name, f"the site's actor did not come back within {self.retry_timeout_s:g} s "
                                            f"(state {state or 'unknown'}, {type(exc).__name__})") from None
                time.sleep(RETRY_PAUSE_S)  # restarting: Ray queues the call until the actor is back
                ref = resubmit()

    def _asks(self, e: _Endpoint) -> str:
        opts = self._placement_cache[e.site] if self._placement_cache else {}
        return ", ".join(f"{k}={v}" for k, v in opts.items() if k in ("num_cpus", "resources"))

    def _call(self, e: _Endpoint, method: str, msg):
        return getattr(e.handle, method).remote(msg)

    def _gather(self, endpoints: list[_Endpoint], method: str, msgs: list, timeout: float | None = None) -> list:
        """Send msgs[j] to endpoints[j] all at once; answers in order, failures translated.

        timeout : fail with a SiteError naming the first site without an answer after that many
            seconds (used at start-up, where an actor Ray cannot place would wait forever).
        """
        import ray

        if self.data_channel != "off" and method in CHANNEL_METHODS and timeout is None:
            return self._gather_channel(endpoints, method, msgs)
        c = self.coordinator
        msgs = [self._outgoing(e, method, msg) for e, msg in zip(endpoints, msgs)]
        refs = []
        for e, msg in zip(endpoints, msgs):
            c.record("to_site", e.name, method, msg)
            refs.append(self._call(e, method, msg))
        if timeout is not None:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            if pending:
                e = endpoints[refs.index(pending[0])]
                state, _ = actor_status(e.handle)
                if state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", None):
                    raise SiteError(e.name, f"Ray could not start the site's actor within {timeout:g} s (state "
                                            f"{state or 'unknown'}): the cluster lacks the CPUs or resources it "
                                            f"asks for ({self._asks(e)})")
        from ray.exceptions import GetTimeoutError

        try:
            outs = ray.get(refs, timeout=self.retry_timeout_s)  # the common case: one wait for all
        except Exception as exc:  # noqa: BLE001 - sort out which call failed and why, one by one
            wait = 0.0 if isinstance(exc, GetTimeoutError) else None  # timed out: name the site now
            outs = [self._get(e, ref, lambda e=e, msg=msg: self._call(e, method, msg), method, replay=True,
                              wait_s=wait) for e, ref, msg in zip(endpoints, refs, msgs)]
        for e, out in zip(endpoints, outs):
            c.record("from_site", e.name, method, out)
        return outs

    # ------------------------------------------------------------------ data channel
    def _drop_channel(self, e: _Endpoint, why=None):
        if e.channel is not None:
            if why is not None:
                log.info("data channel to %s closed (%s); this call goes through Ray", e.name, why)
            e.channel.close()
            e.channel = None

    def _open_channels(self, endpoints: list[_Endpoint]):
        """Open the data channel of every endpoint that has none (and is not in a retry pause)."""
        import ray

        now = time.monotonic()
        todo = [e for e in endpoints if e.channel is None and now >= e.channel_retry_at]
        if not todo:
            return
        if self.data_channel == "tls" and self._identity is None:
            self._identity = make_identity("msa-fed coordinator")
        offer = m.ChannelOffer(mode=self.data_channel, peer_cert=self._identity[0] if self._identity else "")
        here = ray.get_runtime_context().get_node_id()
        c = self.coordinator
        refs = []
        for e in todo:
            c.record("to_site", e.name, "open_channel", offer)
            refs.append(e.handle.open_channel.remote(offer))
        for e, ref in zip(todo, refs):
            try:
                addr = self._get(e, ref, lambda e=e: e.handle.open_channel.remote(offer), "open_channel", replay=False)
                c.record("from_site", e.name, "open_channel", addr)
                if self.data_channel == "plain" and addr.node_id != here:
                    raise ConfigError(f"site {e.name!r} runs on another node than the coordinator; a plaintext "
                                      "data channel is allowed only on loopback: use data_channel='tls'")
                e.channel = ChannelClient(addr, self.data_channel, self._identity, timeout_s=self.retry_timeout_s)
                e.channel_failures = 0
            except ConfigError:
                raise
            except (OSError, MsaFedError) as exc:  # the Ray path works on, and reports a dead site itself
                pause = min(CHANNEL_RETRY_MAX_S, CHANNEL_RETRY_S * 2 ** e.channel_failures)
                e.channel_failures += 1
                log.warning("cannot open the data channel to %s (%s); its calls go through Ray (next try in %g s; "
                            "data_channel='off' turns the channel off)", e.name, exc, pause)
                e.channel_retry_at = time.monotonic() + pause

    def _gather_channel(self, endpoints: list[_Endpoint], method: str, msgs: list) -> list:
        """:meth:`_gather` over the data channels; an endpoint whose channel fails (or whose
        site raised) is asked again through Ray, which restarts, replays and reports errors."""
        c = self.coordinator
        self._open_channels(endpoints)
        started = time.monotonic()
        msgs = [self._outgoing(e, method, msg) for e, msg in zip(endpoints, msgs)]
        sent, refs = [], {}
        for j, (e, msg) in enumerate(zip(endpoints, msgs)):
            c.record("to_site", e.name, method, msg)
            if e.channel is not None:
                try:
                    e.channel.send(method, msg)
                    sent.append(j)
                    continue
                except ChannelError as exc:
                    self._drop_channel(e, exc)
            refs[j] = self._call(e, method, msg)
        outs = [None] * len(endpoints)
        for j in sent:
            e = endpoints[j]
            try:
                outs[j] = e.channel.receive(method)
                continue
            except wire.RemoteError:
                pass  # the site's own error: the Ray call below raises (or replays) it as usual
            except ChannelError as exc:
                self._drop_channel(e, exc)
            refs[j] = self._call(e, method, msgs[j])
        for j, ref in refs.items():
            e, msg = endpoints[j], msgs[j]
            outs[j] = self._get(e, ref, lambda e=e, msg=msg: self._call(e, method, msg), method, replay=True,
                                wait_s=started + self.retry_timeout_s - time.monotonic())
        for e, out in zip(endpoints, outs):
            c.record("from_site", e.name, method, out)
        return outs

    def set_data_channel(self, mode: str):
        """Switch how the per-round calls travel ("tls", "plain", "off"); open channels close,
        and the next round opens new ones in the new mode."""
        check_mode(mode)
        for e in self.sites + self.helpers:
            self._drop_channel(e)
            e.channel_retry_at, e.channel_failures = 0.0, 0
        self.data_channel = mode

    def channel_status(self) -> dict[str, bool]:
        """{endpoint name (helpers as name[start:stop]): whether its data channel is open}."""
        out = {}
        for e in self.sites + self.helpers:
            out[e.name if not e.helper else f"{e.name}[{e.rows[0]}:{e.rows[1]}]"] = e.channel is not None
        return out

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        e = self.sites[i]
        c = self.coordinator
        msg = self._outgoing(e, method, msg)
        c.record("to_site", e.name, method, msg)
        out = self._get(e, self._call(e, method, msg), lambda: self._call(e, method, msg), method, replay)
        c.record("from_site", e.name, method, out)
        return out

    def call_all(self, method: str, msgs: list):
        return self._gather(self.sites, method, msgs)

    def call_shards(self, method: str, msg) -> list:
        """``msg`` to every holder of classifier rows (sites, then helpers); their answers."""
        if method == "setup_shard":
            self._helper_setup = msg
        endpoints = self.sites + self.helpers
        return self._gather(endpoints, method, [msg] * len(endpoints))
