"""``site.toml``: the configuration of a site's process (``msa-fed site serve --config site.toml``).

Each key is one field of :class:`SiteConfig`, declared once with :func:`msa_fed.core.options.option`:
its default (none: the key is required), its check, its description and whether it names a file
(``path``: relative to the folder of ``site.toml``).  The file's parsing, its error lines and the
table of cluster/README.md ("Site configuration", :mod:`msa_fed.federation.config_doc`) read that
declaration.  For example::

    name = "hospital-a"
    registry = "registry.example:7443"
    token_file = "site-token.txt"
    tls_ca = "ca.pem"
    data = "data.npz"
    predictor = "predictor.onnx"
    policy = "policy.toml"
    audit_log = "audit.jsonl"
    seal_key = "site.key"
    job_keys = ["<sha256>"]

A site serves sealed jobs only: ``site serve`` refuses to start without ``seal_key`` and
``job_keys`` unless ``allow_unsealed = true`` says, in so many words, that the registry may read
(and could forge) the job's requests and the site's answers.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

from msa_fed.core.options import (
    Check,
    Choice,
    Flag,
    Optional,
    Text,
    check_value,
    normalise,
    option,
    option_meta,
    unknown_keys,
)
from msa_fed.errors import ConfigError

ACCEPT_JOBS = ("admin", "approve")


class _Fingerprints(Check):
    """A list of sha256 fingerprints (64 hex digits), as a lower-case tuple."""

    expects = "a list of fingerprints (sha256: 64 hex digits)"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise TypeError(self.expects)
        value = tuple(v.strip().lower() for v in value)
        bad = [fp[:80] for fp in value if len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp)]
        if bad:
            raise ValueError(f"{self.expects}, not {bad[0]!r}")
        return value


def _file(doc: str, default: Any = None) -> Any:
    """A key naming a file (relative to site.toml's folder); required without a default."""
    return option(default, doc, Text(nonempty=True) if default is MISSING else Optional(Text(nonempty=True)), path=True)


def _text(doc: str, default: Any = None) -> Any:
    return option(default, doc, Text(nonempty=True) if default is MISSING else Optional(Text(nonempty=True)))


@dataclass(frozen=True)
class SiteConfig:
    name: str = _text("The site's name at the registry; must be the site named by its token.", MISSING)
    registry: str = _text("`HOST:PORT` of the registry the site dials out to.", MISSING)
    token_file: str = _file(
        "File holding the site's token (keep it readable by the site's service user only).", MISSING
    )
    data: str = _file(
        "`.npz` with `X_labeled` (n, d), `y_labeled` (n,), `X_unlabeled` (m, d); never leaves the machine.", MISSING
    )
    predictor: str = _file("The ONNX file the site published (checked against the registry at start).", MISSING)
    audit_log: str = _file(
        "The site's one audit log: the policy's hash-chained JSON lines, one per request answered or refused "
        "(with the policy's measured decisions) and per job joined or ended. `msa-fed site audit --config "
        "site.toml` verifies it.",
        MISSING,
    )
    tls_ca: str | None = _file("CA that signed the registry's certificate (unset: the system roots).")
    tls_cert: str | None = _file(
        "Client certificate for mutual TLS, with `tls_key`; the registry then requires the certificate to name "
        "the site (common name or subject alternative name)."
    )
    tls_key: str | None = _file("The key of `tls_cert`.")
    server_name: str | None = _text("Name to check the registry's certificate against (unset: the host of `registry`).")
    insecure: bool = option(False, "Plaintext; only towards a loopback registry.", Flag())
    unlabeled: str | None = _file(
        "The unlabelled sample (`.npy`) that `msa-fed site publish --config site.toml` publishes, with "
        "`predictor`, when neither `--predictor` nor `--unlabeled` is given."
    )
    policy: str | None = _file(
        'The site\'s privacy policy file (docs/OPERATIONS.md, "Site policy keys"; unset: the defaults), read by '
        "the site's process and enforced on every relayed request; a bad file stops the process with one error "
        "line. Its `[budget] audit_log`, if set, must be this file's `audit_log`."
    )
    accept_jobs: str = option(
        "admin",
        "Serve every job the registry's admin opens, or only jobs admitted with `msa-fed site approve` (which "
        "approves the job id and the digest of its content; `msa-fed site jobs` shows both, the content in words).",
        Choice(*ACCEPT_JOBS),
    )
    jobs_db: str | None = _file(
        "SQLite file of the jobs that asked to be served and their state (unset: next to `audit_log`)."
    )
    ledger: str | None = _file(
        "SQLite ledger of the queries and epsilon each job spent and of the audit log's length: budgets survive "
        "a restart of the process, and a truncated log is detected (unset: next to `audit_log`, "
        "`<stem>.ledger.db`, or the policy's `[budget] ledger`)."
    )
    seal_key: str | None = _file(
        "The site's sealing key (`msa-fed site keygen`, mode 0600), required unless `allow_unsealed`: the site "
        'serves sealed jobs only (docs/CONTROL_PLANE.md, "Sealed job traffic").'
    )
    job_keys: tuple = option(
        (), "The consortium job keys whose jobs this site serves; required with `seal_key`.", _Fingerprints()
    )
    allow_unsealed: bool = option(
        False,
        "Serve unsealed jobs instead (no `seal_key`): the registry then reads the job's requests and the site's "
        "answers and could forge them. Without `seal_key` and without this, `site serve` does not start.",
        Flag(),
    )

    @classmethod
    def from_toml(cls, path) -> SiteConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"site config {str(path)!r} not found")
        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"site config {str(path)!r} is not valid TOML: {exc}") from None
        where = f"site config {str(path)!r}: "
        try:
            unknown_keys(cls, doc, where)
            missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in doc]
            if missing:
                raise ValueError(f"{where}missing key(s) {missing}")
            values = {k: check_value(cls, k, v, where) for k, v in doc.items()}
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        base = path.resolve().parent
        for f in fields(cls):
            if option_meta(f, "path") and values.get(f.name) is not None:
                values[f.name] = str(base / Path(values[f.name]).expanduser())
        return cls(**values).validate()

    def validate(self) -> SiteConfig:
        from msa_fed.control.registry.records import NAME_PATTERN
        from msa_fed.control.transport.address import is_loopback, parse_address

        try:
            normalise(self, "site config: ")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if not NAME_PATTERN.match(self.name):
            raise ConfigError(f"site config: name {self.name!r} is not a valid site name")
        host, _ = parse_address(self.registry, "site config: registry")
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
        return self

    def _beside_audit_log(self, given: str | None, suffix: str) -> Path:
        audit = Path(self.audit_log)
        return Path(given) if given else audit.with_name(audit.stem + suffix)

    @property
    def jobs_path(self) -> Path:
        return self._beside_audit_log(self.jobs_db, ".jobs.db")

    @property
    def ledger_path(self) -> Path:
        """The site's ledger (budgets and epsilon spent, anchor of the audit log): it survives restarts."""
        return self._beside_audit_log(self.ledger, ".ledger.db")

    def channel_kwargs(self) -> dict:
        from msa_fed.control.transport.address import transport_of

        return transport_of(self)

    def read_token(self) -> str:
        p = Path(self.token_file)
        if not p.is_file():
            raise ConfigError(f"site config: token_file {self.token_file!r} not found")
        token = p.read_text().strip()
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"site config: token_file {self.token_file!r} holds no token")
        return token
