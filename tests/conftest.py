"""Suite-wide fixtures, the test markers and the loopback-only local Ray."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# A local Ray started by a test (``ray.init(address="local")``, ``ray.cluster_utils.Cluster``,
# ``fit_dmsa(runtime="ray")``, ``msa-fed demo`` in a subprocess) binds 127.0.0.1 only.  Ray turns
# an explicit ``_node_ip_address="127.0.0.1"`` into the machine's external address; this switch
# (read when ``ray`` is first imported, so set before any test module imports it, and inherited
# by subprocesses) makes it use loopback for the node address and every server it starts.
# `ray start` refuses worker nodes under it: tests/cluster removes it for its own processes.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
os.environ.setdefault(RAY_LOOPBACK_ENV, "0")

TESTS = Path(__file__).resolve().parent

#: markers by path under tests/ (a directory ends with "/"): ray starts or uses a local Ray,
#: cluster runs several Ray nodes, data reads the data sets under shared/data, slow is a long
#: end-to-end run.  `make test-fast` deselects all four.
MARKERS_BY_PATH: dict[str, tuple[str, ...]] = {
    "cluster/": ("cluster", "ray", "slow"),
    "runtime/test_ray_multinode.py": ("cluster", "ray"),
    "runtime/test_ray_runtime.py": ("ray",),
    "privacy/test_runtime_privacy.py": ("ray",),  # one site actor on a local Ray
    "experiments/test_experiments_ray.py": ("ray", "data", "slow"),
    "experiments/test_experiments_quick.py": ("data", "slow"),
    "test_demo.py": ("ray", "slow"),
    "experiments/test_cnn.py": ("slow",),  # trains small CNNs
    "control/test_control_load.py": ("slow",),  # 200 concurrent clients
    # the federated topology: a registry with its relay, `msa-fed site serve` subprocesses, local Ray
    "federation/test_federated_job.py": ("ray", "slow"),
    "federation/test_federation_security.py": ("ray", "slow"),
    "federation/test_federation_network.py": ("ray", "slow"),
    "federation/test_cluster_liveness.py": ("ray", "slow"),
    "federation/test_site_serve_ops.py": ("ray", "slow"),
}
#: single tests that read the data sets (the rest of their module uses temporary files)
DATA_TESTS = {
    "experiments/test_data.py::test_adult_row_counts_and_domains",
    "experiments/test_data.py::test_sentiment_reviews_and_ratings",
    "experiments/test_data.py::test_digits_domains_shapes_and_counts",
    "experiments/test_data_checksums.py::test_the_shared_sums_list_every_file_the_loaders_read",
}
#: fixtures that start a local Ray
RAY_FIXTURES = {"local_ray"}
#: pytest-timeout limit of a slow test (the default, 300 s in pyproject.toml, is for the rest): an
#: end-to-end run on a loaded two-core machine can take several times its idle duration
SLOW_TIMEOUT_S = 900


def markers_for(rel: str, name: str, fixtures: set[str]) -> set[str]:
    """The markers of the test ``name`` in the file ``rel`` (relative to tests/, "/"-separated)."""
    found: set[str] = set()
    for prefix, marks in MARKERS_BY_PATH.items():
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            found.update(marks)
    if f"{rel}::{name.split('[')[0]}" in DATA_TESTS:
        found.add("data")
    if fixtures & RAY_FIXTURES:
        found.add("ray")
    return found


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue
        marks = markers_for(rel, item.name, set(getattr(item, "fixturenames", ())))
        for mark in sorted(marks):
            item.add_marker(mark)
        if ("slow" in marks or "cluster" in marks) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(autouse=True, scope="module")
def _ray_does_not_leak_between_modules():
    """A module that used Ray (``fit_dmsa(runtime="ray")`` starts one and keeps it) must not
    hand it to the next module, which may want its own cluster (multi-node tests)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
