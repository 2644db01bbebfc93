"""Authentication, authorisation, transfer limits and error mapping, as one gRPC server interceptor.

Every method except the standard health check requires
``authorization: Bearer <token>`` metadata.  The interceptor serves every
method as a request stream (gRPC would otherwise wait for a unary call's
request message on a worker thread before any check ran), so that, on the
worker thread and before a request message is awaited:

1. the token is checked (UNAUTHENTICATED: missing, malformed, wrong or revoked);
2. under mutual TLS, the client certificate must name the token's site
   (its subject CN or a DNS subjectAltName equals the site name), else
   PERMISSION_DENIED;
3. the principal's role must be one the method's rule allows (PERMISSION_DENIED);
4. a *transfer* method (an upload or download stream) takes a slot: at most
   ``max_streams_per_principal`` per token and ``max_streams`` in all, else
   RESOURCE_EXHAUSTED at once; the stream is cut off (CANCELLED) after
   ``idle_s`` without a message or ``deadline_s`` in all, so a silent client
   cannot hold a worker thread;
5. the request message of a unary-request call is awaited in a slot (at most
   ``max_pending_reads_per_caller`` per token, or per network address for the
   health check, whose slots are a pool of their own) for ``request_read_s``.

``grpc.health.v1.Health/Watch`` is refused (it would hold a worker per watcher).

The handler then sees an :class:`AuthenticatedContext` whose ``principal``
says who called.  An interceptor outside this one learns it too, refusals
included, when the context it passes in has a ``note_principal(principal)``
method (the audit log, :mod:`msa_fed.control.audit`): it is called as soon
as the token is verified, before the certificate and role checks.  Whatever the handler raises becomes a status through
:func:`msa_fed.control.registry.public.public_status` (library text never reaches the
client).

**Adding a service**: declare a :class:`MethodRule` for each of its methods in
:data:`METHOD_RULES` (e.g. with :func:`service_rules`).  A method of any other
service that has no rule is refused (PERMISSION_DENIED), so a new service
cannot be reachable by accident.

Tokens are never logged; refusals are logged with the claimed principal only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from msa_fed.boundary.proto import OPS_SERVICE_NAME, SERVICE_NAME
from msa_fed.control.registry.public import Busy, abort_public
from msa_fed.control.registry.records import ROLE_ADMIN, ROLE_SITE, Principal
from msa_fed.control.registry.service import ADMIN_TOKEN_NEEDED, SITE_TOKEN_NEEDED, Registry
from msa_fed.errors import RegistryError

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_CHECK = HEALTH_PREFIX + "Check"
ANONYMOUS = "anonymous"  # the caller of the health check, keyed by network address

BOTH = frozenset({ROLE_SITE, ROLE_ADMIN})
SITE = frozenset({ROLE_SITE})
ADMIN = frozenset({ROLE_ADMIN})


@dataclass(frozen=True)
class MethodRule:
    """Who may call a method, and whether it is a transfer (a long stream: slots and deadlines apply)."""

    roles: frozenset[str]
    transfer: bool = False
    idle_s: float | None = None  # a transfer's own idle limit (None: Limits.transfer_idle_s), e.g. a long poll
    deadline_s: float | None = None  # a transfer's own total limit (None: Limits.transfer_deadline_s)


RELAY_SERVICE_NAME = "msa_fed.v1.Relay"
#: a site's relay stream is cut off after this long without a message from the site
RELAY_IDLE_S = 60.0
#: and has no total limit of its own (ten years)
RELAY_STREAM_DEADLINE_S = 10 * 365 * 86400.0


def service_rules(service: str, rules: dict[str, MethodRule]) -> dict[str, MethodRule]:
    """``{"/service/Method": rule}`` from ``{"Method": rule}``."""
    return {f"/{service}/{name}": rule for name, rule in rules.items()}


# The one access table: every method of every service but health.  The domain
# layer then checks that a site touches only its own records.
METHOD_RULES: dict[str, MethodRule] = {
    **service_rules(
        SERVICE_NAME,
        {
            "RegisterSite": MethodRule(SITE),
            "Heartbeat": MethodRule(SITE),
            "GetSite": MethodRule(BOTH),
            "ListSites": MethodRule(ADMIN),
            "DeregisterSite": MethodRule(BOTH),
            "UploadPredictor": MethodRule(SITE, transfer=True),
            "UploadSample": MethodRule(SITE, transfer=True),
            "DownloadPredictor": MethodRule(BOTH, transfer=True),
            "DownloadSample": MethodRule(BOTH, transfer=True),
            "UploadCombinedModel": MethodRule(ADMIN, transfer=True),
            "DownloadCombinedModel": MethodRule(BOTH, transfer=True),
        },
    ),
    # a reflection stream can stay open: it is a transfer
    **{
        f"/{service}/ServerReflectionInfo": MethodRule(BOTH, transfer=True)
        for service in ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
    },
    # the relay between jobs and site processes (msa_fed/control/relay.py; relay.proto).  A site's
    # Connect stream lives as long as the site serves: a transfer (it takes a stream slot) with no
    # total deadline, cut off when silent for RELAY_IDLE_S (the site sends a heartbeat every few
    # seconds; the relay drops a stream silent for its own, shorter, silence_timeout_s first)
    **service_rules(
        RELAY_SERVICE_NAME,
        {
            "Connect": MethodRule(SITE, transfer=True, idle_s=RELAY_IDLE_S, deadline_s=RELAY_STREAM_DEADLINE_S),
            "FetchPredictor": MethodRule(SITE, transfer=True),
            "FetchSample": MethodRule(SITE, transfer=True),
            "OpenJob": MethodRule(ADMIN),
            "Call": MethodRule(ADMIN),
            "CloseJob": MethodRule(ADMIN),
            "ListConnected": MethodRule(ADMIN),
        },
    ),
    # the Operations service (msa_fed/control/ops/servicer.py): admin only, small unary calls
    **service_rules(
        OPS_SERVICE_NAME,
        {
            name: MethodRule(ADMIN)
            for name in (
                "ListModels",
                "GetModel",
                "PromoteModel",
                "ListSiteStatus",
                "DeregisterSite",
                "StartJob",
                "FinishJob",
                "ListJobs",
                "GetJob",
                "AppendJobLog",
                "GetJobLog",
            )
        },
    ),
}

# for compatibility: method -> roles
METHOD_ROLES: dict[str, frozenset[str]] = {method: rule.roles for method, rule in METHOD_RULES.items()}


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


def certificate_names(context: grpc.ServicerContext) -> set[str] | None:
    """Subject CN and subjectAltNames of the peer's verified certificate; None without one."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    if not names and not auth.get("x509_pem_cert"):
        return None
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names}


class AuthenticatedContext:
    """A ``grpc.ServicerContext`` plus the authenticated ``principal``."""

    def __init__(self, context: grpc.ServicerContext, principal: Principal):
        self._context = context
        self.principal = principal
        self.aborted = False

    def abort(self, code, details):
        self.aborted = True
        self._context.abort(code, details)

    def abort_with_status(self, status):
        self.aborted = True
        self._context.abort_with_status(status)

    def __getattr__(self, name):
        return getattr(self._context, name)


class TransferSlots:
    """Concurrent transfers per principal and in all; a refusal is immediate (never a wait)."""

    def __init__(self, per_principal: int, total: int, what: str = "uploads/downloads"):
        self.per_principal = per_principal
        self.total = total
        self.what = what
        self._lock = threading.Lock()
        self._by_principal: dict[Principal, int] = {}
        self._used = 0

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def acquire(self, principal: Principal) -> None:
        with self._lock:
            mine = self._by_principal.get(principal, 0)
            if mine >= self.per_principal:
                raise Busy(
                    f"{principal} already has {mine} {self.what} open; the limit per caller is "
                    f"{self.per_principal}; retry when one has finished",
                )
            if self._used >= self.total:
                raise Busy(
                    f"the registry is serving {self._used} {self.what}, its limit; retry later",
                )
            self._by_principal[principal] = mine + 1
            self._used += 1

    def release(self, principal: Principal) -> None:
        with self._lock:
            left = self._by_principal.get(principal, 1) - 1
            if left:
                self._by_principal[principal] = left
            else:
                self._by_principal.pop(principal, None)
            self._used -= 1


class _Ticket:
    """One watched transfer: cancelled by the watchdog when idle or past its deadline."""

    __slots__ = ("context", "cut", "deadline", "done", "idle_s", "last", "reading", "what")

    def __init__(self, context, what: str, deadline: float, idle_s: float):
        self.context, self.what, self.deadline, self.idle_s = context, what, deadline, idle_s
        self.last = time.monotonic()
        self.reading = True  # idle time counts while the client owes us a message or a read
        self.done = False
        self.cut: str | None = None

    def touch(self) -> None:
        self.last = time.monotonic()

    def due(self) -> float:
        return min(self.deadline, self.last + self.idle_s) if self.reading else self.deadline


class Watchdog:
    """One thread that cancels transfers idle for ``idle_s`` or open for ``deadline_s``."""

    def __init__(self, idle_s: float, deadline_s: float):
        self.idle_s, self.deadline_s = idle_s, deadline_s
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Ticket]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, context, what: str, idle_s: float | None = None, deadline_s: float | None = None) -> _Ticket:
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        ticket = _Ticket(context, what, deadline, self.idle_s if idle_s is None else idle_s)
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="registry-watchdog", daemon=True)
                self._thread.start()
            earliest = not self._heap or ticket.due() < self._heap[0][0]
            heapq.heappush(self._heap, (ticket.due(), next(self._seq), ticket))
            if earliest:  # the thread sleeps until the earliest due time; wake it only to sleep less
                self._cond.notify()
        return ticket

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                expired = []
                while self._heap and self._heap[0][0] <= now:
                    _, _, ticket = heapq.heappop(self._heap)
                    if ticket.done:
                        continue
                    due = ticket.due()
                    if due > now:  # it made progress: look again later
                        heapq.heappush(self._heap, (due, next(self._seq), ticket))
                    else:
                        expired.append(ticket)
                wait = (self._heap[0][0] - now) if self._heap else None
                if not expired:
                    self._cond.wait(wait if wait is None else max(wait, 0.01))
                    continue
            for ticket in expired:
                ticket.cut = "deadline" if time.monotonic() >= ticket.deadline else "idle"
                log.warning(
                    "cut off %s: %s",
                    ticket.what,
                    "past its deadline" if ticket.cut == "deadline" else f"no progress for {ticket.idle_s:g} s",
                )
                ticket.context.cancel()


class _WatchedRequests:
    """A request iterator that tells its ticket about each message and about the end of the stream."""

    def __init__(self, iterator, ticket: _Ticket):
        self._iterator, self._ticket = iterator, ticket

    def __iter__(self):
        return self

    def __next__(self):
        try:
            message = next(self._iterator)
        except StopIteration:
            self._ticket.reading = False  # the request is complete: now only the deadline applies
            raise
        self._ticket.touch()
        return message


class AuthInterceptor(grpc.ServerInterceptor):
    """See the module docstring.

    ``bind_certificates``: under mutual TLS, a site token is accepted only with a
    client certificate that names the site.  ``max_streams`` bounds concurrent
    transfers; ``max_pending_reads`` the authenticated calls whose request
    message is still awaited (a client may send the headers of a call and then
    nothing), ``max_anonymous_reads`` the same for health checks (kept apart, so
    that callers without a token never take the slots of those with one).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        bind_certificates: bool = False,
        max_streams: int = 16,
        max_pending_reads: int = 4,
        max_anonymous_reads: int = 4,
        rules: dict[str, MethodRule] | None = None,
    ):
        limits = registry.limits
        self._registry = registry
        self._limits = limits
        self._bind = bind_certificates
        self._rules = METHOD_RULES if rules is None else rules
        self.slots = TransferSlots(limits.max_streams_per_principal, max_streams, "uploads/downloads")
        self.reads = TransferSlots(limits.max_pending_reads_per_caller, max_pending_reads, "requests being received")
        self.anonymous_reads = TransferSlots(
            limits.max_pending_reads_per_caller, max_anonymous_reads, "health checks being received"
        )
        self.watchdog = Watchdog(limits.transfer_idle_s, limits.transfer_deadline_s)

    def close(self) -> None:
        self.watchdog.stop()

    # checks -----------------------------------------------------------------
    def _authenticate(self, context: grpc.ServicerContext, method: str, rule: MethodRule | None) -> Principal:
        try:
            principal = self._registry.authenticate(bearer_token(context.invocation_metadata()))
        except RegistryError as exc:
            log.warning("refused %s from %s: %s", method, context.peer(), exc)
            raise
        note = getattr(context, "note_principal", None)
        if callable(note):  # an interceptor outside this one (the audit log) records who the token proved
            note(principal)
        if rule is None:
            log.warning("refused %s for %s: the method has no access rule", method, principal)
            raise RegistryError("PERMISSION_DENIED", f"{method} is not open to any caller")
        if self._bind and principal.role == ROLE_SITE:
            names = certificate_names(context)
            if names is None or principal.name not in names:
                log.warning("refused %s for %s: client certificate names %s", method, principal, sorted(names or ()))
                shown = ", ".join(repr(n) for n in sorted(names or ())[:4]) or "nothing"
                raise RegistryError(
                    "PERMISSION_DENIED",
                    f"the client certificate names {shown}, not site {principal.name!r} of the token; under mutual "
                    "TLS a site's certificate must carry its site name (subject CN or DNS subjectAltName)",
                )
        if principal.role not in rule.roles:
            log.warning("refused %s for %s: role not allowed", method, principal)
            needed = ADMIN_TOKEN_NEEDED if rule.roles == ADMIN else SITE_TOKEN_NEEDED
            raise RegistryError("PERMISSION_DENIED", f"{needed} ({method.rsplit('/', 1)[-1]})")
        return principal

    def _enter(self, context, method: str, rule: MethodRule | None, health: bool):
        """(context for the handler, caller, transfer ticket or None): authenticated, a transfer slot taken."""
        if health:  # no token; the caller is its network address
            return context, Principal(ANONYMOUS, peer_host(context)), None
        principal = self._authenticate(context, method, rule)
        assert rule is not None  # _authenticate refuses a method without a rule
        authed = AuthenticatedContext(context, principal)
        if not rule.transfer:
            return authed, principal, None
        self.slots.acquire(principal)
        ticket = self.watchdog.watch(
            context, f"{method.rsplit('/', 1)[-1]} of {principal}", idle_s=rule.idle_s, deadline_s=rule.deadline_s
        )
        return authed, principal, ticket

    def _read_one(self, requests, context, caller: Principal, ticket, method: str):
        """The single request message of a unary-request call, awaited within a deadline and a slot."""
        slots = self.anonymous_reads if caller.role == ANONYMOUS else self.reads
        if ticket is None:  # a small call: the message is awaited under a short deadline of its own
            slots.acquire(caller)
            read_ticket = self.watchdog.watch(
                context,
                f"the request of {method.rsplit('/', 1)[-1]} from {caller}",
                idle_s=self._limits.request_read_s,
                deadline_s=self._limits.request_read_s,
            )
        else:
            read_ticket = ticket
        try:
            message = next(requests, None)
        finally:
            if ticket is None:
                read_ticket.done = True
                slots.release(caller)
        if message is None:
            raise RegistryError("INVALID_ARGUMENT", "the call carries no request message")
        read_ticket.touch()
        return message

    def _leave(self, caller, ticket) -> None:
        if ticket is not None:
            ticket.done = True
            self.slots.release(caller)

    def _fail(self, context, authed, exc: Exception, method: str, ticket):
        """Re-raise what needs no mapping; else abort with the public status of ``exc``."""
        if isinstance(exc, grpc.RpcError) or getattr(authed, "aborted", False):
            raise exc  # the client went away (or was cut off), or the handler chose its status
        if ticket is not None and ticket.cut:
            log.info("%s ended after being cut off: %s", method, type(exc).__name__)
            raise exc
        abort_public(context, exc, method.rsplit("/", 1)[-1], getattr(authed, "principal", None))

    # wrapping ---------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        health = method.startswith(HEALTH_PREFIX)
        if health and method != HEALTH_CHECK:  # Watch would hold a worker thread per watcher
            return grpc.stream_unary_rpc_method_handler(  # refused without reading the request
                lambda requests, context: context.abort(
                    grpc.StatusCode.UNIMPLEMENTED, "this registry answers grpc.health.v1.Health/Check only"
                ),
            )
        return self._wrap(handler, method, self._rules.get(method), health)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, rule: MethodRule | None, health: bool):
        """The handler as a request-streaming one, so that nothing waits for a request before the checks."""
        enter, read_one, leave, fail = self._enter, self._read_one, self._leave, self._fail
        kwargs = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

        def prepare(requests, context, unary_request: bool):
            authed, caller, ticket = enter(context, method, rule, health)
            try:
                if unary_request:
                    request = read_one(requests, context, caller, ticket, method)
                    if ticket is not None:
                        ticket.reading = False
                else:
                    request = _WatchedRequests(requests, ticket) if ticket is not None else requests
            except BaseException:
                leave(caller, ticket)
                raise
            return authed, caller, ticket, request

        def unary_response(inner, unary_request: bool):
            def call(requests, context):
                authed = caller = ticket = None
                try:
                    authed, caller, ticket, request = prepare(requests, context, unary_request)
                    return inner(request, authed)
                except Exception as exc:  # noqa: BLE001 - mapped to a public status in one place
                    fail(context, authed, exc, method, ticket)
                finally:
                    if caller is not None:
                        leave(caller, ticket)

            return call

        def stream_response(inner, unary_request: bool):
            def call(requests, context):
                authed = caller = ticket = None
                try:
                    authed, caller, ticket, request = prepare(requests, context, unary_request)
                    for response in inner(request, authed):
                        if ticket is not None:
                            ticket.reading = True  # a client that stops reading stalls this yield
                            ticket.touch()
                        yield response
                except Exception as exc:  # noqa: BLE001
                    fail(context, authed, exc, method, ticket)
                finally:
                    if caller is not None:
                        leave(caller, ticket)

            return call

        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary_response(handler.unary_unary, True), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary, False), **kwargs)
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(stream_response(handler.unary_stream, True), **kwargs)
        return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream, False), **kwargs)


def peer_host(context: grpc.ServicerContext) -> str:
    """The network address of the peer without its port ("ipv4:10.0.0.5:51234" -> "ipv4:10.0.0.5")."""
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
