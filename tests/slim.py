"""A Python process without the coordinator's packages, for the tests of the site's slim install.

:func:`slim_env` writes a ``sitecustomize.py`` into a folder and returns an environment that puts
that folder first on ``PYTHONPATH``: every Python process started with it (and every process it
starts with the same environment: ``site serve``'s sandboxed predictor workers) refuses to import
torch, Ray, scikit-learn, scipy, skl2onnx and tqdm, as if they were not installed, and appends
each refused import (the module and the msa_fed frames that asked for it) to the folder's
``blocked.log``: an import that a site's code path must never make is both an error there and a
line the test reads.
"""

from __future__ import annotations

import os
from pathlib import Path

from msa_fed.errors import COORDINATOR_PACKAGES

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = '''\
import os
import sys
import traceback

_BLOCKED = frozenset({blocked!r})
_LOG = {log!r}


class _Refuse:
    """A meta-path finder in front of every other: the coordinator's packages are not there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in _BLOCKED:
            return None
        frames = [f"{{f.filename}}:{{f.lineno}}" for f in traceback.extract_stack() if "msa_fed" in f.filename]
        with open(_LOG, "a") as out:
            out.write(f"{{os.getpid()}} {{name}} <- {{' <- '.join(reversed(frames[-6:]))}}\\n")
        raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a site install)", name=name)


sys.meta_path.insert(0, _Refuse())
'''


def slim_env(folder: Path, python_path: tuple[str, ...] = (str(ROOT),)) -> dict[str, str]:
    """An environment whose Python processes cannot import the coordinator's packages (see the
    module's docstring); ``folder/blocked.log`` collects the imports they tried."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "blocked.log"
    log.touch()
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(COORDINATOR_PACKAGES), log=str(log)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *python_path])
    return env


def blocked(folder: Path) -> list[str]:
    """The imports refused so far in processes started with :func:`slim_env`'s environment."""
    log = folder / "blocked.log"
    return log.read_text().splitlines() if log.is_file() else []
