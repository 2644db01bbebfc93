"""``site.toml``: the configuration of a site's process (``msa-fed site serve --config site.toml``).

    name = "hospital-a"                    # the site's name at the registry (its token's site)
    registry = "registry.example:7443"     # HOST:PORT the site dials out to
    token_file = "site-token.txt"          # the site's token (kept readable by the site only)
    tls_ca = "ca.pem"                      # CA of the registry's certificate
    # tls_cert = "site.pem"                # client certificate naming the site (mutual TLS)
    # tls_key = "site-key.pem"
    # insecure = true                      # plaintext, only towards a loopback registry
    data = "data.npz"                      # X_labeled, y_labeled, X_unlabeled
    predictor = "predictor.onnx"           # the ONNX file the site published
    # unlabeled = "unlabeled.npy"          # the unlabelled sample `site publish --config` publishes
    policy = "policy.toml"                 # the site's privacy policy (defaults when absent)
    audit_log = "audit.jsonl"              # every request answered or refused
    accept_jobs = "admin"                  # "admin": every job the registry's admin issues;
                                           # "approve": only jobs approved with `msa-fed site approve`
    # jobs_db = "jobs.db"                  # pending/approved jobs (default: next to audit_log)
    # ledger = "ledger.db"                 # the policy's query/epsilon ledger (default: next to audit_log)
    seal_key = "site.key"                  # the site's sealing key (msa-fed site keygen): serve sealed jobs only
    job_keys = ["<sha256>"]                # fingerprints of the job keys allowed to run jobs here
    # allow_unsealed = true                # instead of seal_key: serve unsealed jobs (the registry reads them)

A site serves sealed jobs only: ``site serve`` refuses to start without ``seal_key`` and
``job_keys`` unless ``allow_unsealed = true`` says, in so many words, that the registry may read
(and could forge) the job's requests and the site's answers.

Relative paths are relative to the folder of ``site.toml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from msa_fed.errors import ConfigError

ACCEPT_JOBS = ("admin", "approve")
_REQUIRED = ("name", "registry", "token_file", "data", "predictor", "audit_log")
_PATHS = (
    "token_file",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "data",
    "predictor",
    "unlabeled",
    "policy",
    "audit_log",
    "jobs_db",
    "ledger",
    "seal_key",
)
_OPTIONAL = (
    "tls_ca",
    "tls_cert",
    "tls_key",
    "server_name",
    "insecure",
    "policy",
    "unlabeled",
    "accept_jobs",
    "jobs_db",
    "ledger",
    "seal_key",
    "job_keys",
    "allow_unsealed",
)


@dataclass(frozen=True)
class SiteConfig:
    name: str
    registry: str
    token_file: str
    data: str
    predictor: str
    audit_log: str
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    server_name: str | None = None
    insecure: bool = False
    unlabeled: str | None = None
    policy: str | None = None
    accept_jobs: str = "admin"
    jobs_db: str | None = None
    ledger: str | None = None
    seal_key: str | None = None
    job_keys: tuple = ()
    allow_unsealed: bool = False

    @classmethod
    def from_toml(cls, path) -> SiteConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"site config {str(path)!r} not found")
        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"site config {str(path)!r} is not valid TOML: {exc}") from None
        unknown = sorted(set(doc) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ConfigError(
                f"site config {str(path)!r}: unknown key(s) {unknown}; expected some of {sorted(_REQUIRED + _OPTIONAL)}"
            )
        missing = [k for k in _REQUIRED if k not in doc]
        if missing:
            raise ConfigError(f"site config {str(path)!r}: missing key(s) {missing}")
        for key, value in doc.items():
            if key == "job_keys":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(
                        f"site config {str(path)!r}: job_keys must be a list of fingerprints; got {value!r}"
                    )
                doc[key] = tuple(v.strip().lower() for v in value)
                continue
            want = bool if key in ("insecure", "allow_unsealed") else str
            if not isinstance(value, want):
                raise ConfigError(f"site config {str(path)!r}: {key} must be a {want.__name__}; got {value!r}")
        base = path.resolve().parent
        values: dict[str, Any] = {k: (str(base / Path(v).expanduser()) if k in _PATHS else v) for k, v in doc.items()}
        return cls(**values).validate()

    def validate(self) -> SiteConfig:
        from msa_fed.control.records import NAME_PATTERN
        from msa_fed.control.server import is_loopback, parse_address

        if not NAME_PATTERN.match(self.name):
            raise ConfigError(f"site config: name {self.name!r} is not a valid site name")
        host, _ = parse_address(self.registry, "site config: registry")
        if self.accept_jobs not in ACCEPT_JOBS:
            raise ConfigError(f"site config: accept_jobs must be one of {list(ACCEPT_JOBS)}; got {self.accept_jobs!r}")
        if self.insecure and (self.tls_ca or self.tls_cert):
            raise ConfigError("site config: insecure = true and tls_ca/tls_cert are mutually exclusive")
        if self.insecure and not is_loopback(host):
            raise ConfigError(f"site config: insecure = true is allowed only towards a loopback registry, not {host!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("site config: tls_cert and tls_key must be given together")
        if bool(self.seal_key) != bool(self.job_keys):
            raise ConfigError(
                "site config: seal_key and job_keys go together (the site's sealing key, and the "
                "fingerprints of the job keys it lets run jobs)"
            )
        if self.seal_key and self.allow_unsealed:
            raise ConfigError(
                "site config: seal_key and allow_unsealed = true are mutually exclusive (a site with a "
                "sealing key serves sealed jobs only)"
            )
        for fp in self.job_keys:
            if len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp):
                raise ConfigError(f"site config: job_keys holds {fp[:80]!r}, not a sha256 fingerprint (64 hex digits)")
        return self

    @property
    def jobs_path(self) -> Path:
        if self.jobs_db:
            return Path(self.jobs_db)
        audit = Path(self.audit_log)
        return audit.with_name(audit.stem + ".jobs.db")

    @property
    def ledger_path(self) -> Path:
        """The site's ledger (budgets and epsilon spent, anchor of the audit log): it survives restarts."""
        if self.ledger:
            return Path(self.ledger)
        audit = Path(self.audit_log)
        return audit.with_name(audit.stem + ".ledger.db")

    def channel_kwargs(self) -> dict:
        return dict(
            insecure=self.insecure,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            server_name=self.server_name,
        )

    def read_token(self) -> str:
        p = Path(self.token_file)
        if not p.is_file():
            raise ConfigError(f"site config: token_file {self.token_file!r} not found")
        token = p.read_text().strip()
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"site config: token_file {self.token_file!r} holds no token")
        return token
