"""The configuration tree of a fit, built once at the edge and validated in one place.

    FitConfig
      classifier : msa_fed.core.config.ClassifierConfig   (the domain classifier)
      solver     : msa_fed.core.config.SolverConfig       (the z solver)
      ray        : RayConfig                                          (runtime="ray" / the cluster topology)
      task, method, features, eta, random_state, min_points, ...      (the run)

The Python API (:func:`msa_fed.fit_dmsa` / :func:`msa_fed.fit_gmsa`, from its keyword
arguments) and the job file (:mod:`msa_fed.jobs.config`, from its TOML tables) both produce a
:class:`FitConfig`; the coordinator and the backends only read it.  Every field is declared
once, with its documentation and its check (:mod:`msa_fed.core.options`): a wrong type is a
``TypeError``, a value out of range a ``ValueError``, an unknown key a ``ValueError``, each
naming the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msa_fed.core.config import FEATURE_NAMES, TASKS, ClassifierConfig, SolverConfig, task_loss
from msa_fed.core.options import Check, Choice, Flag, Integer, Number, Optional, Text, normalise, option

METHODS = ("dmsa", "gmsa")
RUNTIMES = ("local", "ray")
#: how the job reaches its sites: "federated" (each site runs its own agent process and
#: connects out; no shared cluster) or "cluster" (one Ray cluster with a node per site)
TOPOLOGIES = ("federated", "cluster")
#: how the per-round calls of the Ray runtime travel (see msa_fed.boundary.channel)
DATA_CHANNELS = ("tls", "plain", "off")


class _Features(Check):
    """A built-in feature map's name, a (name, {options}) pair, or a transformer object
    (fit/transform); None (raw inputs) only for GMSA (checked by FitConfig)."""

    expects = (
        f"one of {', '.join(repr(n) for n in FEATURE_NAMES)}, a (name, options) pair or a "
        "transformer with fit/transform"
    )

    def __call__(self, value):
        if value is None or (isinstance(value, str) and value == "none"):
            return None
        if isinstance(value, str):
            if value not in FEATURE_NAMES:
                raise ValueError(self.expects)
            return value
        if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str):
            if value[0] not in FEATURE_NAMES or not isinstance(value[1], Mapping):
                raise ValueError(self.expects)
            return (value[0], dict(value[1]))
        if callable(getattr(value, "fit", None)) and callable(getattr(value, "transform", None)):
            return value
        raise TypeError(self.expects)


class _Bandwidth(Check):
    expects = "a number > 0, one per site, or unset (5-fold cross-validation)"

    def __call__(self, value):
        if value is None:
            return None
        import numpy as np

        try:
            bw = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(self.expects) from None
        if bw.ndim > 1 or not np.all(np.isfinite(bw)) or np.any(bw <= 0):
            raise ValueError(self.expects)
        return float(bw) if bw.ndim == 0 else tuple(bw.tolist())


class _Directory(Check):
    """A path (str or os.PathLike) that is a directory or does not exist yet (made on first write)."""

    expects = "a directory path (made if missing)"

    def __call__(self, value):
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise TypeError(self.expects)
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{self.expects}, and {str(path)!r} exists but is not a directory")
        return str(path)


class _Kwargs(Check):
    expects = "a mapping of keyword arguments"

    def __call__(self, value):
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise TypeError(self.expects)
        return dict(value)


@dataclass(frozen=True)
class RayConfig:
    """How the Ray runtime runs the sites (``runtime="ray"`` and the cluster topology)."""

    address: str | None = option(
        None,
        'Ray cluster to attach to ("HOST:PORT", "ray://HOST:PORT"); unset: RAY_ADDRESS if set, else a new local Ray',
        Optional(Text(nonempty=True)),
    )
    num_cpus: float | None = option(
        None, "CPUs each actor reserves; unset: an even share of half the site's node, at most 1", Optional(Number(0.0))
    )
    max_restarts: int = option(3, "restarts of a crashed actor before the site is declared dead", Integer(0))
    retry_timeout_s: float = option(
        120.0, "how long a call waits for a restarting actor (seconds)", Number(0.0, open_low=True)
    )
    start_timeout_s: float = option(
        300.0, "how long start-up waits for Ray to place and start the actors (seconds)", Number(0.0, open_low=True)
    )
    workers_per_site: int = option(1, "actors per site for classifier training (1: the site's own actor)", Integer(1))
    data_channel: str = option(
        "tls",
        'how the per-round calls travel: "tls" (direct mutual-TLS connection to each '
        'site actor), "plain" (no TLS; loopback only) or "off" (through Ray)',
        Choice(*DATA_CHANNELS),
    )
    init_kwargs: dict = option(None, "extra keyword arguments of ray.init when a local Ray is started", _Kwargs())

    def __post_init__(self):
        if self.init_kwargs is None:
            object.__setattr__(self, "init_kwargs", {})

    def validate(self, where: str = "") -> RayConfig:
        return normalise(self, where)


@dataclass(frozen=True)
class FitConfig:
    """Everything a fit needs besides the sites (see the module docstring)."""

    task: str = option(
        "classification",
        '"classification" (probability model, cross-entropy) or "regression" (squared loss)',
        Choice(*TASKS),
    )
    method: str = option(
        "dmsa",
        '"dmsa" (conditional Maxent domain classifier) or "gmsa" (a kernel density estimate per domain)',
        Choice(*METHODS),
    )
    features: Any = option(
        "standard",
        "feature map of the domain model: " + _Features.expects + "; unset (raw inputs) for GMSA only",
        _Features(),
    )
    eta: float = option(
        1e-2, "smoothing of the combination's denominator (>= 0; a small positive number, as in the paper)", Number(0.0)
    )
    random_state: int = option(0, "seed of every random choice (classifier, SGD order, solver restarts)", Integer(0))
    min_points: int = option(20, "a site never aggregates over fewer points (privacy contract)", Integer(1))
    runtime: str = option(
        "local", '"local" (sites as objects in this process) or "ray" (one actor per site)', Choice(*RUNTIMES)
    )
    topology: str = option(
        "federated",
        'job: how the coordinator reaches the sites: "federated" (each site runs '
        'its own agent and connects out) or "cluster" (one Ray cluster, a node per site)',
        Choice(*TOPOLOGIES),
    )
    site_timeout_s: float = option(
        60.0, "federated topology: how long a call waits for a site's answer (seconds)", Number(0.0, open_low=True)
    )
    bandwidth: Any = option(None, "GMSA: KDE bandwidth(s); unset: 5-fold cross-validation per domain", _Bandwidth())
    checkpoint_dir: str | None = option(
        None,
        "the solver state is written here after every iteration; a later run "
        "with the same directory and data resumes from it",
        _Directory(),
    )
    verbose: bool = option(False, "progress bars and notes on stderr", Flag())
    influence: bool = option(
        False,
        "the influence report with the model: each site's loss with and without each other site, z "
        "re-solved without each (about 10 to 30 more evaluations per site; jobs turn it on)",
        Flag(),
    )
    classifier: ClassifierConfig = option(None, "domain classifier options (ClassifierConfig)")
    solver: SolverConfig = option(None, "z solver options (SolverConfig)")
    ray: RayConfig = option(None, "Ray runtime options (RayConfig)")

    def __post_init__(self):
        for name, cls in (("classifier", ClassifierConfig), ("solver", SolverConfig), ("ray", RayConfig)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, cls())

    @property
    def loss(self) -> str:
        return task_loss(self.task)

    def validate(self) -> FitConfig:
        """Every field of the tree checked; returns self (normalised values set)."""
        normalise(self)
        for name, cls in (("classifier", ClassifierConfig), ("solver", SolverConfig), ("ray", RayConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}; got {getattr(self, name)!r}")
        if self.features is None and self.method == "dmsa":
            raise ValueError("features must be set for method 'dmsa' (the classifier needs a feature map)")
        if self.bandwidth is not None and self.method != "gmsa":
            raise ValueError("bandwidth applies only to method 'gmsa'")
        self.classifier.validate()
        self.solver.validate()
        self.ray.validate()
        return self


__all__ = ["FitConfig", "RayConfig", "ClassifierConfig", "SolverConfig", "task_loss"]
