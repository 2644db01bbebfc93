"""The registry's relay between jobs and site processes that dial out (``msa_fed.v1.Relay``).

A site process (``msa-fed site serve``) opens no listening socket: it connects to the registry
and keeps one ``Connect`` stream.  The coordinator's job (an admin principal) opens a job naming
its sites (``OpenJob``) and sends requests for them (``Call``: one request per site, the
answers gathered); the relay forwards each request on the named site's stream and returns the
site's answer.  The payloads are the boundary messages of ``boundary.proto`` or, for a sealed
job, frames sealed end to end between the job and the site (:mod:`msa_fed.crypto.sealing`)
that the registry can neither read nor forge; either way they are carried as they are: the relay
decodes nothing of them and never keeps them.

Checks, on the registry's side:

- ``Connect``: a site principal (token checked by the auth interceptor); the stream's first
  message is a Hello naming the token's own site; with mutual TLS the client certificate must
  name that site too (common name or subject alternative name); the site must be registered.
  A second connection of the same site replaces the first.
- every forwarded request: the job was opened by an admin and names the site; the site is
  connected, still registered, and its token is still valid (a revoked token, a rotated token or
  a deregistered site is refused); the sites of one ``Call`` are checked together, in one
  query of the registry's store.
- a sweep every ``sweep_interval_s`` re-checks every connected site the same way and closes the
  stream of a site whose token was revoked or that was deregistered (PERMISSION_DENIED), or that
  sent nothing (answers, heartbeats) for ``silence_timeout_s`` (UNAVAILABLE).  Calls waiting on a
  site that goes away fail at once with UNAVAILABLE naming it.
- ``FetchPredictor``: a site may download the published predictor of a site named by a job that
  names the caller too (it needs every site's predictor on its own labelled points).
- ``FetchSample``: the same for a site's published unlabelled sample (the site verifies the
  job's domain model against the samples of all the job's sites).

Each connected site holds one of the server's worker threads for its stream (and one reader
thread of its own) and one of its stream slots (half its workers, shared with uploads and
downloads): give ``RegistryServer(max_workers=...)`` more than twice as many workers as sites.  The
relay keeps ``max_streams`` (the server's stream slots, at most its workers less a reserve for
every other RPC) and refuses a site stream beyond that with RESOURCE_EXHAUSTED, so that sites can
never starve the registry.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field

import grpc

from msa_fed.boundary.proto import registry_pb2 as reg_pb
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.control.auth import bearer_token
from msa_fed.control.registry.convert import artifact_to_pb
from msa_fed.control.registry.records import ROLE_ADMIN, ROLE_SITE, check_name
from msa_fed.control.registry.service import Registry
from msa_fed.errors import RegistryError

log = logging.getLogger(__name__)

RELAY_SERVICE = pb.DESCRIPTOR.services_by_name["Relay"].full_name
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
CHUNK_BYTES = 1 << 20
MAX_CALLS = 1024  # site calls in one Call
MAX_OPEN_JOBS = 1024


class _Gather:
    """The answers one Call waits for: its thread is woken once, when the last one is in (or at
    its deadline), not once per site."""

    def __init__(self, n: int):
        self.left = n
        self.lock = threading.Lock()
        self.all_in = threading.Event()
        if n == 0:
            self.all_in.set()


@dataclass
class _Pending:
    site: str
    gather: _Gather = field(default_factory=lambda: _Gather(1))
    done: bool = False
    response: object = None
    status: str = ""
    detail: str = ""

    def _settle(self, response, status: str, detail: str) -> None:
        gather = self.gather
        with gather.lock:
            if self.done:  # the first outcome stays (an answer, a failure, the deadline)
                return
            self.response, self.status, self.detail, self.done = response, status, detail, True
            gather.left -= 1
            if gather.left == 0:
                gather.all_in.set()

    def fail(self, status: str, detail: str):
        self._settle(None, status, detail)

    def succeed(self, response):
        self._settle(response, "", "")


class _Connection:
    """One connected site: its outgoing queue and the calls it has not answered yet."""

    def __init__(self, name: str, token: str, peer: str):
        self.name, self.token, self.peer = name, token, peer
        self.connected_at = self.last_seen = time.time()
        self.out: queue.Queue = queue.Queue()
        self.pending: dict[int, _Pending] = {}
        self.lock = threading.Lock()
        self.closed: tuple[str, str] | None = None  # (status, why) once cut off

    def close(self, status: str, why: str):
        with self.lock:
            if self.closed is None:
                self.closed = (status, why)
            pending, self.pending = list(self.pending.values()), {}
        for p in pending:
            p.fail("UNAVAILABLE", f"site {self.name!r} went away: {why}")
        self.out.put(None)  # wake the stream

    def forward(self, call_id: int, message: pb.RelayToSite, pending: _Pending) -> bool:
        with self.lock:
            if self.closed is not None:
                return False
            self.pending[call_id] = pending
        self.out.put(message)
        return True

    def answer(self, call_id: int, response) -> None:
        with self.lock:
            pending = self.pending.pop(call_id, None)
        if pending is not None:
            pending.succeed(response)

    def forget(self, call_id: int) -> None:
        with self.lock:
            self.pending.pop(call_id, None)


@dataclass
class _Job:
    job_id: str
    admin: str
    sites: tuple
    opened_at: float


def _status(code: str) -> grpc.StatusCode:
    return grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN)


def _peer_names(context) -> set[str] | None:
    """Names in the client certificate (mutual TLS), or None when the client presented none."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - no auth context: plaintext
        return None
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            names.add(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    return names or None


class RelayServicer(pb_grpc.RelayServicer):
    """See the module docstring.  ``context.principal`` comes from the auth interceptor."""

    def __init__(
        self,
        registry: Registry,
        *,
        heartbeat_interval_s: float = 5.0,
        silence_timeout_s: float = 20.0,
        sweep_interval_s: float = 1.0,
        max_call_timeout_s: float = 3600.0,
        max_streams: int | None = None,
    ):
        self.registry = registry
        self.max_streams = max_streams
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.silence_timeout_s = float(silence_timeout_s)
        self.sweep_interval_s = float(sweep_interval_s)
        self.max_call_timeout_s = float(max_call_timeout_s)
        self._sites: dict[str, _Connection] = {}
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sweeper: threading.Thread | None = None

    # ------------------------------------------------------------------ checks
    def _site_ok(self, name: str, token: str) -> str:
        """ "" when the site may still be served, else why not."""
        try:
            principal = self.registry.authenticate(token)
        except RegistryError:
            return f"the token of site {name!r} was revoked or replaced"
        if principal.role != ROLE_SITE or principal.name != name:
            return f"the token does not name site {name!r}"
        if self.registry.store.get_site(name) is None:
            return f"site {name!r} is no longer registered"
        return ""

    def is_connected(self, name: str) -> bool:
        """Whether site ``name`` holds an open stream now."""
        with self._lock:
            conn = self._sites.get(name)
        return conn is not None and conn.closed is None

    def connected(self) -> dict[str, _Connection]:
        with self._lock:
            return dict(self._sites)

    def _sweep(self):
        while True:
            time.sleep(self.sweep_interval_s)
            with self._lock:
                conns = list(self._sites.values())
                if not conns:
                    self._sweeper = None
                    return
            now = time.time()
            for c in conns:
                why = self._site_ok(c.name, c.token)
                if why:
                    log.warning("relay: cutting off site %r: %s", c.name, why)
                    c.close("PERMISSION_DENIED", why)
                elif now - c.last_seen > self.silence_timeout_s:
                    log.warning("relay: site %r silent for %.0f s; closing its stream", c.name, now - c.last_seen)
                    c.close("UNAVAILABLE", f"site {c.name!r} sent nothing for {now - c.last_seen:.0f} s")

    def _ensure_sweeper(self):
        with self._lock:
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="relay-sweep", daemon=True)
                self._sweeper.start()

    # ------------------------------------------------------------------ site side
    def Connect(self, request_iterator, context):
        principal = context.principal
        if principal.role != ROLE_SITE:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only a site may connect; the caller is {principal}")
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message on the stream must be a Hello")
        name = first.hello.site
        if name != principal.name:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"site {principal.name!r} may not serve as site {name[:64]!r}"
            )
        certified = _peer_names(context)
        if certified is not None and name not in certified:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the client certificate names {sorted(certified)}, not site {name!r}",
            )
        token = bearer_token(context.invocation_metadata()) or ""
        why = self._site_ok(name, token)
        if why:
            code = grpc.StatusCode.FAILED_PRECONDITION if "registered" in why else grpc.StatusCode.PERMISSION_DENIED
            context.abort(code, why)
        conn = _Connection(name, token, context.peer())
        with self._lock:
            old = self._sites.get(name)
            full = self.max_streams is not None and old is None and len(self._sites) >= self.max_streams
            if not full:
                self._sites[name] = conn
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the registry serves at most {self.max_streams} site streams; start it with more workers "
                "(msa-fed registry serve --workers)",
            )
        if old is not None:
            old.close("ALREADY_EXISTS", f"site {name!r} connected again from {conn.peer}")
        context.add_callback(lambda: conn.close("CANCELLED", "the stream ended"))
        log.info("relay: site %r connected from %s", name, conn.peer)
        self._record_heartbeat(principal)
        self._ensure_sweeper()
        reader = threading.Thread(
            target=self._read, args=(conn, request_iterator, principal), name=f"relay-{name}", daemon=True
        )
        reader.start()
        try:
            yield pb.RelayToSite(welcome=pb.Welcome(heartbeat_interval_s=self.heartbeat_interval_s))
            while True:
                try:
                    item = conn.out.get(timeout=self.heartbeat_interval_s)
                except queue.Empty:
                    item = pb.RelayToSite(ping=pb.Heartbeat(sent_at=time.time()))
                if conn.closed is not None:
                    status, why = conn.closed
                    if status in ("CANCELLED",):
                        return
                    context.abort(_status(status), why)
                if item is not None:
                    yield item
        finally:
            conn.close("CANCELLED", "the stream ended")
            with self._lock:
                if self._sites.get(name) is conn:
                    del self._sites[name]
            log.info("relay: site %r disconnected", name)

    def _record_heartbeat(self, principal):
        try:
            self.registry.heartbeat(principal, principal.name)
        except RegistryError:
            pass

    def _read(self, conn: _Connection, request_iterator, principal):
        last_beat = 0.0
        try:
            for msg in request_iterator:
                conn.last_seen = time.time()
                part = msg.WhichOneof("part")
                if part == "answer":
                    conn.answer(msg.answer.call_id, msg.answer)  # in the clear or sealed: carried as it is
                elif part == "heartbeat" and conn.last_seen - last_beat >= self.heartbeat_interval_s / 2:
                    last_beat = conn.last_seen
                    self._record_heartbeat(principal)
        except grpc.RpcError:
            pass
        except Exception:  # noqa: BLE001 - a broken stream ends the connection, never the server
            log.exception("relay: reading the stream of site %r failed", conn.name)
        conn.close("CANCELLED", "the site closed its stream")

    def FetchPredictor(self, request, context):
        yield from self._fetch(request, context, "predictor")

    def FetchSample(self, request, context):
        yield from self._fetch(request, context, "sample")

    def _fetch(self, request, context, kind):
        """The published ``kind`` of ``request.site``, to a site of an open job naming both."""
        principal = context.principal
        if principal.role != ROLE_SITE:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only a site fetches {kind}s through the relay")
        with self._lock:
            job = self._jobs.get(request.job_id)
        if job is None or principal.name not in job.sites or request.site not in job.sites:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"no open job {request.job_id[:128]!r} names both site {principal.name!r} and "
                f"site {request.site[:64]!r}",
            )
        site = self.registry.store.get_site(request.site)
        record = getattr(site, kind) if site is not None else None
        data = self.registry.store.get_blob(record.sha256) if record is not None else None
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"site {request.site!r} has no published {kind}")
        yield reg_pb.DownloadChunk(artifact=artifact_to_pb(record))
        for start in range(0, len(data), CHUNK_BYTES):
            yield reg_pb.DownloadChunk(chunk=data[start : start + CHUNK_BYTES])

    # ------------------------------------------------------------------ job side
    def _admin(self, context, action: str):
        principal = context.principal
        if principal.role != ROLE_ADMIN:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only an admin may {action}; the caller is {principal}")
        return principal

    def cancel_job(self, job_id: str) -> None:
        """An admin cancelled the job (``msa-fed job cancel``): close it here and tell its sites;
        its calls, and opening it again, are refused from now on (:meth:`_refuse_cancelled`)."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
            conns = [self._sites[n] for n in (job.sites if job else ()) if n in self._sites]
        for conn in conns:
            conn.out.put(pb.RelayToSite(end_job=pb.EndJob(job_id=job_id)))
        if job is not None:
            log.info("relay: job %r cancelled; its sites were told", job_id)

    def _refuse_cancelled(self, job_id: str, context) -> None:
        """FAILED_PRECONDITION naming who cancelled the job, when its newest record is cancelled
        (read from the store: a registry restarted since still refuses it)."""
        from msa_fed.control.ops.service import Operations

        record = Operations(self.registry).cancelled(job_id)
        if record is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {job_id} ({record.job_id}) was {record.error}")

    def OpenJob(self, request, context):
        principal = self._admin(context, "open a job")
        if not JOB_ID_PATTERN.match(request.job_id):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "job_id must be 1-128 letters, digits, '_', '.', ':' or '-'"
            )
        self._refuse_cancelled(request.job_id, context)
        sites = tuple(request.sites)
        if not sites or len(set(sites)) != len(sites):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job names its sites, each once")
        states = self.registry.store.token_states(ROLE_SITE)
        for name in sites:
            try:
                check_name(name)
            except RegistryError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            if self.registry.store.get_site(name) is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"site {name!r} is not registered")
            if states.get(name) != "active":
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"site {name!r} has no active token (revoked?); it cannot take part in a job",
                )
        with self._lock:
            if request.job_id not in self._jobs and len(self._jobs) >= MAX_OPEN_JOBS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open jobs; close some")
            self._jobs[request.job_id] = _Job(request.job_id, principal.name, sites, time.time())
            connected = [n for n in sites if n in self._sites]
        log.info("relay: job %r opened by %s for sites %s", request.job_id, principal, list(sites))
        return pb.OpenJobResponse(connected=connected)

    def Call(self, request, context):
        self._admin(context, "send requests to sites")
        with self._lock:
            job = self._jobs.get(request.job_id)
        if job is None:
            if JOB_ID_PATTERN.match(request.job_id):
                self._refuse_cancelled(request.job_id, context)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no open job {request.job_id[:128]!r}")
        if len(request.calls) > MAX_CALLS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_CALLS} site calls per Call")
        timeout = request.timeout_s if request.timeout_s > 0 else self.max_call_timeout_s
        deadline = time.monotonic() + min(timeout, self.max_call_timeout_s)
        waits: list[tuple[_Pending, _Connection | None, int]] = []
        with self._lock:
            conns = {c.site: self._sites.get(c.site) for c in request.calls if c.site in job.sites}
        # every site of the call checked at once (one store query); a site that fails is checked
        # again alone, for the reason in words
        present = {name: conn.token for name, conn in conns.items() if conn is not None}
        admitted = self.registry.sites_admitted(present) if present else set()
        refused = {name: self._site_ok(name, token) for name, token in present.items() if name not in admitted}
        gather = _Gather(len(request.calls))
        for call in request.calls:
            pending = _Pending(call.site, gather)
            conn = None
            call_id = next(self._ids)
            if call.site not in job.sites:
                pending.fail("PERMISSION_DENIED", f"job {job.job_id!r} does not name site {call.site[:64]!r}")
            else:
                conn = conns[call.site]
                why = refused.get(call.site, "")
                if conn is None:
                    pending.fail("UNAVAILABLE", f"site {call.site!r} is not connected to the registry")
                elif why:
                    conn.close("PERMISSION_DENIED", why)
                    pending.fail("PERMISSION_DENIED", why)
                else:
                    fwd = pb.RelayToSite(
                        forward=pb.Forward(
                            call_id=call_id,
                            job_id=job.job_id,
                            admin=job.admin,
                            request=call.request,
                            sealed=call.sealed,
                        )
                    )
                    if not conn.forward(call_id, fwd, pending):
                        pending.fail("UNAVAILABLE", f"site {call.site!r} is disconnecting")
            waits.append((pending, conn, call_id))
        gather.all_in.wait(max(0.0, deadline - time.monotonic()))
        results = []
        for pending, conn, call_id in waits:
            if not pending.done:
                if conn is not None:
                    conn.forget(call_id)
                pending.fail("DEADLINE_EXCEEDED", f"site {pending.site!r} did not answer within {timeout:g} s")
            if pending.status:
                results.append(pb.SiteResult(site=pending.site, status=pending.status, detail=pending.detail))
            else:
                answer = pending.response
                results.append(pb.SiteResult(site=pending.site, response=answer.response, sealed=answer.sealed))
        return pb.CallResponse(results=results)

    def CloseJob(self, request, context):
        self._admin(context, "close a job")
        with self._lock:
            job = self._jobs.pop(request.job_id, None)
            conns = [self._sites[n] for n in (job.sites if job else ()) if n in self._sites]
        for conn in conns:
            conn.out.put(pb.RelayToSite(end_job=pb.EndJob(job_id=request.job_id)))
        return pb.CloseJobResponse()

    def ListConnected(self, request, context):
        self._admin(context, "list connected sites")
        return pb.ListConnectedResponse(
            sites=[
                pb.ConnectedSite(site=c.name, connected_at=c.connected_at, last_seen=c.last_seen, peer=c.peer)
                for c in sorted(self.connected().values(), key=lambda c: c.name)
            ]
        )


def add_relay(server: grpc.Server, registry: Registry, **kwargs) -> RelayServicer:
    """Register the relay on ``server`` (the registry's gRPC server); returns the servicer."""
    servicer = RelayServicer(registry, **kwargs)
    pb_grpc.add_RelayServicer_to_server(servicer, server)
    return servicer
