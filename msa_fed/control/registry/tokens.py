"""Bearer tokens: generation, salted hashing and constant-time verification.

A token reads ``mft1.<role>.<name>.<secret>``: the role ("site" or "admin")
and the principal name are not secret, they tell the server which stored
record to compare against; the secret is 32 random bytes (urlsafe base64).
The server stores only a random 16-byte salt and HMAC-SHA256(salt, secret).

A fast salted hash is sufficient because the secret carries 256 bits of
entropy: there is no dictionary to attack, and a slow KDF would cost
milliseconds on every RPC.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from msa_fed.control.registry.records import NAME_PATTERN, ROLES, Principal, TokenRecord

TOKEN_PREFIX = "mft1"
SECRET_BYTES = 32
SALT_BYTES = 16
_DUMMY_SALT = b"\x00" * SALT_BYTES


def _digest(salt: bytes, secret: str) -> bytes:
    return hmac.new(salt, secret.encode("utf-8"), hashlib.sha256).digest()


def new_token(role: str, name: str, now: float) -> tuple[str, TokenRecord]:
    """Create a token for ``role``/``name``; return (plaintext token, record to store)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}; got {role!r}")
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"invalid principal name {name!r}")
    secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode("ascii")
    salt = secrets.token_bytes(SALT_BYTES)
    token = f"{TOKEN_PREFIX}.{role}.{name}.{secret}"
    return token, TokenRecord(role=role, principal=name, salt=salt, digest=_digest(salt, secret), created_at=now)


def parse_token(token: str) -> tuple[Principal, str] | None:
    """Split a token into (principal, secret); None when it is not well formed."""
    if not isinstance(token, str) or len(token) > 256:
        return None
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX or parts[1] not in ROLES:
        return None
    if not NAME_PATTERN.fullmatch(parts[2]) or not parts[3]:
        return None
    return Principal(role=parts[1], name=parts[2]), parts[3]


def verify_secret(record: TokenRecord | None, secret: str) -> bool:
    """Constant-time check of ``secret`` against ``record`` (a hash is computed even when None)."""
    salt = record.salt if record is not None else _DUMMY_SALT
    expected = record.digest if record is not None else b"\x00" * 32
    ok = hmac.compare_digest(_digest(salt, secret), expected)
    return ok and record is not None
