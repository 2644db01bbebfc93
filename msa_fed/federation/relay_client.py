"""gRPC clients of the relay (``relay.proto``): the job's side, and the channel both sides use.

    with RelayClient("registry:7443", admin_token, tls_ca="ca.pem") as relay:
        relay.open_job("job-1", ["a", "b"])
        results = relay.call("job-1", [("a", "dc_evaluate", request), ...], timeout_s=60)

``call`` returns, per site, the decoded response message, a
:class:`msa_fed.boundary.wire.RemoteError` (the site refused or failed) or a
:class:`msa_fed.runtime.federated.SiteUnreachable` (the registry got no answer).  A site's
answer is decoded with :mod:`msa_fed.boundary.wire` and must be a boundary response; anything
else counts as the site's failure.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from msa_fed.boundary import wire
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.control.registry.client import MTLS_HINT, REGISTRY_AWAY, _error
from msa_fed.control.transport.connection import KEY_LABELS, Connection
from msa_fed.errors import RegistryError
from msa_fed.runtime.federated import SiteUnreachable

#: the relay's gRPC calls wait this much longer than the site timeout they carry
CALL_MARGIN_S = 10.0


def open_channel(address: str, *, flag: str = "registry", **tls: Any) -> grpc.Channel:
    """A channel to the registry (``tls``: insecure, tls_ca, tls_cert, tls_key, server_name): the
    shared builder, :class:`msa_fed.control.transport.connection.Connection`, holds the TLS / loopback rule."""
    return Connection(address, **tls).open_channel({**KEY_LABELS, "address": flag})


def cancelled(exc: RegistryError) -> Exception:
    """``exc``, or a JobCancelled when the relay refused the job because an admin cancelled it."""
    from msa_fed.errors import JobCancelled

    if exc.code == "FAILED_PRECONDITION" and " was cancelled by " in exc.message:
        return JobCancelled(exc.message)
    return exc


class RelayClient:
    """The job's connection to the relay (admin token); see the module docstring."""

    def __init__(self, address: str, token: str, *, timeout: float = 30.0, sealer=None, **channel_kwargs):
        """sealer : a :class:`msa_fed.crypto.sealing.JobSealer`: every request is sealed end to
        end for its site and every answer must be that site's sealed, signed answer (else the call
        raises :class:`msa_fed.crypto.sealing.TamperedError` naming the site)."""
        self.sealer = sealer
        self._channel = open_channel(address, **channel_kwargs)
        secure = not channel_kwargs.get("insecure")
        self._hint = MTLS_HINT if secure and channel_kwargs.get("tls_cert") is None else ""
        self._stub = pb_grpc.RelayStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.timeout = timeout
        self._opened: dict[str, list[str]] = {}  # job -> sites: reopened after a registry restart

    def close(self):
        self._channel.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *exc):
        self.close()

    def _unary(self, method, request, timeout: float, retries: int = 2):
        for attempt in range(retries + 1):
            try:
                return method(request, metadata=self._metadata, timeout=timeout)
            except grpc.RpcError as exc:
                # CANCELLED: the registry stopped with the call in flight (open/close/list are idempotent)
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or attempt == retries:
                    raise _error(exc, self._hint) from None
                time.sleep(0.2 * 2**attempt)

    def open_job(self, job_id: str, sites) -> list[str]:
        try:
            response = self._unary(
                self._stub.OpenJob, pb.OpenJobRequest(job_id=job_id, sites=list(sites)), self.timeout
            )
        except RegistryError as exc:
            raise cancelled(exc) from None
        self._opened[job_id] = list(sites)
        return list(response.connected)

    def _reopen(self, job_id: str, n: int) -> list:
        """The registry restarted and forgot its open jobs (the relay keeps them in memory): open
        this one again; the calls count as unreachable, so the caller retries them while the sites
        reconnect (within its site_timeout_s)."""
        try:
            self.open_job(job_id, self._opened[job_id])
        except RegistryError as exc:
            if exc.code not in REGISTRY_AWAY:
                raise
        return [SiteUnreachable("UNAVAILABLE", "the registry: restarted; the job was opened again") for _ in range(n)]

    def close_job(self, job_id: str) -> None:
        self._opened.pop(job_id, None)
        self._unary(self._stub.CloseJob, pb.CloseJobRequest(job_id=job_id), self.timeout)

    def list_connected(self) -> list[str]:
        return [s.site for s in self._unary(self._stub.ListConnected, pb.ListConnectedRequest(), self.timeout).sites]

    def call(self, job_id: str, calls, timeout_s: float) -> list:
        request = pb.CallRequest(job_id=job_id, timeout_s=float(timeout_s))
        sealed: list[tuple[bytes, int]] = []
        encoded: dict[tuple[str, int], tuple[Any, bytes]] = {}  # one encoding of a message sent to many sites
        for site, method, msg in calls:
            key = (method, id(msg))
            if key not in encoded:
                proto = wire.to_proto(method, msg, wire.REQUESTS)
                encoded[key] = (proto, proto.SerializeToString() if self.sealer is not None else b"")
            proto, plain = encoded[key]
            if self.sealer is None:
                request.calls.add(site=site, request=proto)
            else:
                frame, seq = self.sealer.seal(site, plain)  # sealed for each site, under its own keys
                request.calls.add(site=site, sealed=frame)
                sealed.append((plain, seq))
        try:
            response = self._unary(self._stub.Call, request, float(timeout_s) + CALL_MARGIN_S, retries=0)
        except RegistryError as exc:
            if exc.code in REGISTRY_AWAY:  # the registry itself: every site unreachable
                return [SiteUnreachable(exc.code, f"the registry: {exc.message}") for _ in calls]
            if exc.code == "FAILED_PRECONDITION" and job_id in self._opened and "no open job" in exc.message:
                return self._reopen(job_id, len(calls))
            raise cancelled(exc) from None
        if len(response.results) != len(request.calls):
            raise RegistryError(
                "DATA_LOSS", f"the relay answered {len(response.results)} of {len(request.calls)} calls"
            )
        out: list[Any] = []
        for k, ((site, method, _), result) in enumerate(zip(calls, response.results)):
            if result.site != site:
                raise RegistryError("DATA_LOSS", f"the relay answered for {result.site!r} in place of {site!r}")
            if result.status:
                out.append(SiteUnreachable(result.status, result.detail))
                continue
            answer = result.response
            if self.sealer is not None:
                answer = self._open(site, method, result, *sealed[k])
            try:
                got, msg = wire.from_proto(answer, wire.RESPONSES)
            except wire.WireError as exc:
                out.append(wire.RemoteError("WireError", f"site {site!r} sent a malformed answer: {exc}"))
                continue
            if isinstance(msg, wire.RemoteError):
                out.append(msg)
            elif got != method:
                out.append(wire.RemoteError("WireError", f"site {site!r} answered {got!r} to {method!r}"))
            else:
                out.append(msg)
        return out

    def _open(self, site: str, method: str, result, plain: bytes, seq: int):
        """The SiteResponse inside a site's sealed answer; TamperedError unless it is authentic."""
        from msa_fed.boundary.proto import boundary_pb2 as bpb
        from msa_fed.crypto.sealing import TamperedError

        if not result.sealed:  # the site could not open the request, or the registry answered itself
            said = ""
            if result.response.WhichOneof("body") == "failure":
                said = " (it says: " + " ".join(result.response.failure.text[:300].split()) + ")"
            raise TamperedError(site, f"tampered: its answer to {method} is not sealed{said}")
        inner = self.sealer.open(site, seq, result.sealed, plain, method)
        try:
            return bpb.SiteResponse.FromString(inner)
        except Exception:  # noqa: BLE001 - an authentic but malformed answer is the site's failure
            return wire.error_proto("WireError", f"site {site!r} sent a sealed answer that is not a SiteResponse")
