"""Each site's verdict on a combined model, and the sites whose exclusion removes a harm.

A consortium model is good for a member only if that member says so (docs/DESIGN.md, section 4,
point 4).  Site k measures, on its own labelled points, two means: the combined model's loss and
its own predictor's loss.  ``harm_k`` = combined - own.  The losses L_k(z) the solver works with
are importance-weighted estimates over every site's points: a peer's predictor that is wrong
only on k's rows, or a peer that lies about its own losses, moves them and z while every check
passes; only k's own measurement shows what the model does to k's data.

Site k is *harmed* when harm_k exceeds ``tolerance * max(own_k, SCALE_FLOOR)`` and
:data:`MIN_HARM` (``tolerance`` is a policy value of the site: :func:`harmed`).  The min-max
solution raises the easy domains' losses towards the hardest one's by design, so an honest
model is often worse than a site's own predictor on its data: measured on the policy sweep's
honest federations (p = 2 to 8, 30 to 1000 points per site, separated and overlapping domains
with their own labelling rules), harm reached 0.74 nats and 2.98 x max(own, 0.25); the default
tolerance, 4, lies above every one of them.  Where the influence analysis re-solved the mixture without each
site j (z^{-j}), the sites measure the combined model's loss at every z^{-j} in the same request;
site j is a *suspect* when a harmed site k != j is no longer harmed at z^{-j}
(:func:`suspects`).  A site's own claims never clear it: only the other sites' measurements
decide whether j is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from msa_fed.core.dc_terms import PROB_FLOOR

#: a harm below this (in loss units) is never a harm: the noise of an honest measurement
MIN_HARM = 0.01
#: the tolerance is a multiple of the site's own predictor's loss, or of this when that is smaller
#: (a near-perfect own predictor does not make every honest trade-off a harm)
SCALE_FLOOR = 0.25


def point_losses(g: np.ndarray, loss: str, y: np.ndarray | None) -> np.ndarray:
    """Per-point loss of predictions ``g`` (true-label probabilities, or values for the squared
    loss against ``y``); g may be (n,) or (m, n)."""
    if loss == "cross_entropy":
        out: np.ndarray = -np.log(np.maximum(g, PROB_FLOOR))
        return out
    assert y is not None  # squared loss: regression labels
    sq: np.ndarray = (g - y) ** 2
    return sq


def measured_losses(
    Q: np.ndarray,
    qhat: np.ndarray,
    H: np.ndarray,
    zs: np.ndarray,
    eta: float,
    loss: str,
    own: int,
    *,
    y: np.ndarray | None = None,
    loss_clip: float = np.inf,
) -> tuple[np.ndarray, float]:
    """(combined (m,), own) mean losses over a site's n labelled points.

    Q (n, p): Q(k|x_i);  qhat (p,);  H (n, p): h_k(x_i) (regression) or h_k(x_i, y_i);
    zs (m, p): the mixtures;  own: the column of the site's own predictor.  The combined model
    is the deployed g_z(x) = sum_k (z_k q_k(x) + eta/p) h_k(x) / (sum_k z_k q_k(x) + eta);
    each point's loss is clipped to [0, loss_clip] (one point moves each mean by at most
    loss_clip / n)."""
    Q = np.asarray(Q, dtype=np.float64)
    H = np.asarray(H, dtype=np.float64)
    zs = np.atleast_2d(np.asarray(zs, dtype=np.float64))
    n, p = Q.shape
    if loss == "cross_entropy":
        H = np.maximum(H, PROB_FLOOR)
    ratios = Q / np.asarray(qhat, dtype=np.float64)[None, :]  # q_k(x_i)
    den = zs @ ratios.T + eta  # (m, n)
    num = zs @ (ratios * H).T + (eta / p) * H.sum(axis=1)[None, :]  # (m, n)
    g = num / den
    combined = np.clip(point_losses(g, loss, y), 0.0, loss_clip).mean(axis=1)
    own_loss = float(np.clip(point_losses(H[:, own], loss, y), 0.0, loss_clip).mean())
    return combined, own_loss


def harmed(combined: float, own: float, tolerance: float) -> bool:
    """Whether a site whose own predictor's loss is ``own`` is harmed by a model of loss
    ``combined`` on its data, at the site's ``tolerance``."""
    return bool(combined - own > max(tolerance * max(own, SCALE_FLOOR), MIN_HARM))


def suspects(
    names: Sequence[str],
    combined: np.ndarray,
    own: np.ndarray,
    tolerance: np.ndarray,
    noisy: Sequence[bool] | None = None,
    without_sites: np.ndarray | None = None,
) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """(suspects, {harmed site: the sites whose exclusion removes its harm}).

    combined (p, 1 + p): row k, site k's measured loss at the model's z (column 0) and at each
    z^{-j} (column 1 + j);  own (p,), tolerance (p,).  Site j is a suspect when some harmed
    site k != j is not harmed at z^{-j}.  A site whose verdict carries DP noise (``noisy``) is
    not judged: its noise, not the model, can put it past its tolerance.

    ``without_sites`` (p, p), when given, decides instead: row k, site k's measured loss at the
    mixture re-solved without site j *and its labelled points* (column j).  The influence
    analysis's z^{-j} drops only domain j from the min-max: a site whose labelled points poison a
    peer's loss estimate (rows in the peer's region, labelled against the peer) moves z just as
    much without its domain, and the exclusion that removes the harm is the one of its data."""
    combined = np.asarray(combined, dtype=np.float64)
    p = len(names)
    noisy = [False] * p if noisy is None else [bool(x) for x in noisy]
    removed: dict[str, list[str]] = {}
    named: set[int] = set()
    for k in range(p):
        if noisy[k] or not harmed(combined[k, 0], own[k], tolerance[k]):
            continue
        by = []
        if without_sites is not None:
            table = np.asarray(without_sites, dtype=np.float64)
            by = [j for j in range(p) if j != k and not harmed(table[k, j], own[k], tolerance[k])]
        elif combined.shape[1] == 1 + p:
            by = [j for j in range(p) if j != k and not harmed(combined[k, 1 + j], own[k], tolerance[k])]
        removed[names[k]] = [names[j] for j in by]
        named.update(by)
    return tuple(names[j] for j in sorted(named)), removed


def site_check(
    names: Sequence[str],
    combined: np.ndarray,
    own: np.ndarray,
    tolerance: np.ndarray,
    noisy: Sequence[bool],
    signs_off: Sequence[bool],
    without_sites: np.ndarray | None = None,
) -> dict[str, Any]:
    """The sites' verdicts on a model as a JSON-able dict (the model's ``info["site_check"]``):
    ``sites``, ``combined`` / ``own`` (each site's measured losses at the model's z), ``harm``
    (combined - own), ``tolerance``, ``noisy`` (DP noise in the site's answer), ``harmed``,
    ``signs_off``, ``disputed`` (the sites that do not sign it off), ``suspects``,
    ``removed_by`` ({harmed site: the sites whose exclusion removes its harm}) and
    ``combined_without`` (p x p: site k's loss without site j, row k; absent without the
    influence analysis) and ``loss_without_site`` (p x p: site k's loss at the mixture re-solved
    without site j and its labelled points, row k; :func:`suspects`; present once a site was
    harmed)."""
    names = [str(n) for n in names]
    combined = np.asarray(combined, dtype=np.float64)
    own = np.asarray(own, dtype=np.float64)
    tolerance = np.asarray(tolerance, dtype=np.float64)
    named, removed = suspects(names, combined, own, tolerance, noisy, without_sites)
    out: dict[str, Any] = {
        "sites": names,
        "combined": [float(x) for x in combined[:, 0]],
        "own": [float(x) for x in own],
        "harm": [float(x) for x in combined[:, 0] - own],
        "tolerance": [float(x) for x in tolerance],
        "noisy": [bool(x) for x in noisy],
        "harmed": [not noisy[k] and harmed(combined[k, 0], own[k], tolerance[k]) for k in range(len(names))],
        "signs_off": [bool(x) for x in signs_off],
        "disputed": [n for n, ok in zip(names, signs_off) if not ok],
        "suspects": list(named),
        "removed_by": removed,
    }
    if combined.shape[1] == 1 + len(names):
        out["combined_without"] = [[float(x) for x in row[1:]] for row in combined]
    if without_sites is not None:
        out["loss_without_site"] = [[float(x) for x in row] for row in np.asarray(without_sites, dtype=np.float64)]
    return out


def harm_lines(check: dict[str, Any]) -> list[str]:
    """The sites' verdicts in words (job summary, ``msa-fed model show``, the HTML report)."""
    out = ["each site's verdict (measured on its own labelled data; ~ noisy: the site answers with DP noise):"]
    for k, n in enumerate(check["sites"]):
        mark = "~" if check["noisy"][k] else ""
        c, o = check["combined"][k], check["own"][k]
        line = (
            f"  {n}: the combined model's loss on {n}'s data is {mark}{max(c, 0.0):.4f} against "
            f"{mark}{max(o, 0.0):.4f} for {n}'s own predictor"
        )
        if check["noisy"][k]:
            line += "  (DP noise: not judged)"
        elif check["harmed"][k]:
            line += f"  <-- HARMED (beyond its tolerance {check['tolerance'][k]:g})"
        if not check["signs_off"][k]:
            line += "; it does not sign the model off"
        out.append(line)
    for k, by in check.get("removed_by", {}).items():
        if by:
            out.append(f"  {k}'s harm goes away without {', '.join(by)}")
        else:
            out.append(f"  {k}'s harm stays without any single site")
    shown = ", ".join(check["suspects"]) if check["suspects"] else "none"
    out.append(f"  suspects (sites whose exclusion removes a harm): {shown}")
    if check["disputed"]:
        out.append(f"  disputed: {', '.join(check['disputed'])} do not sign this model off")
    return out


def guarantee_line(record: dict[str, Any], names: Sequence[str]) -> str:
    """The own-loss guarantee's outcome in one line (the fit's log, the job summary): whether no
    site's L_k(z) exceeds its own predictor's loss (+ the slack), and where none could be kept
    within it, the largest excess left (:func:`msa_fed.core.dc_solver.solve_dc`, ``guarantee``)."""
    head = f"own-loss guarantee (L_k(z) <= own_k + {record.get('slack', 0.0):g}):"
    status = record.get("status")
    if status == "not applied":
        return f"{head} not applied: {record.get('reason', '')}"
    before, losses = record.get("max_loss_unconstrained"), record.get("losses") or []
    after = max(losses) if losses else before
    if status == "holds at the min-max point":
        return f"{head} holds at the min-max point, at no cost (max_k L_k = {after:.4f})"
    if status == "constrained":
        return f"{head} holds: z moved so that no site is worse off than alone; max_k L_k {before:.4f} -> {after:.4f}"
    excess = record.get("excess") or []
    k = int(np.argmax(excess)) if excess else 0
    site = names[k] if k < len(names) else str(k)
    return (
        f"{head} NOT feasible: no z keeps every site within its own predictor's loss; z minimises the "
        f"largest excess: {site} {excess[k]:+.4f} (L_k = {losses[k]:.4f} against own {record['own'][k]:.4f}); "
        f"max_k L_k {before:.4f} -> {after:.4f}"
    )
