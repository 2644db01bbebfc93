"""Ray itself for the Ray runtime: attaching, placing the site actors, reading their state.

A node that carries the custom resource ``site:<name>`` is that site's machine; the site's
actor asks for a sliver of that resource, so Ray can only place it there and the data never
leaves the institution.  Without any ``site:`` resource (a laptop, a test) actors go anywhere;
with some, every site must have its node.  The per-round calls to the placed actors are
:mod:`msa_fed.runtime.ray_sites`.
"""

from __future__ import annotations

import logging
import os
import secrets
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from msa_fed.errors import SiteError
from msa_fed.runtime.ray_own import process_alive, stop_processes

SITE_RESOURCE_PREFIX = "site:"
#: the share of a site node's ``site:<name>`` resource one actor takes (several may share it)
SITE_RESOURCE_SHARE = 0.01
#: constructor arrays above this size are put in the object store once (Ray inlines smaller ones)
LARGE_ARG_BYTES = 100 * 1024


log = logging.getLogger(__name__)
#: tries to start or attach to Ray before giving up (see ensure_ray)
RAY_START_ATTEMPTS = 2


def ensure_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs):
    """Attach to ``address`` / ``RAY_ADDRESS`` if given, else start a new local Ray (once).

    ``address="local"`` is passed explicitly in the second case: a bare ``ray.init()`` would
    attach to any Ray that happens to run on this machine (it reads /tmp/ray).  A SIGTERM handler
    of this process's own (a job's, which ends it as Ctrl-C does) is kept: Ray's driver installs
    its own, which exits with status 15 and no record, wherever Ray starts (a federated job starts
    it only when it needs stand-in actors, mid-job).
    """
    import signal
    import threading

    import ray

    if ray.is_initialized():
        return ray
    main = threading.current_thread() is threading.main_thread()
    own_sigterm = signal.getsignal(signal.SIGTERM) if main else None
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    kwargs.update(init_kwargs)
    if address == "local" and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if address == "local":
        quiet_local_ray()
        private_token_file()
    for attempt in range(RAY_START_ATTEMPTS):
        before = ray_children() if address == "local" else {}
        try:
            with _DashboardFailureNoted() if kwargs.get("include_dashboard") is False else nullcontext():
                ray.init(address=address, **kwargs)
            break
        except Exception as exc:  # Ray raises a bare Exception when its raylet starts too slowly
            # measured: on a loaded 2-core machine a local raylet can miss Ray's fixed 30 s wait, and
            # a new head's GCS, started beside another Ray, can fail to write its port file
            text = str(exc)
            slow = "timed out during startup" in text or "Timed out waiting for file" in text
            ray.shutdown()
            if address == "local":
                # a node that never finished starting is out of ray.shutdown's reach: its GCS,
                # dashboard and monitors would run on for this process's life
                stop_processes(set(ray_children()) - set(before))
            if not slow or attempt + 1 == RAY_START_ATTEMPTS:
                raise
            log.warning("Ray did not start in time (machine loaded?); trying again")
    if address == "local":
        private_ray_token()
    if callable(own_sigterm):
        signal.signal(signal.SIGTERM, own_sigterm)
    return ray


def ray_children() -> dict[int, str]:
    """This process's child processes that run Ray's programs (a local Ray's GCS, raylet,
    dashboard and monitors, or Ray's workers), alive, with their command lines.  Read from
    ``/proc/PID/task/*/children`` (no scan of every process; elsewhere than Linux: none)."""
    found: dict[int, str] = {}
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            kids = [int(k) for k in task.read_text().split()]
        except (OSError, ValueError):
            continue
        for kid in kids:
            try:
                cmdline = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if not process_alive(kid):  # exited (a zombie not yet waited for included)
                continue
            if "/ray/" in cmdline or cmdline.startswith("ray::"):
                found[kid] = cmdline.strip()[:160]
    return found


def private_ray_token(path: str | os.PathLike | None = None) -> bool:
    """Make the token Ray keeps for a local cluster (``~/.ray/auth_token``) readable by its owner
    only: Ray 2.60 writes it 0644, and it admits whoever holds it to the cluster.  True when a
    file was tightened; a file of another user is left alone."""
    import stat

    token = Path(path) if path is not None else Path.home() / ".ray" / "auth_token"
    try:
        info = token.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or not info.st_mode & 0o077:
        return False
    os.chmod(token, stat.S_IMODE(info.st_mode) & 0o700)
    return True


#: the Ray module that reports its dashboard process's failure to start (with its log's tail)
_DASHBOARD_LOGGER = "ray._private.services"


class _DashboardFailureNoted(logging.Filter):
    """While a local Ray starts with ``include_dashboard=False``: Ray still starts its dashboard
    process (the API server, in minimal mode) and, when that process dies at start (seen on a
    loaded machine: SIGABRT), logs the failure and the tail of the dashboard's log as ERROR
    lines, then goes on without it. Nothing here uses the dashboard: those records are dropped
    and one INFO line says so."""

    dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "dashboard" in record.getMessage():
            self.dropped += 1
            return False
        return True

    def __enter__(self) -> _DashboardFailureNoted:
        logging.getLogger(_DASHBOARD_LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(_DASHBOARD_LOGGER).removeFilter(self)
        if self.dropped:
            log.info("Ray's dashboard process did not start (not used: started with include_dashboard=False)")


def quiet_local_ray() -> None:
    """Silence what Ray would otherwise warn about on every start of a local instance.

    Ray 2.60 turns token authentication on for a new local cluster when ``RAY_AUTH_MODE`` is
    unset (keeping its token in ``~/.ray/auth_token``) and says so with a WARNING on every run:
    nothing for the user to act on, and the behaviour wanted here.  That one logger is raised to
    ERROR; an operator's explicit ``RAY_AUTH_MODE`` is used by Ray without any warning anyway.
    """
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def private_token_file() -> Path | None:
    """Before a new local Ray starts with its token check on (Ray's default when ``RAY_AUTH_MODE``
    is unset, or ``token``) and no token given in the environment: Ray keeps its token in
    ``~/.ray/auth_token`` and would write it readable by every user (0644).  Made here first,
    readable by the user only (0600), or narrowed to 0600 when it exists.  Returns the file
    (None when the environment names the token or turns the check off)."""
    if os.environ.get("RAY_AUTH_MODE", "token") != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path = Path.home() / ".ray" / "auth_token"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    except OSError as exc:  # an unwritable home: Ray reports its own error when it needs the file
        log.info("could not prepare %s (%s)", path, exc)
    return path


def _actor_entry(handle) -> dict:
    """The actor's row of the GCS actor table ({} if unknown).  The table is read directly
    (``ray._private.state``), which needs no dashboard."""
    try:
        from ray._private import state as ray_state

        return ray_state.actors(actor_id=handle._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - any failure here just means "unknown"
        return {}


def actor_pid(handle) -> int:
    """The process id of an actor's worker from the GCS actor table; 0 while Ray has not
    given it a worker (it waits for resources, or for its worker process to start)."""
    try:
        return int(_actor_entry(handle).get("Pid") or 0)
    except (TypeError, ValueError):
        return 0


def actor_status(handle) -> tuple[str | None, str]:
    """(state, death cause) of an actor from the GCS actor table; (None, "") if unknown.

    state is one of DEPENDENCIES_UNREADY, PENDING_CREATION, ALIVE, RESTARTING, DEAD.
    """
    info = _actor_entry(handle)
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
    return info.get("State"), last_line(cause)


def _cpu_share(share: float) -> float:
    """A CPU reservation Ray can always honour: at most 1, at most ``share`` (half of what is
    free, so a second backend never waits for a warm first one), 0 when that is a crumb."""
    share = min(1.0, float(share))
    return 0.0 if share < 0.01 else float(np.floor(share * 1e4) / 1e4)


def placement(ray, names: list[str], workers_per_site: int, max_restarts: int, num_cpus: float | None) -> list[dict]:
    """Actor options per site: the site's resource when pinned, and a CPU share."""
    resources = ray.cluster_resources()
    free_cpus = ray.available_resources().get("CPU", 0.0)
    pinned = any(k.startswith(SITE_RESOURCE_PREFIX) for k in resources)
    # a node may carry several sites' resources (the demo: one machine standing in for all);
    # the CPU share is then split among this run's sites on that node
    node_cpus, node_sites = {}, {}
    ours = {SITE_RESOURCE_PREFIX + name for name in names}
    for node in ray.nodes():
        if node.get("Alive"):
            keys = [k for k in node.get("Resources", {}) if k in ours]
            for key in keys:
                node_cpus[key] = node["Resources"].get("CPU", 0.0)
                node_sites[key] = len(keys)
    out = []
    per_site = workers_per_site
    n_actors = len(names) * per_site
    for name in names:
        key = SITE_RESOURCE_PREFIX + name
        opts: dict[str, Any] = dict(max_restarts=max_restarts, max_task_retries=max_restarts)
        if pinned:
            if key not in resources:
                raise SiteError(
                    name,
                    f"no Ray node carries the resource {key!r} (the cluster has site "
                    "resources, so every site needs its node)",
                )
            opts["resources"] = {key: SITE_RESOURCE_SHARE}
            share = 0.5 * node_cpus.get(key, 1.0) / (node_sites.get(key, 1) * per_site)
        else:
            share = 0.5 * free_cpus / n_actors
        opts["num_cpus"] = num_cpus if num_cpus is not None else _cpu_share(share)
        out.append(opts)
    return out


def original_error(site: str, text: str) -> str:
    """The last "pkg.ErrorType: message" line of a remote traceback, for a SiteError message."""
    found = ""
    for line in str(text).splitlines():
        head, sep, rest = line.strip().partition(": ")
        if (
            sep
            and head.replace(".", "").replace("_", "").isalnum()
            and head[:1].isalpha()
            and not head.startswith("ray.")
            and head.split(".")[-1][:1].isupper()
        ):
            found = f"{head.split('.')[-1]}: {rest}"
    prefix = f"SiteError: site {site!r}: "
    return found[len(prefix) :] if found.startswith(prefix) else (found or last_line(text))


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""
