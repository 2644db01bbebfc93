"""The job's relay client after a registry restart (in-process servers on one port and one
database): the relay forgot the open job; the client opens it again and reports the calls as
unreachable, so the job retries them instead of failing on FAILED_PRECONDITION."""

from __future__ import annotations

import pytest

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer
from msa_fed.errors import RegistryError
from msa_fed.federation.relay_client import RelayClient
from msa_fed.runtime.federated import TRANSIENT, SiteUnreachable


def test_a_forgotten_job_is_opened_again(tmp_path):
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    admin = registry.issue_token("admin", "admin")
    tokens = {n: registry.issue_token("site", n) for n in ("a", "b")}
    server = RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=16).start()
    port = server.port
    try:
        for name, token in tokens.items():
            with RegistryClient(server.address, token, insecure=True) as site:
                site.register(name)
        relay = RelayClient(f"127.0.0.1:{port}", admin, insecure=True)
        relay.open_job("j-1", ["a", "b"])
        server.stop(0.5)  # the restart: a new server, same port, same database, an empty relay
        server = RegistryServer(registry, f"127.0.0.1:{port}", insecure=True, max_workers=16).start()
        first = relay.call("j-1", [("a", "ping", None)], 1.0)
        assert isinstance(first[0], SiteUnreachable) and first[0].status in TRANSIENT
        assert "restarted; the job was opened again" in first[0].detail
        # open again: the next call reaches the relay's job (site a is simply not connected)
        second = relay.call("j-1", [("a", "ping", None)], 0.5)
        assert isinstance(second[0], SiteUnreachable) and "opened again" not in second[0].detail
        # a job this client never opened is not opened behind the caller's back
        with pytest.raises(RegistryError) as info:
            relay.call("never-opened", [("a", "ping", None)], 0.5)
        assert info.value.code == "FAILED_PRECONDITION"
        relay.close_job("j-1")
        relay.close()
    finally:
        server.stop(0.5)
        store.close()
