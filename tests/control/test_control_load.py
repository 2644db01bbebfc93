"""200 concurrent site clients against one server: none lost, none duplicated, server responsive."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
from control_helpers import linear_onnx

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer

N_SITES = 200
N_FEATURES = 3


@pytest.mark.timeout(240)
def test_200_concurrent_sites(tmp_path):
    store = SqliteStore(tmp_path / "load.db")
    registry = Registry(store)
    tokens = {f"site-{i:03d}": registry.issue_token("site", f"site-{i:03d}") for i in range(N_SITES)}
    admin_token = registry.issue_token("admin", "admin")
    models = {name: linear_onnx([i, 1.0, -1.0], float(i)) for i, name in enumerate(tokens)}
    samples = {name: np.full((4, N_FEATURES), i, dtype=np.float32) for i, name in enumerate(tokens)}
    errors: list[str] = []
    start = threading.Barrier(N_SITES + 1, timeout=120)
    done = threading.Event()
    probes_answered: list[int] = []

    def site(name: str):
        try:
            with RegistryClient(server.address, tokens[name], insecure=True, timeout=60, retries=3) as client:
                start.wait()
                client.register(name)
                client.register(name)  # registering twice creates no duplicate
                for _ in range(3):
                    client.heartbeat()
                first = client.upload_predictor(models[name], upload_id=f"{name}-p")
                retry = client.upload_predictor(models[name], upload_id=f"{name}-p")  # a retried upload
                assert retry == first
                client.upload_sample(samples[name], upload_id=f"{name}-s")
        except Exception as exc:  # collected and asserted below
            errors.append(f"{name}: {exc!r}")

    def probe():
        """Health checks and admin reads keep being answered while the load runs."""
        with RegistryClient(server.address, admin_token, insecure=True, timeout=30, retries=0) as admin:
            start.wait()
            while not done.is_set():
                assert admin.health() == "SERVING"
                probes_answered.append(len(admin.list_sites()))
                # a read of every site's record a quarter second apart: often enough to see the
                # server answer throughout, rarely enough not to be most of the load itself
                time.sleep(0.25)

    with RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=32) as server:
        threads = [threading.Thread(target=site, args=(name,)) for name in tokens]
        for t in threads:
            t.start()
        prober_errors = []

        def run_probe():
            try:
                probe()
            except Exception as exc:
                prober_errors.append(repr(exc))

        prober = threading.Thread(target=run_probe)
        prober.start()
        for t in threads:
            t.join(180)
        done.set()
        prober.join(60)

        assert errors == []
        assert prober_errors == []
        # answered while the load ran, each within the client's deadline (30 s, no retry)
        assert probes_answered
        with RegistryClient(server.address, admin_token, insecure=True) as admin:
            sites = admin.list_sites()
            assert admin.health() == "SERVING"

    assert sorted(s.name for s in sites) == sorted(tokens)  # none lost, none duplicated
    for s in sites:
        assert s.last_heartbeat is not None
        assert s.predictor.upload_id == f"{s.name}-p"
        assert s.predictor.sha256 == hashlib.sha256(models[s.name]).hexdigest()
        assert s.sample.meta["rows"] == 4
        assert len(store.artifact_history(s.name, "predictor")) == 1
        assert len(store.artifact_history(s.name, "sample")) == 1
    store.close()
