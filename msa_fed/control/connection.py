"""How a client reaches the registry: one connection value and the one channel builder that
holds the transport rule, used by :class:`msa_fed.control.client.RegistryClient` (sites, the CLI,
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from msa_fed.control.transport import MAX_MESSAGE_BYTES, is_loopback, parse_address
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
