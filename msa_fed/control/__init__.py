"""gRPC control plane: site registration, authentication, artifact and sample upload.

Public entry points:

- :class:`RegistryClient` (sites, the CLI and the coordinator's job);
- :class:`RegistryServer` with a :class:`Registry` over a :class:`SqliteStore`
  or :class:`MemoryStore`, and :class:`TlsConfig`.

See ``docs/CONTROL_PLANE.md`` for the CLI, authentication, TLS and storage.
"""

from msa_fed.control.client import HeartbeatInfo, RegistryClient
from msa_fed.control.records import (
    ArtifactRecord,
    CombinedModelRecord,
    Principal,
    SiteRecord,
)
from msa_fed.control.registry import Limits, Registry
from msa_fed.control.server import RegistryServer, TlsConfig
from msa_fed.control.sqlite_store import SqliteStore
from msa_fed.control.store import MemoryStore, RegistryStore

__all__ = [
    "ArtifactRecord",
    "CombinedModelRecord",
    "HeartbeatInfo",
    "Limits",
    "MemoryStore",
    "Principal",
    "Registry",
    "RegistryClient",
    "RegistryServer",
    "RegistryStore",
    "SiteRecord",
    "SqliteStore",
    "TlsConfig",
]
