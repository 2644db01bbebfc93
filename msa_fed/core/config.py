"""The configuration of the math core: the domain classifier's and the z solver's options.

Kept apart from the modules that use them (:mod:`msa_fed.core.domain_classifier` imports torch,
:mod:`msa_fed.core.dc_solver` scipy) so that a configuration, e.g. a job file, is checked
without loading either.  Each field is declared with its documentation and its check
(:mod:`msa_fed.core.options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from msa_fed.core.options import Choice, Flag, Integer, Number, Optional, Text, normalise, option, validates_once

if TYPE_CHECKING:
    import torch

#: the two tasks: a probability model with the cross-entropy, a regression model with the squared loss
TASKS = ("classification", "regression")
#: the ``influence`` setting that makes the influence report only once a site's verdict shows it harmed
WHEN_HARMED = "when-harmed"


def task_loss(task: str) -> str:
    """The loss of ``task`` (a ValueError naming it for anything else)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(repr(t) for t in TASKS)}; got {task!r}")
    return "cross_entropy" if task == "classification" else "squared"


#: the privacy contract's smallest aggregate: no site sums over fewer points (the default of the
#: fit's ``min_points`` and of a site's policy; each may only raise it)
MIN_POINTS = 20

#: the built-in feature maps of the domain model (msa_fed.core.features.FEATURE_MAPS)
FEATURE_NAMES = ("standard", "onehot", "threshold", "rff")


@dataclass(frozen=True)
class ClassifierConfig:
    """Hyper-parameters of the domain classifier; each field's documentation is its ``doc``."""

    mu: float = option(
        1e-3,
        "L2 weight of the classifier (> 0); small: the domains are usually well separated",
        Number(0.0, open_low=True),
        keyword=True,  # a keyword of the API of its own (fit_dmsa(mu=...)), in the job's [model] table
        job="model",
    )
    optimizer: str = option(
        "lbfgs", '"lbfgs": full-batch, exact optimum; "sgd": mini-batch Adam for huge samples', Choice("lbfgs", "sgd")
    )
    max_iter: int = option(1000, "L-BFGS iterations (rarely reached)", Integer(1))
    tol: float = option(1e-9, "L-BFGS relative objective tolerance (ftol)", Number(0.0))
    gtol: float = option(1e-7, "L-BFGS projected-gradient tolerance", Number(0.0))
    epochs: int = option(20, "SGD epochs over the largest shard", Integer(1))
    batch_size: int = option(256, "SGD mini-batch per shard", Integer(1))
    lr: float = option(0.05, "SGD (Adam) initial learning rate, cosine-decayed to 0", Number(0.0, open_low=True))
    device: str = option("cpu", "torch device for the shard computations", Text(nonempty=True))
    #: products in float32, sums across row blocks in float64: final objective within ~2e-9
    #: relative of float64's, 1.6-2.1x faster per evaluation, half the memory (benchmarks/bench_core.py)
    dtype: str = option(
        "float32",
        "precision of the products of the sites' shards (data-parallel training and SGD; L-BFGS in "
        "one process runs in float64)",
        Choice("float64", "float32"),
    )

    @validates_once
    def validate(self) -> ClassifierConfig:
        """Every field checked (TypeError / ValueError naming it); returns self."""
        normalise(self)
        if self.device != "cpu":  # the string only: whether a GPU is there is checked where the shards live
            parse_device(self.device)
        return self


def parse_device(device: str) -> torch.device:
    """``device`` as a torch device (the string only; whether this process can use it is checked
    where the shards live); ValueError naming it otherwise.  Imports torch on first use."""
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None


METHODS = ("auto", "homotopy", "newton", "dca")
OBJECTIVES = ("minmax", "gamma", "regret")
#: the options that only the objective "gamma" uses (an error under "minmax")
GAMMA_ONLY = ("method", "bound")


class _Start(Optional):
    """None, or a start point z0 (a sequence of numbers; checked against the simplex later)."""

    def __init__(self) -> None:
        self.expects = "a list of numbers on the simplex (or unset)"

    def __call__(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            z = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(self.expects) from None
        if z.ndim != 1:
            raise ValueError(self.expects)
        return tuple(float(v) for v in z)


@dataclass(frozen=True)
class SolverConfig:
    """Options of the z solver (:func:`solve_dc`); each field's documentation is its ``doc``."""

    objective: str = option(
        "minmax",
        '"minmax": min over z of max_k L_k(z), the worst domain loss (SLSQP on the '
        'epigraph); "gamma": the paper\'s min Gamma(z) (DC programming); "regret": min over z of '
        "max_k L_k(z) - b_k, b_k the best loss of domain k at a vertex or the uniform point (a "
        "domain no mixture serves, or a site overstating its losses, cannot drag the others)",
        Choice(*OBJECTIVES),
        job="model",  # in the job's [model] table, not [solver]
    )
    method: str | None = option(
        None, 'objective "gamma" only: "auto" (default), "homotopy", "newton" or "dca"', Optional(Choice(*METHODS))
    )
    tol: float = option(1e-9, "stop when Gamma(z) <= tol (a global optimality test)", Number(0.0))
    max_iter: int = option(200, "iterations per run (a ConvergenceWarning when reached)", Integer(1))
    n_restarts: int = option(4, "random simplex starts tried after the first one, only while not converged", Integer(0))
    all_starts: bool = option(
        False,
        "run every start (the first and the n_restarts random ones) to the end and keep the best, "
        "even after one has converged: the exhaustive solve, for checking a solution; each start "
        "costs rounds at every site",
        Flag(),
    )
    bound: str | None = option(
        None,
        'objective "gamma", squared loss only: "pointwise" (default; M_i per point, tighter) or "global" (one M)',
        Optional(Choice("pointwise", "global")),
    )
    z0: tuple[float, ...] | None = option(None, "first start instead of the uniform point", _Start())
    guarantee: float | None = option(
        None,
        'objective "minmax" only: no site worse off than alone. Each site reports its own '
        "predictor's loss on its labelled points (one more request per site before the solve) "
        "and z is the min-max point with every L_k(z) <= own_k + this slack; where no z "
        "satisfies them all, the z with the smallest largest excess, said in one line (unset: off)",
        Optional(Number(0.0)),
    )

    @validates_once
    def validate(self) -> SolverConfig:
        """Every field checked; an option the objective does not use is a ValueError naming it."""
        normalise(self)
        if self.objective in ("minmax", "regret"):
            given = [name for name in GAMMA_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{given[0]}={getattr(self, given[0])!r} applies only to objective='gamma'; "
                    "objective='minmax' solves by SLSQP on the epigraph"
                )
        if self.guarantee is not None and self.objective != "minmax":
            raise ValueError(
                f"guarantee={self.guarantee!r} applies only to objective='minmax' (the own-loss "
                "constraints are added to its epigraph problem)"
            )
        return self
