"""``msa-fed consortium init | add-site``: a start-up kit for every party of a consortium.

    msa-fed consortium init OUT --registry HOST:PORT --sites a,b,c [--listen HOST:PORT] [--days N]
    msa-fed consortium add-site OUT NAME

``init`` writes, under ``OUT`` (which must not exist or be empty), one folder per party, each
holding only what that party may hold (mutual TLS, sealed job traffic, explicit peer rosters):

    OUT/consortium/        the consortium's own: the CA's key, kit.json (kept by whoever ran init;
                           `add-site` needs it; no other party gets it)
    OUT/registry/          registry.toml, registry.db (token hashes only), ca.pem, server.pem,
                           server.key: `msa-fed registry serve --config registry.toml`
    OUT/sites/NAME/        site.toml, policy.toml, token.txt, ca.pem, client.pem, client.key,
                           site.key (+ .pub): `msa-fed site register|publish|serve --config site.toml`
    OUT/coordinator/       job.toml, admin_token, job.key (+ .pub), ca.pem, client.pem, client.key:
                           `msa-fed run --job job.toml`

Certificates come from ``cryptography``'s x509 builder: an EC P-256 CA, the registry's server
certificate for HOST (subjectAltName; with ``localhost`` also 127.0.0.1 and ::1), a client
certificate per site naming the site (common name and DNS subjectAltName: the registry binds it
to the site's token) and one for the coordinator.  Tokens are issued into the registry's
database, which keeps only their salted hashes.  Private keys and tokens are mode 0600, every
party folder 0700.  Paths in site.toml and registry.toml are relative to the file; job.toml
holds absolute paths (a job file's paths are the driver's: cluster/README.md, "Job file").
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from msa_fed.errors import ConfigError

KIT_FORMAT = "msa-fed consortium kit 1"
JOB_NAME = "consortium-job"
COORDINATOR_CN = "coordinator"


@dataclass
class Kit:
    """What ``consortium init`` wrote (kit.json: nothing secret)."""

    root: Path
    registry: str
    listen: str
    sites: list[str]
    job_key_fingerprint: str
    site_fingerprints: dict[str, str] = field(default_factory=dict)
    days: int = 730

    @property
    def kit_file(self) -> Path:
        return self.root / "consortium" / "kit.json"

    def save(self) -> None:
        doc = {
            "format": KIT_FORMAT,
            "registry": self.registry,
            "listen": self.listen,
            "sites": self.sites,
            "job_key_fingerprint": self.job_key_fingerprint,
            "site_fingerprints": self.site_fingerprints,
            "days": self.days,
        }
        self.kit_file.write_text(json.dumps(doc, indent=2) + "\n")

    @classmethod
    def load(cls, root) -> Kit:
        root = Path(root).resolve()
        path = root / "consortium" / "kit.json"
        if not path.is_file():
            raise ConfigError(
                f"{str(root)!r} is not a consortium kit ({path} not found; 'msa-fed consortium init' writes it)"
            )
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != KIT_FORMAT:
                raise ValueError("format")
            return cls(
                root=root,
                registry=str(doc["registry"]),
                listen=str(doc["listen"]),
                sites=[str(s) for s in doc["sites"]],
                job_key_fingerprint=str(doc["job_key_fingerprint"]),
                site_fingerprints={str(k): str(v) for k, v in doc["site_fingerprints"].items()},
                days=int(doc.get("days", 730)),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{str(path)!r} is not a kit file of this version ({KIT_FORMAT})") from None


# --------------------------------------------------------------------------- files


def _private(path: Path, data: bytes) -> Path:
    """A file readable by its owner only (0600 from creation); an existing file is an error."""
    if path.exists():
        raise ConfigError(f"{str(path)!r} exists; the kit never overwrites a file")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


def _public(path: Path, data: bytes | str) -> Path:
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    os.chmod(path, 0o644)
    return path


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=False)
    os.chmod(path, 0o700)
    return path


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string for the text written here


def _toml_list(values) -> str:
    return "[" + ", ".join(_toml_str(v) for v in values) + "]"


# --------------------------------------------------------------------------- certificates


def _key_usage(*, signs_certificates: bool):
    """A CA's key signs certificates and revocation lists; a leaf's signs (TLS handshakes) only."""
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not signs_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


class Authority:
    """The consortium's CA: an EC P-256 key and a self-signed certificate."""

    def __init__(self, key, cert):
        self.key, self.cert = key, cert

    @classmethod
    def create(cls, days: int) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "msa-fed consortium CA")])
        now = dt.datetime.now(dt.timezone.utc)
        public = key.public_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days + 365))  # outlives every certificate it signs
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(signs_certificates=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, folder: Path) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        key_file, cert_file = folder / "ca.key", folder / "ca.pem"
        if not key_file.is_file() or not cert_file.is_file():
            raise ConfigError(f"the consortium's CA ({key_file}, {cert_file}) is missing from the kit")
        if key_file.stat().st_mode & 0o077:
            raise ConfigError(f"{str(key_file)!r} is readable by others; chmod 600 it")
        try:
            key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        except ValueError:
            raise ConfigError(f"the consortium's CA in {str(folder)!r} cannot be read") from None
        return cls(key, cert)

    def pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    def issue(self, common_name: str, *, server: bool, dns=(), ips=(), days: int) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a leaf signed by this CA."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        san = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(signs_certificates=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _server_names(host: str) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) the registry's certificate carries for ``host``."""
    try:
        return [], [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    if host == "localhost":
        return ["localhost"], ["127.0.0.1", "::1"]
    return [host], []


def _default_listen(host: str, port: int) -> str:
    from msa_fed.control.transport.address import format_address

    try:
        ipaddress.ip_address(host)
        return format_address(host, port)
    except ValueError:
        return format_address("127.0.0.1" if host == "localhost" else "0.0.0.0", port)


def parse_sites(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ConfigError("--sites: give the site names, comma-separated (e.g. --sites north,east,west)")
    for name in names:
        check_site_name(name)
    if len(set(names)) != len(names):
        raise ConfigError(f"--sites names a site twice: {','.join(names)}")
    return names


def check_site_name(name: str) -> None:
    from msa_fed.control.registry.records import NAME_PATTERN

    if not NAME_PATTERN.fullmatch(name) or name == COORDINATOR_CN:
        raise ConfigError(
            f"site name {name!r} is not valid: 1-64 letters, digits, '_' or '-', starting with a letter "
            f"or digit (and not {COORDINATOR_CN!r})"
        )


# --------------------------------------------------------------------------- the kit


def _issue_token(db: Path, role: str, name: str) -> str:
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    with SqliteStore(db) as store:
        return Registry(store).issue_token(role, name)


def _write_registry(kit: Kit, ca: Authority) -> None:
    from msa_fed.control.transport.address import parse_address

    folder = _folder(kit.root / "registry")
    host, _ = parse_address(kit.registry, "--registry")
    dns, ips = _server_names(host)
    cert, key = ca.issue("msa-fed registry", server=True, dns=dns, ips=ips, days=kit.days)
    _public(folder / "ca.pem", ca.pem())
    _public(folder / "server.pem", cert)
    _private(folder / "server.key", key)
    _public(
        folder / "registry.toml",
        "# the registry of the consortium (msa-fed consortium init): msa-fed registry serve --config registry.toml\n"
        "# relative paths are relative to this file; the database holds token hashes only\n"
        f"listen = {_toml_str(kit.listen)}\n"
        'db = "registry.db"\n'
        'audit_log = "audit.jsonl"\n'
        'tls_cert = "server.pem"\n'
        'tls_key = "server.key"\n'
        "# mutual TLS: every client shows a certificate of this CA; a site's names the site\n"
        'tls_ca = "ca.pem"\n',
    )


def _site_toml(kit: Kit, name: str) -> str:
    return (
        f"# site {name} of the consortium (msa-fed consortium init); relative paths are relative to this file.\n"
        "# Put next to it: data.npz (X_labeled, y_labeled, X_unlabeled: never leaves this machine),\n"
        "# predictor.onnx (the site's frozen predictor) and unlabeled.npy (the sample it publishes), then:\n"
        "#   msa-fed site register --config site.toml\n"
        "#   msa-fed site publish --config site.toml\n"
        "#   msa-fed site serve --config site.toml\n"
        f"name = {_toml_str(name)}\n"
        f"registry = {_toml_str(kit.registry)}\n"
        'token_file = "token.txt"\n'
        'tls_ca = "ca.pem"\n'
        'tls_cert = "client.pem"\n'
        'tls_key = "client.key"\n'
        'data = "data.npz"\n'
        'predictor = "predictor.onnx"\n'
        'unlabeled = "unlabeled.npy"\n'
        'policy = "policy.toml"\n'
        'audit_log = "audit.jsonl"\n'
        'accept_jobs = "admin"\n'
        'seal_key = "site.key"\n'
        f"job_keys = {_toml_list([kit.job_key_fingerprint])}\n"
    )


def _policy_toml(kit: Kit, name: str) -> str:
    peers = [s for s in kit.sites if s != name]
    return (
        f'# site {name}\'s privacy policy (docs/OPERATIONS.md, "Site policy keys"); the site owns it.\n'
        "# peers: the sites this site federates with; a job naming any other site is refused.\n"
        "[limits]\n"
        f"peers = {_toml_list(peers)}\n"
    )


def _write_site(kit: Kit, ca: Authority, db: Path, name: str) -> str:
    """The site's folder; returns its sealing key's fingerprint."""
    from msa_fed.crypto.sealing import SiteKey

    folder = _folder(kit.root / "sites" / name)
    cert, key = ca.issue(name, server=False, dns=[name], days=kit.days)
    _public(folder / "ca.pem", ca.pem())
    _public(folder / "client.pem", cert)
    _private(folder / "client.key", key)
    _private(folder / "token.txt", (_issue_token(db, "site", name) + "\n").encode())
    seal = SiteKey.generate()
    seal.save(folder / "site.key")
    kit.site_fingerprints[name] = seal.public.fingerprint
    _public(folder / "site.toml", _site_toml(kit, name))
    _public(folder / "policy.toml", _policy_toml(kit, name))
    return seal.public.fingerprint


def _job_toml(kit: Kit) -> str:
    folder = kit.root / "coordinator"
    pins = [f"{s}={kit.site_fingerprints[s]}" for s in kit.sites]
    return (
        "# the consortium's job (msa-fed consortium init): msa-fed run --job job.toml\n"
        "# a job file's paths are the driver's machine's: these are where the kit was written\n"
        f"name = {_toml_str(JOB_NAME)}\n\n"
        "[registry]\n"
        f"address = {_toml_str(kit.registry)}\n"
        f"tls_ca = {_toml_str(str(folder / 'ca.pem'))}\n"
        f"tls_cert = {_toml_str(str(folder / 'client.pem'))}\n"
        f"tls_key = {_toml_str(str(folder / 'client.key'))}\n"
        f"admin_token_file = {_toml_str(str(folder / 'admin_token'))}\n\n"
        "[sealing]\n"
        f"job_key = {_toml_str(str(folder / 'job.key'))}\n"
        "# each site's sealing-key fingerprint, pinned: a key the registry lists otherwise is refused\n"
        f"sites = {_toml_list(pins)}\n\n"
        "[run]\n"
        'topology = "federated"\n'
        f"sites = {_toml_list(kit.sites)}\n"
    )


def _write_coordinator(kit: Kit, ca: Authority, db: Path) -> None:
    from msa_fed.crypto.sealing import JobKey

    folder = _folder(kit.root / "coordinator")
    cert, key = ca.issue(COORDINATOR_CN, server=False, dns=[COORDINATOR_CN], days=kit.days)
    _public(folder / "ca.pem", ca.pem())
    _public(folder / "client.pem", cert)
    _private(folder / "client.key", key)
    _private(folder / "admin_token", (_issue_token(db, "admin", "admin") + "\n").encode())
    job_key = JobKey.generate()
    job_key.save(folder / "job.key")
    kit.job_key_fingerprint = job_key.fingerprint


def init_kit(out, registry: str, sites: list[str], *, listen: str | None = None, days: int = 730) -> Kit:
    """Write the kit of a new consortium under ``out`` (see the module docstring)."""
    from msa_fed.control.transport.address import parse_address

    host, port = parse_address(registry, "--registry")
    if port == 0:
        raise ConfigError("--registry: give the port the registry will listen on (not 0)")
    if listen is not None:
        parse_address(listen, "--listen")
    if not isinstance(days, int) or days < 1 or days > 3650:
        raise ConfigError(f"--days must be an integer in 1..3650; got {days!r}")
    root = Path(out).expanduser().resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{str(root)!r} exists and is not an empty folder; the kit goes into a new one")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    kit = Kit(root, registry, listen or _default_listen(host, port), list(sites), "", days=days)
    own = _folder(root / "consortium")
    ca = Authority.create(days)
    _public(own / "ca.pem", ca.pem())
    _private(own / "ca.key", ca.key_pem())
    _write_registry(kit, ca)
    db = root / "registry" / "registry.db"
    _write_coordinator(kit, ca, db)
    _folder(root / "sites")
    os.chmod(root / "sites", 0o755)  # each site's own folder is 0700
    for name in sites:
        _write_site(kit, ca, db, name)
    _public(root / "coordinator" / "job.toml", _job_toml(kit))
    _tighten_db(db)
    kit.save()
    return kit


def _tighten_db(db: Path) -> None:
    for path in (db, Path(str(db) + "-wal"), Path(str(db) + "-shm")):
        if path.exists():
            os.chmod(path, 0o600)


def add_site(out, name: str) -> Kit:
    """A new site's folder in an existing kit: its certificate, token (issued into the kit's
    registry database), sealing key and policy; the job file pins it and every site's policy
    names it (the kit's copies: a site that has its folder already adds the peer itself)."""
    kit = Kit.load(out)
    check_site_name(name)
    if name in kit.sites:
        raise ConfigError(f"site {name!r} is in the kit already")
    db = kit.root / "registry" / "registry.db"
    if not db.is_file():
        raise ConfigError(f"the registry's database {str(db)!r} is not in the kit; a token cannot be issued here")
    ca = Authority.load(kit.root / "consortium")
    kit.sites.append(name)
    _write_site(kit, ca, db, name)
    for other in kit.sites:
        if other != name:
            (kit.root / "sites" / other / "policy.toml").write_text(_policy_toml(kit, other))
    job = kit.root / "coordinator" / "job.toml"
    job.write_text(_job_toml(kit))
    _tighten_db(db)
    kit.save()
    return kit


# --------------------------------------------------------------------------- command line


def _init(args) -> int:
    from msa_fed.control.transport.address import parse_address

    parse_address(args.registry, "--registry")
    kit = init_kit(args.out, args.registry, parse_sites(args.sites), listen=args.listen, days=args.days)
    root = kit.root
    print(f"consortium kit written to {root} (private keys and tokens mode 0600, each party's folder 0700)")
    print(f"  {root / 'registry'}: msa-fed registry serve --config registry.toml  (listens on {kit.listen})")
    for name in kit.sites:
        print(
            f"  {root / 'sites' / name}: add data.npz, predictor.onnx and unlabeled.npy, then "
            "msa-fed site register|publish|serve --config site.toml"
        )
    print(f"  {root / 'coordinator'}: msa-fed run --job {root / 'coordinator' / 'job.toml'}")
    print(f"  {root / 'consortium'}: the CA's key, for 'msa-fed consortium add-site'; give it to no party")
    print("give each party its own folder only, over a channel you trust")
    return 0


def _add_site(args) -> int:
    kit = add_site(args.out, args.name)
    root = kit.root
    others = [s for s in kit.sites if s != args.name]
    print(f"site {args.name} added: {root / 'sites' / args.name} (its token is in {root / 'registry' / 'registry.db'})")
    print(f"  the job file pins it: {root / 'coordinator' / 'job.toml'}")
    if others:
        print(
            f"  each of {', '.join(others)} adds {args.name!r} to [limits] peers of its policy.toml "
            "(the kit's copies have it) and restarts its 'msa-fed site serve'"
        )
    print(
        "  a registry started from an older copy of registry.db: copy the kit's registry.db over it while "
        "the registry is stopped"
    )
    return 0


def register(sub) -> None:
    from msa_fed.clitools import command_group

    group = command_group(sub, "consortium")
    init = group.add_parser(
        "init",
        help="write a start-up kit per party: CA and certificates (mutual TLS), tokens, sealing keys, "
        "registry.toml, site.toml per site, job.toml",
    )
    init.add_argument("out", metavar="OUT", help="a new (or empty) folder")
    init.add_argument("--registry", required=True, metavar="HOST:PORT", help="the address sites and jobs dial")
    init.add_argument("--sites", required=True, metavar="a,b,c", help="the sites' names, comma-separated")
    init.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="what the registry binds (default: HOST:PORT for an IP address, 127.0.0.1 for localhost, "
        "else 0.0.0.0:PORT)",
    )
    init.add_argument("--days", type=int, default=730, help="validity of the certificates (default 730 days)")
    init.set_defaults(func=_init)
    add = group.add_parser("add-site", help="add a site's start-up kit to an existing consortium kit")
    add.add_argument("out", metavar="OUT", help="the kit folder 'consortium init' wrote")
    add.add_argument("name", metavar="NAME", help="the new site's name")
    add.set_defaults(func=_add_site)
