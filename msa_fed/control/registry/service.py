"""The registry's domain layer: authentication, ownership rules, artifact checks.

Everything here is transport-free: the gRPC servicer parses requests, calls a
:class:`Registry` method with the authenticated :class:`Principal`, and maps
the :class:`~msa_fed.errors.RegistryError` / :class:`~msa_fed.errors.ArtifactError`
it may raise to a status code.  The rules:

- a site may act only on its own records; an admin may read every record,
  deregister any site and store combined models, but never publishes artifacts;
- a predictor must pass :func:`msa_fed.artifacts.load_predictor` (ONNX only,
  size, declared width and kind, probe batch);
- a sample is a finite float32 matrix whose width matches the site's predictor.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from msa_fed.artifacts.predictors import DEFAULT_MAX_BYTES, META_N_FEATURES, load_predictor, sha256_hex
from msa_fed.control.registry import tokens
from msa_fed.control.registry.records import (
    KIND_PREDICTOR,
    KIND_SAMPLE,
    ROLE_ADMIN,
    ROLE_SITE,
    ArtifactRecord,
    CombinedModelRecord,
    Principal,
    SiteRecord,
    check_name,
    check_sha256,
    check_upload_id,
)
from msa_fed.control.registry.store import RegistryStore
from msa_fed.errors import ArtifactError, RegistryError

log = logging.getLogger(__name__)

SAMPLE_DTYPE = "float32"
DEFAULT_PROBE_MEMORY_BYTES = 2**30  # when the loader names no sandbox limit of its own
ADMIN_TOKEN_NEEDED = "this RPC needs the admin token; a site token was given"
SITE_TOKEN_NEEDED = "this RPC needs a site token; the admin token was given"


@dataclass(frozen=True)
class Limits:
    """Resource limits enforced by the registry (bytes unless said otherwise).

    Everything an upload will use is charged before the upload is read: its
    declared size, and for a predictor also the memory its probe may take
    (``probe_memory_bytes``; None: the loader's sandbox limit).  Uploads and
    downloads are *transfers*: at most ``max_streams_per_principal`` at once per
    token, at most ``max_streams`` in all (None: half the server's worker
    threads, so heartbeats and health checks always find a free worker), each cut
    off after ``transfer_idle_s`` without a message or ``transfer_deadline_s`` in
    all.  A call whose request message has not arrived holds a worker thread too:
    at most ``max_pending_reads_per_caller`` such calls per token (per network
    address for the health check), each cut off after ``request_read_s``.
    """

    max_predictor_bytes: int = DEFAULT_MAX_BYTES
    max_sample_bytes: int = 256 * 2**20  # 67M float32 values: far above any unlabelled sample we use
    max_combined_bytes: int = 512 * 2**20  # p predictors of up to 64 MiB plus the domain classifier
    max_manifest_bytes: int = 2**20
    max_upload_bytes_in_flight: int | None = None  # None: max(2 GiB, twice one largest predictor upload)
    max_n_features: int = 1_000_000  # declared predictor input width
    probe_memory_bytes: int | None = None
    max_streams_per_principal: int = 2
    max_streams: int | None = None
    transfer_idle_s: float = 30.0
    transfer_deadline_s: float = 900.0
    max_pending_reads_per_caller: int = 2
    request_read_s: float = 5.0
    max_labels: int = 32
    max_label_chars: int = 256

    def __post_init__(self):
        for name in (
            "max_predictor_bytes",
            "max_sample_bytes",
            "max_combined_bytes",
            "max_manifest_bytes",
            "max_upload_bytes_in_flight",
            "max_n_features",
            "probe_memory_bytes",
            "max_streams_per_principal",
            "max_streams",
            "max_labels",
            "max_label_chars",
            "max_pending_reads_per_caller",
        ):
            value = getattr(self, name)
            if value is None and name in ("max_upload_bytes_in_flight", "probe_memory_bytes", "max_streams"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer; got {value!r}")
        for name in ("transfer_idle_s", "transfer_deadline_s", "request_read_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive finite number of seconds; got {value!r}")

    @property
    def probe_charge(self) -> int:
        """Bytes charged to the in-flight budget for one predictor's probe."""
        if self.probe_memory_bytes is not None:
            return self.probe_memory_bytes
        from msa_fed.artifacts import predictors

        return int(getattr(predictors, "SANDBOX_MEMORY_BYTES", DEFAULT_PROBE_MEMORY_BYTES))

    @property
    def in_flight_bytes(self) -> int:
        """The in-flight budget: bytes of uploads being received plus their probes' memory."""
        if self.max_upload_bytes_in_flight is not None:
            return self.max_upload_bytes_in_flight
        return max(2 * 2**30, 2 * (self.max_predictor_bytes + self.probe_charge))


def declared_n_features(data: bytes) -> int | None:
    """The ``msa_fed.n_features`` an ONNX model declares, or None (unparsable or absent: the loader decides)."""
    import onnx
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return None
    for prop in model.metadata_props:
        if prop.key == META_N_FEATURES:
            text = prop.value.strip()
            return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None
    return None


class Registry:
    """Registry operations over a :class:`RegistryStore`.

    ``clock`` returns unix seconds (tests may inject a fake one).
    """

    #: whether a site's stream is connected to the relay (set by the server that runs the relay)
    site_connected: Callable[[str], bool] | None = None
    #: set by the server to its relay's ``cancel_job`` (msa-fed job cancel stops the job's traffic)
    job_cancelled: Callable[[str], None] | None = None

    def __init__(self, store: RegistryStore, limits: Limits = Limits(), clock: Callable[[], float] = time.time):
        self.store = store
        self.limits = limits
        self.clock = clock

    # tokens (admin CLI and tests; never exposed over RPC) ------------------
    def issue_token(self, role: str, name: str) -> str:
        """Create (or rotate) the token of ``role``/``name`` and return it; only its hash is stored."""
        check_name(name, "admin name" if role == ROLE_ADMIN else "site name")
        token, record = tokens.new_token(role, name, self.clock())
        self.store.put_token(record)
        log.info("issued a new token for %s %r", role, name)
        return token

    def revoke_token(self, role: str, name: str) -> bool:
        """Revoke the active token of ``role``/``name``; False when there was none."""
        return self.store.revoke_tokens(role, name, self.clock()) > 0

    def authenticate(self, token: str | None) -> Principal:
        """The principal ``token`` proves, or UNAUTHENTICATED."""
        if not token:
            raise RegistryError("UNAUTHENTICATED", "missing token (send 'authorization: Bearer <token>' metadata)")
        parsed = tokens.parse_token(token)
        if parsed is None:
            tokens.verify_secret(None, "")  # same work as a real check
            raise RegistryError("UNAUTHENTICATED", "malformed token")
        principal, secret = parsed
        record = self.store.get_token(principal.role, principal.name)
        if not tokens.verify_secret(record, secret):
            if any(
                tokens.verify_secret(old, secret) for old in self.store.revoked_tokens(principal.role, principal.name)
            ):
                raise RegistryError(
                    "UNAUTHENTICATED",
                    f"the token of {principal.role} {principal.name!r} was revoked (or replaced by a newer one)",
                )
            raise RegistryError("UNAUTHENTICATED", f"invalid token for {principal.role} {principal.name!r}")
        return principal

    def sites_admitted(self, site_tokens: dict[str, str]) -> set[str]:
        """The sites of ``site_tokens`` ({site: the token it connected with}) that are still
        registered and whose token still proves that site (neither revoked nor replaced): what
        :meth:`authenticate` and the site's registration say, for many sites in one store query."""
        access = self.store.site_access(list(site_tokens))
        admitted = set()
        for name, token in site_tokens.items():
            parsed = tokens.parse_token(token)
            if parsed is None or name not in access:
                continue
            principal, secret = parsed
            if principal.role == ROLE_SITE and principal.name == name and tokens.verify_secret(access[name], secret):
                admitted.add(name)
        return admitted

    # access rules ----------------------------------------------------------
    @staticmethod
    def require_site(principal: Principal, action: str) -> None:
        if principal.role != ROLE_SITE:
            raise RegistryError("PERMISSION_DENIED", f"{SITE_TOKEN_NEEDED} (to {action})")

    @staticmethod
    def require_admin(principal: Principal, action: str) -> None:
        if principal.role != ROLE_ADMIN:
            raise RegistryError("PERMISSION_DENIED", f"{ADMIN_TOKEN_NEEDED} (to {action})")

    @staticmethod
    def _own_or_admin(principal: Principal, name: str) -> str:
        """``name`` (default: the caller's own site) if the caller may touch that site's records."""
        if not name:
            if principal.role != ROLE_SITE:
                raise RegistryError("INVALID_ARGUMENT", "site name is required for an admin caller")
            return principal.name
        check_name(name)
        if principal.role == ROLE_SITE and name != principal.name:
            raise RegistryError("PERMISSION_DENIED", f"site {principal.name!r} may not act on site {name!r}")
        return name

    def _registered(self, name: str) -> SiteRecord:
        site = self.store.get_site(name)
        if site is None:
            raise RegistryError("NOT_FOUND", f"site {name!r} is not registered")
        return site

    # sites -----------------------------------------------------------------
    def register(self, principal: Principal, name: str, labels: dict[str, str] | None = None) -> SiteRecord:
        self.require_site(principal, "register")
        name = self._own_or_admin(principal, name)
        labels = dict(labels or {})
        if len(labels) > self.limits.max_labels:
            raise RegistryError(
                "INVALID_ARGUMENT", f"at most {self.limits.max_labels} labels are allowed; got {len(labels)}"
            )
        for key, value in labels.items():
            if not key or len(key) > 64 or len(value) > self.limits.max_label_chars:
                raise RegistryError(
                    "INVALID_ARGUMENT",
                    f"label keys must be 1-64 characters and values at most {self.limits.max_label_chars}; got key {key[:80]!r}",
                )
        site = self.store.register_site(name, labels, self.clock())
        log.info("site %r registered", name)
        return site

    def heartbeat(self, principal: Principal, name: str = "") -> float:
        """Record a heartbeat of the caller's site; return the server time."""
        self.require_site(principal, "send heartbeats")
        name = self._own_or_admin(principal, name)
        now = self.clock()
        if not self.store.heartbeat(name, now):
            raise RegistryError(
                "FAILED_PRECONDITION", f"site {name!r} is not registered; run 'msa-fed site register' first"
            )
        return now

    def get_site(self, principal: Principal, name: str = "") -> SiteRecord:
        return self._registered(self._own_or_admin(principal, name))

    def list_sites(self, principal: Principal) -> list[SiteRecord]:
        """Every registered site (admin only: a site reads its own record with :meth:`get_site`)."""
        self.require_admin(principal, "list the sites")
        return self.store.list_sites()

    def deregister(self, principal: Principal, name: str) -> bool:
        name = self._own_or_admin(principal, name)
        removed = self.store.deregister_site(name)
        if removed:
            log.info("site %r deregistered by %s", name, principal)
        return removed

    # artifacts -------------------------------------------------------------
    def put_predictor(
        self,
        principal: Principal,
        upload_id: str,
        data: bytes,
        sha256: str,
        output_kind: str = "",
        n_features: int = 0,
    ) -> tuple[ArtifactRecord, bool]:
        """Verify and store the caller's ONNX predictor; return (record, created)."""
        self.require_site(principal, "publish a predictor")
        check_upload_id(upload_id)
        check_sha256(sha256)
        site = self._registered_for_upload(principal.name)
        self.check_n_features(n_features)
        self.check_n_features(declared_n_features(data))
        predictor = load_predictor(
            data,
            expected_sha256=sha256,
            n_features=n_features or None,
            kind=output_kind or None,
            max_bytes=self.limits.max_predictor_bytes,
        )
        if site.sample is not None and site.sample.meta["cols"] != predictor.n_features_in_:
            raise ArtifactError(
                f"predictor takes n_features={predictor.n_features_in_} but site {site.name!r} published a sample "
                f"with {site.sample.meta['cols']} columns"
            )
        classes = predictor.classes_.tolist() if predictor.kind == "probabilities" else None  # type: ignore[attr-defined]
        meta = {"output_kind": predictor.kind, "n_features": predictor.n_features_in_, "classes": classes}
        record = ArtifactRecord(principal.name, upload_id, KIND_PREDICTOR, sha256, len(data), meta, self.clock())
        return self.store.commit_artifact(record, data)

    def put_sample(
        self,
        principal: Principal,
        upload_id: str,
        data: bytes,
        sha256: str,
        rows: int,
        cols: int,
        dtype: str = SAMPLE_DTYPE,
    ) -> tuple[ArtifactRecord, bool]:
        """Verify and store the caller's unlabelled sample (rows x cols float32, little endian)."""
        self.require_site(principal, "publish a sample")
        check_upload_id(upload_id)
        check_sha256(sha256)
        self.check_sample_shape(rows, cols, dtype)
        if len(data) != rows * cols * 4:
            raise RegistryError(
                "INVALID_ARGUMENT",
                f"sample has {len(data)} bytes; shape ({rows}, {cols}) float32 needs {rows * cols * 4}",
            )
        if sha256_hex(data) != sha256:
            raise RegistryError(
                "INVALID_ARGUMENT", f"sample sha256 is {sha256_hex(data)}; the header declared {sha256}"
            )
        values = np.frombuffer(data, dtype="<f4")
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            raise RegistryError("INVALID_ARGUMENT", f"sample contains {bad} NaN or infinite values")
        site = self._registered_for_upload(principal.name)
        if site.predictor is not None and site.predictor.meta["n_features"] != cols:
            raise RegistryError(
                "INVALID_ARGUMENT",
                f"sample has {cols} columns but site {site.name!r}'s predictor takes n_features={site.predictor.meta['n_features']}",
            )
        meta = {"rows": int(rows), "cols": int(cols), "dtype": SAMPLE_DTYPE}
        record = ArtifactRecord(principal.name, upload_id, KIND_SAMPLE, sha256, len(data), meta, self.clock())
        return self.store.commit_artifact(record, data)

    def check_n_features(self, n_features: int | None) -> None:
        """Refuse a declared predictor width above ``limits.max_n_features`` (before any probe is built)."""
        if n_features is not None and n_features > self.limits.max_n_features:
            raise RegistryError(
                "INVALID_ARGUMENT",
                f"the predictor declares n_features={n_features}; this registry accepts at most {self.limits.max_n_features}",
            )

    def check_sample_shape(self, rows: int, cols: int, dtype: str) -> int:
        """Validate a declared sample shape; return its size in bytes."""
        if dtype != SAMPLE_DTYPE:
            raise RegistryError("INVALID_ARGUMENT", f"sample dtype must be 'float32'; got {dtype!r}")
        if rows < 1 or cols < 1:
            raise RegistryError("INVALID_ARGUMENT", f"sample shape must be positive; got ({rows}, {cols})")
        size = rows * cols * 4
        if size > self.limits.max_sample_bytes:
            raise RegistryError(
                "RESOURCE_EXHAUSTED",
                f"sample of shape ({rows}, {cols}) is {size} bytes; the limit is {self.limits.max_sample_bytes}",
            )
        return size

    def _registered_for_upload(self, name: str) -> SiteRecord:
        site = self.store.get_site(name)
        if site is None:
            raise RegistryError(
                "FAILED_PRECONDITION", f"site {name!r} is not registered; run 'msa-fed site register' first"
            )
        return site

    def get_artifact(self, principal: Principal, name: str, kind: str) -> tuple[ArtifactRecord, bytes]:
        """The latest ``kind`` artifact of site ``name`` with its bytes."""
        site = self._registered(self._own_or_admin(principal, name))
        record = site.predictor if kind == KIND_PREDICTOR else site.sample
        if record is None:
            raise RegistryError("NOT_FOUND", f"site {site.name!r} has published no {kind}")
        data = self.store.get_blob(record.sha256)
        if data is None:
            raise RegistryError(
                "DATA_LOSS", f"the {kind} of site {site.name!r} ({record.sha256}) is missing from storage"
            )
        return record, data

    # combined models ---------------------------------------------------------
    def put_combined_model(
        self, principal: Principal, upload_id: str, data: bytes, sha256: str, manifest_json: str
    ) -> tuple[CombinedModelRecord, bool]:
        self.require_admin(principal, "store a combined model")
        check_upload_id(upload_id)
        check_sha256(sha256)
        if sha256_hex(data) != sha256:
            raise RegistryError(
                "INVALID_ARGUMENT", f"combined model sha256 is {sha256_hex(data)}; the header declared {sha256}"
            )
        if len(manifest_json.encode("utf-8")) > self.limits.max_manifest_bytes:
            raise RegistryError("RESOURCE_EXHAUSTED", f"manifest is larger than {self.limits.max_manifest_bytes} bytes")
        try:
            manifest = json.loads(manifest_json)
        except (ValueError, RecursionError):
            raise RegistryError("INVALID_ARGUMENT", "manifest_json is not valid JSON (or nests too deeply)") from None
        if not isinstance(manifest, dict):
            raise RegistryError(
                "INVALID_ARGUMENT", f"manifest_json must be a JSON object; got {type(manifest).__name__}"
            )
        return self.store.commit_combined_model(upload_id, sha256, data, manifest_json, principal.name, self.clock())

    def get_combined_model(self, principal: Principal, version: int = 0) -> tuple[CombinedModelRecord, bytes]:
        if version < 0:
            raise RegistryError("INVALID_ARGUMENT", f"version must be >= 0 (0 = latest); got {version}")
        record = self.store.get_combined_model(version or None)
        if record is None:
            what = f"version {version}" if version else "any version"
            raise RegistryError("NOT_FOUND", f"no combined model stored ({what})")
        data = self.store.get_blob(record.sha256)
        if data is None:
            raise RegistryError("DATA_LOSS", f"combined model version {record.version} is missing from storage")
        return record, data

    def latest_combined_version(self) -> int:
        record = self.store.get_combined_model(None)
        return record.version if record is not None else 0
