"""The Ray runtime: one actor per site, pinned to the site's node when the cluster has one.

Placement, attaching to Ray and reading an actor's state are :mod:`msa_fed.runtime.ray_actors`;
this module is the per-round calls.  ``workers_per_site > 1`` adds helper actors
(:class:`msa_fed.site.published.ShardWorker`) on each site's node, each holding a block of the
site's unlabelled rows for data-parallel classifier training.

Failures are translated once, here, from Ray 2.x's exception types
(``ray/exceptions.py``): an error raised by the site's own code (``RayTaskError``) is re-raised
as the library error it is, anything else becomes a :class:`SiteError` naming the site;
``ActorUnavailableError`` means the actor is restarting (Ray: "temporarily unavailable"), so
the call is retried and, once the restarted worker reports that it lost its state, the backend
replays the set-up log; ``ActorDiedError`` (or any ``RayActorError``) is final when the
GCS actor table says the actor is ``DEAD`` (killed with ``no_restart``, restarts exhausted,
constructor failed): the run fails with a :class:`SiteError` naming the site and Ray's cause.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from msa_fed.errors import ConfigError, MsaFedError, SiteError
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.channel import CHANNEL_METHODS, ChannelClient, ChannelError, check_mode, make_identity
from msa_fed.core.options import from_mapping
from msa_fed.runtime.backend import NullRecorder, SetupLog
from msa_fed.runtime.config import RayConfig
from msa_fed.runtime.ray_actors import (
    LARGE_ARG_BYTES,
    SITE_RESOURCE_PREFIX,  # noqa: F401 - re-exported
    SITE_RESOURCE_SHARE,  # noqa: F401 - re-exported
    actor_pid,
    actor_status,
    ensure_ray,
    last_line,
    original_error,
    placement,
)
from msa_fed.site.shards import split_rows
from msa_fed.site.published import ShardWorker, SiteStateLost
from msa_fed.site.worker import SiteWorker

#: pause between retries of a call to a restarting actor
RETRY_PAUSE_S = 0.1
#: after a data channel could not be opened, the calls go through Ray for this long before a
#: retry, doubling with each failure in a row up to CHANNEL_RETRY_MAX_S (a firewalled site
#: costs a connect time-out per retry, not per round)
CHANNEL_RETRY_S = 5.0
CHANNEL_RETRY_MAX_S = 600.0

log = logging.getLogger(__name__)


class _Endpoint:
    """One actor the coordinator talks to: a site (index < p) or a helper of site ``site``."""

    def __init__(self, name: str, site: int, handle, rows: tuple[int, int] | None = None):
        self.name, self.site, self.handle, self.rows = name, site, handle, rows
        self.channel: ChannelClient | None = None
        self.channel_retry_at = 0.0
        self.channel_failures = 0  # failed opens in a row
        # per-round calls (CHANNEL_METHODS) answered over the data channel, and through Ray
        self.channel_calls = 0
        self.ray_calls = 0

    @property
    def helper(self) -> bool:
        return self.rows is not None


class RaySites:
    """A :class:`msa_fed.runtime.backend.Backend` with Ray actors.

    config : a :class:`msa_fed.runtime.config.RayConfig` (each option documented there), or its
        fields as keyword arguments.
    worker_cls : the site class (a :class:`SiteWorker` or subclass) made remote.

    The actors are told their host (:data:`site_host_kwargs`): the site's policy is its node's
    policy file, and a policy passed with the job only tightens it (:mod:`msa_fed.site.policy`).
    """

    #: what every site actor's constructor is given besides its own keyword arguments
    site_host_kwargs: dict = {"host": "ray"}

    def __init__(self, site_kwargs: list[dict], config: RayConfig | None = None, *, worker_cls=SiteWorker, **options):
        if config is None:
            config = from_mapping(RayConfig, options, "RaySites: ")
        elif options:
            raise TypeError("give RaySites a RayConfig or its fields as keyword arguments, not both")
        self.config = config.validate()  # at once when checked with the fit's config
        self.data_channel = check_mode(config.data_channel)
        self._identity: tuple[str, bytes] | None = None  # the coordinator's ephemeral (cert, key) for the channel
        self.site_kwargs = site_kwargs
        self.num_cpus = config.num_cpus
        self.max_restarts = config.max_restarts
        self.address = config.address
        self.retry_timeout_s = config.retry_timeout_s
        self.start_timeout_s = config.start_timeout_s
        self.workers_per_site = config.workers_per_site
        self.worker_cls = worker_cls
        self.init_kwargs = dict(config.init_kwargs)
        self.names = [kw["name"] for kw in site_kwargs]
        self.sites: list[_Endpoint] = []
        self.helpers: list[_Endpoint] = []
        self.recorder = NullRecorder()
        self.setup_log = SetupLog()
        self._placement_cache: list[dict] | None = None  # actor options per site
        self._arg_refs: list[dict] = []

    @property
    def actors(self) -> list:
        """The sites' actor handles, in site order."""
        return [e.handle for e in self.sites]

    # ------------------------------------------------------------------ lifecycle
    def start(self, recorder=None, setup_log: SetupLog | None = None):
        """Start the actors, or, when they run already (a warm backend), serve a new run."""
        self.recorder = recorder if recorder is not None else NullRecorder()
        self.setup_log = setup_log if setup_log is not None else SetupLog()
        if self.sites:
            return self.call_all("info", [None] * len(self.sites))
        ray = ensure_ray(self.address, **self.init_kwargs)
        placement_opts = self._placement_cache = self._placement(ray)
        site_cls = ray.remote(self.worker_cls)
        # large constructor arguments (in-process data) go to the object store; holding their
        # references for the backend's life keeps them there for actor restarts
        self._arg_refs = [
            {k: ray.put(v) if isinstance(v, np.ndarray) and v.nbytes > LARGE_ARG_BYTES else v for k, v in kw.items()}
            for kw in ({**kw, **self.site_host_kwargs} for kw in self.site_kwargs)
        ]
        self.sites = [
            _Endpoint(name, i, site_cls.options(**opts).remote(**kw))
            for i, (name, kw, opts) in enumerate(zip(self.names, self._arg_refs, placement_opts))
        ]
        self.helpers = []
        try:
            infos = self._gather(self.sites, "info", [None] * len(self.sites), timeout=self.start_timeout_s)
            if self.workers_per_site > 1:
                helper_cls = ray.remote(ShardWorker)
                for i, info in enumerate(infos):
                    for start, stop in split_rows(info.n_unlabeled, self.workers_per_site)[1:]:
                        handle = helper_cls.options(**placement_opts[i]).remote(
                            info.name, i, start, stop, info.n_unlabeled
                        )
                        self.helpers.append(_Endpoint(info.name, i, handle, rows=(start, stop)))
                for e, ref in [(e, self._load_rows(e)) for e in self.helpers]:
                    self._get(e, ref, lambda e=e: self._load_rows(e), "load_rows", replay=False)
        except BaseException:
            self.shutdown()
            raise
        return infos

    def _placement(self, ray) -> list[dict]:
        """Actor options per site (:func:`msa_fed.runtime.ray_actors.placement`)."""
        return placement(ray, self.names, self.workers_per_site, self.max_restarts, self.num_cpus)

    def _load_rows(self, e: _Endpoint):
        """Have site e.site send helper e its rows, by reference: they go from the site's actor
        to the helper on the same node, never through the coordinator."""
        assert e.rows is not None  # a helper endpoint
        req = m.RowRange(*e.rows)
        self.recorder.record("to_site", e.name, "unlabeled_rows", req)
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
        self._published = None

    # ------------------------------------------------------------------ calls
    def _outgoing(self, e: _Endpoint, method: str, msg):
        if method == "setup_shard" and not e.helper:  # the site keeps only its first row block
            return replace(msg, workers_per_site=self.workers_per_site)
        return msg

    def share_samples(self, samples) -> None:
        """Give every site actor the job's published samples (it verifies domain models against
        them): one copy in the object store, kept for an actor that restarts."""
        import ray

        # published material from the host, not a coordinator request: not recorded (local.py)
        self._published = ray.put(m.PublishedSamples(tuple(samples)))
        refs = [e.handle.set_published.remote(self._published) for e in self.sites]
        for e, ref in zip(self.sites, refs):
            self._get(e, ref, lambda e=e: e.handle.set_published.remote(self._published), "set_published", False)

    def _recover(self, e: _Endpoint, method: str):
        """Give a restarted actor back the state it lost."""
        if not e.helper:
            if getattr(self, "_published", None) is not None:
                ref = e.handle.set_published.remote(self._published)
                self._get(e, ref, lambda: e.handle.set_published.remote(self._published), "set_published", False)
            for setup_method, msg in self.setup_log.entries():
                self.call_one(e.site, setup_method, msg, replay=False)
            return
        self._get(e, self._load_rows(e), lambda: self._load_rows(e), "load_rows", replay=False)
        msg = self.setup_log.get("setup_shard")
        if method != "setup_shard" and msg is not None:
            self._get(
                e,
                e.handle.setup_shard.remote(msg),
                lambda: e.handle.setup_shard.remote(msg),
                "setup_shard",
                replay=False,
            )

    def _get(self, e: _Endpoint, ref, resubmit, method: str, replay: bool, wait_s: float | None = None):
        """The answer of ``ref``; ``resubmit()`` sends the same call again (after a restart).

        wait_s : how long to wait at most (default ``retry_timeout_s``); then a SiteError."""
        import ray
        from ray.exceptions import (
            ActorDiedError,
            GetTimeoutError,
            ObjectLostError,
            RayActorError,
            RayTaskError,
            UnserializableException,
        )

        deadline = time.monotonic() + (self.retry_timeout_s if wait_s is None else max(0.0, wait_s))
        while True:
            try:
                return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:  # a node lost or stuck: Ray may wait for it for ever, the job does not
                state, _ = actor_status(e.handle)
                raise SiteError(
                    e.name,
                    f"no answer to {method} within {self.retry_timeout_s:g} s "
                    f"(retry_timeout_s; the site's actor is "
                    f"{state or 'in an unknown state'})",
                ) from None
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
                raise SiteError(e.name, original_error(e.name, str(exc))) from None
            except (RayActorError, ObjectLostError) as exc:
                state, why = actor_status(e.handle)
                init_failed = isinstance(exc, RayActorError) and exc.actor_init_failed
                if init_failed or state == "DEAD" or (state is None and isinstance(exc, ActorDiedError)):
                    if init_failed:
                        raise SiteError(
                            e.name, "the site's actor failed to start: " + original_error(e.name, why or str(exc))
                        ) from None
                    detail = why or last_line(str(exc)) or type(exc).__name__
                    raise SiteError(e.name, f"the site's actor died and will not be restarted: {detail}") from None
                if time.monotonic() > deadline:
                    raise SiteError(
                        e.name,
                        f"the site's actor did not come back within {self.retry_timeout_s:g} s "
                        f"(state {state or 'unknown'}, {type(exc).__name__})",
                    ) from None
                time.sleep(RETRY_PAUSE_S)  # restarting: Ray queues the call until the actor is back
                ref = resubmit()

    def _asks(self, e: _Endpoint) -> str:
        opts: dict = self._placement_cache[e.site] if self._placement_cache else {}
        return ", ".join(f"{k}={v}" for k, v in opts.items() if k in ("num_cpus", "resources"))

    def _call(self, e: _Endpoint, method: str, msg):
        return e.handle.handle.remote(method, msg)  # the site's one entry point (msa_fed/site/methods.py)

    def _gather(self, endpoints: list[_Endpoint], method: str, msgs: list, timeout: float | None = None) -> list:
        """Send msgs[j] to endpoints[j] all at once; answers in order, failures translated.

        timeout : fail with a SiteError naming the first site without an answer after that many
            seconds (used at start-up, where an actor Ray cannot place would wait forever).
        """
        import ray

        if self.data_channel != "off" and method in CHANNEL_METHODS and timeout is None:
            return self._gather_channel(endpoints, method, msgs)
        c = self.recorder
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
                pid = actor_pid(e.handle) if state == "PENDING_CREATION" else 0
                if pid:
                    raise SiteError(
                        e.name,
                        f"the site's actor (pid {pid}) had not finished starting within {timeout:g} s: "
                        "the node is overloaded, or the site's data takes that long to load",
                    )
                if state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", None):
                    raise SiteError(
                        e.name,
                        f"Ray could not start the site's actor within {timeout:g} s (state "
                        f"{state or 'unknown'}): the cluster lacks the CPUs or resources it "
                        f"asks for ({self._asks(e)})",
                    )
        from ray.exceptions import GetTimeoutError

        try:
            outs = ray.get(refs, timeout=self.retry_timeout_s)  # the common case: one wait for all
        except Exception as exc:  # noqa: BLE001 - sort out which call failed and why, one by one
            wait = 0.0 if isinstance(exc, GetTimeoutError) else None  # timed out: name the site now
            outs = [
                self._get(e, ref, lambda e=e, msg=msg: self._call(e, method, msg), method, replay=True, wait_s=wait)
                for e, ref, msg in zip(endpoints, refs, msgs)
            ]
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
        c = self.recorder
        refs = []
        for e in todo:
            c.record("to_site", e.name, "open_channel", offer)
            refs.append(e.handle.open_channel.remote(offer))
        for e, ref in zip(todo, refs):
            try:
                addr = self._get(e, ref, lambda e=e: e.handle.open_channel.remote(offer), "open_channel", replay=False)
                c.record("from_site", e.name, "open_channel", addr)
                if self.data_channel == "plain" and addr.node_id != here:
                    raise ConfigError(
                        f"site {e.name!r} runs on another node than the coordinator; a plaintext "
                        "data channel is allowed only on loopback: use data_channel='tls'"
                    )
                e.channel = ChannelClient(addr, self.data_channel, self._identity, timeout_s=self.retry_timeout_s)
                e.channel_failures = 0
            except ConfigError:
                raise
            except (OSError, MsaFedError) as exc:  # the Ray path works on, and reports a dead site itself
                pause = min(CHANNEL_RETRY_MAX_S, CHANNEL_RETRY_S * 2**e.channel_failures)
                e.channel_failures += 1
                log.warning(
                    "cannot open the data channel to %s (%s); its calls go through Ray (next try in %g s; "
                    "data_channel='off' turns the channel off)",
                    e.name,
                    exc,
                    pause,
                )
                e.channel_retry_at = time.monotonic() + pause

    def _gather_channel(self, endpoints: list[_Endpoint], method: str, msgs: list) -> list:
        """:meth:`_gather` over the data channels; an endpoint whose channel fails (or whose
        site raised) is asked again through Ray, which restarts, replays and reports errors."""
        c = self.recorder
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
                assert e.channel is not None  # sent over it above
                outs[j] = e.channel.receive(method)
                e.channel_calls += 1
                continue
            except wire.RemoteError:
                pass  # the site's own error: the Ray call below raises (or replays) it as usual
            except ChannelError as exc:
                self._drop_channel(e, exc)
            refs[j] = self._call(e, method, msgs[j])
        for j, ref in refs.items():
            e, msg = endpoints[j], msgs[j]
            e.ray_calls += 1
            outs[j] = self._get(
                e,
                ref,
                lambda e=e, msg=msg: self._call(e, method, msg),
                method,
                replay=True,
                wait_s=started + self.retry_timeout_s - time.monotonic(),
            )
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
            rows = e.rows or (0, 0)  # a helper has its rows
            out[e.name if not e.helper else f"{e.name}[{rows[0]}:{rows[1]}]"] = e.channel is not None
        return out

    def call_one(self, i: int, method: str, msg, replay: bool = True):
        e = self.sites[i]
        c = self.recorder
        msg = self._outgoing(e, method, msg)
        c.record("to_site", e.name, method, msg)
        out = self._get(e, self._call(e, method, msg), lambda: self._call(e, method, msg), method, replay)
        c.record("from_site", e.name, method, out)
        return out

    def call_all(self, method: str, msgs: list):
        return self._gather(self.sites, method, msgs)

    def call_shards(self, method: str, msg) -> list:
        """``msg`` to every holder of classifier rows (sites, then helpers); their answers."""
        endpoints = self.sites + self.helpers
        return self._gather(endpoints, method, [msg] * len(endpoints))
