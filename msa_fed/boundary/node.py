"""Which Ray node this process runs on (a site's actor, its data channel, the coordinator)."""

from __future__ import annotations


def current_node_id() -> str:
    """The Ray node this process runs on, or "" outside Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return ""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
