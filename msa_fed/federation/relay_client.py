"""gRPC clients of the relay (``relay.proto``): the job's side, and the channel both sides use.

    with RelayClient("registry:7443", admin_token, tls_ca="ca.pem") as relay:
        relay.open_job("job-1", ["a", "b"])
        results = relay.call("job-1", [("a", "dc_evaluate", request), ...], timeout_s=60)

``call`` returns, per site, the decoded response message, a
:class:`msa_fed.runtime.wire.RemoteError` (the site refused or failed) or a
:class:`msa_fed.runtime.federated.SiteUnreachable` (the registry got no answer).  A site's
answer is decoded with :mod:`msa_fed.runtime.wire` and must be a boundary response; anything
else counts as the site's failure.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from msa_fed.control.client import _error, _pem
from msa_fed.control.proto import relay_pb2 as pb
from msa_fed.control.proto import relay_pb2_grpc as pb_grpc
from msa_fed.control.server import MAX_MESSAGE_BYTES, is_loopback, parse_address
from msa_fed.errors import ConfigError, RegistryError
from msa_fed.runtime import wire
from msa_fed.runtime.federated import SiteUnreachable

#: the relay's gRPC calls wait this much longer than the site timeout they carry
CALL_MARGIN_S = 10.0


def open_channel(
    address: str,
    *,
    insecure: bool = False,
    tls_ca=None,
    tls_cert=None,
    tls_key=None,
    server_name: str | None = None,
    flag: str = "registry",
) -> grpc.Channel:
    """A channel to the registry: TLS (``tls_ca``; mutual with ``tls_cert``/``tls_key``), or
    plaintext with ``insecure`` towards loopback only."""
    host, _ = parse_address(address, flag)
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if insecure:
        if tls_ca is not None or tls_cert is not None:
            raise ConfigError("insecure and tls_ca/tls_cert are mutually exclusive")
        if not is_loopback(host):
            raise ConfigError(
                f"insecure would send the token in plaintext to {host!r}; it is only allowed "
                "towards loopback (127.0.0.1, ::1, localhost)"
            )
        return grpc.insecure_channel(address, options=options)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls_cert and tls_key must be given together")
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca, "tls_ca"),
        private_key=_pem(tls_key, "tls_key"),
        certificate_chain=_pem(tls_cert, "tls_cert"),
    )
    return grpc.secure_channel(address, credentials, options=options)


class RelayClient:
    """The job's connection to the relay (admin token); see the module docstring."""

    def __init__(self, address: str, token: str, *, timeout: float = 30.0, **channel_kwargs):
        self._channel = open_channel(address, **channel_kwargs)
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
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == retries:
                    raise _error(exc) from None
                time.sleep(0.2 * 2**attempt)

    def open_job(self, job_id: str, sites) -> list[str]:
        response = self._unary(self._stub.OpenJob, pb.OpenJobRequest(job_id=job_id, sites=list(sites)), self.timeout)
        self._opened[job_id] = list(sites)
        return list(response.connected)

    def _reopen(self, job_id: str, n: int) -> list:
        """The registry restarted and forgot its open jobs (the relay keeps them in memory): open
        this one again; the calls count as unreachable, so the caller retries them while the sites
        reconnect (within its site_timeout_s)."""
        try:
            self.open_job(job_id, self._opened[job_id])
        except RegistryError as exc:
            if exc.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise
        return [SiteUnreachable("UNAVAILABLE", "the registry: restarted; the job was opened again") for _ in range(n)]

    def close_job(self, job_id: str) -> None:
        self._opened.pop(job_id, None)
        self._unary(self._stub.CloseJob, pb.CloseJobRequest(job_id=job_id), self.timeout)

    def list_connected(self) -> list[str]:
        return [s.site for s in self._unary(self._stub.ListConnected, pb.ListConnectedRequest(), self.timeout).sites]

    def call(self, job_id: str, calls, timeout_s: float) -> list:
        request = pb.CallRequest(job_id=job_id, timeout_s=float(timeout_s))
        for site, method, msg in calls:
            request.calls.add(site=site, request=wire.to_proto(method, msg, wire.REQUESTS))
        try:
            response = self._unary(self._stub.Call, request, float(timeout_s) + CALL_MARGIN_S, retries=0)
        except RegistryError as exc:
            if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # the registry itself: every site unreachable
                return [SiteUnreachable(exc.code, f"the registry: {exc.message}") for _ in calls]
            if exc.code == "FAILED_PRECONDITION" and job_id in self._opened and "no open job" in exc.message:
                return self._reopen(job_id, len(calls))
            raise
        if len(response.results) != len(request.calls):
            raise RegistryError(
                "DATA_LOSS", f"the relay answered {len(response.results)} of {len(request.calls)} calls"
            )
        out: list[Any] = []
        for (site, method, _), result in zip(calls, response.results):
            if result.site != site:
                raise RegistryError("DATA_LOSS", f"the relay answered for {result.site!r} in place of {site!r}")
            if result.status:
                out.append(SiteUnreachable(result.status, result.detail))
                continue
            try:
                got, msg = wire.from_proto(result.response, wire.RESPONSES)
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
