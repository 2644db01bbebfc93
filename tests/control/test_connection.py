"""One connection value and one channel builder (msa_fed/control/transport/connection.py): the registry's
client and the relay's clients get their channels, and the TLS / loopback rule, from it."""

from __future__ import annotations

import grpc
import pytest
from control_helpers import make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.store import MemoryStore
from msa_fed.control.server import RegistryServer, TlsConfig
from msa_fed.control.transport.connection import KEY_LABELS, Connection
from msa_fed.errors import ConfigError
from msa_fed.federation import relay_client
from msa_fed.federation.relay_client import RelayClient


@pytest.fixture(scope="module")
def pki():
    return make_pki()


def health(channel: grpc.Channel) -> int:
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


REFUSED = [  # (options, what the refusal says, with command-line flags / with file keys)
    ({"insecure": True, "address": "10.1.2.3:7443"}, "--insecure would send the token in plaintext to '10.1.2.3'"),
    ({"insecure": True, "address": "example.org:7443"}, "only allowed towards loopback"),
    (
        {"insecure": True, "tls_ca": b"-----BEGIN"},
        "--insecure and --tls-ca/--tls-cert/--tls-key are mutually exclusive",
    ),
    ({"insecure": True, "tls_key": b"-----BEGIN"}, "mutually exclusive"),
    ({"tls_cert": b"-----BEGIN"}, "--tls-cert and --tls-key must be given together"),
    ({"tls_key": b"-----BEGIN"}, "--tls-cert and --tls-key must be given together"),
    ({"address": "no-port"}, "--registry must be HOST:PORT"),
]


@pytest.mark.parametrize(("options", "message"), REFUSED)
def test_every_client_refuses_what_the_rule_refuses(options, message):
    options = dict(options)
    address = options.pop("address", "127.0.0.1:7443")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Connection(address, "t", **options).open_channel()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RegistryClient(address, "t", **options)
    # the relay's clients name the keys of a configuration file
    file_message = message.replace("--registry", "registry").replace("--tls-", "tls_").replace("--insecure", "insecure")
    with pytest.raises(ConfigError, match=file_message.replace("(", r"\(").replace(")", r"\)")):
        relay_client.open_channel(address, **options)
    with pytest.raises(ConfigError, match=file_message.replace("(", r"\(").replace(")", r"\)")):
        RelayClient(address, "t", **options)


def test_plaintext_to_loopback_is_allowed_only_when_asked():
    registry = Registry(MemoryStore())
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        for host in ("127.0.0.1", "localhost"):
            address = f"{host}:{server.port}"
            assert health(Connection(address, insecure=True).open_channel()) == health_pb2.HealthCheckResponse.SERVING
            assert health(relay_client.open_channel(address, insecure=True)) == health_pb2.HealthCheckResponse.SERVING
        # without insecure the client speaks TLS: a plaintext server does not answer it
        with pytest.raises(grpc.RpcError) as err:
            health(Connection(server.address).open_channel(options=(("grpc.enable_retries", 0),)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_through_the_one_builder(pki, tmp_path):
    paths = pki.write(tmp_path)
    registry = Registry(MemoryStore())
    tls = TlsConfig.from_files(paths["server_cert"], paths["server_key"], paths["ca"])
    with RegistryServer(registry, "127.0.0.1:0", tls=tls) as server:
        assert server.mode == "mutual TLS"
        mutual = {"tls_ca": paths["ca"], "tls_cert": paths["client_cert"], "tls_key": paths["client_key"]}
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health(Connection(server.address, **mutual).open_channel()) == serving
        assert health(relay_client.open_channel(server.address, **mutual)) == serving
        # a client without a certificate is refused by the server's TLS handshake
        with pytest.raises(grpc.RpcError) as err:
            health(Connection(server.address, tls_ca=pki.ca).open_channel())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # the certificate's name is checked: a wrong server_name fails, the right one passes
        with pytest.raises(grpc.RpcError):
            health(Connection(server.address, server_name="not-the-registry", **mutual).open_channel())
        assert health(Connection(server.address, server_name="localhost", **mutual).open_channel()) == serving


def test_the_token_and_the_key_never_show_in_a_repr():
    conn = Connection("registry:7443", "mft1.site.a.secret", tls_cert=b"CERT", tls_key=b"PRIVATE KEY")
    assert "secret" not in repr(conn) and "PRIVATE" not in repr(conn) and "registry:7443" in repr(conn)
    assert conn.metadata() == (("authorization", "Bearer mft1.site.a.secret"),)
    assert Connection("registry:7443").metadata() == ()
    assert set(KEY_LABELS) == {"address", "insecure", "tls_ca", "tls_cert", "tls_key"}


def test_a_shared_client_is_one_connection_reopened_only_after_it_broke():
    """SharedClient: every borrower gets the same client; a call that finds the registry away
    retires it (closed once its last borrower is done) and the next borrower reaches the
    restarted registry over a new connection; a refusal keeps the connection."""
    from msa_fed.control.registry.client import SharedClient
    from msa_fed.errors import RegistryError

    registry = Registry(MemoryStore())
    token = registry.issue_token("admin", "admin")
    opened: list[RegistryClient] = []
    first = RegistryServer(registry, "127.0.0.1:0", insecure=True).start()
    address = first.address

    def open_client():
        opened.append(RegistryClient(address, token, insecure=True, retries=0, timeout=5))
        return opened[-1]

    shared = SharedClient(open_client)
    with shared() as a, shared() as b:
        assert a is b and a.list_sites() == []
    with pytest.raises(RegistryError, match="NOT_FOUND"), shared() as c:
        c.get_site("nobody")  # a refusal: the connection stays
    first.stop(grace=0)
    with shared() as held:  # a borrower that outlives the failure below
        with pytest.raises(RegistryError) as err, shared() as c:
            c.list_sites()
        assert err.value.code == "UNAVAILABLE" and len(opened) == 1
        second = RegistryServer(registry, address, insecure=True).start()
        with shared() as d:  # a new connection reaches the restarted registry at once: no retry,
            # though the old one (held, in gRPC's reconnect backoff) is still open
            assert d is not held and d.list_sites() == [] and len(opened) == 2
        assert held.with_retries(6).health() == "SERVING"  # the retired one is open while borrowed
    with pytest.raises(ValueError, match="closed"):  # and closed once its last borrower is done
        held.health()
    shared.close()
    with pytest.raises(ValueError):
        opened[1].health()
    second.stop(grace=0)
