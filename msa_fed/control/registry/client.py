"""Python client of the registry, used by sites, the CLI and the coordinator's job.

    with RegistryClient("registry.example:7443", token, tls_ca="ca.pem") as client:
        client.register("hospital-a")
        client.upload_predictor(onnx_bytes)
        client.upload_sample(X_unlabeled)

    # the coordinator (admin token)
    with RegistryClient(address, admin_token, tls_ca="ca.pem") as client:
        for site in client.list_sites():
            predictor = client.fetch_predictor(site.name, expected_sha256=site.predictor.sha256)
            X, _ = client.download_sample(site.name)
        info = client.upload_combined_model(model_bytes, manifest)

Every failure raises :class:`msa_fed.errors.RegistryError` whose ``code`` is
the gRPC status name and whose message is one line.  Idempotent calls
(uploads keep their ``upload_id`` across attempts) are retried on UNAVAILABLE,
and on a RESOURCE_EXHAUSTED the registry marks as temporary (its transfer
slots or in-flight budget are taken) for up to ``busy_wait`` seconds.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from msa_fed.artifacts.predictors import OnnxPredictor, load_predictor, sha256_hex
from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.registry.convert import artifact_from_pb, combined_from_pb, site_from_pb
from msa_fed.control.registry.public import RETRY_AFTER_KEY
from msa_fed.control.registry.records import ArtifactRecord, CombinedModelRecord, Principal, SiteRecord
from msa_fed.control.registry.tokens import parse_token
from msa_fed.control.transport.address import parse_address
from msa_fed.control.transport.connection import FLAG_LABELS, Connection, diagnose_tls
from msa_fed.errors import ConfigError, RegistryError, TlsError

UPLOAD_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class HeartbeatInfo:
    server_time: float
    latest_combined_version: int


def _one_line(text: str) -> str:
    return " ".join((text or "").split())


#: added to UNAVAILABLE when a TLS client presented no certificate: the registry may require one
MTLS_HINT = (
    "; if the registry requires client certificates (mutual TLS), give --tls-cert and --tls-key "
    "(tls_cert and tls_key in the job file's [registry] table)"
)


#: codes that say the registry itself is away (down, restarting: CANCELLED when it stopped with
#: the call in flight), not that it refused: the callers retry or count every site unreachable
REGISTRY_AWAY = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})


def _error(exc: grpc.RpcError, hint: str = "") -> RegistryError:
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    text = _one_line(details) or name.lower()
    return RegistryError(name, text + hint if name == "UNAVAILABLE" else text)


def _busy_retry_after_ms(exc: grpc.RpcError) -> int | None:
    """The registry's retry hint of a temporary RESOURCE_EXHAUSTED, or None."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ():
        if key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
            return min(int(value), 5000)
    return None


class RegistryClient:
    """Authenticated connection to a registry (see the module docstring).

    Parameters
    ----------
    address : "HOST:PORT" of the registry.
    token : bearer token from ``msa-fed admin issue-token`` (None sends none).
    insecure : plaintext; only allowed towards a loopback address.
    tls_ca : PEM (bytes or path) of the CA that signed the server certificate;
        None uses the system roots.
    tls_cert, tls_key : client certificate and key for mutual TLS.
    server_name : name to check the server certificate against, when it differs
        from the host in ``address``.
    timeout : seconds per unary call; ``transfer_timeout`` per upload/download.
    retries : extra attempts after UNAVAILABLE.
    busy_wait : seconds to keep retrying a transfer the registry refused as busy (0: never).
    labels : how messages name the options (command-line flags, or a configuration file's keys).
    """

    def __init__(
        self,
        address: str,
        token: str | None,
        *,
        insecure: bool = False,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        server_name: str | None = None,
        timeout: float = 30.0,
        transfer_timeout: float = 600.0,
        retries: int = 2,
        busy_wait: float = 120.0,
        labels: dict[str, str] = FLAG_LABELS,
    ):
        host, _ = parse_address(address, "--registry")
        if token is not None and (not isinstance(token, str) or not token.strip() or any(c.isspace() for c in token)):
            raise ConfigError("--token must be a non-empty token without spaces")
        self.address = address
        self.token = token
        parsed = parse_token(token) if token else None
        self.principal: Principal | None = parsed[0] if parsed else None
        self.timeout = timeout
        self.transfer_timeout = transfer_timeout
        self.retries = retries
        self.busy_wait = busy_wait
        self.connection = Connection(
            address,
            token,
            insecure=insecure,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            server_name=server_name,
            timeout=timeout,
        )
        self.labels = labels
        self._channel = self.connection.open_channel(labels)
        self._hint = MTLS_HINT if not insecure and tls_cert is None else ""
        self._stub = pb_grpc.RegistryStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = self.connection.metadata()

    # plumbing ------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def with_retries(self, retries: int) -> RegistryClient:
        """This client, over the same connection, retrying UNAVAILABLE ``retries`` times."""
        view = copy.copy(self)
        view.retries = retries
        return view

    def _call(self, fn, *, retry: bool = True):
        """Run ``fn()`` translating gRPC errors; retry UNAVAILABLE, and a busy registry, with backoff."""
        attempts = 1 + (self.retries if retry else 0)
        attempt, busy_until, busy_sleep = 0, time.monotonic() + self.busy_wait, 0.0
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                busy_ms = _busy_retry_after_ms(exc) if retry else None
                if busy_ms is not None and time.monotonic() < busy_until:
                    busy_sleep = min(max(busy_sleep * 2, busy_ms / 1000), 2.0)
                    time.sleep(busy_sleep * random.uniform(0.5, 1.5))
                    continue
                attempt += 1
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= attempts:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self._raise_tls_mistake()
                    raise _error(exc, self._hint) from None
                time.sleep(0.2 * 2 ** (attempt - 1))

    def _raise_tls_mistake(self) -> None:
        """A TlsError in words when the registry is unavailable because of a TLS mistake (a wrong
        CA, a missing or foreign client certificate, a name mismatch, plaintext against TLS or the
        reverse): it ends the caller at once, where a registry that is away would be asked again.
        The same verdict twice, 0.5 s apart: a registry that is restarting is not a mistake."""
        words = diagnose_tls(self.connection, self.labels)
        if words is None:
            return
        time.sleep(0.5)
        if diagnose_tls(self.connection, self.labels) == words:
            raise TlsError(words)

    def _unary(self, method, request, retry: bool = True):
        return self._call(lambda: method(request, metadata=self._metadata, timeout=self.timeout), retry=retry)

    def _upload(self, method, header_field: str, header, data: bytes):
        def messages():
            yield method_request(**{header_field: header})
            for start in range(0, len(data), UPLOAD_CHUNK_BYTES):
                yield method_request(chunk=data[start : start + UPLOAD_CHUNK_BYTES])

        method_request = {
            "UploadPredictor": pb.UploadPredictorRequest,
            "UploadSample": pb.UploadSampleRequest,
            "UploadCombinedModel": pb.UploadCombinedModelRequest,
        }[method]
        stub_method = getattr(self._stub, method)
        return self._call(lambda: stub_method(messages(), metadata=self._metadata, timeout=self.transfer_timeout))

    def _download(self, method, request) -> tuple[Any, bytes]:
        def fetch():
            header, parts = None, []
            for msg in getattr(self._stub, method)(request, metadata=self._metadata, timeout=self.transfer_timeout):
                part = msg.WhichOneof("part")
                if part == "chunk":
                    parts.append(msg.chunk)
                elif header is None:
                    header = getattr(msg, part)
                else:
                    raise RegistryError("DATA_LOSS", f"{method}: the server sent two headers")
            return header, b"".join(parts)

        header, data = self._call(fetch)
        if header is None:
            raise RegistryError("DATA_LOSS", f"{method}: the server sent no header")
        if len(data) != header.size or sha256_hex(data) != header.sha256:
            raise RegistryError(
                "DATA_LOSS", f"{method}: received {len(data)} bytes whose sha256 does not match {header.sha256}"
            )
        return header, data

    # sites -----------------------------------------------------------------------
    def health(self, service: str = "") -> str:
        """Health status name of ``service`` ("" = the whole server); needs no token."""
        response = self._call(
            lambda: self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def register(self, name: str, labels: dict[str, str] | None = None) -> SiteRecord:
        """Register site ``name`` (must be the token's site); idempotent."""
        return site_from_pb(
            self._unary(self._stub.RegisterSite, pb.RegisterSiteRequest(name=name, labels=labels or {}))
        )

    def heartbeat(self, name: str = "") -> HeartbeatInfo:
        response = self._unary(self._stub.Heartbeat, pb.HeartbeatRequest(name=name))
        return HeartbeatInfo(response.server_time, response.latest_combined_version)

    def get_site(self, name: str = "") -> SiteRecord:
        """A site's record ("" = the caller's own site)."""
        return site_from_pb(self._unary(self._stub.GetSite, pb.GetSiteRequest(name=name)))

    def list_sites(self) -> list[SiteRecord]:
        """Every registered site with artifact sha256s (admin token; a site reads its own record with :meth:`get_site`)."""
        return [site_from_pb(s) for s in self._unary(self._stub.ListSites, pb.ListSitesRequest()).sites]

    def deregister(self, name: str = "") -> bool:
        return self._unary(self._stub.DeregisterSite, pb.DeregisterSiteRequest(name=name)).removed

    # artifacts -------------------------------------------------------------------
    def upload_predictor(
        self, data: bytes, *, upload_id: str | None = None, kind: str | None = None, n_features: int | None = None
    ) -> ArtifactRecord:
        """Publish ONNX bytes as the caller's predictor; ``kind``/``n_features`` are optional expectations."""
        data = bytes(data)
        header = pb.PredictorHeader(
            upload_id=upload_id or uuid.uuid4().hex,
            sha256=sha256_hex(data),
            size=len(data),
            output_kind=kind or "",
            n_features=n_features or 0,
        )
        return artifact_from_pb(self._upload("UploadPredictor", "header", header, data))

    def upload_sample(self, X, *, upload_id: str | None = None) -> ArtifactRecord:
        """Publish the unlabelled sample ``X`` of shape (m, d), sent as float32."""
        X = np.asarray(X)
        if X.ndim != 2:
            raise ConfigError(f"the unlabelled sample must be a 2-D array (m, d); got shape {X.shape}")
        data = np.ascontiguousarray(X, dtype="<f4").tobytes()
        header = pb.SampleHeader(
            upload_id=upload_id or uuid.uuid4().hex,
            sha256=sha256_hex(data),
            rows=X.shape[0],
            cols=X.shape[1],
            dtype="float32",
        )
        return artifact_from_pb(self._upload("UploadSample", "header", header, data))

    def download_predictor(self, site: str = "", *, expected_sha256: str | None = None) -> tuple[bytes, ArtifactRecord]:
        """(ONNX bytes, record) of ``site``'s latest predictor, checked against ``expected_sha256`` if given."""
        header, data = self._download("DownloadPredictor", pb.DownloadArtifactRequest(site=site))
        record = artifact_from_pb(header)
        _pin(record.sha256, expected_sha256, f"predictor of site {site!r}")
        return data, record

    def fetch_predictor(self, site: str = "", *, expected_sha256: str | None = None, **load_kwargs) -> OnnxPredictor:
        """Download and verify ``site``'s predictor with :func:`msa_fed.artifacts.load_predictor`."""
        data, record = self.download_predictor(site, expected_sha256=expected_sha256)
        return load_predictor(
            data,
            expected_sha256=record.sha256,
            n_features=record.meta["n_features"],
            kind=record.meta["output_kind"],
            **load_kwargs,
        )

    def download_sample(
        self, site: str = "", *, expected_sha256: str | None = None
    ) -> tuple[np.ndarray, ArtifactRecord]:
        """(float32 array (rows, cols), record) of ``site``'s latest unlabelled sample."""
        header, data = self._download("DownloadSample", pb.DownloadArtifactRequest(site=site))
        record = artifact_from_pb(header)
        _pin(record.sha256, expected_sha256, f"sample of site {site!r}")
        rows, cols = record.meta["rows"], record.meta["cols"]
        if rows * cols * 4 != len(data):
            raise RegistryError(
                "DATA_LOSS", f"sample of site {site!r}: {len(data)} bytes do not make shape ({rows}, {cols})"
            )
        return np.frombuffer(data, dtype="<f4").reshape(rows, cols).astype(np.float32), record

    # combined models ---------------------------------------------------------------
    def upload_combined_model(self, data: bytes, manifest, *, upload_id: str | None = None) -> CombinedModelRecord:
        """Store ``data`` with ``manifest`` (a dict or JSON text of an object) as a new version (admin)."""
        manifest_json = manifest if isinstance(manifest, str) else json.dumps(manifest, sort_keys=True)
        data = bytes(data)
        header = pb.CombinedModelHeader(
            upload_id=upload_id or uuid.uuid4().hex,
            sha256=sha256_hex(data),
            size=len(data),
            manifest_json=manifest_json,
        )
        return combined_from_pb(self._upload("UploadCombinedModel", "header", header, data))

    def download_combined_model(self, version: int | None = None) -> tuple[bytes, CombinedModelRecord]:
        """(bytes, record) of combined model ``version`` (None: the latest)."""
        header, data = self._download("DownloadCombinedModel", pb.DownloadCombinedModelRequest(version=version or 0))
        return data, combined_from_pb(header)


def _pin(actual: str, expected: str | None, what: str) -> None:
    if expected is not None and actual != expected:
        raise RegistryError(
            "FAILED_PRECONDITION", f"the {what} is now {actual}; expected {expected} (it was republished)"
        )


class SharedClient:
    """One :class:`RegistryClient` for every call of a long task (a job's plan, log, store and
    record): ``with shared() as client`` lends it.  A call that finds the registry away
    (:data:`REGISTRY_AWAY`, an OSError) retires it and the next ``shared()`` opens a fresh one, so
    a restarted registry is reached at once; a retired client is closed when its last borrower
    is done.  ``open_client`` makes a client (each construction is a new connection)."""

    def __init__(self, open_client: Callable[[], RegistryClient]):
        self._open = open_client
        self._lock = threading.Lock()
        self._client: RegistryClient | None = None
        self._borrowers: dict[RegistryClient, int] = {}

    @contextmanager
    def __call__(self) -> Iterator[RegistryClient]:
        with self._lock:
            if self._client is None:
                self._client = self._open()
            client = self._client
            self._borrowers[client] = self._borrowers.get(client, 0) + 1
        try:
            yield client
        except (RegistryError, OSError) as exc:
            if not isinstance(exc, RegistryError) or exc.code in REGISTRY_AWAY:
                with self._lock:  # the connection broke: the next borrower gets a new one
                    if self._client is client:
                        self._client = None
            raise
        finally:
            self._release(client)

    def _release(self, client: RegistryClient) -> None:
        with self._lock:
            self._borrowers[client] -= 1
            if self._borrowers[client] or client is self._client:
                return
            del self._borrowers[client]
        client.close()

    def close(self) -> None:
        """Retire the current client (closed now, or when its last borrower is done)."""
        with self._lock:
            client, self._client = self._client, None
            if client is None or self._borrowers.get(client):
                return
            self._borrowers.pop(client, None)
        client.close()
