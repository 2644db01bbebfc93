"""Authentication and authorisation matrix over a real server on port 0 (both stores)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from control_helpers import linear_onnx
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.registry.store import MemoryStore
from msa_fed.control.server import RegistryServer
from msa_fed.errors import RegistryError

X = np.arange(12, dtype=np.float32).reshape(4, 3)
PREDICTOR = linear_onnx([1.0, 2.0, 3.0])

# method -> call made by (or about) site 'a'
CALLS = {
    "RegisterSite": lambda c: c.register("a"),
    "Heartbeat": lambda c: c.heartbeat("a"),
    "GetSite": lambda c: c.get_site("a"),
    "ListSites": lambda c: c.list_sites(),
    "DeregisterSite": lambda c: c.deregister("a"),
    "UploadPredictor": lambda c: c.upload_predictor(PREDICTOR, upload_id="p1"),
    "UploadSample": lambda c: c.upload_sample(X, upload_id="s1"),
    "DownloadPredictor": lambda c: c.download_predictor("a"),
    "DownloadSample": lambda c: c.download_sample("a"),
    "UploadCombinedModel": lambda c: c.upload_combined_model(b"model", {"z": [1.0]}, upload_id="m1"),
    "DownloadCombinedModel": lambda c: c.download_combined_model(),
}
SITE_ONLY = {"RegisterSite", "Heartbeat", "UploadPredictor", "UploadSample"}
ADMIN_ONLY = {"UploadCombinedModel", "ListSites"}
NAMES_A_SITE = {"RegisterSite", "Heartbeat", "GetSite", "DeregisterSite", "DownloadPredictor", "DownloadSample"}


@pytest.fixture(scope="module", params=["memory", "sqlite"])
def env(request, tmp_path_factory):
    store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path_factory.mktemp("auth") / "r.db")
    reg = Registry(store)
    tok = {name: reg.issue_token("site", name) for name in ("a", "b", "revoked")}
    tok["admin"] = reg.issue_token("admin", "admin")
    reg.revoke_token("site", "revoked")
    with RegistryServer(reg, "127.0.0.1:0", insecure=True) as server:
        with RegistryClient(server.address, tok["a"], insecure=True) as a:
            a.register("a")
            a.upload_predictor(PREDICTOR, upload_id="p1")
            a.upload_sample(X, upload_id="s1")
        with RegistryClient(server.address, tok["b"], insecure=True) as b:
            b.register("b")
        with RegistryClient(server.address, tok["admin"], insecure=True) as admin:
            admin.upload_combined_model(b"model", {"z": [1.0]}, upload_id="m1")
        yield server, tok
    store.close()


def call(server, token, method):
    with RegistryClient(server.address, token, insecure=True, retries=0) as client:
        return CALLS[method](client)


def code_of(server, token, method) -> str:
    try:
        call(server, token, method)
    except RegistryError as exc:
        return exc.code
    return "OK"


def wrong_secret(token: str) -> str:
    head, secret = token.rsplit(".", 1)
    return f"{head}.{'A' if secret[0] != 'A' else 'B'}{secret[1:]}"


@pytest.mark.parametrize("method", sorted(CALLS))
def test_bad_credentials_are_unauthenticated(env, method):
    server, tok = env
    for token in (
        None,
        "garbage",
        "mft1.site.a.",
        wrong_secret(tok["a"]),
        tok["revoked"],
        tok["a"].replace(".site.a.", ".site.b."),
        tok["admin"].replace(".admin.admin.", ".site.admin."),
    ):
        assert code_of(server, token, method) == "UNAUTHENTICATED", (method, token and token[:12])


@pytest.mark.parametrize("method", sorted(NAMES_A_SITE))
def test_another_sites_token_is_denied(env, method):
    server, tok = env
    assert code_of(server, tok["b"], method) == "PERMISSION_DENIED"


@pytest.mark.parametrize("method", sorted(CALLS))
def test_roles(env, method):
    server, tok = env
    if method == "DeregisterSite":
        # the right token passes: on a throwaway site so the fixture stays intact
        reg_tok = env_site(server, tok, "gone")
        with RegistryClient(server.address, reg_tok, insecure=True) as c:
            assert c.deregister("gone") is True
        return
    site_code = code_of(server, tok["a"], method)
    admin_code = code_of(server, tok["admin"], method)
    assert site_code == ("PERMISSION_DENIED" if method in ADMIN_ONLY else "OK")
    assert admin_code == ("PERMISSION_DENIED" if method in SITE_ONLY else "OK")


def env_site(server, tok, name):
    # the registry object is reachable through the server; issuing tokens is not an RPC
    token = server.registry.issue_token("site", name)
    with RegistryClient(server.address, token, insecure=True) as c:
        c.register(name)
    return token


def test_a_site_token_in_place_of_the_admin_token_says_so(env):
    """A job run with a site token is told it used the wrong token (it once read "sites not registered")."""
    server, tok = env
    for method in sorted(ADMIN_ONLY):
        with pytest.raises(RegistryError) as err:
            call(server, tok["b"], method)
        assert err.value.code == "PERMISSION_DENIED"
        assert "this RPC needs the admin token; a site token was given" in str(err.value), method
    with RegistryClient(server.address, tok["b"], insecure=True) as b:
        assert b.get_site().name == "b"  # a site reads its own record
    with RegistryClient(server.address, tok["admin"], insecure=True) as admin:
        names = {s.name for s in admin.list_sites()}
    assert {"a", "b"} <= names
    for method in sorted(SITE_ONLY):
        with pytest.raises(RegistryError) as err:
            call(server, tok["admin"], method)
        assert "this RPC needs a site token; the admin token was given" in str(err.value), method


def test_revoked_and_replaced_tokens_are_reported_as_revoked(env):
    server, tok = env
    with pytest.raises(RegistryError) as err:
        call(server, tok["revoked"], "Heartbeat")
    assert str(err.value) == "UNAUTHENTICATED: the token of site 'revoked' was revoked (or replaced by a newer one)"
    old = server.registry.issue_token("site", "rotated")
    server.registry.issue_token("site", "rotated")  # replaces the first
    with pytest.raises(RegistryError) as err:
        call(server, old, "GetSite")
    assert "was revoked" in str(err.value)
    # a wrong secret for a principal with revoked tokens is still just invalid
    with pytest.raises(RegistryError) as err:
        call(server, wrong_secret(tok["revoked"]), "Heartbeat")
    assert str(err.value) == "UNAUTHENTICATED: invalid token for site 'revoked'"


def test_a_method_without_an_access_rule_is_refused(env):
    """A service added without rules is not reachable: the table fails closed."""
    from msa_fed.control.auth import METHOD_RULES, AuthInterceptor

    server, tok = env
    rules = {m: r for m, r in METHOD_RULES.items() if not m.endswith("/GetSite")}
    interceptor = AuthInterceptor(server.registry, rules=rules)
    handler = interceptor.intercept_service(
        lambda details: grpc.unary_unary_rpc_method_handler(lambda req, ctx: "reached"),
        type("Details", (), {"method": "/msa_fed.v1.Registry/GetSite"})(),
    )

    class Context:
        def invocation_metadata(self):
            return (("authorization", f"Bearer {tok['admin']}"),)

        def peer(self):
            return "test"

        def abort(self, code, details):
            raise RuntimeError(code, details)

    with pytest.raises(RuntimeError) as err:
        handler.stream_unary(iter([None]), Context())
    assert err.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
    interceptor.close()


def test_health_needs_no_token_but_reflection_does(env):
    server, tok = env
    with RegistryClient(server.address, None, insecure=True) as anonymous:
        assert anonymous.health() == "SERVING"
        assert anonymous.health("msa_fed.v1.Registry") == "SERVING"
    channel = grpc.insecure_channel(server.address)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    responses = list(
        stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=(("authorization", f"Bearer {tok['b']}"),))
    )
    services = {s.name for s in responses[0].list_services_response.service}
    assert "msa_fed.v1.Registry" in services and "grpc.health.v1.Health" in services
    channel.close()


def test_error_message_names_the_site(env):
    server, tok = env
    with pytest.raises(RegistryError) as err:
        call(server, wrong_secret(tok["a"]), "Heartbeat")
    assert str(err.value) == "UNAUTHENTICATED: invalid token for site 'a'"
