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

The declaration also says where else the field appears, and everything else is made from it
(:func:`fit_options`): the keyword arguments of ``fit_dmsa`` / ``fit_gmsa`` and the parameters
of the estimators ``DMSA`` / ``GMSA`` (:func:`api_signature`), the job file's keys
(``msa_fed.jobs.config.SCHEMA``) and the option table in docs/OPTIONS.md
(:func:`options_markdown`).  The keywords of :func:`msa_fed.core.options.option`:

- ``job="table"`` or ``job="table.key"``: the field's key in the job file (its own name by
  default); unset: a job does not set it.  On a sub-configuration: the table that holds its
  fields, unless a field says otherwise.
- ``api=False``: the API does not take it (the job's topology; the method is the function's).
  On a sub-configuration: ``api="NAME_options"``, the keyword of the mapping of its fields.
- ``keyword=True`` (a sub-configuration's field): a keyword of the API of its own (``mu``), not
  inside the mapping.

Adding an option is one :func:`option` line here (or in ``msa_fed.core.config``);
``tests/runtime/test_fit_options.py`` adds one and follows it to every place.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from msa_fed.core.config import FEATURE_NAMES, MIN_POINTS, TASKS, WHEN_HARMED, ClassifierConfig, SolverConfig, task_loss
from msa_fed.core.harm import SUSPECT_RULES
from msa_fed.core.options import (
    Check,
    Choice,
    Flag,
    FlagOr,
    Integer,
    Number,
    Optional,
    Text,
    check_value,
    expects,
    field_doc,
    from_mapping,
    normalise,
    option,
    option_meta,
    validates_once,
)

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
        job="run.ray_address",
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
        job="run",
    )
    init_kwargs: dict = option(None, "extra keyword arguments of ray.init when a local Ray is started", _Kwargs())

    def __post_init__(self):
        if self.init_kwargs is None:
            object.__setattr__(self, "init_kwargs", {})

    @validates_once
    def validate(self, where: str = "") -> RayConfig:
        return normalise(self, where)


@dataclass(frozen=True)
class FitConfig:
    """Everything a fit needs besides the sites (see the module docstring)."""

    task: str = option(
        "classification",
        '"classification" (probability model, cross-entropy) or "regression" (squared loss)',
        Choice(*TASKS),
        job="model",
    )
    method: str = option(
        "dmsa",
        '"dmsa" (conditional Maxent domain classifier) or "gmsa" (a kernel density estimate per domain)',
        Choice(*METHODS),
        job="model",
        api=False,  # the function's (fit_dmsa / fit_gmsa) or the estimator's (DMSA / GMSA)
    )
    features: Any = option(
        "standard",
        "feature map of the domain model: " + _Features.expects + "; unset (raw inputs) for GMSA only",
        _Features(),
        job="model",
    )
    eta: float = option(
        1e-2,
        "smoothing of the combination's denominator (>= 0; a small positive number, as in the paper)",
        Number(0.0),
        job="model",
    )
    random_state: int = option(
        0, "seed of every random choice (classifier, SGD order, solver restarts)", Integer(0), job="model"
    )
    min_points: int = option(
        MIN_POINTS, "a site never aggregates over fewer points (privacy contract)", Integer(1), job="privacy"
    )
    runtime: str = option(
        "local", '"local" (sites as objects in this process) or "ray" (one actor per site)', Choice(*RUNTIMES)
    )
    topology: str = option(
        "federated",
        'job: how the coordinator reaches the sites: "federated" (each site runs '
        'its own agent and connects out) or "cluster" (one Ray cluster, a node per site)',
        Choice(*TOPOLOGIES),
        job="run",
        api=False,
    )
    site_timeout_s: float = option(
        60.0,
        "federated topology: how long a call waits for a site's answer (seconds)",
        Number(0.0, open_low=True),
        job="run",
        api=False,
    )
    bandwidth: Any = option(None, "GMSA: KDE bandwidth(s); unset: 5-fold cross-validation per domain", _Bandwidth())
    checkpoint_dir: str | None = option(
        None,
        "the solver state is written here after every iteration; a later run "
        "with the same directory and data resumes from it",
        _Directory(),
        job="run",
    )
    verbose: bool = option(False, "progress bars and notes on stderr", Flag())
    influence: bool | str = option(
        False,
        "the influence report with the model: each site's loss with and without each other site, z "
        f're-solved without each (about 10 to 30 more evaluations per site); "{WHEN_HARMED}": only once '
        "a site's verdict shows it harmed (a job's default)",
        FlagOr(WHEN_HARMED),
    )
    suspects: str = option(
        "corroborated",
        'who a harmed site\'s accusation names: "corroborated" (a site is named only when no single other '
        'site, lying, accounts for every accusation against it) or "any" (one harmed site\'s word names '
        "too: only where every site is trusted to report its verdict honestly)",
        Choice(*SUSPECT_RULES),
        job="model",
    )
    classifier: ClassifierConfig = option(
        None, "domain classifier options (ClassifierConfig)", api="classifier_options", job="classifier"
    )
    solver: SolverConfig = option(None, "z solver options (SolverConfig)", api="solver_options", job="solver")
    ray: RayConfig = option(None, 'Ray runtime options (RayConfig; runtime="ray" only)', api="ray_options")

    def __post_init__(self):
        for name, cls in (("classifier", ClassifierConfig), ("solver", SolverConfig), ("ray", RayConfig)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, cls())

    @property
    def loss(self) -> str:
        return task_loss(self.task)

    @validates_once
    def validate(self) -> FitConfig:
        """Every field of the tree checked; returns self (normalised values set), marked checked:
        validated again, it returns at once (a copy made by ``replace`` is checked anew)."""
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


#: the sub-configurations of the tree: FitConfig's field -> its class
SUBTREES: dict[str, type] = {"classifier": ClassifierConfig, "solver": SolverConfig, "ray": RayConfig}
#: defaults of the API that differ by method (GMSA's KDEs work on the raw inputs)
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {"gmsa": {"features": None}}


@dataclass(frozen=True)
class FitOption:
    """One option of the fit, as its declaration places it (see the module docstring)."""

    path: tuple[str, ...]  #: where it lives in the tree: ("eta",), ("classifier", "mu")
    keyword: str | None  #: its API keyword; None: inside a mapping keyword, or not in the API
    mapping: str | None  #: the API keyword of the mapping that holds it ("solver_options"), if any
    job: tuple[str, str] | None  #: its job-file (table, key); None: a job does not set it
    default: Any
    doc: str
    expects: str


def job_place(spec: str | None, name: str) -> tuple[str, str] | None:
    """(table, key) of a declaration's ``job="table"`` or ``job="table.key"``; None when unset."""
    if not spec:
        return None
    table, _, key = spec.partition(".")
    return table, key or name


def fit_options(root: type = FitConfig) -> list[FitOption]:
    """Every option of the tree ``root`` (FitConfig, or a class extending it), in declaration
    order, a sub-configuration's fields where the sub-configuration is declared."""
    out = []
    for f in fields(root):
        sub = SUBTREES.get(f.name)
        if sub is None:
            keyword = f.name if option_meta(f, "api", True) else None
            default = f.default if f.default is not MISSING else None
            place = job_place(option_meta(f, "job"), f.name)
            out.append(
                FitOption((f.name,), keyword, None, place, default, field_doc(root, f.name), expects(root, f.name))
            )
            continue
        mapping, table = option_meta(f, "api"), option_meta(f, "job")
        for g in fields(sub):
            keyword = g.name if option_meta(g, "keyword") else None
            place = job_place(option_meta(g, "job") or table, g.name)
            out.append(
                FitOption(
                    (f.name, g.name),
                    keyword,
                    None if keyword else mapping,
                    place,
                    g.default,
                    field_doc(sub, g.name),
                    expects(sub, g.name),
                )
            )
    return out


def api_keywords(method: str, root: type = FitConfig) -> dict[str, Any]:
    """{keyword: default} of ``fit_dmsa`` / ``fit_gmsa`` (``method``) and of the estimators, in
    order: the tree's options that the API takes, then each sub-configuration's mapping."""
    out: dict[str, Any] = {}
    for opt in fit_options(root):
        if opt.keyword is not None:
            out[opt.keyword] = opt.default
    for f in fields(root):
        if f.name in SUBTREES:
            out[option_meta(f, "api")] = None
    out.update({k: v for k, v in METHOD_DEFAULTS.get(method, {}).items() if k in out})
    return out


def api_signature(
    method: str, first: tuple[str, ...] = (), last: tuple[str, ...] = (), root: type = FitConfig
) -> inspect.Signature:
    """The signature of the API's fit of ``method``: the ``first`` parameters (``sites``,
    ``self``), ``task`` (by position too), every other keyword of :func:`api_keywords`, then the
    ``last`` keywords (default None: the run's observers)."""
    P = inspect.Parameter
    keywords = api_keywords(method, root)
    params = [P(name, P.POSITIONAL_OR_KEYWORD) for name in first]
    params.append(P("task", P.POSITIONAL_OR_KEYWORD, default=keywords.pop("task")))
    params += [P(k, P.KEYWORD_ONLY, default=v) for k, v in keywords.items()]
    params += [P(k, P.KEYWORD_ONLY, default=None) for k in last]
    return inspect.Signature(params)


def from_keywords(method: str, keywords: dict[str, Any], root: type = FitConfig) -> FitConfig:
    """The validated tree of the API's keyword arguments (every value checked: TypeError /
    ValueError naming the keyword)."""
    values = {**METHOD_DEFAULTS.get(method, {}), **keywords}
    subs: dict[str, Any] = {}
    for f in fields(root):
        sub = SUBTREES.get(f.name)
        if sub is None:
            continue
        mapping = option_meta(f, "api")
        keywords_of_their_own = tuple(g.name for g in fields(sub) if option_meta(g, "keyword"))
        own = {name: check_value(sub, name, values.pop(name)) for name in keywords_of_their_own if name in values}
        given = values.pop(mapping, None)
        runtime = values.get("runtime", root().runtime)
        if f.name == "ray" and given and runtime != "ray":
            raise ValueError(f"{mapping} apply only to runtime='ray'; got runtime={runtime!r}")
        subs[f.name] = from_mapping(sub, given, f"{mapping}: ", exclude=keywords_of_their_own, **own)
    return root(method=method, **values, **subs).validate()


def options_markdown(root: type = FitConfig) -> str:
    """The option table of docs/OPTIONS.md: one row per option of the tree."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [
        "| option | API keyword | job file key | accepts | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for opt in fit_options(root):
        if opt.keyword:
            api = f"`{opt.keyword}`"
        elif opt.mapping:
            api = f"`{opt.mapping}` key `{opt.path[-1]}`"
        else:
            api = "-"
        job = f"`[{opt.job[0]}] {opt.job[1]}`" if opt.job else "-"
        default = "unset" if opt.default is None else f"`{opt.default!r}`"
        rows.append(f"| `{'.'.join(opt.path)}` | {api} | {job} | {cell(opt.expects)} | {default} | {cell(opt.doc)} |")
    return "\n".join(rows) + "\n"


#: the line of docs/OPTIONS.md after which the table made by :func:`options_markdown` stands
OPTIONS_DOC_MARK = "<!-- generated from the configuration tree: do not edit by hand -->\n"
OPTIONS_DOC = Path(__file__).resolve().parents[2] / "docs" / "OPTIONS.md"


def write_options_doc(path: Path = OPTIONS_DOC) -> None:
    """Write the option table of docs/OPTIONS.md again (in a checkout), after its mark."""
    text = path.read_text()
    path.write_text(text[: text.index(OPTIONS_DOC_MARK) + len(OPTIONS_DOC_MARK)] + options_markdown())


__all__ = [
    "FitConfig",
    "FitOption",
    "RayConfig",
    "ClassifierConfig",
    "SolverConfig",
    "api_keywords",
    "api_signature",
    "fit_options",
    "job_place",
    "from_keywords",
    "options_markdown",
    "task_loss",
]
