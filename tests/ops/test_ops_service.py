"""The Operations gRPC service against a real server on port 0 (memory and SQLite stores)."""

from __future__ import annotations

import grpc
import pytest

from msa_fed.boundary.proto import OPS_SERVICE_NAME
from msa_fed.boundary.proto import operations_pb2 as ops_pb
from msa_fed.boundary.proto import operations_pb2_grpc as ops_grpc
from msa_fed.control.ops.client import OpsClient
from msa_fed.errors import RegistryError

OPS_METHODS = [m.name for m in ops_pb.DESCRIPTOR.services_by_name["Operations"].methods]


def upload(client, n: int):
    return client.upload_combined_model(f"model bytes {n}".encode(), {"job": f"j{n}", "sites": ["a", "b"]})


@pytest.fixture
def admin(registry, connect):
    token = registry.issue_token("admin", "admin")
    client = connect(token)
    return client, OpsClient(client)


def test_promote_rolls_back_what_latest_resolves_to(admin, registry, connect):
    client, ops = admin
    for n in (1, 2, 3):
        upload(client, n)
    models, current = ops.list_models()
    assert [m["record"].version for m in models] == [1, 2, 3] and current == 3
    assert [m["current"] for m in models] == [False, False, True]
    promoted = ops.promote(1, reason="version 3 is poisoned")
    assert promoted["current"] and promoted["promotions"][0].reason == "version 3 is poisoned"
    # every client, sites included, now gets version 1 as "latest"
    data, rec = client.download_combined_model()
    assert rec.version == 1 and data == b"model bytes 1"
    site = connect(registry.issue_token("site", "a"))
    site.register("a")
    assert site.heartbeat().latest_combined_version == 1
    _, site_rec = site.download_combined_model()
    assert site_rec.version == 1
    assert ops.get_model(0)["record"].version == 1
    upload(client, 4)  # a newer model becomes current again
    assert ops.list_models()[1] == 4
    with pytest.raises(RegistryError) as err:
        ops.promote(9)
    assert err.value.code == "NOT_FOUND"


def test_deregistration_and_revocation_show_in_site_status(admin, registry, connect):
    _, ops = admin
    for name in ("a", "b", "c"):
        c = connect(registry.issue_token("site", name))
        c.register(name)
        c.heartbeat()
    registry.revoke_token("site", "c")
    status = ops.deregister("b", reason="left the consortium")
    assert not status.registered and status.token == "revoked"
    assert status.deregistration.reason == "left the consortium" and status.deregistration.deregistered_by == "admin"
    rows = {s.name: s for s in ops.site_statuses()}
    assert rows["a"].registered and rows["a"].token == "active" and rows["a"].last_heartbeat
    assert rows["a"].connected is False  # the registry's relay holds no stream of a site process
    assert not rows["b"].registered and rows["b"].deregistration is not None
    assert rows["c"].registered and rows["c"].token == "revoked" and rows["c"].token_revoked_at
    with pytest.raises(RegistryError) as err:
        ops.deregister("nobody")
    assert err.value.code == "NOT_FOUND"


def test_deregistered_site_cannot_come_back_with_its_old_token(admin, registry, connect):
    _, ops = admin
    token = registry.issue_token("site", "b")
    connect(token).register("b")
    ops.deregister("b")
    with pytest.raises(RegistryError) as err:
        connect(token).register("b")
    assert err.value.code == "UNAUTHENTICATED"


def test_job_records(admin):
    _, ops = admin
    started = ops.start_job("j-1", "nightly", ["a", "b"], "ray")
    assert started.status == "running" and started.sites == ("a", "b") and started.started_by == "admin"
    assert ops.start_job("j-1", "other", ["a"], "ray").name == "nightly"  # a retry keeps the first record
    failed = ops.finish_job("j-1", "failed", error="site 'b' was deregistered at 2026-01-01T00:00:00Z")
    assert failed.status == "failed" and failed.ended_at and "deregistered" in failed.error
    assert [j.job_id for j in ops.list_jobs()] == ["j-1"]
    assert ops.get_job("j-1") == failed
    for bad in (
        lambda: ops.finish_job("j-1", "exploded"),
        lambda: ops.finish_job("j-1", "succeeded", 5),
        lambda: ops.start_job("../etc", "x", [], "ray"),
        lambda: ops.start_job("j2", "x", ["bad name"], "ray"),
    ):
        with pytest.raises(RegistryError) as err:
            bad()
        assert err.value.code in ("INVALID_ARGUMENT", "NOT_FOUND")
    for bad_id in ("j-2\n", "j 2", "", "-j", "j" * 65):  # the whole id is checked, a trailing newline too
        with pytest.raises(RegistryError, match="job id must be 1-64 characters") as err:
            ops.start_job(bad_id, "x", ["a"], "ray")
        assert err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(RegistryError) as err:
        ops.get_job("missing")
    assert err.value.code == "NOT_FOUND"


@pytest.mark.parametrize("method", OPS_METHODS)
def test_every_operation_is_admin_only(method, registry, server):
    """A site's token is refused (PERMISSION_DENIED) and no token is UNAUTHENTICATED, on every method."""
    site_token = registry.issue_token("site", "a")
    descriptor = ops_pb.DESCRIPTOR.services_by_name["Operations"].methods_by_name[method]
    request_type = getattr(ops_pb, descriptor.input_type.name)
    with grpc.insecure_channel(server.address) as channel:
        stub = getattr(ops_grpc.OperationsStub(channel), method)
        for metadata, code in (
            (((("authorization", f"Bearer {site_token}"),)), grpc.StatusCode.PERMISSION_DENIED),
            ((), grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub(request_type(), metadata=metadata, timeout=30)
            assert err.value.code() == code
    assert OPS_SERVICE_NAME == "msa_fed.v1.Operations"


def test_connected_column_comes_from_the_registry_hook(admin, registry, connect):
    _, ops = admin
    for name in ("a", "b"):
        connect(registry.issue_token("site", name)).register(name)
    registry.site_connected = {"a": True, "b": False}.get  # what the federated topology's relay sets
    assert {s.name: s.connected for s in ops.site_statuses()} == {"a": True, "b": False}
