"""Suite-wide fixtures."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def _ray_does_not_leak_between_modules():
    """A module that used Ray (``fit_dmsa(runtime="ray")`` starts one and keeps it) must not
    hand it to the next module, which may want its own cluster (multi-node tests)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
