"""Who a site federates with, and what it publishes: checks a site runs before any answer.

- :func:`check_consortium`: a job's sites against the site's policy (``peers``, ``max_sites``).
  A job that names a site outside the site's peers (a fake site registered by whoever holds the
  registry's admin token) or more sites than ``max_sites`` (a domain model with one column per
  hidden point needs many sources) is refused, naming the stranger.
- :func:`check_disjoint`: a site's published unlabelled sample shares no row with its labelled
  inputs.  Every answer of a site is a sum over its labelled points weighted by functions of
  their inputs x_i; when those inputs are public, the answers are linear in the labels with
  known coefficients and a coordinator decodes them by least squares (``tests/privacy``).  So
  the labelled inputs never leave the site: every path that publishes or serves a sample from a
  site's data file refuses one that contains a labelled row.
"""

from __future__ import annotations

import numpy as np

from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.policy import SitePolicy


def check_consortium(site: str, sites, n_sources: int, policy: SitePolicy) -> dict:
    """Refuse a job of more than ``policy.max_sites`` sites or one naming a site that is not a
    peer of ``site``.  ``sites``: the job's site names (None when the caller did not name
    them: then only ``peers = ["any"]`` admits the job)."""
    p = int(n_sources)
    if p > policy.max_sites:
        raise PrivacyError(
            "max_sites", site, f"a job of {p} sites: it serves jobs of at most max_sites={policy.max_sites}"
        )
    if sites is None:
        if not policy.admits(""):
            raise PrivacyError("peers", site, "a job that does not name its sites: its policy names its peers")
        return {"sites": None, "p": p}
    sites = [str(s) for s in sites]
    if len(sites) != p:
        raise PrivacyError("peers", site, f"a job that names {len(sites)} sites for {p} predictors")
    strangers = [s for s in sites if s != site and not policy.admits(s)]
    if strangers:
        raise PrivacyError(
            "peers",
            site,
            f"a job with site(s) {strangers}: not among its peers {list(policy.peers)}",
        )
    return {"sites": sites, "p": p}


def row_keys(X: np.ndarray) -> set[bytes]:
    """The rows of X as bytes of their float32 form (the form in which a sample is published)."""
    A = np.ascontiguousarray(np.asarray(X, dtype="<f4"))
    if A.ndim != 2 or A.shape[0] == 0:
        return set()
    A = A + np.float32(0.0)  # -0.0 and 0.0 are one value
    return {r.tobytes() for r in A}


def shared_rows(X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> int:
    """The number of rows of X_unlabeled that are also labelled inputs (compared as float32)."""
    labelled = row_keys(X_labeled)
    if not labelled:
        return 0
    U = np.ascontiguousarray(np.asarray(X_unlabeled, dtype="<f4")) + np.float32(0.0)
    return sum(1 for r in U if r.tobytes() in labelled)


def check_disjoint(site: str, X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> None:
    """ConfigError (one line) when the published sample shares a row with the labelled inputs."""
    if shared_rows(X_labeled, X_unlabeled):  # the count stays here: the message may leave the site
        raise ConfigError(
            f"site {site!r}: the unlabelled sample shares rows with the labelled inputs; a site never "
            "publishes its labelled inputs (use a sample disjoint from X_labeled)"
        )
