"""Transport helpers shared by the registry's server and client: addresses and message sizes."""

from __future__ import annotations

import ipaddress
from typing import Any

from msa_fed.errors import ConfigError

MAX_MESSAGE_BYTES = 4 * 2**20 + 2**16  # uploads arrive in chunks of at most 1 MiB


def parse_address(address: str, flag: str = "--listen") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6) into (host, port)."""
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"{flag} must be HOST:PORT; got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 <= port <= 65535:
        raise ConfigError(f"{flag} must be HOST:PORT with a port in 0..65535; got {address!r}")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: the transport options of a connection, as every configuration that makes one names them
TRANSPORT = ("insecure", "tls_ca", "tls_cert", "tls_key", "server_name")


def transport_of(config: Any) -> dict[str, Any]:
    """The :data:`TRANSPORT` options of ``config`` (a site.toml, a job file, parsed flags)."""
    return {name: getattr(config, name) for name in TRANSPORT}
