"""Parties excluded after a fault, until an operator clears them: a small JSON file per holder.

A site records a peer whose predictor broke a limit in its own process; the party that runs jobs
records a site whose answers failed a plausibility check.  Each check lives with the party it
protects, so each keeps its own book: ``msa-fed site peers`` / ``msa-fed site clear-peer`` at a
site, ``msa-fed job excluded`` / ``msa-fed job clear-site`` where jobs run.

The file maps a site's name to ``{"reason": one line, "since": ISO time (UTC), "count": n}``;
it is rewritten atomically (temporary file, then rename) under a process-wide lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from msa_fed.errors import ConfigError, PeerFault

_lock = threading.Lock()


class ExclusionBook:
    """The excluded parties of one holder, stored in ``path`` (created on first record)."""

    def __init__(self, path, holder: str):
        self.path = Path(path)
        self.holder = str(holder)

    def entries(self) -> dict[str, dict]:
        """{site: {"reason", "since", "count"}} (empty when the file does not exist)."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the exclusion record {str(self.path)!r}: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ConfigError(f"the exclusion record {str(self.path)!r} is not a JSON object of objects")
        return data

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    def add(self, site: str, reason: str) -> None:
        """Exclude ``site`` (again: the count goes up, the first reason and time stay)."""
        with _lock:
            data = self.entries()
            entry = data.get(site) or {
                "reason": " ".join(str(reason).split())[:500],
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "count": 0,
            }
            entry["count"] = int(entry.get("count", 0)) + 1
            data[site] = entry
            self._write(data)

    def clear(self, site: str) -> bool:
        """Admit ``site`` again; False when it was not excluded."""
        with _lock:
            data = self.entries()
            if site not in data:
                return False
            del data[site]
            self._write(data)
            return True

    def check(self, sites, clear_hint: str) -> None:
        """Raise :class:`PeerFault` naming the first excluded site among ``sites``."""
        data = self.entries()
        for site in sites:
            if site in data:
                e = data[site]
                raise PeerFault(
                    site,
                    f"site {site!r} is excluded by {self.holder} since {e.get('since')}: {e.get('reason')} "
                    f"(cleared with '{clear_hint} {site}')",
                )
