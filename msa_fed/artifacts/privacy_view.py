"""How a combined model's differential privacy is shown: epsilon per site, losses as estimates.

With DP on at any site, the losses L_k(z) a model carries are the DP solver's estimates from
noisy, clipped answers (:mod:`msa_fed.privacy.solver`), not measured values: they are shown
clamped at 0 (a loss is never negative) and marked as estimates.  One place for the job
summary, ``msa-fed model show`` and the HTML report (``msa_fed.jobs.report``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: the mark after a loss that is a DP estimate, and what it means
ESTIMATE_MARK = "~"
ESTIMATE_NOTE = "~ DP estimate: from noisy, clipped answers (clamped at 0), not a measured loss"


def dp_on(epsilon_by_site: Mapping[str, float] | None) -> bool:
    """Whether any site answered with DP (spent a positive epsilon)."""
    return any(float(v) > 0 for v in (epsilon_by_site or {}).values())


def epsilon_line(names: Sequence[str], epsilon_by_site: Mapping[str, float] | None) -> str | None:
    """ "a=1, b=0.98, c=0 (DP off)" for the sites in order; None when no site used DP."""
    eps = dict(epsilon_by_site or {})
    if not dp_on(eps):
        return None
    parts = []
    for n in names:
        v = float(eps.get(n, 0.0))
        parts.append(f"{n}={v:.4g}" if v > 0 else f"{n}=0 (DP off)")
    return ", ".join(parts)


def shown_losses(losses, epsilon_by_site: Mapping[str, float] | None) -> np.ndarray:
    """The losses as shown: clamped at 0 when they are DP estimates (NaN stays NaN)."""
    L = np.asarray(losses, dtype=np.float64)
    return np.where(np.isnan(L), L, np.maximum(L, 0.0)) if dp_on(epsilon_by_site) else L


def loss_texts(losses, epsilon_by_site: Mapping[str, float] | None) -> list[str]:
    """Each loss as text ("0.1234", or "~0.1234" for a DP estimate)."""
    mark = ESTIMATE_MARK if dp_on(epsilon_by_site) else ""
    return [f"{mark}{v:.4f}" for v in shown_losses(losses, epsilon_by_site)]


#: what the losses shown are when the sites measured them (the model's info["site_check"])
MEASURED_NOTE = (
    "L_k(z): the combined model's loss on site k's labelled data, measured by site k"
    " (~ noisy: the site answers with DP noise)"
)


def site_check_of(info) -> dict | None:
    """The sites' verdicts a model carries (info["site_check"]), or None."""
    check = info.get("site_check") if isinstance(info, Mapping) else None
    return check if isinstance(check, Mapping) and check.get("sites") else None  # type: ignore[return-value]


def reported_losses(
    info, domain_losses, epsilon_by_site: Mapping[str, float] | None
) -> tuple[np.ndarray, list[str], bool]:
    """(values, texts, measured) of the per-site losses a summary shows: the values the sites
    measured on their own labelled data where the model carries them (noisy ones marked ~),
    else the solver's L_k(z) (:func:`loss_texts`)."""
    check = site_check_of(info)
    if check is not None:
        values = np.maximum(np.asarray(check["combined"], dtype=np.float64), 0.0)
        texts = [f"{ESTIMATE_MARK if noisy else ''}{v:.4f}" for v, noisy in zip(values, check["noisy"])]
        return values, texts, True
    if domain_losses is None:
        return np.array([]), [], False
    return shown_losses(domain_losses, epsilon_by_site), loss_texts(domain_losses, epsilon_by_site), False


def worst_text(values: np.ndarray, texts: list[str]) -> str:
    """The text of the largest of ``values`` (as :func:`reported_losses` wrote it)."""
    return texts[int(np.nanargmax(values))] if len(texts) else "-"
