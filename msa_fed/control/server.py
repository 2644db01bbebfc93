"""The registry gRPC server as a context manager.

    with RegistryServer(Registry(SqliteStore("reg.db")), "127.0.0.1:0", tls=TlsConfig.from_files(...)) as server:
        print(server.port)        # the real port when 0 was asked

TLS is the default: a server needs a certificate and key, and verifies client
certificates (mutual TLS) when ``tls.client_ca`` is given.  Plaintext needs
``insecure=True`` and refuses any address but loopback.  The standard health
service (``grpc.health.v1``) and server reflection are registered too.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from msa_fed.boundary.proto import OPS_SERVICE_NAME, SERVICE_NAME
from msa_fed.boundary.proto import operations_pb2_grpc as ops_grpc
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.audit import AuditInterceptor, AuditLog
from msa_fed.control.auth import AuthInterceptor
from msa_fed.control.ops.service import Operations
from msa_fed.control.ops.servicer import OperationsServicer
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.servicer import RegistryServicer
from msa_fed.control.relay import add_relay
from msa_fed.control.transport.address import MAX_MESSAGE_BYTES, format_address, is_loopback, parse_address  # noqa: F401 - re-exported
from msa_fed.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes of the server certificate chain and key, and optionally the CA that signs client certificates."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert, key, ca=None) -> "TlsConfig":
        return cls(
            _read_pem(cert, "--tls-cert"), _read_pem(key, "--tls-key"), _read_pem(ca, "--tls-ca") if ca else None
        )


def _read_pem(path, flag: str) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} is not a readable file; expected a PEM file")
    data = path.read_bytes()
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {str(path)!r} is not PEM (no '-----BEGIN' line)")
    return data


def check_transport(listen: str, tls: "TlsConfig | None", insecure: bool) -> tuple[str, int]:
    """Validate ``--listen`` with the TLS choice; return (host, port).  TLS unless ``insecure`` on loopback."""
    host, port = parse_address(listen)
    if insecure and tls is not None:
        raise ConfigError("--insecure and --tls-cert/--tls-key are mutually exclusive")
    if not insecure and tls is None:
        raise ConfigError("TLS is required: give --tls-cert and --tls-key (or --insecure on a loopback address)")
    if insecure and not is_loopback(host):
        raise ConfigError(
            f"--insecure refuses to listen on {host!r}; plaintext is only allowed on loopback "
            "(127.0.0.1, ::1 or localhost)"
        )
    return host, port


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.cert_chain)],
        root_certificates=tls.client_ca,
        require_client_auth=tls.client_ca is not None,
    )


class RegistryServer:
    """Serve ``registry`` on ``listen``; use as a context manager (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        listen: str = "127.0.0.1:0",
        *,
        tls: TlsConfig | None = None,
        insecure: bool = False,
        max_workers: int = 32,
        audit_log: AuditLog | None = None,
    ):
        self.registry = registry
        self.host, self._requested_port = check_transport(listen, tls, insecure)
        self.tls = tls
        self.insecure = insecure
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 2:
            raise ConfigError(f"--workers must be an integer >= 2; got {max_workers!r}")
        self.max_workers = max_workers
        self.audit_log = audit_log
        limits = registry.limits
        self.max_streams = limits.max_streams if limits.max_streams is not None else max(1, max_workers // 2)
        # calls whose request message has not arrived yet, with a token and without (health checks)
        self.max_pending_reads = self.max_anonymous_reads = max(2, max_workers // 8)
        held = self.max_streams + self.max_pending_reads + self.max_anonymous_reads
        if held >= max_workers:
            raise ConfigError(
                f"{self.max_streams} concurrent uploads/downloads and {2 * self.max_pending_reads} requests being "
                f"received would leave no worker thread for heartbeats and health checks; use more than {held} "
                "workers (--workers)"
            )
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` with the bound port."""
        if self.port is None:
            raise RuntimeError("the server is not started")
        return format_address(self.host, self.port)

    def start(self) -> "RegistryServer":
        import onnx  # noqa: F401 - load the artifact checker's libraries now, not on the first upload
        import onnxruntime  # noqa: F401

        self.interceptor = AuthInterceptor(
            self.registry,
            bind_certificates=bool(self.tls is not None and self.tls.client_ca),
            max_streams=self.max_streams,
            max_pending_reads=self.max_pending_reads,
            max_anonymous_reads=self.max_anonymous_reads,
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="registry"),
            interceptors=[*([AuditInterceptor(self.audit_log)] if self.audit_log else []), self.interceptor],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
                ("grpc.keepalive_time_ms", 60_000),  # detect vanished clients holding a worker thread
                ("grpc.keepalive_timeout_ms", 20_000),
            ],
        )
        self.servicer = RegistryServicer(self.registry)
        pb_grpc.add_RegistryServicer_to_server(self.servicer, server)
        # the relay (relay.py): each site stream holds a worker thread and a stream slot
        self.relay = add_relay(server, self.registry, max_streams=max(1, min(self.max_streams, self.max_workers - 8)))
        self.registry.site_connected = self.relay.is_connected  # the CONNECTED column of admin list-sites
        self.registry.job_cancelled = self.relay.cancel_job  # msa-fed job cancel: the relay stops the job
        ops_grpc.add_OperationsServicer_to_server(OperationsServicer(Operations(self.registry)), server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, OPS_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        bind = format_address(self.host, self._requested_port)
        try:
            if self.insecure:
                port = server.add_insecure_port(bind)
            else:
                assert self.tls is not None  # check_transport: TLS unless insecure
                port = server.add_secure_port(bind, server_credentials(self.tls))
        except RuntimeError as exc:
            self.interceptor.close()
            raise ConfigError(f"--listen {bind!r}: cannot bind ({exc})") from None
        if not port:
            self.interceptor.close()
            raise ConfigError(f"--listen {bind!r}: cannot bind (address in use or not local?)")
        server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        log.info("registry listening on %s (%s)", self.address, self.mode)
        return self

    @property
    def mode(self) -> str:
        if self.insecure:
            return "plaintext, loopback only"
        return "mutual TLS" if self.tls is not None and self.tls.client_ca else "TLS"

    def stop(self, grace: float | None = 1.0) -> None:
        if self._server is None:
            return
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self.interceptor.close()
        self._server = None

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        if self._server is None:
            return True  # never started, or stopped
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> "RegistryServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
