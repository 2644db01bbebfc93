"""A site's privacy policy: the limits a site applies to every request, owned by the site.

The policy is a TOML file the site writes and passes to its own process (``load_policy``); on
a Ray node the site actor reads it from ``$MSA_FED_SITE_POLICY`` on its own node.  It is never
taken from the job, the coordinator or the registry: a job may only ask for stricter values
(:func:`tighten`).  The defaults stop the attacks of ``tests/privacy`` and leave honest runs
unaffected; ``docs/DESIGN.md`` ("Site policy") states every rule.

Each key is declared once, as a field of :class:`SitePolicy` (:func:`msa_fed.core.options.option`):
its default, its check, its one-line description, the file table (``section``) and name (``key``,
default the field's name) it is read from, and what a job may do with it (``job``: "raise",
"lower", "narrow", "turn off", "turn on"; absent: the site's alone).  The file's parsing, the
error messages, :func:`tighten` and the reference table of docs/OPERATIONS.md
(:mod:`msa_fed.federation.config_doc`) all read that declaration.  Every table and key of the file
is optional; an unknown one is an error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import tomllib

from msa_fed.core.config import MIN_POINTS
from msa_fed.core.options import Check, Flag, Integer, Number, Text, check_value, normalise, option, option_meta
from msa_fed.errors import ConfigError

#: on a site's node: the path of the site's policy file (read by the site's own process)
POLICY_ENV = "MSA_FED_SITE_POLICY"
FEATURE_MAPS = ("standard", "onehot", "threshold", "rff")
#: ``peers`` value that admits any site (the default; a deployed site names its peers)
ANY_PEER = ("any",)
_WHERE = "site policy: "


class _Names(Check):
    """A list of names as a tuple: drawn from ``known`` (if given), or site names where "any"
    stands alone and the list is not empty."""

    def __init__(self, known: tuple[str, ...] | None = None) -> None:
        self.known = known
        self.expects = f"a list of names from {list(known)}" if known else 'a non-empty list of site names, or ["any"]'

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise TypeError(self.expects)
        unknown = [v for v in value if self.known and v not in self.known]
        if unknown:
            raise ValueError(f"{self.expects}, not unknown map(s) {unknown}")
        if not self.known and (not value or ("any" in value and len(value) > 1)):
            raise ValueError(self.expects)
        return tuple(value)


def _positive(high: float | None = None) -> Number:
    return Number(0, high, open_low=True, open_high=high is not None)


def limits(default: Any, doc: str, check: Check, job: str | None = None) -> Any:
    return option(default, doc, check, section="limits", job=job)


def budget(default: Any, doc: str, check: Check, job: str | None = "lower") -> Any:
    return option(default, doc, check, section="budget", job=job)


@dataclass(frozen=True)
class SitePolicy:
    min_points: int = limits(MIN_POINTS, "never aggregate over fewer labelled / unlabelled points", Integer(1), "raise")
    min_effective_points: float = limits(
        8.0, "every returned sum: effective sample size >= this (by clipping)", _positive(), "raise"
    )
    max_point_share: float = limits(
        0.25, "every returned sum: one point's share <= this (by clipping)", Number(0, 1, open_low=True), "lower"
    )
    weight_floor: float = limits(0.05, 'density ratio below which a weight is "small influence"', Number(0), "raise")
    mu_min: float = limits(1e-4, "|W|^2 <= log p / mu_min for a Maxent domain model", _positive(), "raise")
    eta_min: float = limits(1e-3, "smoothing: eta >= eta_min", _positive(), "raise")
    scale_floor: float = limits(0.1, "standardisation scales >= scale_floor * the site's own std", _positive(), "raise")
    mean_bound: float = limits(
        10.0, "|mean - site mean| <= mean_bound * site std (standard, rff)", _positive(), "lower"
    )
    max_thresholds: int = limits(1000, '"threshold" map: at most this many thresholds', Integer(1), "lower")
    max_components: int = limits(5000, '"rff" map: at most this many components', Integer(1), "lower")
    rff_gamma_max: float = limits(100.0, '"rff" map: mean W^2 / 2 <= rff_gamma_max', _positive(), "lower")
    kde_bandwidth_floor: float = limits(1e-3, "KDE bandwidths >= floor * the site's feature std", _positive(), "raise")
    feature_maps: tuple = limits(FEATURE_MAPS, "feature maps a domain model may use", _Names(FEATURE_MAPS), "narrow")
    allow_custom_feature_map: bool = limits(
        True, "in-process callers only (same party); never under Ray", Flag(), "turn off"
    )
    model_carries_sample: bool = limits(
        True,
        "the combined model may carry rows of the published sample (target checks)",
        Flag(),
        "turn off",
    )
    # a job naming a site outside ``peers`` (unless "any") or more than ``max_sites`` sites is
    # refused; every honest example runs (p <= 10); a deployed site names its peers
    peers: tuple = limits(ANY_PEER, 'the sites this site federates with (names), or ["any"]', _Names())
    max_sites: int = limits(16, "the largest number of sites (p) of a job this site serves", Integer(2), "lower")
    domain_models_per_job: int = budget(3, "distinct domain models a job may set", Integer(1))
    dc_evaluations_per_job: int = budget(5000, "loss evaluations (one per solver step) a job may ask", Integer(1))
    domain_models_per_day: int = budget(10, "rolling 24 hours, all jobs", Integer(1))
    dc_evaluations_per_day: int = budget(50000, "rolling 24 hours, all jobs", Integer(1))
    ledger: str = budget("", 'SQLite file of the query ledger ("" = in memory)', Text(), None)
    audit_log: str = budget("", 'JSON-lines audit log ("" = kept in memory)', Text(), None)
    dp_enabled: bool = option(
        False,
        "answer with calibrated Gaussian noise (differential privacy)",
        Flag(),
        section="dp",
        key="enabled",
        job="turn on",
    )
    epsilon_per_job: float = option(1.0, "privacy loss one job may spend", _positive(), section="dp", job="lower")
    epsilon_lifetime: float = option(10.0, "privacy loss all jobs together may spend, ever", _positive(), section="dp")
    delta: float = option(
        1e-6, "the delta of every (epsilon, delta) guarantee", _positive(1), section="dp", job="lower"
    )
    dp_dc_evaluations: int = option(
        40,
        "DC answers planned per job; with the verdict's one answer, reserved for it, the noise is calibrated for them",
        Integer(1),
        section="dp",
        key="dc_evaluations",
        job="lower",
    )
    loss_clip: float = option(10.0, "per-point loss clipped to [0, loss_clip]", _positive(), section="dp", job="lower")
    ratio_clip: float = option(
        10.0, "density ratio q_k = Q(k|x) / Qhat(k) clipped to ratio_clip", _positive(), section="dp", job="lower"
    )
    # the site's verdict on the combined model (msa_fed/core/harm.py)
    harm_tolerance: float = option(
        4.0,
        "harmed: model's loss on own data > own predictor's + tolerance x max(own, 0.25)",
        Number(0),
        section="harm",
        key="tolerance",
    )
    accept_harm: bool = option(
        True,
        "false: the site does not sign off a model that harms it (disputed)",
        Flag(),
        section="harm",
        key="accept",
    )
    # msa_fed/privacy/verify.py
    verify_domain_models: bool = option(
        True,
        "recompute the domain model from the published samples",
        Flag(),
        section="verify",
        key="domain_models",
        job="turn on",
    )
    mu_max: float = option(
        10.0, "a Maxent model's mu must lie in [mu_min, mu_max]", _positive(), section="verify", job="lower"
    )
    verify_tolerance: float = option(
        0.01,
        "largest log-odds deviation from the public optimum",
        _positive(),
        section="verify",
        key="tolerance",
        job="lower",
    )

    def __post_init__(self):
        validate(self)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["feature_maps"] = list(self.feature_maps)
        d["peers"] = list(self.peers)
        return d

    def admits(self, site: str) -> bool:
        """Whether ``site`` is one of this site's peers (always, with peers = ["any"])."""
        return self.peers == ANY_PEER or site in self.peers


def declared(cls: type) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """From the fields' declarations: {file table: {key in the file: field name}} and
    {field name: what a job may do with it}."""
    sections: dict[str, dict[str, str]] = {}
    for f in fields(cls):
        sections.setdefault(option_meta(f, "section"), {})[option_meta(f, "key") or f.name] = f.name
    return sections, {f.name: option_meta(f, "job") for f in fields(cls) if option_meta(f, "job")}


#: what a job may ask for (stricter values only); files, DP planning and lifetime stay the site's
SECTIONS, JOB_RULES = declared(SitePolicy)
_TIGHTEN: dict[str, Callable[[Any, Any], Any]] = {
    "raise": max,
    "lower": min,
    "narrow": lambda current, asked: tuple(v for v in current if v in set(asked)),
    "turn off": lambda current, asked: current and asked,
    "turn on": lambda current, asked: current or asked,
}


def _checked(name: str, value: Any) -> Any:
    """``value`` checked and normalised for field ``name``; ConfigError "site policy: name must be ..."."""
    try:
        return check_value(SitePolicy, name, value, _WHERE)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def validate(policy: SitePolicy) -> SitePolicy:
    """Every field checked and normalised (lists kept as tuples), then the rules between fields."""
    try:
        normalise(policy, _WHERE)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if policy.mu_max < policy.mu_min:
        raise ConfigError(f"site policy: mu_max ({policy.mu_max!r}) is below mu_min ({policy.mu_min!r})")
    if policy.epsilon_per_job > policy.epsilon_lifetime:
        raise ConfigError(
            f"site policy: epsilon_per_job ({policy.epsilon_per_job}) exceeds epsilon_lifetime "
            f"({policy.epsilon_lifetime})"
        )
    return policy


def policy_from_mapping(doc: Mapping[str, Any], source: str = "site policy") -> SitePolicy:
    """A policy from the parsed TOML document (tables and keys as declared on :class:`SitePolicy`)."""
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
            values[name] = _checked(name, value)
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
        req = {k: v for k, v in req.items() if k in JOB_RULES}
    changes: dict[str, Any] = {}
    for key, value in req.items():
        if key not in JOB_RULES:
            raise ConfigError(
                f"job privacy request: {key!r} cannot be set by a job; it may set some of {sorted(JOB_RULES)}"
            )
        try:
            value = check_value(SitePolicy, key, value, "job privacy request: ")
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        except ValueError:  # the right type, out of range: the stricter of it and the site's value is checked below
            pass
        changes[key] = _TIGHTEN[JOB_RULES[key]](getattr(policy, key), value)
    if not changes:
        return policy
    out = replace(policy, **changes)
    if out.epsilon_per_job > out.epsilon_lifetime:  # cannot happen by min(); kept as a guard
        raise ConfigError("job privacy request: epsilon_per_job above the site's lifetime budget")
    return out


__all__ = [
    "JOB_RULES",
    "POLICY_ENV",
    "SitePolicy",
    "load_policy",
    "policy_from_env",
    "policy_from_mapping",
    "tighten",
]
