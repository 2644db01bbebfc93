"""What a client may learn from a failed RPC: the one place exceptions become gRPC statuses.

A :class:`~msa_fed.errors.RegistryError` is the registry's own refusal: its
code and message (composed by the registry from the request and its own
state) go back as they are.  Anything else -- an artifact refused by the
loader, a library's exception, an internal failure -- may carry text the
client must never see (onnxruntime once echoed bytes of a server file in its
error message).  The client gets a fixed public reason and an *incident id*;
the registry logs the id with the full detail, so the operator can look it up.
"""

from __future__ import annotations

import logging
import secrets

import grpc

from msa_fed.errors import ArtifactError, MsaFedError, RegistryError

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "msa-fed-retry-after-ms"  # trailing metadata of a refusal that is worth retrying


class Busy(RegistryError):
    """RESOURCE_EXHAUSTED that will pass later (slots or the in-flight budget are taken): the client may retry."""

    def __init__(self, message: str, retry_after_ms: int = 200):
        super().__init__("RESOURCE_EXHAUSTED", message)
        self.retry_after_ms = int(retry_after_ms)

    def __reduce__(self):
        return (type(self), (self.message, self.retry_after_ms))


ARTIFACT_REFUSED = (
    "the artifact was refused: it is not a self-contained ONNX predictor that passes the registry's checks "
    "(declaration, width, probe batch); run msa_fed.artifacts.load_predictor_file on it locally for the reason"
)
REQUEST_REFUSED = "the request was refused"
OUT_OF_MEMORY = "the registry cannot take this request now (out of memory); retry later"
INTERNAL = "internal error"


def new_incident_id() -> str:
    """12 random hex characters naming one logged failure."""
    return secrets.token_hex(6)


def public_status(exc: BaseException, where: str = "", who: object = None) -> tuple[grpc.StatusCode, str]:
    """(code, message) to send for ``exc``; logs the detail of anything but a RegistryError under an incident id."""
    if isinstance(exc, RegistryError):
        return grpc.StatusCode.__members__.get(exc.code, grpc.StatusCode.UNKNOWN), " ".join(exc.message.split())
    incident = new_incident_id()
    if isinstance(exc, ArtifactError):
        code, reason, level = grpc.StatusCode.INVALID_ARGUMENT, ARTIFACT_REFUSED, logging.WARNING
    elif isinstance(exc, (MsaFedError, ValueError, TypeError)):
        code, reason, level = grpc.StatusCode.INVALID_ARGUMENT, REQUEST_REFUSED, logging.WARNING
    elif isinstance(exc, MemoryError):
        code, reason, level = grpc.StatusCode.RESOURCE_EXHAUSTED, OUT_OF_MEMORY, logging.ERROR
    else:
        code, reason, level = grpc.StatusCode.INTERNAL, INTERNAL, logging.ERROR
    log.log(
        level,
        "incident %s: %s by %s failed with %s: %s",
        incident,
        where or "an RPC",
        who or "a caller",
        type(exc).__name__,
        exc,
        exc_info=level >= logging.ERROR,
    )
    return code, f"{reason} (incident {incident})"


def abort_public(context: grpc.ServicerContext, exc: BaseException, where: str = "", who: object = None) -> None:
    """Abort the RPC with :func:`public_status` of ``exc`` (raises, as ``context.abort`` does)."""
    code, message = public_status(exc, where, who)
    if isinstance(exc, Busy):
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(exc.retry_after_ms)),))
    context.abort(code, message)
