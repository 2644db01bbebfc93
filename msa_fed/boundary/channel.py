"""The direct data channel between the coordinator and the site actors.

A round of the DC solver (or a step of data-parallel SGD) is one small request to every site and
one small answer back.  Through Ray's actor calls such a round costs ~10 ms for 8 sites on a
2-core machine, most of it Ray's own task submission; over a socket it costs well under 1 ms
(BENCHMARKS.md).  So the Ray runtime starts the actors, places them on their sites' nodes,
restarts them and carries their setup through Ray, and the hot calls
(:data:`CHANNEL_METHODS`) go over this channel:

- the site's actor listens on its node (:func:`serve_channel`, a thread blocked in
  ``accept``/``recv`` between rounds: no polling), the coordinator connects (:class:`ChannelClient`);
- ``mode="tls"`` (the default): mutual TLS 1.3 with ephemeral per-run certificates.  The
  coordinator makes a key pair and self-signed certificate for the run and hands the
  certificate to the site through Ray's authenticated actor call; the site makes its own and
  answers with its certificate the same way.  Each end then accepts exactly the other's
  certificate (pinned, compared byte for byte after the handshake), so only this run's
  coordinator can talk to the site, and only the real site can answer; private keys never leave
  the process that made them.
- ``mode="plain"``: no TLS, only on loopback (the site binds 127.0.0.1 and the coordinator must
  run on the same node); an explicit choice for single-machine research runs.
- messages are encoded by :mod:`msa_fed.boundary.wire` (the protobuf schema of
  ``protos/msa_fed/v1/boundary.proto``, one message per length-prefixed frame, never pickle) and
  must be boundary messages of the allowed direction.

Any failure of the channel (the actor restarted, a socket error, a time-out) falls back to the
Ray call for that site and round, with Ray's restart and replay logic; the channel is reopened
afterwards.  The answers are bit for bit those of the Ray path (same worker methods).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import struct
import tempfile
import threading

from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.node import current_node_id
from msa_fed.errors import ConfigError

log = logging.getLogger(__name__)

#: the calls that go over the channel: pure functions of the site's state, safe to repeat
CHANNEL_METHODS = frozenset({"dc_evaluate", "classifier_loss_grad", "max_bound", "ping"})
MODES = ("tls", "plain", "off")
#: the largest frame either end accepts (a request or answer is O(p^2) or O(parameters))
MAX_FRAME_BYTES = 1 << 28
HANDSHAKE_TIMEOUT_S = 10.0
#: on a site's node: "LOW-HIGH", the TCP ports its channel may listen on (default: any free port)
PORTS_ENV = "MSA_FED_CHANNEL_PORTS"
#: connections a site serves at once (the coordinator needs one; the rest wait in the handshake)
MAX_CONNECTIONS = 8
_LEN = struct.Struct("!Q")


class ChannelError(OSError):
    """The channel cannot carry this call (closed, broken, timed out, bad frame)."""


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"data_channel must be one of {list(MODES)}; got {mode!r}")
    return mode


# ------------------------------------------------------------------ identities
def make_identity(common_name: str) -> tuple[str, bytes]:
    """(certificate PEM text, private key PEM): EC P-256, self-signed, valid one day, for one run."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64] or "msa-fed")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii"), key_pem


def _der(pem: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem)


def _context(server: bool, cert_pem: str, key_pem: bytes, peer_cert_pem: str) -> ssl.SSLContext:
    """A TLS 1.3 context presenting (cert, key) and trusting only ``peer_cert_pem``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if not server:
        ctx.check_hostname = False  # the peer is pinned by its exact certificate instead
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=peer_cert_pem)
    folder = tempfile.mkdtemp(prefix="msa-fed-chan-")  # 0700; the key file lives for one call
    try:
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert_path, "w", encoding="ascii") as f:
            f.write(cert_pem)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        ctx.load_cert_chain(cert_path, key_path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return ctx


def _check_peer(sock, peer_cert_pem: str):
    if isinstance(sock, ssl.SSLSocket) and sock.getpeercert(binary_form=True) != _der(peer_cert_pem):
        raise ssl.SSLError("the peer presented a certificate other than the pinned one")


# ------------------------------------------------------------------ framing
def _send_frame(sock, payload: bytes):
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError("the connection was closed")
        got += k
    return bytes(buf)


def _recv_frame(sock) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME_BYTES:
        raise ChannelError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return _recv_exact(sock, n)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ------------------------------------------------------------------ site side
class ChannelServer:
    """Serves :data:`CHANNEL_METHODS` of ``target`` (a site worker) to the pinned coordinator."""

    def __init__(self, target, name: str, offer: m.ChannelOffer, host: str):
        check_mode(offer.mode)
        if offer.mode == "off":
            raise ConfigError("data_channel 'off' opens no channel")
        if offer.mode == "plain":
            host = "127.0.0.1"
        self.target, self.name, self.mode = target, name, offer.mode
        self._peer = offer.peer_cert
        self.cert = ""
        self._ctx = None
        if self.mode == "tls":
            if not offer.peer_cert:
                raise ConfigError("a TLS data channel needs the coordinator's certificate")
            self.cert, key = make_identity(f"msa-fed site {name}")
            self._ctx = _context(True, self.cert, key, offer.peer_cert)
        self._lock = threading.Lock()  # one call at a time into the worker
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._listener = _listen(host)
        self.host, self.port = self._listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"msa-fed-channel-{name}", daemon=True).start()

    def address(self) -> m.ChannelAddress:
        return m.ChannelAddress(host=str(self.host), port=int(self.port), cert=self.cert, node_id=current_node_id())

    def close(self):
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept_loop(self):
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many open connections: a stale or hostile peer, not ours
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                conn = self._ctx.wrap_socket(conn, server_side=True)
                _check_peer(conn, self._peer)
                conn.settimeout(None)
            while not self._closed:
                frame = _recv_frame(conn)
                _send_frame(conn, self._answer(frame))
        except (OSError, ssl.SSLError, ChannelError):
            pass  # the coordinator went away, or was not the pinned one
        finally:
            self._slots.release()
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, frame: bytes) -> bytes:
        try:
            method, msg = wire.decode(frame, wire.REQUESTS)
            if method not in CHANNEL_METHODS or not hasattr(self.target, method):
                raise wire.WireError(f"{method!r} is not served over the data channel")
            with self._lock:
                handle = getattr(self.target, "handle", None)  # a site's one entry point, where it has one
                out = handle(method, msg) if handle is not None else getattr(self.target, method)(msg)
            return wire.encode(method, out, wire.RESPONSES)
        except Exception as exc:  # noqa: BLE001 - reported by type name; the coordinator retries through Ray
            return wire.encode_failure(exc)


def port_range() -> range | None:
    """The ports of ``$MSA_FED_CHANNEL_PORTS`` ("LOW-HIGH", inclusive), or None when unset."""
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return None
    low, sep, high = spec.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        lo = hi = -1
    if not (1 <= lo <= hi <= 65535):
        raise ConfigError(f"{PORTS_ENV}={spec!r} on this node: expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535")
    return range(lo, hi + 1)


def _listen(host: str) -> socket.socket:
    """A listening socket on ``host``: any free port, or the first free one of the node's range."""
    ports = port_range()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a node's Ray IP may be IPv6
    if ports is None:
        return socket.create_server((host, 0), family=family)
    for port in ports:
        try:
            return socket.create_server((host, port), family=family)
        except OSError:
            continue
    raise OSError(f"no free port for the data channel in {PORTS_ENV}={ports.start}-{ports.stop - 1}")


def node_ip() -> str:
    """The address other nodes reach this one at (Ray's node IP), or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


def serve_channel(target, name: str, offer: m.ChannelOffer) -> m.ChannelAddress:
    """Open (or reopen) ``target``'s channel server; its address and certificate."""
    old = getattr(target, "_channel_server", None)
    if old is not None:
        old.close()
    server = ChannelServer(target, name, offer, node_ip())
    target._channel_server = server
    return server.address()


# ------------------------------------------------------------------ coordinator side
class ChannelClient:
    """The coordinator's connection to one site actor's channel server."""

    def __init__(
        self,
        address: m.ChannelAddress,
        mode: str,
        identity: tuple[str, bytes] | None,
        timeout_s: float,
        connect_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ):
        check_mode(mode)
        if mode == "plain" and not _is_loopback(address.host):
            raise ConfigError(
                f"a plaintext data channel is allowed only on loopback, not to {address.host}; use data_channel='tls'"
            )
        sock = socket.create_connection((address.host, address.port), timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if mode == "tls":
                if identity is None or not address.cert:
                    raise ConfigError("a TLS data channel needs both certificates")
                ctx = _context(False, identity[0], identity[1], address.cert)
                sock = ctx.wrap_socket(sock)
                _check_peer(sock, address.cert)
            sock.settimeout(timeout_s)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def send(self, method: str, msg) -> None:
        if method not in CHANNEL_METHODS:
            raise ValueError(f"{method!r} does not go over the data channel")
        try:
            _send_frame(self.sock, wire.encode(method, msg, wire.REQUESTS))
        except OSError as exc:  # ssl.SSLError included
            raise ChannelError(f"send failed: {exc}") from None

    def receive(self, method: str):
        """The answer to the last request; :class:`wire.RemoteError` if the site raised."""
        try:
            got, out = wire.decode(_recv_frame(self.sock), wire.RESPONSES)
        except wire.WireError as exc:
            raise ChannelError(f"bad answer: {exc}") from None
        except ChannelError:
            raise
        except OSError as exc:  # ssl.SSLError and socket.timeout are OSErrors too
            raise ChannelError(f"receive failed: {type(exc).__name__}: {exc}") from None
        if isinstance(out, wire.RemoteError):
            raise out
        if got != method:
            raise ChannelError(f"answer to {got!r} while waiting for {method!r}")
        return out

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
