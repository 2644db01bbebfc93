"""A site process started before its registry, or while the registry is too loaded to answer
in time, waits for it (bounded, a line each time) instead of exiting."""

from __future__ import annotations

import pytest
from fedhelpers import write_site_files, write_site_toml

from msa_fed.federation.config import SiteConfig


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_waits_for_a_registry_that_is_not_up_yet(tmp_path):
    """A site process started before its registry (or while the registry is too busy to
    answer) asks again with back-off, a line each time, instead of exiting; the first real
    answer ends the wait (here: the registry does not know the token, which is final)."""
    import threading
    import time

    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore
    from msa_fed.control.server import RegistryServer
    from msa_fed.errors import RegistryError
    from msa_fed.federation.agent import SiteAgent

    write_site_files(tmp_path)
    port = _free_port()
    lines: list[str] = []
    agent = SiteAgent(
        SiteConfig.from_toml(write_site_toml(tmp_path, registry=f"127.0.0.1:{port}", allow_unsealed=True)),
        echo=lines.append,
    )
    outcome: dict = {}

    def check():
        try:
            agent.check_published(wait_s=120)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not any("did not answer (UNAVAILABLE)" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert thread.is_alive() and "error" not in outcome, (lines, outcome)
    assert "asking again in" in lines[0] and f"127.0.0.1:{port}" in lines[0], lines
    store = SqliteStore(tmp_path / "registry.db")
    server = RegistryServer(Registry(store), f"127.0.0.1:{port}", insecure=True, max_workers=16).start()
    try:
        thread.join(90)
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), RegistryError) and outcome["error"].code == "UNAUTHENTICATED"
    finally:
        server.stop(0.5)
        store.close()
        agent.close()


def test_the_start_up_wait_is_bounded_and_stops_on_request(tmp_path):
    import threading
    import time

    from msa_fed.errors import RegistryError
    from msa_fed.federation.agent import SiteAgent

    write_site_files(tmp_path)
    config = SiteConfig.from_toml(write_site_toml(tmp_path, registry=f"127.0.0.1:{_free_port()}", allow_unsealed=True))
    agent = SiteAgent(config, echo=lambda _: None)
    try:
        with pytest.raises(RegistryError) as info:  # gives up after its wait (pytest-timeout stops a hang)
            agent.check_published(wait_s=1.0)
        assert info.value.code == "UNAVAILABLE"
        outcome: dict = {}
        thread = threading.Thread(
            target=lambda: outcome.setdefault("error", pytest.raises(RegistryError, agent.check_published, wait_s=600)),
            daemon=True,
        )
        thread.start()
        time.sleep(1.0)
        agent.stop()
        thread.join(30)
        assert not thread.is_alive() and outcome["error"].value.code == "UNAVAILABLE"
    finally:
        agent.close()
