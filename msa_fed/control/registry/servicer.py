"""The ``msa_fed.v1.Registry`` servicer: parse, call the domain layer, serialise.

Exceptions become status codes in one place,
:func:`msa_fed.control.registry.public.public_status`: a :class:`RegistryError`
carries its code and the registry's own message; anything else (an artifact
the loader refused, a library error, a bug) is a fixed public reason with an
incident id that the registry logs with the detail.  The auth interceptor
applies the same mapping to every service; the decorators here make the
servicer safe on its own too.

Resources are charged before they are used: an upload's declared size (and
for a predictor the memory of its probe) is reserved from the in-flight budget
before its first chunk is read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import grpc

from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
from msa_fed.control.registry.convert import artifact_to_pb, combined_to_pb, site_to_pb
from msa_fed.control.registry.public import Busy, abort_public
from msa_fed.control.registry.records import KIND_PREDICTOR, KIND_SAMPLE
from msa_fed.control.registry.service import Registry
from msa_fed.errors import RegistryError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # download chunk; well under the 4 MiB gRPC message limit


def _principal(context):
    return getattr(context, "principal", None)


def _unary(fn):
    """Map exceptions of a unary-response handler to public statuses."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except grpc.RpcError:  # the client went away while we read its stream
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code in one place
            abort_public(context, exc, fn.__name__, _principal(context))

    return wrapper


def _streaming(fn):
    """Map exceptions of a streaming-response handler to public statuses."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            yield from fn(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001
            abort_public(context, exc, fn.__name__, _principal(context))

    return wrapper


def _header(request_iterator, what: str):
    first = next(request_iterator, None)
    if first is None or first.WhichOneof("part") != "header":
        raise RegistryError("INVALID_ARGUMENT", f"the first message of {what} must be its header")
    return first.header


def _check_declared_size(size: int, limit: int, what: str) -> None:
    if size <= 0:
        raise RegistryError("INVALID_ARGUMENT", f"{what} header must declare a positive size; got {size}")
    if size > limit:
        raise RegistryError("RESOURCE_EXHAUSTED", f"{what} of {size} bytes exceeds the limit of {limit} bytes")


def _body(request_iterator, size: int, what: str) -> bytes:
    """Concatenate the chunk messages after the header; exactly ``size`` bytes or an error."""
    buf = bytearray()
    for msg in request_iterator:
        if msg.WhichOneof("part") != "chunk":
            raise RegistryError("INVALID_ARGUMENT", f"{what}: only the first message may be a header")
        buf += msg.chunk
        if len(buf) > size:
            raise RegistryError("INVALID_ARGUMENT", f"{what} sent more than the {size} bytes its header declared")
    if len(buf) != size:
        raise RegistryError("INVALID_ARGUMENT", f"{what} ended after {len(buf)} bytes; its header declared {size}")
    return bytes(buf)


class _UploadBudget:
    """Bytes of uploads being received and checked: their bodies, held in memory until committed, and probes."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    @contextlib.contextmanager
    def reserve(self, size: int):
        with self._lock:
            if size > self.limit:
                raise RegistryError(
                    "RESOURCE_EXHAUSTED",
                    f"this upload needs {size} bytes (its size, plus the probe's memory for a predictor); the "
                    f"registry's in-flight limit is {self.limit}",
                )
            if self._used + size > self.limit:
                raise Busy(
                    f"the registry is already receiving {self._used} bytes; {size} more would exceed its "
                    f"in-flight limit of {self.limit}; retry later",
                )
            self._used += size
        try:
            yield
        finally:
            with self._lock:
                self._used -= size


def _chunks(data: bytes):
    for start in range(0, len(data), CHUNK_BYTES):
        yield pb.DownloadChunk(chunk=data[start : start + CHUNK_BYTES])


class RegistryServicer(pb_grpc.RegistryServicer):
    """gRPC face of a :class:`Registry`; ``context.principal`` comes from the auth interceptor."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._budget = _UploadBudget(registry.limits.in_flight_bytes)

    @property
    def upload_bytes_in_flight(self) -> int:
        """Bytes reserved by uploads being received now (bounded by the registry's limit)."""
        return self._budget.used

    @_unary
    def RegisterSite(self, request, context):
        site = self.registry.register(context.principal, request.name, dict(request.labels))
        return site_to_pb(site)

    @_unary
    def Heartbeat(self, request, context):
        now = self.registry.heartbeat(context.principal, request.name)
        return pb.HeartbeatResponse(server_time=now, latest_combined_version=self.registry.latest_combined_version())

    @_unary
    def GetSite(self, request, context):
        return site_to_pb(self.registry.get_site(context.principal, request.name))

    @_unary
    def ListSites(self, request, context):
        return pb.ListSitesResponse(sites=[site_to_pb(s) for s in self.registry.list_sites(context.principal)])

    @_unary
    def DeregisterSite(self, request, context):
        return pb.DeregisterSiteResponse(removed=self.registry.deregister(context.principal, request.name))

    @_unary
    def UploadPredictor(self, request_iterator, context):
        header = _header(request_iterator, "UploadPredictor")
        self.registry.require_site(context.principal, "publish a predictor")
        _check_declared_size(header.size, self.registry.limits.max_predictor_bytes, "predictor")
        self.registry.check_n_features(header.n_features or None)
        with self._budget.reserve(header.size + self.registry.limits.probe_charge):
            data = _body(request_iterator, header.size, "UploadPredictor")
            record, _ = self.registry.put_predictor(
                context.principal, header.upload_id, data, header.sha256, header.output_kind, header.n_features
            )
        return artifact_to_pb(record)

    @_unary
    def UploadSample(self, request_iterator, context):
        header = _header(request_iterator, "UploadSample")
        self.registry.require_site(context.principal, "publish a sample")
        size = self.registry.check_sample_shape(header.rows, header.cols, header.dtype)
        with self._budget.reserve(size):
            data = _body(request_iterator, size, "UploadSample")
            record, _ = self.registry.put_sample(
                context.principal, header.upload_id, data, header.sha256, header.rows, header.cols, header.dtype
            )
        return artifact_to_pb(record)

    @_unary
    def UploadCombinedModel(self, request_iterator, context):
        header = _header(request_iterator, "UploadCombinedModel")
        self.registry.require_admin(context.principal, "store a combined model")
        _check_declared_size(header.size, self.registry.limits.max_combined_bytes, "combined model")
        with self._budget.reserve(header.size):
            data = _body(request_iterator, header.size, "UploadCombinedModel")
            record, _ = self.registry.put_combined_model(
                context.principal, header.upload_id, data, header.sha256, header.manifest_json
            )
        return combined_to_pb(record)

    @_streaming
    def DownloadPredictor(self, request, context):
        record, data = self.registry.get_artifact(context.principal, request.site, KIND_PREDICTOR)
        yield pb.DownloadChunk(artifact=artifact_to_pb(record))
        yield from _chunks(data)

    @_streaming
    def DownloadSample(self, request, context):
        record, data = self.registry.get_artifact(context.principal, request.site, KIND_SAMPLE)
        yield pb.DownloadChunk(artifact=artifact_to_pb(record))
        yield from _chunks(data)

    @_streaming
    def DownloadCombinedModel(self, request, context):
        record, data = self.registry.get_combined_model(context.principal, request.version)
        yield pb.DownloadChunk(combined_model=combined_to_pb(record))
        yield from _chunks(data)
