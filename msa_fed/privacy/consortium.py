"""Who a site federates with, and what it publishes: checks a site runs before any answer.

- :func:`check_consortium`: a job's sites against the site's policy (``peers``, ``max_sites``).
  A job that names a site outside the site's peers (a fake site registered by whoever holds the
  registry's admin token) or more sites than ``max_sites`` (a domain model with one column per
  hidden point needs many sources) is refused, naming the stranger.
- :func:`check_disjoint`: a site's published unlabelled sample shares no row with its labelled
  inputs (:func:`shared_mask` marks the rows, :func:`drop_shared` removes them).  Every answer
  of a site is a sum over its labelled points weighted by functions of their inputs x_i; when
  those inputs are public, the answers are linear in the labels with known coefficients and a
  coordinator decodes them by least squares (``tests/privacy``).  So the labelled inputs never
  leave the site: every path that publishes or serves a sample from a site's data file refuses
  one that contains a labelled row.
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


def _published_form(X) -> np.ndarray:
    """X as the published sample holds it: contiguous little-endian float32 rows, -0.0 as 0.0."""
    A = np.ascontiguousarray(np.asarray(X, dtype="<f4"))
    return A + np.float32(0.0)


def _row_hashes(A: np.ndarray) -> np.ndarray:
    """(n,) uint64: a hash of each row's bytes (A: float32, 2-D, contiguous); equal rows hash equal."""
    words = A.view("<u4").astype(np.uint64)
    h = np.full(A.shape[0], 1469598103934665603, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):
            h = (h ^ words[:, j]) * np.uint64(1099511628211)
    return h


def _member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.isin(a, b) for uint64 keys by a sort and a binary search (measured: np.isin took 15 s on
    1e6 keys where this takes under 1 s)."""
    keys = np.sort(b)
    at = np.minimum(np.searchsorted(keys, a), keys.size - 1)
    return keys[at] == a


def shared_mask(X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> np.ndarray:
    """(m,) bool: which rows of X_unlabeled are also labelled inputs (compared as float32, the
    form in which a sample is published).  Vectorised: rows are matched by a hash of their bytes,
    and the few candidates compared byte for byte."""
    L, U = _published_form(X_labeled), _published_form(X_unlabeled)
    if L.ndim != 2 or U.ndim != 2 or L.shape[0] == 0 or U.shape[0] == 0 or L.shape[1] != U.shape[1]:
        return np.zeros(U.shape[0] if U.ndim else 0, dtype=bool)
    hL, hU = _row_hashes(L), _row_hashes(U)
    mask = _member(hU, hL)
    if mask.any():  # a hash match is a candidate: confirm it on the bytes
        exact = {r.tobytes() for r in L[_member(hL, hU[mask])]}
        rows = np.flatnonzero(mask)
        mask[rows] = [U[i].tobytes() in exact for i in rows]
    return mask


def drop_shared(X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> tuple[np.ndarray, int]:
    """(X_unlabeled without the rows that are labelled inputs too, how many were dropped): what
    ``site publish --drop-shared`` publishes and what the experiments draw their samples through
    (real data sets hold duplicate records: a row drawn for the sample may equal a labelled one)."""
    shared = shared_mask(X_labeled, X_unlabeled)
    n = int(shared.sum())
    return (np.asarray(X_unlabeled)[~shared] if n else X_unlabeled), n


def shared_rows(X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> int:
    """The number of rows of X_unlabeled that are also labelled inputs (compared as float32)."""
    return int(shared_mask(X_labeled, X_unlabeled).sum())


def check_disjoint(site: str, X_labeled: np.ndarray, X_unlabeled: np.ndarray) -> None:
    """ConfigError (one line) when the published sample shares a row with the labelled inputs."""
    if shared_rows(X_labeled, X_unlabeled):  # the count stays here: the message may leave the site
        raise ConfigError(
            f"site {site!r}: the unlabelled sample shares rows with the labelled inputs; a site never "
            "publishes its labelled inputs (use a sample disjoint from X_labeled)"
        )
