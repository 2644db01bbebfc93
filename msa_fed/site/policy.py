"""Which policy a site enforces, as its host hands it in.

A site worker does not guess who runs it: its host says so (``host``), and that decides where its
policy comes from and which requests it may trust:

- ``"process"``: the site's own process: an in-process caller of the API (the policy it passes,
  else the node's), or the site process ``msa-fed site serve`` (site.toml's policy).  A custom
  feature map (a Python object) is accepted when the policy allows it: only the site's own
  process can hand one over.
- ``"ray"``: an actor started by the party that runs the job (the Ray runtime, the cluster
  topology): its arguments come from the job, so the policy is the one named by
  ``$MSA_FED_SITE_POLICY`` on the site's node (else the defaults) and a policy passed with the
  job only tightens it; no custom feature map is accepted.

In both, the job's own requests (min_points, privacy values) only tighten.
"""

from __future__ import annotations

from msa_fed.errors import ConfigError
from msa_fed.privacy.policy import SitePolicy, policy_from_env, tighten

#: who hosts a site worker (see the module docstring)
HOSTS = ("process", "ray")


def check_host(host: str) -> str:
    if host not in HOSTS:
        raise ConfigError(f"a site's host must be one of {list(HOSTS)}; got {host!r}")
    return host


def trusts_custom_feature_maps(host: str, policy: SitePolicy) -> bool:
    """Whether a site under ``host`` accepts a custom (in-process) feature map."""
    return host == "process" and policy.allow_custom_feature_map


def site_policy(given: SitePolicy | None, job_request=None, *, host: str = "process") -> SitePolicy:
    """The policy a site under ``host`` enforces (see the module docstring): ``given`` is the
    policy its host passed, ``job_request`` (the job's own values, e.g. min_points) only tightens."""
    if given is not None and not isinstance(given, SitePolicy):
        raise ConfigError(f"policy must be a SitePolicy; got {type(given).__name__}")
    if check_host(host) == "ray":
        base = tighten(policy_from_env(), given)
    else:
        base = given if given is not None else policy_from_env()
    return tighten(base, job_request)
