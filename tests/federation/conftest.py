"""Fixtures of the federation tests: real registries, real `msa-fed site serve` processes, local Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _worktree_on_path(request):
    """Site processes are started with ``python -m msa_fed.cli``: they must import this checkout."""
    import os

    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != root:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + parts)
    yield


@pytest.fixture(scope="module")
def local_ray(request):
    """A local Ray for the test module (2 CPUs; the resources of its ``RAY_RESOURCES``), shut down after it."""
    import ray

    from msa_fed.runtime.ray_actors import ensure_ray

    ensure_ray(num_cpus=2, resources=getattr(request.module, "RAY_RESOURCES", None))
    yield ray
    ray.shutdown()
