"""TLS and mutual TLS end to end, with certificates generated in the test."""

from __future__ import annotations

import pytest
from control_helpers import make_pki

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.store import MemoryStore
from msa_fed.control.server import RegistryServer, TlsConfig
from msa_fed.errors import ConfigError, RegistryError, TlsError


@pytest.fixture(scope="module")
def pki():
    return make_pki()


@pytest.fixture(scope="module")
def other_pki():
    return make_pki("an unrelated CA")


@pytest.fixture
def registry():
    return Registry(MemoryStore())


def expect_tls_mistake(fn, *words):
    """A TLS mistake is a TlsError in words (never retried, never the TLS library's text)."""
    with pytest.raises(TlsError) as err:
        fn()
    text = str(err.value)
    assert "\n" not in text and "SSL" not in text and "UNAVAILABLE" not in text, text
    for word in words:
        assert word in text, (word, text)
    return err.value


def expect_code(fn, code):
    with pytest.raises(RegistryError) as err:
        fn()
    assert err.value.code == code
    assert "\n" not in str(err.value)
    return err.value


def test_tls_end_to_end(registry, pki, other_pki):
    token = registry.issue_token("site", "a")
    with RegistryServer(registry, "127.0.0.1:0", tls=TlsConfig(pki.server_cert, pki.server_key)) as server:
        assert server.mode == "TLS"
        for host in ("127.0.0.1", "localhost"):  # IP and DNS subject alternative names
            with RegistryClient(f"{host}:{server.port}", token, tls_ca=pki.ca, retries=0) as client:
                assert client.register("a").name == "a"
                assert client.health() == "SERVING"
        # a client that trusts another CA refuses the server
        with RegistryClient(server.address, token, tls_ca=other_pki.ca, retries=0, timeout=5) as client:
            expect_tls_mistake(lambda: client.heartbeat(), "is not signed by the CA in --tls-ca", "(unknown CA)")
        # a plaintext client against the TLS server fails cleanly, and the server survives
        with RegistryClient(server.address, token, insecure=True, retries=0, timeout=5) as client:
            expect_tls_mistake(lambda: client.heartbeat(), "speaks TLS, and --insecure is plaintext")
        with RegistryClient(server.address, token, tls_ca=pki.ca, retries=0) as client:
            assert client.heartbeat().server_time > 0


def test_mutual_tls(registry, pki, other_pki, tmp_path):
    token = registry.issue_token("site", "site-a")  # the client certificate's CN
    paths = pki.write(tmp_path)
    tls = TlsConfig.from_files(paths["server_cert"], paths["server_key"], paths["ca"])
    with RegistryServer(registry, "127.0.0.1:0", tls=tls) as server:
        assert server.mode == "mutual TLS"
        with RegistryClient(
            server.address,
            token,
            tls_ca=paths["ca"],
            tls_cert=paths["client_cert"],
            tls_key=paths["client_key"],
            retries=0,
        ) as client:
            assert client.register("site-a").name == "site-a"
        # no client certificate
        with RegistryClient(server.address, token, tls_ca=pki.ca, retries=0, timeout=5) as client:
            expect_tls_mistake(lambda: client.heartbeat(), "requires a client certificate (mutual TLS)")
        # a client certificate from a CA the server does not trust
        with RegistryClient(
            server.address,
            token,
            tls_ca=pki.ca,
            tls_cert=other_pki.client_cert,
            tls_key=other_pki.client_key,
            retries=0,
            timeout=5,
        ) as client:
            expect_tls_mistake(lambda: client.heartbeat(), "refused the client certificate --tls-cert", "not signed")
        # a good certificate does not replace the token
        with RegistryClient(
            server.address, None, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key, retries=0
        ) as client:
            expect_code(lambda: client.heartbeat(), "UNAUTHENTICATED")


def test_plaintext_is_loopback_only_and_explicit(registry, pki):
    for host in ("0.0.0.0", "10.1.2.3", "example.org", "::"):
        with pytest.raises(ConfigError, match="--insecure refuses"):
            RegistryServer(registry, f"[{host}]:0" if ":" in host else f"{host}:0", insecure=True)
    with pytest.raises(ConfigError, match="TLS is required"):
        RegistryServer(registry, "127.0.0.1:0")
    with pytest.raises(ConfigError, match="mutually exclusive"):
        RegistryServer(registry, "127.0.0.1:0", insecure=True, tls=TlsConfig(pki.server_cert, pki.server_key))
    with pytest.raises(ConfigError, match="only allowed towards loopback"):
        RegistryClient("10.1.2.3:7443", "t", insecure=True)
    for ok in ("127.0.0.1:0", "localhost:0", "[::1]:0"):
        RegistryServer(registry, ok, insecure=True)  # constructing is enough: the check is up front


def test_bad_pem_files_are_named(tmp_path, pki):
    paths = pki.write(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="--tls-cert .* is not PEM"):
        TlsConfig.from_files(junk, paths["server_key"])
    with pytest.raises(ConfigError, match="--tls-key .* is not a readable file"):
        TlsConfig.from_files(paths["server_cert"], tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="--tls-ca .* is not PEM"):
        TlsConfig.from_files(paths["server_cert"], paths["server_key"], junk)


def test_the_audit_log_shows_refused_calls_with_peer_and_certificate_but_no_failed_handshake(
    registry, pki, other_pki, tmp_path
):
    """What a real registry (mutual TLS, port 0, --audit-log) logs of the mistakes a party can
    make.  A connection refused in its TLS handshake (plaintext, no client certificate, one of
    another CA, a client that does not trust the registry's CA) makes no call: it leaves no line
    (gRPC's Python server tells nothing of it; docs/OPERATIONS.md says why) and the registry
    serves on.  Every call that reaches the registry is a line, refusals too, with the peer's
    address and the names of the client certificate that carried it: a token of another site, a
    revoked or forged token, a role the method does not take."""
    import json

    from msa_fed.control.audit import AuditLog

    token_a, token_b = registry.issue_token("site", "site-a"), registry.issue_token("site", "site-b")
    revoked = registry.issue_token("site", "site-c")
    assert registry.revoke_token("site", "site-c")
    forged = token_a[:-3] + ("aaa" if not token_a.endswith("aaa") else "bbb")
    cert_b, key_b = pki.client("site-b")
    log_path = tmp_path / "audit.jsonl"
    audit = AuditLog(log_path)
    tls = TlsConfig(pki.server_cert, pki.server_key, pki.ca)
    with RegistryServer(registry, "127.0.0.1:0", tls=tls, audit_log=audit) as server:

        def client(token, cert=pki.client_cert, key=pki.client_key, ca=pki.ca, **kw):
            return RegistryClient(
                server.address, token, tls_ca=ca, tls_cert=cert, tls_key=key, retries=0, timeout=5, **kw
            )

        mistakes = [
            (lambda: RegistryClient(server.address, token_a, insecure=True, retries=0, timeout=5), "speaks TLS"),
            (lambda: client(token_a, cert=None, key=None), "requires a client certificate"),
            (lambda: client(token_a, cert=other_pki.client_cert, key=other_pki.client_key), "refused the client"),
            (lambda: client(token_a, ca=other_pki.ca), "(unknown CA)"),
        ]
        for make, words in mistakes:
            with make() as c:
                expect_tls_mistake(lambda: c.heartbeat(), words)
        assert log_path.read_text() == ""  # no call reached the registry: nothing to log
        with client(token_a) as c:
            assert c.register("site-a").name == "site-a"  # it serves on
            expect_code(lambda: c.upload_combined_model(b"x", {}), "PERMISSION_DENIED")  # a site's token
        with client(token_b) as c:  # site-b's token on site-a's certificate
            expect_code(lambda: c.register("site-b"), "PERMISSION_DENIED")
        with client(token_b, cert=cert_b, key=key_b) as c:
            assert c.register("site-b").name == "site-b"
        for token in (revoked, forged):
            with client(token) as c:
                expect_code(lambda: c.heartbeat(), "UNAUTHENTICATED")
    audit.close()
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    seen = [(e["method"].rsplit("/", 1)[1], e["outcome"], e["certificate"], e["principal"]) for e in entries]
    site = lambda name, verified=True: {"role": "site", "name": name, "verified": verified}  # noqa: E731
    assert seen == [
        ("RegisterSite", "OK", ["site-a"], site("site-a")),
        ("UploadCombinedModel", "PERMISSION_DENIED", ["site-a"], site("site-a")),
        ("RegisterSite", "PERMISSION_DENIED", ["site-a"], site("site-b")),
        ("RegisterSite", "OK", ["site-b"], site("site-b")),
        ("Heartbeat", "UNAUTHENTICATED", ["site-a"], site("site-c", False)),
        ("Heartbeat", "UNAUTHENTICATED", ["site-a"], site("site-a", False)),
    ], seen
    for e in entries:
        assert e["peer"].startswith("ipv4:127.0.0.1:"), e
    assert "not site 'site-b' of the token" in entries[2]["details"]
