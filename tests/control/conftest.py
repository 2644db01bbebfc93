"""Fixtures of the control-plane tests: both stores, a registry, a real server on port 0."""

from __future__ import annotations

import pytest

from msa_fed.control import MemoryStore, Registry, RegistryClient, RegistryServer, SqliteStore

STORE_KINDS = ["memory", "sqlite"]


def open_store(kind: str, tmp_path):
    if kind == "memory":
        return MemoryStore()
    return SqliteStore(tmp_path / "registry.db")


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path):
    s = open_store(request.param, tmp_path)
    yield s
    s.close()


@pytest.fixture
def registry(store):
    return Registry(store)


@pytest.fixture
def tokens(registry):
    """Tokens of sites 'a' and 'b' and of the admin."""
    return {
        "a": registry.issue_token("site", "a"),
        "b": registry.issue_token("site", "b"),
        "admin": registry.issue_token("admin", "admin"),
    }


@pytest.fixture
def server(registry):
    with RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=16) as srv:
        yield srv


@pytest.fixture
def connect(server):
    """``connect(token)`` -> a plaintext loopback client of ``server`` (closed at teardown)."""
    clients = []

    def make(token, **kwargs):
        kwargs.setdefault("retries", 0)
        c = RegistryClient(server.address, token, insecure=True, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()
