"""Authentication as a gRPC server interceptor.

Every method except the standard health service requires
``authorization: Bearer <token>`` metadata.  The interceptor wraps the
method's handler so the token check runs on the worker thread, before the
handler reads its request stream or writes a response; a failure aborts with
UNAUTHENTICATED (no, malformed, wrong or revoked token) or PERMISSION_DENIED
(the principal's role may not call that method).  The handler then sees an
:class:`AuthenticatedContext` whose ``principal`` says who called.

Tokens are never logged; failures are logged with the claimed principal only.
"""
from __future__ import annotations

import logging

import grpc

from msa_fed.control.proto import OPS_SERVICE_NAME, SERVICE_NAME
from msa_fed.control.records import ROLE_ADMIN, ROLE_SITE, Principal
from msa_fed.control.registry import Registry
from msa_fed.errors import RegistryError

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

BOTH = frozenset({ROLE_SITE, ROLE_ADMIN})
SITE = frozenset({ROLE_SITE})
ADMIN = frozenset({ROLE_ADMIN})

# Which roles may call each Registry method; the domain layer then checks
# that a site touches only its own records.
METHOD_ROLES: dict[str, frozenset[str]] = {
    f"/{SERVICE_NAME}/{name}": roles
    for name, roles in {
        "RegisterSite": SITE,
        "Heartbeat": SITE,
        "GetSite": BOTH,
        "ListSites": BOTH,
        "DeregisterSite": BOTH,
        "UploadPredictor": SITE,
        "UploadSample": SITE,
        "DownloadPredictor": BOTH,
        "DownloadSample": BOTH,
        "UploadCombinedModel": ADMIN,
        "DownloadCombinedModel": BOTH,
    }.items()
}
METHOD_ROLES.update({  # the Operations service (msa_fed/control/ops_servicer.py) is admin-only
    f"/{OPS_SERVICE_NAME}/{name}": ADMIN
    for name in ("ListModels", "GetModel", "PromoteModel", "ListSiteStatus", "DeregisterSite", "StartJob",
                 "FinishJob", "ListJobs", "GetJob")
})


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


class AuthenticatedContext:
    """A ``grpc.ServicerContext`` plus the authenticated ``principal``."""

    def __init__(self, context: grpc.ServicerContext, principal: Principal):
        self._context = context
        self.principal = principal

    def __getattr__(self, name):
        return getattr(self._context, name)


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires a valid token on every method but health checks; see the module docstring."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def _authenticate(self, context: grpc.ServicerContext, method: str, roles: frozenset[str]) -> Principal:
        try:
            principal = self._registry.authenticate(bearer_token(context.invocation_metadata()))
        except RegistryError as exc:
            log.warning("refused %s from %s: %s", method, context.peer(), exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc).split(": ", 1)[-1])
        if principal.role not in roles:
            log.warning("refused %s for %s: role not allowed", method, principal)
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal} may not call {method.rsplit('/', 1)[-1]} (allowed: {', '.join(sorted(roles))})",
            )
        return principal

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        if method.startswith(REFLECTION_PREFIXES):
            roles = BOTH
        else:
            roles = METHOD_ROLES.get(method, BOTH)
        return self._wrap(handler, method, roles)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, roles: frozenset[str]):
        auth = self._authenticate
        kwargs = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary_unary(request, context):
                return inner(request, AuthenticatedContext(context, auth(context, method, roles)))

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request, context):
                authed = AuthenticatedContext(context, auth(context, method, roles))
                yield from inner_us(request, authed)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            def stream_unary(request_iterator, context):
                return inner_su(request_iterator, AuthenticatedContext(context, auth(context, method, roles)))

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        inner_ss = handler.stream_stream

        def stream_stream(request_iterator, context):
            authed = AuthenticatedContext(context, auth(context, method, roles))
            yield from inner_ss(request_iterator, authed)

        return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
