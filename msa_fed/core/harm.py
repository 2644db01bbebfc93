"""Each site's verdict on a combined model, and the sites whose exclusion removes harms of others.

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
with their own labelling rules), harm reached 0.745 nats and 2.98 x max(own, 0.25); the default
tolerance, 4, lies above every one of them.  It is not tighter: a peer's poisoning that took a
site from 0.975 to 0.29 accuracy harmed it by 0.78 nats (3.1 x), within 5% of the honest
maximum, and a smaller floor widens the honest ratios more (docs/DESIGN.md, "Each site's
verdict").  Where the influence analysis re-solved the mixture without each
site j (z^{-j}), the sites measure the combined model's loss at every z^{-j} in the same request.
A harmed site k *accuses* j != k when it is no longer harmed at z^{-j}.  One site's verdict
is only its own word: a hostile site can lie in it, or place labelled rows against a peer's rule
so that it is honestly harmed by any model that serves that peer, and "k is harmed, not without
j" then reads exactly as it would if j had harmed an honest k.  And an honest site's harm that a
hostile site causes can go away without an honest peer too (the peer's predictor took the
harmed site's region).  So site j is a *suspect* only when no single other site h accounts for
the accusations against it: some accuser of j other than h is still harmed without h
(:func:`suspects`).  With at most one hostile site, and no honest site harmed by the federation
without it (the default tolerance's calibration), an honest site is never named: every honest
accuser of an honest j also accuses the hostile site, which accounts for them all, its own word
included.  A lone accusation names nobody (it is reported, and the harmed site can still refuse
to sign the model off) unless the fit asks for it (``suspects="any"``, for consortia that trust
their members' verdicts: it names a framed honest site just as well); j's own claims never clear j.
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
#: who an accusation names (the fit's ``suspects`` option): "corroborated", the rule above; "any",
#: also a lone harmed site's accusation (:func:`suspects`, ``lone``)
SUSPECT_RULES = ("corroborated", "any")
#: the head of the suspects' line (summary, report)
SUSPECTS_HEAD = "suspects (accused by harmed sites that no single other site accounts for)"


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
    lone: bool = False,
) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """(suspects, {harmed site: the sites whose exclusion removes its harm, its accusations}).

    combined (p, 1 + p): row k, site k's measured loss at the model's z (column 0) and at each
    z^{-j} (column 1 + j);  own (p,), tolerance (p,).  A harmed site k accuses j != k when it is
    not harmed at z^{-j}; j is a suspect when for every other site h, some accuser of j other than
    h does not accuse h (h hostile would not account for its harm; module docstring).  A site whose verdict carries DP
    noise (``noisy``) is not judged: its noise, not the model, can put it past its tolerance.

    ``without_sites`` (p, p), when given, decides instead: row k, site k's measured loss at the
    mixture re-solved without site j *and its labelled points* (column j).  The influence
    analysis's z^{-j} drops only domain j from the min-max: a site whose labelled points poison a
    peer's loss estimate (rows in the peer's region, labelled against the peer) moves z just as
    much without its domain, and the exclusion that removes the harm is the one of its data.

    ``lone`` (the fit's ``suspects="any"``): an accuser's own word accounts for its accusation only
    when some other site accuses the accuser; a harmed site nobody accuses names whom it accuses,
    alone.  It names the hostile peer of a three-site federation that one honest site sees, and an
    honest peer that one lying site frames just as well: only where every site is trusted to
    report its verdict honestly."""
    combined = np.asarray(combined, dtype=np.float64)
    p = len(names)
    noisy = [False] * p if noisy is None else [bool(x) for x in noisy]
    removed: dict[str, list[str]] = {}
    accusers: list[set[int]] = [set() for _ in range(p)]
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
        for j in by:
            accusers[j].add(k)
    accused = [set(removed.get(names[k], ())) for k in range(p)]  # accused[k]: whom k accuses

    def accounted(j: int, h: int) -> bool:  # h hostile accounts for every accusation against j
        if lone and h in accusers[j] and not accusers[h]:
            return False  # h's own word counts only once someone accuses h
        return all(names[h] in accused[k] for k in accusers[j] if k != h)

    named = [j for j in range(p) if accusers[j] and not any(accounted(j, h) for h in range(p) if h != j)]
    return tuple(names[j] for j in named), removed


def site_check(
    names: Sequence[str],
    combined: np.ndarray,
    own: np.ndarray,
    tolerance: np.ndarray,
    noisy: Sequence[bool],
    signs_off: Sequence[bool],
    without_sites: np.ndarray | None = None,
    lone: bool = False,
) -> dict[str, Any]:
    """The sites' verdicts on a model as a JSON-able dict (the model's ``info["site_check"]``):
    ``sites``, ``combined`` / ``own`` (each site's measured losses at the model's z), ``harm``
    (combined - own), ``tolerance``, ``noisy`` (DP noise in the site's answer), ``harmed``,
    ``signs_off``, ``disputed`` (the sites that do not sign it off), ``suspects``,
    ``removed_by`` ({harmed site: the sites whose exclusion removes its harm}), ``accusers``
    ({suspect: the harmed sites that accuse it}), ``rule`` (:data:`SUSPECT_RULES`), ``not_named``
    (the sites some harmed site accuses that are not named: :func:`suspects`) and
    ``combined_without`` (p x p: site k's loss without site j, row k; absent without the
    influence analysis) and ``loss_without_site`` (p x p: site k's loss at the mixture re-solved
    without site j and its labelled points, row k; :func:`suspects`; present once a site was
    harmed)."""
    names = [str(n) for n in names]
    combined = np.asarray(combined, dtype=np.float64)
    own = np.asarray(own, dtype=np.float64)
    tolerance = np.asarray(tolerance, dtype=np.float64)
    named, removed = suspects(names, combined, own, tolerance, noisy, without_sites, lone=lone)
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
        "rule": SUSPECT_RULES[1] if lone else SUSPECT_RULES[0],
        "accusers": {j: [k for k, by in removed.items() if j in by] for j in named},
        "removed_by": removed,
        "not_named": [n for n in names if n not in named and any(n in by for by in removed.values())],
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
    accusers = check.get("accusers") or {}

    def who(j: str) -> str:
        by = accusers.get(j) or []
        return f"{j} (on {by[0]}'s word alone)" if len(by) == 1 else j

    shown = ", ".join(who(j) for j in check["suspects"]) if check["suspects"] else "none"
    out.append(f"  {SUSPECTS_HEAD}: {shown}")
    lone = check.get("not_named") or []
    if lone:
        out.append(
            f"  not named: {', '.join(lone)} (one other site, hostile, would account for every accusation: "
            "its own word, or a harm its exclusion removes too)"
        )
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
