"""Plain records of the registry's state, shared by the stores, the servicer and the client.

Times are unix seconds (float).  sha256 values are lowercase hex of the raw bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from msa_fed.errors import RegistryError

ROLE_SITE = "site"
ROLE_ADMIN = "admin"
ROLES = (ROLE_SITE, ROLE_ADMIN)

KIND_PREDICTOR = "predictor"
KIND_SAMPLE = "sample"

# Anchored with \Z (``$`` would accept a trailing newline), and used with fullmatch.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
UPLOAD_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}\Z")


def check_pattern(value: str, pattern: re.Pattern, message: str) -> str:
    """``value`` if ``pattern`` matches the whole string, else INVALID_ARGUMENT: ``message``, got what."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise RegistryError("INVALID_ARGUMENT", f"{message}; got {value!r}")
    return value


def check_name(name: str, what: str = "site name") -> str:
    """Return ``name`` if it is a valid principal name, else raise INVALID_ARGUMENT."""
    rule = "must be 1-64 characters of letters, digits, '_' or '-' (starting with a letter or digit)"
    return check_pattern(name, NAME_PATTERN, f"{what} {rule}")


def check_upload_id(upload_id: str) -> str:
    return check_pattern(
        upload_id, UPLOAD_ID_PATTERN, "upload_id must be 1-128 characters of letters, digits, '_', '.', ':' or '-'"
    )


def check_sha256(value: str, what: str = "sha256") -> str:
    return check_pattern(value, SHA256_PATTERN, f"{what} must be 64 lowercase hex characters")


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``role`` is "site" or "admin", ``name`` the site (or admin) name."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}"


@dataclass(frozen=True)
class TokenRecord:
    """A stored token: only a random salt and the salted digest of the secret."""

    role: str
    principal: str
    salt: bytes
    digest: bytes
    created_at: float


@dataclass(frozen=True)
class ArtifactRecord:
    """A published predictor or sample.

    ``meta`` for a predictor: {"output_kind", "n_features", "classes"};
    for a sample: {"rows", "cols", "dtype"}.
    """

    site: str
    upload_id: str
    kind: str
    sha256: str
    size: int
    meta: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class SiteRecord:
    """A registered site and its latest artifacts (None when none was published)."""

    name: str
    registered_at: float
    last_heartbeat: float | None
    labels: dict[str, str] = field(default_factory=dict)
    predictor: ArtifactRecord | None = None
    sample: ArtifactRecord | None = None


@dataclass(frozen=True)
class CombinedModelRecord:
    """A stored combined model; ``manifest_json`` is a JSON object as text."""

    version: int
    upload_id: str
    sha256: str
    size: int
    manifest_json: str
    created_by: str
    created_at: float
