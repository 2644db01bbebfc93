"""The run's checkpoint: the classifier and solver state, written after every iteration.

``directory/dc_state.json`` holds a fingerprint of the problem (sites, sizes, options, a digest
of the published samples) and the state (``theta``, ``z``, ``gamma``, ``gamma_name``: the
objective ``gamma`` holds, ``iteration``, ``done``).  A run with the same directory resumes
from a state of the same problem and ignores any other.  The file is replaced atomically (write, then rename).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from msa_fed.errors import ConfigError

FILE_NAME = "dc_state.json"


class Checkpoint:
    """State of one problem in ``directory`` (None: nothing is read or written).

    Read from disk once (:meth:`bind`) and then kept in memory: the solver writes after every
    iteration and must not re-read it.
    """

    def __init__(self, directory: str | None):
        self.directory = None if directory is None else Path(directory)
        self._state: dict | None = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def bind(self, fingerprint: str) -> dict:
        """Load the state stored for ``fingerprint`` (empty if none); returns it."""
        self._state = {"fingerprint": fingerprint}
        if self.directory is None:
            return {}
        f = self.directory / FILE_NAME
        if f.is_file():
            try:
                stored = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"checkpoint {str(f)!r} is unreadable ({exc}); remove it to start afresh") from None
            if isinstance(stored, dict) and stored.get("fingerprint") == fingerprint:
                self._state = stored
        return self.state

    @property
    def state(self) -> dict:
        """The stored state of the bound problem, without its fingerprint."""
        return {k: v for k, v in (self._state or {}).items() if k != "fingerprint"}

    def update(self, **state) -> None:
        """Merge ``state`` and write the file (nothing without a directory)."""
        if self.directory is None:
            return
        if self._state is None:
            raise RuntimeError("Checkpoint.update before bind")
        self._state.update(state)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / (FILE_NAME + ".tmp")
            tmp.write_text(json.dumps(self._state))
            os.replace(tmp, self.directory / FILE_NAME)
        except OSError as exc:
            raise ConfigError(f"cannot write the checkpoint in {str(self.directory)!r}: {exc}") from None
