"""The run's checkpoint: the classifier and solver state, written after every iteration.

``directory/dc_state.json`` holds a fingerprint of the problem (sites, sizes, options, a digest
of the published samples) and the state (``theta``, ``z``, ``gamma``, ``gamma_name``: the
objective ``gamma`` holds, ``iteration``, ``done``) and ``answers``: the DC rounds the sites
answered (:class:`KeptAnswers`), so that a resumed run asks the sites only what they have not
answered yet.  A run with the same directory resumes from a state of the same problem and
ignores any other.  The file is replaced atomically (write, then rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from msa_fed.core.dc_terms import DCSums
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


#: the fields of a DC round's answer that the checkpoint keeps
_SUMS = ("L", "dL", "u", "du", "v", "dv")


class KeptAnswers:
    """A DC loss oracle whose answers are kept in the run's checkpoint (``answers``).

    The solver is deterministic given its answers (its seed is the run's): a resumed run starts
    it afresh and each round the sites answered before is answered here from the checkpoint,
    bit for bit (JSON keeps a float's shortest repr, which reads back as the same double), so
    the solver retraces its path without asking the sites, and asks them only the rounds they
    have not answered (not charged to their budgets again).  A round's key is a digest of
    ``context`` (the Qhat the sites were given: another Qhat is another problem), ``z`` as
    float64 bytes, ``eta``, ``what`` and the bound.

    oracle : the live oracle (``evaluate``, ``max_bound``, ``n_sources``).
    checkpoint : the run's :class:`Checkpoint` (without a directory nothing is kept).
    asked, kept : the rounds sent to the sites and the rounds answered from the checkpoint."""

    def __init__(self, oracle, checkpoint: Checkpoint, context: bytes = b""):
        self.oracle = oracle
        self.checkpoint = checkpoint
        self.context = bytes(context)
        self.n_sources = int(oracle.n_sources)
        stored = checkpoint.state.get("answers")
        self._answers: dict = dict(stored) if isinstance(stored, dict) else {}
        self.asked = 0
        self.kept = 0

    def _key(self, *parts) -> str:
        h = hashlib.sha256(self.context)
        for part in parts:
            h.update(b"\0")
            h.update(part if isinstance(part, bytes) else repr(part).encode())
        return h.hexdigest()[:32]

    def _keep(self, key: str, value) -> None:
        self._answers[key] = value
        self.checkpoint.update(answers=self._answers)

    def _evaluate_key(self, z: np.ndarray, eta, what, global_bound) -> str:
        bound = None if global_bound is None else float(global_bound)
        return self._key(
            b"evaluate", np.ascontiguousarray(z, dtype=np.float64).tobytes(), float(eta), tuple(what), bound
        )

    def _kept_sums(self, key: str) -> DCSums | None:
        got = self._answers.get(key)
        if not isinstance(got, dict):
            return None
        self.kept += 1
        arrays = {k: np.asarray(got[k], dtype=np.float64) for k in _SUMS if got.get(k) is not None}
        return DCSums(**arrays, n=int(got.get("n", 0)))

    @staticmethod
    def _stored(out: DCSums) -> dict:
        kept = {k: np.asarray(getattr(out, k)).tolist() for k in _SUMS if getattr(out, k) is not None}
        return {**kept, "n": int(out.n)}

    def evaluate(self, z, eta, what, global_bound=None) -> DCSums:
        z = np.ascontiguousarray(z, dtype=np.float64)
        key = self._evaluate_key(z, eta, what, global_bound)
        got = self._kept_sums(key)
        if got is not None:
            return got
        out = self.oracle.evaluate(z, eta, what, global_bound)
        self.asked += 1
        self._keep(key, self._stored(out))
        return out

    def evaluate_batch(self, zs, eta, what, global_bound=None) -> list[DCSums]:
        """The sums at each row of ``zs``: the rows answered before from the checkpoint, the
        others in one batched request (the live oracle's ``evaluate_batch``, else one each)."""
        zs = np.asarray(zs, dtype=np.float64)
        keys = [self._evaluate_key(z, eta, what, global_bound) for z in zs]
        out: list = [self._kept_sums(k) for k in keys]
        todo = [i for i, got in enumerate(out) if got is None]
        if todo:
            batch = getattr(self.oracle, "evaluate_batch", None)
            if batch is not None:
                fresh = batch(zs[todo], eta, what, global_bound)
                self.asked += 1
            else:
                fresh = [self.oracle.evaluate(zs[i], eta, what, global_bound) for i in todo]
                self.asked += len(todo)
            for i, sums in zip(todo, fresh):
                out[i] = sums
                self._answers[keys[i]] = self._stored(sums)
            self.checkpoint.update(answers=self._answers)
        return out

    def max_bound(self) -> float:
        key = self._key(b"max_bound")
        got = self._answers.get(key)
        if isinstance(got, float):
            self.kept += 1
            return got
        value = float(self.oracle.max_bound())
        self.asked += 1
        self._keep(key, value)
        return value
