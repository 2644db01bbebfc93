"""The registry's audit log: one JSON line per RPC, written by a gRPC server interceptor.

    msa-fed registry serve ... --audit-log /var/log/msa-fed/audit.jsonl

Each line is a JSON object:

    {"time": "2026-01-02T03:04:05.123Z", "unix": 1767323045.123, "method": "/msa_fed.v1.Registry/UploadPredictor",
     "peer": "ipv4:127.0.0.1:50312", "principal": {"role": "site", "name": "a", "verified": true},
     "outcome": "OK", "details": "", "duration_ms": 12.5,
     "request": {"messages": 3, "bytes": 2097190, "content_bytes": 2097152, "content_sha256": "9f..."},
     "response": {"messages": 1, "bytes": 160, "content_bytes": 0, "content_sha256": null}}

- ``principal`` is the caller the authentication interceptor verified from the bearer token
  (``verified`` true, also when the call was then refused for its role or certificate); when
  the token proved nothing (refused as UNAUTHENTICATED, or a health check, which is not
  authenticated) it is the principal the token claims, with ``verified`` false; null when no
  token was sent.  The token itself is never written.
- ``certificate`` (mutual TLS only): the subject CN and subjectAltNames of the client
  certificate the connection's handshake verified, so a refused call shows which party's
  certificate carried it (a site's token on another party's certificate, say).
- ``outcome`` is the gRPC status name: OK, or the refusal (UNAUTHENTICATED, PERMISSION_DENIED,
  INVALID_ARGUMENT, ...); ``details`` the status message the client saw (one line, cut).
- ``request`` / ``response``: serialised sizes of the messages that moved, and for the chunked
  transfers (uploads, downloads) the size and sha256 of the content carried in ``chunk`` fields:
  the artifact's or model's bytes, so the log shows exactly what was stored or handed out.

The interceptor sits outside the authentication interceptor (``interceptors=[audit, auth]``),
so refusals are logged too, with the status the client saw; the authentication interceptor
tells it the verified principal through :meth:`_AuditedContext.note_principal`.
Write failures are logged to the server's log and never fail an RPC.

A connection whose TLS handshake fails (plaintext against TLS, a client certificate of another
CA or none, a client that does not trust the registry's CA) makes no call, so it has no line
here: gRPC's Python server tells nothing of it (docs/OPERATIONS.md, "What the registry sees of
a refused connection").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import grpc

from msa_fed.control.auth import bearer_token, certificate_names
from msa_fed.control.registry.records import Principal
from msa_fed.control.registry.tokens import parse_token

log = logging.getLogger(__name__)

MAX_DETAILS_CHARS = 300


class AuditLog:
    """Append-only JSON-lines file (mode 0600), one line per :meth:`write`, flushed each time."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ValueError(f"--audit-log {str(self.path)!r}: folder {str(self.path.parent)!r} does not exist")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(self, entry: dict) -> None:
        line = json.dumps(entry, sort_keys=True, separators=(",", ":"))
        try:
            with self._lock:
                self._file.write(line + "\n")
                self._file.flush()
        except (OSError, ValueError) as exc:  # a full disk must not take the registry down
            log.error("audit log %s: cannot write (%s)", self.path, exc)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Traffic:
    """Messages, serialised bytes, and the size and sha256 of ``chunk`` content seen in one direction."""

    def __init__(self):
        self.messages = 0
        self.bytes = 0
        self.content_bytes = 0
        self._sha = None

    def see(self, msg) -> None:
        self.messages += 1
        try:
            self.bytes += msg.ByteSize()
            oneofs = msg.DESCRIPTOR.oneofs_by_name
            if "part" in oneofs and msg.WhichOneof("part") == "chunk":
                if self._sha is None:
                    self._sha = hashlib.sha256()
                self._sha.update(msg.chunk)
                self.content_bytes += len(msg.chunk)
        except AttributeError:  # not a protobuf message (never in this server)
            pass

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "bytes": self.bytes,
            "content_bytes": self.content_bytes,
            "content_sha256": self._sha.hexdigest() if self._sha is not None else None,
        }


def _principal(metadata, verified: Principal | None) -> dict | None:
    """The verified principal; else the one the token claims (unverified); None without a token."""
    if verified is not None:
        return {"role": verified.role, "name": verified.name, "verified": True}
    token = bearer_token(metadata)
    if not token:
        return None
    parsed = parse_token(token)
    if parsed is None:
        return {"role": None, "name": None, "verified": False}
    principal, _ = parsed
    return {"role": principal.role, "name": principal.name, "verified": False}


class _AuditedContext:
    """The call's ``grpc.ServicerContext``, passed inwards, that the auth interceptor tells who called."""

    def __init__(self, context: grpc.ServicerContext):
        self._context = context
        self.verified: Principal | None = None

    def note_principal(self, principal: Principal) -> None:
        self.verified = principal

    def __getattr__(self, name):
        return getattr(self._context, name)


def _outcome(context, exc: BaseException | None) -> tuple[str, str]:
    code = None
    details = ""
    try:
        code = context.code()
        details = context.details() or ""
    except AttributeError:  # grpc without ServicerContext.code()
        pass
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    if code is None:
        if isinstance(exc, GeneratorExit):
            return "CANCELLED", ""
        code = grpc.StatusCode.UNKNOWN if exc is not None else grpc.StatusCode.OK
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return name, " ".join(str(details).split())[:MAX_DETAILS_CHARS]


class AuditInterceptor(grpc.ServerInterceptor):
    """Logs every RPC to an :class:`AuditLog` (see the module docstring); put it before (outside) the auth
    interceptor: ``interceptors=[audit, auth]``."""

    def __init__(self, audit_log: AuditLog):
        self.audit_log = audit_log

    def _record(self, method, context: _AuditedContext, started, request: _Traffic, response: _Traffic, exc) -> None:
        outcome, details = _outcome(context, exc)
        principal = _principal(context.invocation_metadata(), context.verified)
        now = time.time()
        try:
            names = certificate_names(context)
        except (AttributeError, ValueError):  # a context without an auth context (never in this server)
            names = None
        extra = {} if names is None else {"certificate": sorted(names)}
        self.audit_log.write(
            {
                **extra,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z",
                "unix": round(now, 3),
                "method": method,
                "peer": context.peer(),
                "principal": principal,
                "outcome": outcome,
                "details": details if outcome != "OK" else "",
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                "request": request.as_dict(),
                "response": response.as_dict(),
            }
        )

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return None
        return self._wrap(handler, method)

    def _wrap(self, handler, method: str):
        record = self._record
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        def counted(iterator, traffic):
            for msg in iterator:
                traffic.see(msg)
                yield msg

        @contextlib.contextmanager
        def audited(request_or_iterator, context, streaming_request: bool):
            """(the request, the audited context, the response's traffic); one record at the end."""
            started, req, resp, exc = time.perf_counter(), _Traffic(), _Traffic(), None
            context = _AuditedContext(context)
            if streaming_request:
                request_or_iterator = counted(request_or_iterator, req)
            else:
                req.see(request_or_iterator)
            try:
                yield request_or_iterator, context, resp
            except BaseException as e:
                exc = e
                raise
            finally:
                record(method, context, started, req, resp, exc)

        def run_unary_response(inner, request_or_iterator, context, streaming_request: bool):
            with audited(request_or_iterator, context, streaming_request) as (request, context, resp):
                response = inner(request, context)
                if response is not None:
                    resp.see(response)
                return response

        def run_stream_response(inner, request_or_iterator, context, streaming_request: bool):
            with audited(request_or_iterator, context, streaming_request) as (request, context, resp):
                for msg in inner(request, context):
                    resp.see(msg)
                    yield msg

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(lambda r, c: run_unary_response(inner_uu, r, c, False), **kwargs)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(lambda r, c: run_unary_response(inner_su, r, c, True), **kwargs)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                lambda r, c: run_stream_response(inner_us, r, c, False), **kwargs
            )
        inner_ss = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(lambda r, c: run_stream_response(inner_ss, r, c, True), **kwargs)
