"""A registry on both stores and a real server on port 0: the fixtures the control-plane and the
operations tests share (each folder's conftest.py imports them)."""

from __future__ import annotations

import pytest

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.registry.store import MemoryStore
from msa_fed.control.server import RegistryServer


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    s = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "registry.db")
    yield s
    s.close()


@pytest.fixture
def registry(store):
    return Registry(store)


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
