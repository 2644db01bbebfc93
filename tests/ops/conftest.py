"""Fixtures of the operations tests: both stores, a registry, a real server on port 0."""

from __future__ import annotations

from registry_fixtures import connect, registry, server, store  # noqa: F401 - the shared fixtures
