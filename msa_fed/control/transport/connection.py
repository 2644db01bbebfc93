"""How a client reaches the registry: one connection value and the one channel builder that
holds the transport rule, used by :class:`msa_fed.control.registry.client.RegistryClient` (sites, the CLI,
the job) and :mod:`msa_fed.federation.relay_client` (the relay's job and site sides).

The rule: TLS by default, checking the registry's certificate against ``tls_ca`` (None: the
system roots; ``server_name`` when the certificate names another host); the client presents
``tls_cert`` / ``tls_key`` (mutual TLS) when given, always both or neither; plaintext only with
``insecure``, only towards a loopback address, and never together with TLS files.  Every refusal
is a :class:`ConfigError` raised before any connection is made, naming the caller's option.

    conn = Connection("registry.example.org:7443", token, tls_ca="ca.pem",
                      tls_cert="site.pem", tls_key="site.key")
    channel = conn.open_channel()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from msa_fed.control.transport.address import MAX_MESSAGE_BYTES, is_loopback, parse_address
from msa_fed.errors import ConfigError

MAX_PEM_BYTES = 1 << 20  # a certificate chain or a key is a few KiB

#: how a refusal names each option: command-line flags (the default) or the keys of a
#: configuration file (``site.toml``, the relay's callers)
FLAG_LABELS = {
    "address": "--registry",
    "insecure": "--insecure",
    "tls_ca": "--tls-ca",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
}
KEY_LABELS = {
    "address": "registry",
    "insecure": "insecure",
    "tls_ca": "tls_ca",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
}


def read_pem(value: Any, flag: str) -> bytes | None:
    """PEM bytes from bytes or a file path (None stays None); ConfigError naming ``flag``."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} is not a readable file; expected a PEM file")
    if path.stat().st_size > MAX_PEM_BYTES:
        raise ConfigError(f"{flag} {str(path)!r} is larger than {MAX_PEM_BYTES} bytes; expected a PEM file")
    data = path.read_bytes()
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {str(path)!r} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class Connection:
    """Everything a client needs to reach the registry.

    address : "HOST:PORT" of the registry.
    token : the bearer token sent with every call (None sends none); never shown by ``repr``.
    insecure : plaintext; only towards a loopback address.
    tls_ca : PEM (bytes or path) of the CA that signed the registry's certificate; None: system roots.
    tls_cert, tls_key : the client's certificate and key (mutual TLS); both or neither.
    server_name : the name to check the registry's certificate against, when not the host of ``address``.
    timeout : seconds per unary call.
    """

    address: str
    token: str | None = field(default=None, repr=False)
    insecure: bool = False
    tls_ca: Any = None
    tls_cert: Any = None
    tls_key: Any = field(default=None, repr=False)
    server_name: str | None = None
    timeout: float = 30.0

    def check(self, labels: dict[str, str] = FLAG_LABELS) -> tuple[str, int]:
        """The transport rule (see the module docstring); returns (host, port) of the address."""
        host, port = parse_address(self.address, labels["address"])
        insecure, ca, cert, key = (labels[k] for k in ("insecure", "tls_ca", "tls_cert", "tls_key"))
        if self.insecure:
            if self.tls_ca is not None or self.tls_cert is not None or self.tls_key is not None:
                raise ConfigError(f"{insecure} and {ca}/{cert}/{key} are mutually exclusive (plaintext or TLS)")
            if not is_loopback(host):
                raise ConfigError(
                    f"{insecure} would send the token in plaintext to {host!r}; it is only allowed "
                    "towards loopback (127.0.0.1, ::1, localhost)"
                )
        elif (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"{cert} and {key} must be given together")
        return host, port

    def open_channel(
        self, labels: dict[str, str] = FLAG_LABELS, options: tuple[tuple[str, Any], ...] = ()
    ) -> grpc.Channel:
        """A gRPC channel to the registry under the transport rule (the only place one is built)."""
        self.check(labels)
        opts: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a channel of its own connection: by default gRPC shares one connection among a
            # process's channels to the same address, and a connection that found the registry
            # away waits out its reconnect backoff (seconds, growing) before it tries again, so a
            # new channel (SharedClient's after a failure, a site's next session) would not reach
            # a restarted registry until then; measured: 9 s after a 30 s outage
            ("grpc.use_local_subchannel_pool", 1),
            *options,
        ]
        if self.insecure:
            return grpc.insecure_channel(self.address, options=opts)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.tls_ca, labels["tls_ca"]),
            private_key=read_pem(self.tls_key, labels["tls_key"]),
            certificate_chain=read_pem(self.tls_cert, labels["tls_cert"]),
        )
        return grpc.secure_channel(self.address, credentials, options=opts)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the token."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


# --------------------------------------------------------------------------- TLS mistakes in words

#: how long the probe waits for the registry at each step (it runs once, after a call failed)
PROBE_TIMEOUT_S = 5.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
#: OpenSSL's X509_V_ERR codes the probe names
_V_EXPIRED, _V_NOT_YET = 10, 9
_V_UNKNOWN_ISSUER = (2, 7, 18, 19, 20, 21)  # 7: signed by another key of the same name
_V_NAME = (62, 64)


def _label(labels: dict[str, str], key: str, value: Any = None) -> str:
    """``tls_ca '/srv/ca.pem'``: the option and, when it is a file, the file."""
    name = labels.get(key, key)
    return f"{name} {str(value)!r}" if isinstance(value, (str, Path)) else name


def _insecure(labels: dict[str, str]) -> str:
    """``--insecure`` (a flag) or ``insecure = true`` (a file's key)."""
    name = labels["insecure"]
    return name if name.startswith("-") else f"{name} = true"


def _server_names(der: bytes | None) -> str:
    if not der:
        return "no name"
    try:
        from cryptography import x509

        cert = x509.load_der_x509_certificate(der)
        names: list[str] = []
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names += san.get_values_for_type(x509.DNSName)
            names += [str(a) for a in san.get_values_for_type(x509.IPAddress)]
        except x509.ExtensionNotFound:
            pass
        return ", ".join(names[:6]) or "no subjectAltName"
    except ValueError:
        return "names that cannot be read"


def _speaks_plaintext_h2(host: str, port: int) -> bool:
    """Whether the server at host:port answers a plaintext HTTP/2 preface with an HTTP/2 frame."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(_H2_PREFACE)
            head = sock.recv(9)
    except OSError:
        return False
    return len(head) == 9 and head[3] in (0x04, 0x07)  # SETTINGS or GOAWAY


def _speaks_tls(host: str, port: int) -> bool:
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            with ctx.wrap_socket(sock, server_hostname=host):
                return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc).upper()  # the server answered in TLS (an alert is TLS too)
    except OSError:
        return False


def diagnose_tls(conn: Connection, labels: dict[str, str] = FLAG_LABELS) -> str | None:
    """Why a connection to ``conn.address`` fails at the TLS layer, in words naming the option and
    the file to fix; None when TLS is not the problem (nothing listens, the network is away, or the
    handshake succeeds).  One probe with Python's ``ssl`` (a few seconds at most), run after a gRPC
    call failed: gRPC reports every TLS mistake as UNAVAILABLE with the TLS library's text."""
    import socket
    import ssl

    try:
        host, port = parse_address(conn.address, labels["address"])
    except ConfigError:
        return None
    where = f"the registry {conn.address}"
    if conn.insecure:
        if _speaks_tls(host, port):
            return (
                f"{where} speaks TLS, and {_insecure(labels)} is plaintext: drop it and give "
                f"{labels['tls_ca']} (the CA of the registry's certificate; a consortium kit's ca.pem)"
            )
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    try:
        ca = read_pem(conn.tls_ca, labels["tls_ca"])
        if ca is not None:
            ctx.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        else:
            ctx.load_default_certs()
        if conn.tls_cert is not None and conn.tls_key is not None:
            _load_client_cert(ctx, conn, labels)
    except (ConfigError, ssl.SSLError, ValueError) as exc:
        return str(exc) if isinstance(exc, ConfigError) else None
    ca_label = _label(labels, "tls_ca", conn.tls_ca) if conn.tls_ca is not None else "the system's CA roots"
    try:
        sock = socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S)
    except OSError:
        return None  # nothing listens, or the network is away: not a TLS mistake
    with sock:
        try:
            tls = ctx.wrap_socket(sock, server_hostname=conn.server_name or host)
        except ssl.SSLCertVerificationError as exc:
            code = getattr(exc, "verify_code", None)
            if code in _V_NAME:
                der = _peer_der(host, port)
                return (
                    f"{where}'s certificate names {_server_names(der)}, not {conn.server_name or host!r}: "
                    f"dial it by a name it carries ({labels['address']}), or ask the registry's operator for a "
                    "certificate that names this host"
                )
            if code in (_V_EXPIRED, _V_NOT_YET):
                when = "has expired" if code == _V_EXPIRED else "is not valid yet (a clock or a date is wrong)"
                return f"{where}'s certificate {when}: its operator renews it (registry serve warns at start)"
            if code in _V_UNKNOWN_ISSUER:
                return (
                    f"{where}'s certificate is not signed by the CA in {ca_label} (unknown CA): "
                    f"{labels['tls_ca']} must be the CA that signed the registry's certificate (a consortium "
                    "kit's ca.pem)"
                )
            return f"{where}'s certificate was refused ({exc.verify_message}); check {ca_label}"
        except ssl.SSLError as exc:
            if _speaks_plaintext_h2(host, port):
                return (
                    f"{where} speaks plaintext (it runs with --insecure), not TLS: give {_insecure(labels)} "
                    "towards a loopback registry, or have its operator serve TLS"
                )
            return _alert_words(getattr(exc, "reason", None) or str(exc), where, conn, labels)
        except OSError:
            return None
        with tls:
            # TLS 1.3: the server refuses a client certificate after the handshake (an alert, or
            # the connection closed, on a read); a healthy server keeps the connection open
            deadline = time.monotonic() + 2.0
            try:
                tls.sendall(_H2_PREFACE)
                while time.monotonic() < deadline:
                    tls.settimeout(max(0.05, deadline - time.monotonic()))
                    if not tls.recv(4096):
                        return _alert_words("CLOSED", where, conn, labels)
            except ssl.SSLError as exc:
                return _alert_words(getattr(exc, "reason", None) or str(exc), where, conn, labels)
            except (ConnectionResetError, BrokenPipeError):
                return _alert_words("CLOSED", where, conn, labels)
            except OSError:  # the read timed out: the connection stays open, TLS is fine
                return None
    return None


def _peer_der(host: str, port: int) -> bytes | None:
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                return tls.getpeercert(binary_form=True)
    except OSError:
        return None


def _alert_words(reason: str, where: str, conn: Connection, labels: dict[str, str]) -> str | None:
    """The words for the TLS alert ``reason`` (OpenSSL's name; "CLOSED": the server hung up)."""
    reason = reason.upper()
    cert = _label(labels, "tls_cert", conn.tls_cert)
    refused = "HANDSHAKE_FAILURE" in reason or reason == "CLOSED"
    if "CERTIFICATE_REQUIRED" in reason or (conn.tls_cert is None and refused):
        return (
            f"{where} requires a client certificate (mutual TLS) and none was given: set "
            f"{labels['tls_cert']} and {labels['tls_key']} (a consortium kit's client.pem and client.key)"
        )
    if reason == "CLOSED" or any(
        k in reason for k in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR")
    ):
        return (
            f"{where} refused the client certificate {cert}: it is not signed by the CA the registry trusts "
            f"(give the certificate the consortium issued for this party, with its key in {labels['tls_key']})"
        )
    if "CERTIFICATE_EXPIRED" in reason:
        return f"{where} refused the client certificate {cert}: it has expired; ask the consortium for a new one"
    if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason or "UNEXPECTED_EOF" in reason:
        return f"{where} does not speak TLS on this port: check {labels['address']} and whether it runs with --insecure"
    return None


def _load_client_cert(ctx, conn: Connection, labels: dict[str, str]) -> None:
    """The client certificate and key into ``ctx`` (files as given; bytes through a private temporary file)."""
    import os
    import ssl
    import tempfile

    paths, temps = [], []
    try:
        for key in ("tls_cert", "tls_key"):
            value = getattr(conn, key)
            if isinstance(value, bytes):
                fd, path = tempfile.mkstemp(prefix="msa-fed-probe-")
                with os.fdopen(fd, "wb") as fh:
                    fh.write(value)
                temps.append(path)
                paths.append(path)
            else:
                paths.append(str(value))
        try:
            ctx.load_cert_chain(paths[0], paths[1])
        except (ssl.SSLError, OSError):
            raise ConfigError(
                f"{_label(labels, 'tls_cert', conn.tls_cert)} and {_label(labels, 'tls_key', conn.tls_key)} "
                "are not a certificate and its private key (PEM) that belong together"
            ) from None
    finally:
        for path in temps:
            os.unlink(path)
