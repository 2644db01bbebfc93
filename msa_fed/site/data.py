"""A site's private data on its own node: an .npz of its labelled and unlabelled points.

Read by the site itself (a site process at start, a cluster site's actor on its first request),
never by the party that runs the job; never unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from msa_fed.errors import ConfigError
from msa_fed.privacy.consortium import check_disjoint

SITE_DATA_KEYS = ("X_labeled", "y_labeled", "X_unlabeled")
#: on a site's node, the directory its relative data paths are read from (see cluster/README.md)
SITE_DATA_ENV = "MSA_FED_SITE_DATA"


def resolve_site_path(name: str, data_path) -> Path:
    """``data_path`` as a path on this node: relative paths are under ``$MSA_FED_SITE_DATA``."""
    path = Path(os.path.expanduser(str(data_path)))
    if not path.is_absolute():
        base = os.environ.get(SITE_DATA_ENV)
        if not base:
            raise ConfigError(
                f"site {name!r}: data_path {str(data_path)!r} is relative but {SITE_DATA_ENV} "
                "is not set on the site's node; give an absolute path or set it"
            )
        path = Path(base) / path
    return path


def load_site_data(name: str, data_path) -> dict[str, np.ndarray]:
    """Read a site's private data from an .npz on this node (never unpickles).

    Returns {"X_labeled": (n, d), "y_labeled": (n,), "X_unlabeled": (m, d)}.
    """
    path = resolve_site_path(name, data_path)
    if not path.is_file():
        raise ConfigError(f"site {name!r}: data file {str(path)!r} not found on the site's node")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in SITE_DATA_KEYS if k not in npz.files]
            if missing:
                raise ConfigError(
                    f"site {name!r}: data file {str(path)!r} lacks arrays {missing}; expected {list(SITE_DATA_KEYS)}"
                )
            out = {k: npz[k] for k in SITE_DATA_KEYS}
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"site {name!r}: cannot read data file {str(path)!r}: {exc}") from None
    Xl, y, Xu = out["X_labeled"], out["y_labeled"], out["X_unlabeled"]
    if Xl.ndim != 2 or Xu.ndim != 2 or y.shape != (Xl.shape[0],) or Xu.shape[1] != Xl.shape[1]:
        raise ConfigError(
            f"site {name!r}: data file {str(path)!r} has inconsistent shapes: X_labeled {Xl.shape}, "
            f"y_labeled {y.shape}, X_unlabeled {Xu.shape}; expected (n, d), (n,), (m, d)"
        )
    for key in ("X_labeled", "X_unlabeled"):
        if out[key].dtype.kind not in "biuf" or not np.all(np.isfinite(out[key])):
            raise ConfigError(f"site {name!r}: data file {str(path)!r}: {key} must be finite numbers")
    check_disjoint(name, Xl, Xu)  # a data file is a deployed site's: its labelled inputs stay private
    return out
