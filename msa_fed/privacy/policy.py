"""A site's privacy policy: the limits a site applies to every request, owned by the site.

The policy is a TOML file the site writes and passes to its own process (``load_policy``); on
a Ray node the site actor reads it from ``$MSA_FED_SITE_POLICY`` on its own node.  It is never
taken from the job, the coordinator or the registry: a job may only ask for stricter values
(:func:`tighten`).  The defaults stop the attacks of ``tests/privacy`` and leave honest runs
unaffected; ``docs/DESIGN.md`` ("Site privacy policy") states every rule.

File layout (every section and key optional; unknown ones are errors naming them)::

    [limits]
    min_points = 20                # never aggregate over fewer labelled / unlabelled points
    min_effective_points = 8.0     # every returned sum: effective sample size >= this (by clipping)
    max_point_share = 0.25         # every returned sum: one point's share <= this (by clipping)
    weight_floor = 0.05            # density ratio below which a weight is "small influence"
    peers = ["any"]                # the sites this site federates with (names), or ["any"]
    max_sites = 16                 # the largest number of sites (p) of a job this site serves
    mu_min = 1e-4                  # |W|^2 <= log p / mu_min for a Maxent domain model
    eta_min = 1e-3                 # smoothing: eta >= eta_min
    scale_floor = 0.1              # standardisation scales >= scale_floor * the site's own std
    mean_bound = 10.0              # |mean - site mean| <= mean_bound * site std (standard, rff)
    max_thresholds = 1000          # "threshold" map: at most this many thresholds
    max_components = 5000          # "rff" map: at most this many components
    rff_gamma_max = 100.0          # "rff" map: mean W^2 / 2 <= rff_gamma_max
    kde_bandwidth_floor = 0.001    # KDE bandwidths >= floor * the site's feature std
    feature_maps = ["standard", "onehot", "threshold", "rff"]  # feature maps a domain model may use
    allow_custom_feature_map = true  # in-process callers only (same party); never under Ray
    model_carries_sample = true    # the combined model may carry rows of the published sample (target checks)

    [budget]
    domain_models_per_job = 3      # distinct domain models a job may set
    dc_evaluations_per_job = 5000  # loss evaluations (one per solver step) a job may ask
    domain_models_per_day = 10     # rolling 24 hours, all jobs
    dc_evaluations_per_day = 50000  # rolling 24 hours, all jobs
    ledger = ""                    # SQLite file of the query ledger ("" = in memory)
    audit_log = ""                 # JSON-lines audit log ("" = kept in memory)

    [dp]
    enabled = false                # answer with calibrated Gaussian noise (differential privacy)
    epsilon_per_job = 1.0          # privacy loss one job may spend
    epsilon_lifetime = 10.0        # privacy loss all jobs together may spend, ever
    delta = 1e-6                   # the delta of every (epsilon, delta) guarantee
    dc_evaluations = 40            # DP answers planned per job (noise calibrated for them)
    loss_clip = 10.0               # per-point loss clipped to [0, loss_clip]
    ratio_clip = 10.0              # density ratio q_k = Q(k|x) / Qhat(k) clipped to ratio_clip

    [harm]
    tolerance = 4.0                # harmed: model's loss on own data > own predictor's + tolerance x max(own, 0.25)
    accept = true                  # false: the site does not sign off a model that harms it (disputed)

    [verify]
    domain_models = true           # recompute the domain model from the published samples
    mu_max = 10.0                  # a Maxent model's mu must lie in [mu_min, mu_max]
    tolerance = 0.01               # largest log-odds deviation from the public optimum
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import tomllib

from msa_fed.core.config import MIN_POINTS
from msa_fed.errors import ConfigError

#: on a site's node: the path of the site's policy file (read by the site's own process)
POLICY_ENV = "MSA_FED_SITE_POLICY"
FEATURE_MAPS = ("standard", "onehot", "threshold", "rff")
#: ``peers`` value that admits any site (the default; a deployed site names its peers)
ANY_PEER = ("any",)


@dataclass(frozen=True)
class SitePolicy:
    # [limits]
    min_points: int = MIN_POINTS
    min_effective_points: float = 8.0
    max_point_share: float = 0.25
    weight_floor: float = 0.05
    mu_min: float = 1e-4
    eta_min: float = 1e-3
    scale_floor: float = 0.1
    mean_bound: float = 10.0
    max_thresholds: int = 1000
    max_components: int = 5000
    rff_gamma_max: float = 100.0
    kde_bandwidth_floor: float = 1e-3
    feature_maps: tuple = FEATURE_MAPS
    allow_custom_feature_map: bool = True
    # the combined model may carry rows and summaries of this site's published sample (the
    # support score and the confusion matrix of its target checks); false: nothing of it
    model_carries_sample: bool = True
    # the consortium: a job naming a site outside ``peers`` (unless "any") or more than
    # ``max_sites`` sites is refused.  Default "any" and 16: every honest example and experiment
    # runs (p <= 10); a deployed site names its peers (fake sites are then strangers).
    peers: tuple = ANY_PEER
    max_sites: int = 16
    # [budget]
    domain_models_per_job: int = 3
    dc_evaluations_per_job: int = 5000
    domain_models_per_day: int = 10
    dc_evaluations_per_day: int = 50000
    ledger: str = ""
    audit_log: str = ""
    # [dp]
    dp_enabled: bool = False
    epsilon_per_job: float = 1.0
    epsilon_lifetime: float = 10.0
    delta: float = 1e-6
    dp_dc_evaluations: int = 40
    loss_clip: float = 10.0
    ratio_clip: float = 10.0
    # [harm] the site's verdict on the combined model (msa_fed/core/harm.py)
    harm_tolerance: float = 4.0
    accept_harm: bool = True
    # [verify] (msa_fed/privacy/verify.py)
    verify_domain_models: bool = True
    mu_max: float = 10.0
    verify_tolerance: float = 0.01

    def __post_init__(self):
        for name in ("feature_maps", "peers"):  # lists from a caller: kept as tuples (hashable, frozen)
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        validate(self)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["feature_maps"] = list(self.feature_maps)
        d["peers"] = list(self.peers)
        return d

    def admits(self, site: str) -> bool:
        """Whether ``site`` is one of this site's peers (always, with peers = ["any"])."""
        return self.peers == ANY_PEER or site in self.peers


#: file section -> {key in the file: field name}
SECTIONS: dict[str, dict[str, str]] = {
    "limits": {
        k: k
        for k in (
            "min_points",
            "min_effective_points",
            "max_point_share",
            "weight_floor",
            "mu_min",
            "eta_min",
            "scale_floor",
            "mean_bound",
            "max_thresholds",
            "max_components",
            "rff_gamma_max",
            "kde_bandwidth_floor",
            "feature_maps",
            "allow_custom_feature_map",
            "model_carries_sample",
            "peers",
            "max_sites",
        )
    },
    "budget": {
        k: k
        for k in (
            "domain_models_per_job",
            "dc_evaluations_per_job",
            "domain_models_per_day",
            "dc_evaluations_per_day",
            "ledger",
            "audit_log",
        )
    },
    "dp": {
        "enabled": "dp_enabled",
        "epsilon_per_job": "epsilon_per_job",
        "epsilon_lifetime": "epsilon_lifetime",
        "delta": "delta",
        "dc_evaluations": "dp_dc_evaluations",
        "loss_clip": "loss_clip",
        "ratio_clip": "ratio_clip",
    },
    "harm": {"tolerance": "harm_tolerance", "accept": "accept_harm"},
    "verify": {"domain_models": "verify_domain_models", "mu_max": "mu_max", "tolerance": "verify_tolerance"},
}

_INTS = {
    "min_points",
    "max_sites",
    "max_thresholds",
    "max_components",
    "domain_models_per_job",
    "dc_evaluations_per_job",
    "domain_models_per_day",
    "dc_evaluations_per_day",
    "dp_dc_evaluations",
}
_BOOLS = {"allow_custom_feature_map", "model_carries_sample", "dp_enabled", "verify_domain_models", "accept_harm"}
_STRS = {"ledger", "audit_log"}
#: numbers where a larger value is stricter (the rest of the numbers: smaller is stricter)
HIGHER_IS_STRICTER = {
    "min_points",
    "min_effective_points",
    "weight_floor",
    "mu_min",
    "eta_min",
    "scale_floor",
    "kde_bandwidth_floor",
}
LOWER_IS_STRICTER = {
    "max_point_share",
    "max_sites",
    "mean_bound",
    "max_thresholds",
    "max_components",
    "rff_gamma_max",
    "domain_models_per_job",
    "dc_evaluations_per_job",
    "domain_models_per_day",
    "dc_evaluations_per_day",
    "epsilon_per_job",
    "epsilon_lifetime",
    "delta",
    "dp_dc_evaluations",
    "loss_clip",
    "ratio_clip",
    "mu_max",
    "verify_tolerance",
}
#: what a job may ask for (stricter values only); files, DP planning and lifetime stay the site's
JOB_KEYS = (
    HIGHER_IS_STRICTER
    | LOWER_IS_STRICTER
    | {"feature_maps", "allow_custom_feature_map", "model_carries_sample", "dp_enabled"}
) - {"epsilon_lifetime"}


#: a job may turn verification on (never off)
JOB_KEYS = JOB_KEYS | {"verify_domain_models"}


def _check_type(name: str, value):
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"site policy: {name} must be true or false; got {value!r}")
    elif name in _STRS:
        if not isinstance(value, str):
            raise ConfigError(f"site policy: {name} must be a string; got {value!r}")
    elif name == "peers":
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(v, str) and v for v in value)
            or ("any" in value and len(value) > 1)
        ):
            raise ConfigError(f'site policy: peers must be a non-empty list of site names, or ["any"]; got {value!r}')
    elif name == "feature_maps":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"site policy: feature_maps must be a list of names; got {value!r}")
        unknown = [v for v in value if v not in FEATURE_MAPS]
        if unknown:
            raise ConfigError(f"site policy: feature_maps: unknown map(s) {unknown}; known: {list(FEATURE_MAPS)}")
    elif name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"site policy: {name} must be an integer; got {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"site policy: {name} must be a finite number; got {value!r}")


def validate(policy: SitePolicy) -> SitePolicy:
    for f in fields(policy):
        _check_type(f.name, getattr(policy, f.name))
    positive = [
        "min_effective_points",
        "mu_min",
        "eta_min",
        "scale_floor",
        "mean_bound",
        "rff_gamma_max",
        "kde_bandwidth_floor",
        "epsilon_per_job",
        "epsilon_lifetime",
        "delta",
        "loss_clip",
        "ratio_clip",
        "mu_max",
        "verify_tolerance",
    ]
    for name in positive:
        if not getattr(policy, name) > 0:
            raise ConfigError(f"site policy: {name} must be > 0; got {getattr(policy, name)!r}")
    if policy.max_sites < 2:
        raise ConfigError(f"site policy: max_sites must be >= 2 (a job has two sites); got {policy.max_sites!r}")
    at_least_one = [
        "min_points",
        "max_thresholds",
        "max_components",
        "domain_models_per_job",
        "dc_evaluations_per_job",
        "domain_models_per_day",
        "dc_evaluations_per_day",
        "dp_dc_evaluations",
    ]
    for name in at_least_one:
        if getattr(policy, name) < 1:
            raise ConfigError(f"site policy: {name} must be >= 1; got {getattr(policy, name)!r}")
    if not 0 < policy.max_point_share <= 1:
        raise ConfigError(f"site policy: max_point_share must be in (0, 1]; got {policy.max_point_share!r}")
    if policy.harm_tolerance < 0:
        raise ConfigError(f"site policy: harm_tolerance must be >= 0; got {policy.harm_tolerance!r}")
    if policy.weight_floor < 0:
        raise ConfigError(f"site policy: weight_floor must be >= 0; got {policy.weight_floor!r}")
    if policy.mu_max < policy.mu_min:
        raise ConfigError(f"site policy: mu_max ({policy.mu_max!r}) is below mu_min ({policy.mu_min!r})")
    if not policy.delta < 1:
        raise ConfigError(f"site policy: delta must be < 1; got {policy.delta!r}")
    if policy.epsilon_per_job > policy.epsilon_lifetime:
        raise ConfigError(
            f"site policy: epsilon_per_job ({policy.epsilon_per_job}) exceeds epsilon_lifetime "
            f"({policy.epsilon_lifetime})"
        )
    return policy


def policy_from_mapping(doc: Mapping[str, Any], source: str = "site policy") -> SitePolicy:
    """A policy from the parsed TOML document (sections as in the module docstring)."""
    values: dict[str, Any] = {}
    for section, body in doc.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; expected some of {sorted(SECTIONS)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table")
        for key, value in body.items():
            if key not in SECTIONS[section]:
                raise ConfigError(
                    f"{source}: unknown key {key!r} in [{section}]; expected some of {sorted(SECTIONS[section])}"
                )
            name = SECTIONS[section][key]
            _check_type(name, value)
            values[name] = tuple(value) if name in ("feature_maps", "peers") else value
    return SitePolicy(**values)


def load_policy(path) -> SitePolicy:
    """Read and validate a site policy file (TOML); ConfigError naming the file and the key."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"site policy file {path!r} not found") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"site policy file {path!r} is unreadable: {exc}") from None
    return policy_from_mapping(doc, f"site policy {path!r}")


def policy_from_env() -> SitePolicy:
    """The policy named by ``$MSA_FED_SITE_POLICY`` on this node, else the defaults."""
    path = os.environ.get(POLICY_ENV)
    return load_policy(path) if path else SitePolicy()


def tighten(policy: SitePolicy, job_request: Mapping[str, Any] | SitePolicy | None) -> SitePolicy:
    """``policy`` with the job's requested values applied where they are stricter.

    A job may raise floors (min_points, mu_min, eta_min, ...), lower ceilings and budgets
    (max_point_share, budgets, epsilon, ...), shrink the feature-map allowlist, turn DP on and
    forbid custom feature maps; a looser value is ignored (the site's value stays).  Keys a job
    may not set at all (files, epsilon_lifetime) and unknown keys are errors.
    """
    if job_request is None:
        return policy
    req = job_request.as_dict() if isinstance(job_request, SitePolicy) else dict(job_request)
    if isinstance(job_request, SitePolicy):  # a whole policy object: only its tightenings count
        req = {k: v for k, v in req.items() if k in JOB_KEYS}
    changes: dict[str, Any] = {}
    for key, value in req.items():
        if key not in JOB_KEYS:
            raise ConfigError(
                f"job privacy request: {key!r} cannot be set by a job; it may set some of {sorted(JOB_KEYS)}"
            )
        _check_type(key, value)
        current = getattr(policy, key)
        if key in HIGHER_IS_STRICTER:
            changes[key] = type(current)(max(current, value))
        elif key in LOWER_IS_STRICTER:
            changes[key] = type(current)(min(current, value))
        elif key == "feature_maps":
            changes[key] = tuple(v for v in current if v in set(value))
        elif key in ("allow_custom_feature_map", "model_carries_sample"):
            changes[key] = current and value
        elif key in ("dp_enabled", "verify_domain_models"):
            changes[key] = current or value
    if not changes:
        return policy
    out = replace(policy, **changes)
    if out.epsilon_per_job > out.epsilon_lifetime:  # cannot happen by min(); kept as a guard
        raise ConfigError("job privacy request: epsilon_per_job above the site's lifetime budget")
    return out


__all__ = [
    "JOB_KEYS",
    "POLICY_ENV",
    "SitePolicy",
    "load_policy",
    "policy_from_env",
    "policy_from_mapping",
    "tighten",
]
