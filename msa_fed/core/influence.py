"""Influence of each site on the others: each site's loss with and without each other site.

With the combined model's z (the min-max solution over all p domains), site k's loss is L_k(z).
*Without* site j, the mixture is re-solved over the other domains: z_j = 0 and the objective is
max over k != j of L_k, solved by the same min-max solver on the face z_j = 0 of the simplex,
warm-started at z with z_j removed.  A site j whose inclusion makes another site's loss clearly
worse (L_k(z) - L_k(z^{-j}) large) for little gain to its own domain (L_j(z^{-j}) - L_j(z)) stands
out: an honest site adds a predictor that is good on its own domain, so including it gains its
domain much and costs the others little (the min-max trade-off at the domains' borders); a
predictor that is confidently wrong on real rows, or a site that overstates its own losses to pull
z towards itself, raises the others' losses for a small gain of its own.

The re-solves use the same loss oracle and advance in lockstep (:class:`Lockstep`): each round,
every re-solve still running asks for its next z and the round's z's go to every site as one
batched request (a DCRequest whose z has one row per re-solve, each z charged to the site's budget
like any other evaluation); a z already answered comes from a cache.  The relay rounds of the
report are then those of its longest re-solve, not the sum over the p of them.  A re-solve whose
answer is known is not run (:func:`known_without`): where site j has no weight in z and its domain's
loss is below the top, z itself is a local minimum of the problem without j (the one the re-solve
from z would stay at), so z^{-j} = z and L(z^{-j}) = L(z), in no round.  Measured: a
surrogate built only from the solver's own path (first-order expansions around the evaluated z)
put honest sites' losses at 0 on faces the path never came near and flagged them; exact
evaluations do not.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from msa_fed.core.dc_solver import LossOracle, solve_dc
from msa_fed.core.dc_terms import DCSums
from msa_fed.core.threads import one_blas_thread

#: a re-solve's end point is the point it last evaluated when they differ by at most this (rounding)
SAME_Z = 1e-12
#: SLSQP iterations of each re-solve (warm-started next to its optimum)
RESOLVE_MAX_ITER = 40
#: a site's weight at most this in the model's z is zero (the solver's rounding off the face)
ZERO_WEIGHT = 1e-10
#: ... and its domain's loss at least this far below the top one (loss units): inactive, the
#: re-solve without it is known (:func:`known_without`)
INACTIVE_GAP = 1e-6
#: a site is flagged only when the rise is also above this, in loss units (noise of a re-solve)
MIN_ABS_RISE = 0.01
#: ... and by SAVED_FACTOR times the fraction of its own loss that including the site saves it
SAVED_FACTOR = 2.5


class CachedOracle:
    """A loss oracle that answers a repeated (z, eta, what) from memory (``n_sources``, ``evaluate``)."""

    def __init__(self, oracle: LossOracle) -> None:
        self.oracle = oracle
        self.n_sources = int(oracle.n_sources)
        self._memo: dict[tuple[Any, ...], DCSums] = {}
        self.calls = 0

    def evaluate(self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None) -> DCSums:
        z = np.asarray(z, dtype=np.float64)
        key = (z.tobytes(), float(eta), tuple(what), global_bound)
        if key not in self._memo:
            self.calls += 1
            self._memo[key] = self.oracle.evaluate(z, eta, what, global_bound)
        out: DCSums = self._memo[key]
        return out

    def max_bound(self) -> float:
        return float(self.oracle.max_bound())


class _Face:
    """The oracle restricted to the face z_j = 0 (domains ``keep``; z and sums of size p - 1)."""

    def __init__(self, oracle: CachedOracle, keep: np.ndarray):
        self.oracle, self.keep = oracle, keep
        self.n_sources = int(keep.sum())
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []  # (z on the face, every domain's L)

    def full(self, z: np.ndarray) -> np.ndarray:
        out = np.zeros(self.keep.size)
        out[self.keep] = z
        return out

    def evaluate(self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None) -> DCSums:
        s = self.oracle.evaluate(self.full(z), eta, what, global_bound)
        if s.L is not None:  # every domain's losses, the one left out included
            self.seen.append((np.array(z, dtype=np.float64), s.L))
        k = self.keep
        return DCSums(L=None if s.L is None else s.L[k], dL=None if s.dL is None else s.dL[np.ix_(k, k)], n=s.n)

    def losses_at(self, z: np.ndarray) -> np.ndarray | None:
        """Every domain's losses (p,) at a point of the face already evaluated, to rounding
        (the solver returns its last iterate with the rounding off the simplex removed); None
        when no such point was evaluated."""
        for zz, L in reversed(self.seen):
            if zz.shape == z.shape and float(np.max(np.abs(zz - z))) <= SAME_Z:
                return np.asarray(L, dtype=np.float64)
        return None

    def max_bound(self) -> float:
        return self.oracle.max_bound()


class Lockstep:
    """The p re-solves advancing together: each runs in its own thread against :meth:`evaluate`,
    which waits until every re-solve still running has asked for its next z (or ended); then the
    round's z's go to the sites as one batched request (the oracle's ``evaluate_batch``, else one
    evaluation each) and every re-solve gets its answer.  A z already answered comes from the
    cache without waiting.  ``rounds``: the batched requests sent; ``calls``: the z's evaluated."""

    def __init__(self, oracle: Any, workers: int):
        self.oracle = oracle
        self.n_sources = int(oracle.n_sources)
        self.live = int(workers)
        self.rounds = 0
        self.calls = 0
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[np.ndarray, float, tuple[str, ...], float | None]] = {}
        self._answers: dict[int, Any] = {}
        self._memo: dict[tuple[Any, ...], DCSums] = {}

    def evaluate(
        self, worker: int, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None
    ) -> DCSums:
        z = np.asarray(z, dtype=np.float64)
        key = (z.tobytes(), float(eta), tuple(what), global_bound)
        with self._cv:
            if key in self._memo:
                return self._memo[key]
            self._pending[worker] = (z, float(eta), tuple(what), global_bound)
            self._fire_if_complete()
            while worker not in self._answers:
                self._cv.wait()
            out = self._answers.pop(worker)
        if isinstance(out, BaseException):
            raise out
        result: DCSums = out
        return result

    def done(self) -> None:
        """One re-solve has ended (or failed): the others no longer wait for it."""
        with self._cv:
            self.live -= 1
            self._fire_if_complete()

    def _fire_if_complete(self) -> None:
        if not self._pending or len(self._pending) < self.live:
            return
        pending, self._pending = self._pending, {}
        groups: dict[tuple[Any, ...], list[int]] = {}
        for worker, (_, eta, what, bound) in pending.items():
            groups.setdefault((eta, what, bound), []).append(worker)
        for (eta, what, bound), workers in groups.items():
            zs = np.stack([pending[w][0] for w in workers])
            unique, index = np.unique(zs, axis=0, return_inverse=True)
            try:
                batch = getattr(self.oracle, "evaluate_batch", None)
                if batch is not None:
                    sums = list(batch(unique, eta, what, bound))
                else:
                    sums = [self.oracle.evaluate(u, eta, what, bound) for u in unique]
            except BaseException as exc:  # noqa: BLE001 - handed to every re-solve of the round
                for w in workers:
                    self._answers[w] = exc
                continue
            self.rounds += 1
            self.calls += len(unique)
            for u, s in zip(unique, sums):
                self._memo[(u.tobytes(), eta, what, bound)] = s
            for w, i in zip(workers, np.ravel(index)):
                self._answers[w] = sums[int(i)]
        self._cv.notify_all()

    def max_bound(self) -> float:
        return float(self.oracle.max_bound())


class _Worker:
    """One re-solve's view of the :class:`Lockstep` oracle (the ``n_sources``/``evaluate`` interface)."""

    def __init__(self, lockstep: Lockstep, worker: int):
        self.lockstep, self.worker = lockstep, worker
        self.n_sources = lockstep.n_sources

    def evaluate(self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None) -> DCSums:
        return self.lockstep.evaluate(self.worker, z, eta, what, global_bound)

    def max_bound(self) -> float:
        return self.lockstep.max_bound()


def run_threads(target: Any, items: list[int], name: str) -> None:
    """``target(j)`` for each j of ``items``, each in its own thread (the re-solves of a
    :class:`Lockstep`), under one BLAS thread set by the caller for the whole run.

    The threads' own one-thread sections (each solve's, each site's sums') do not do it: with
    the OpenBLAS builds numpy and scipy ship (0.3.30 / 0.3.31, pthreads), a thread's
    ``set_num_threads`` has no effect once the main thread has set the count (measured: after
    one section in the main thread, as the fit's solve opens, a thread's section still reads 2),
    so the re-solves ran on two BLAS threads and their small products spun (p = 16: the
    single-domain finish's least-squares fits 75 ms of CPU each instead of 5 ms).  Set from the
    caller (the main thread, in a fit) it holds in every thread."""
    threads = [threading.Thread(target=target, args=(j,), name=f"{name}-{j}", daemon=True) for j in items]
    with one_blas_thread():
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def known_without(z: np.ndarray, losses: np.ndarray, j: int) -> bool:
    """Whether the re-solve without site j is known without asking: z_j = 0 (to
    :data:`ZERO_WEIGHT`) and L_j(z) below max_k L_k(z) by :data:`INACTIVE_GAP`.

    Then z is a local minimum of max_{k != j} L_k on the face z_j = 0: it is one of max_k L_k on
    the simplex (the min-max solution), the two objectives agree near z on the face (L_j stays
    below the top there), and the re-solve, which starts from z, ends there.  With domain j
    active (its multiplier may be positive) or z_j > 0 the re-solve is run."""
    z = np.asarray(z, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    if z.size < 3:  # without one of two sites the answer is the other's vertex: asked as before
        return False
    return bool(z[j] <= ZERO_WEIGHT and losses[j] <= float(np.max(losses)) - INACTIVE_GAP)


def all_without(
    oracle: LossOracle, eta: float, z: np.ndarray, losses: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(z^{-j} (p x p), L(z^{-j}) (p x p), z's evaluated, rounds): :func:`losses_without` for every
    j, the p re-solves in lockstep (:class:`Lockstep`: one batched request per site per round).
    With ``losses`` (L(z), (p,)) the re-solves whose answer is known (:func:`known_without`) are
    not run: their row is z with z_j = 0 and L(z)."""
    z = np.asarray(z, dtype=np.float64)
    p = int(z.size)
    known = [j for j in range(p) if losses is not None and known_without(z, losses, j)]
    run_j = [j for j in range(p) if j not in known]
    lock = Lockstep(oracle, len(run_j))
    z_without = np.zeros((p, p))
    without = np.zeros((p, p))
    for j in known:
        assert losses is not None
        zj = z.copy()
        zj[j] = 0.0
        z_without[j] = zj / zj.sum()
        without[j] = losses
    errors: list[BaseException] = []

    def run(j: int) -> None:
        try:
            z_without[j], without[j] = losses_without(_Worker(lock, j), eta, z, j)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
        finally:
            lock.done()

    run_threads(run, run_j, "influence")
    if errors:
        raise errors[0]
    return z_without, without, lock.calls, lock.rounds


def losses_without(oracle: CachedOracle, eta: float, z: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(z^{-j}, L(z^{-j})): the min-max solution without site j in the mixture or the objective,
    and every domain's loss there (p,)."""
    p = z.size
    keep = np.ones(p, bool)
    keep[j] = False
    start = np.where(keep, z, 0.0)
    start = start / start.sum() if start.sum() > 0 else keep / keep.sum()
    if keep.sum() > 1:
        face = _Face(oracle, keep)
        res = solve_dc(
            face,
            eta,
            objective="minmax",
            n_restarts=0,
            z0=start[keep],
            max_iter=RESOLVE_MAX_ITER,
            warn=False,
        )
        zj = face.full(res.z)
        known = face.losses_at(res.z)
        if known is not None:  # the solver's last point: its losses are already known
            return zj, np.array(known)
    else:
        zj = start
    return zj, oracle.evaluate(zj, eta, ("L",)).array("L")


def influence_table(
    oracle: LossOracle,
    eta: float,
    z: np.ndarray,
    losses: np.ndarray,
    names: Any,
    *,
    margin: float = 0.1,
    minmax_point: bool = False,
) -> dict[str, Any]:
    """The per-site influence report of a combined model (a JSON-able dict).

    oracle : the fit's loss oracle (wrapped in a :class:`CachedOracle` unless it is one);
    z, losses : the model's z and L_k(z), (p,);  names : the sites, in order;
    margin : site j is flagged when including it raises another site k's loss by more than
        ``margin`` times k's loss without j (relative) and :data:`MIN_ABS_RISE`, and by a larger
        fraction than it lowers j's own loss (:func:`flagged_at`);
    minmax_point : z is the converged min-max solution over all p domains (objective "minmax",
        no own-loss guarantee): the re-solves whose answer is then known are not run
        (:func:`known_without`).  Off for any other z (the regret or Gamma objectives, the
        guarantee), where z_j = 0 says nothing of the problem without j.

    Returns ``{"sites", "loss_with" (p,), "loss_without" (p x p; row j: every domain's loss
    without site j, the diagonal is j's own loss without its predictor), "z_without" (p x p),
    "raise" (p x p relative: row j, column k: (loss_with[k] - loss_without[j][k]) /
    loss_without[j][k], None on the diagonal), "flagged" (names), "worst" ({site: [other,
    relative raise]}), "gain" (p,: site j's loss without minus with its predictor), "margin",
    "evaluations" (new oracle calls), "rounds" (batched requests), "known" (the sites whose
    re-solve was known without asking, :func:`known_without`), "method"}``.
    """
    names = [str(n) for n in names]
    z = np.asarray(z, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    p = z.size
    z_without, without, calls, rounds = all_without(oracle, eta, z, losses if minmax_point else None)
    known = [names[j] for j in range(p) if minmax_point and known_without(z, losses, j)]
    rise = losses[None, :] - without
    rel = rise / np.maximum(without, 1e-12)
    np.fill_diagonal(rel, np.nan)
    gain = np.diag(without) - losses  # what including site j gains its own domain
    table = {
        "sites": names,
        "loss_with": [float(x) for x in losses],
        "loss_without": [[float(x) for x in r] for r in without],
        "raise": [[None if np.isnan(x) else float(x) for x in r] for r in rel],
    }
    flagged = sorted({site for site, _, _ in flagged_at(table, margin)}, key=names.index)
    worst = {}
    for j in range(p):
        row = np.where(np.isnan(rel[j]), -np.inf, rel[j])
        k = int(np.argmax(row))
        worst[names[j]] = [names[k], float(row[k])]
    return {
        "sites": names,
        "loss_with": [float(x) for x in losses],
        "loss_without": [[float(x) for x in r] for r in without],
        "z_without": [[float(x) for x in r] for r in z_without],
        "raise": [[None if np.isnan(x) else float(x) for x in r] for r in rel],
        "gain": [float(x) for x in gain],
        "flagged": flagged,
        "worst": worst,
        "margin": float(margin),
        "evaluations": int(calls),
        "rounds": int(rounds),
        "known": known,
        "method": "min-max re-solved without each site, the p re-solves in lockstep (one batched request per round)",
    }


def flagged_at(table: dict[str, Any], margin: float) -> list[tuple[str, str, float]]:
    """(site, other site, relative raise) for each site j whose inclusion raises another site k's
    loss by more than ``margin`` and by more than :data:`MIN_ABS_RISE`, and costs k more than
    :data:`SAVED_FACTOR` times the fraction of j's own loss that including j saves it.

    The last condition is the min-max trade-off: an honest hard domain (the paper's MNIST among
    the digits) pulls the others' losses up by design, and its own predictor saves it a fair
    fraction of its loss (measured, quick mode: +63% for optdigits against 30% saved for MNIST,
    +27% against 38%); a predictor confidently wrong on its own site's real rows saves its domain
    little (+25% for another against 3% saved), and so does a site that adds a large constant to
    its losses (+13% against 3% for a constant of 3).  An overstatement that mimics an honest hard
    domain cannot be told from one by aggregates; the "regret" objective takes a constant
    overstatement's lever away (docs/DESIGN.md, "Hostile peers").  With two sites nothing is flagged: the
    min-max trades one domain's loss against the other's, so including either raises the other's
    loss (measured on the paper's Adult experiment: +23% for a gain of 0.13), and no third site
    tells a hostile inclusion from that trade-off."""
    names = table["sites"]
    out: list[tuple[str, str, float]] = []
    if len(names) < 3:  # two sites: each one's claim raises the other's loss by construction
        return out
    for j, n in enumerate(names):
        own = table["loss_without"][j][j]
        saved = (own - table["loss_with"][j]) / max(own, 1e-12)
        for k, other in enumerate(names):
            rel = table["raise"][j][k]
            rise = table["loss_with"][k] - table["loss_without"][j][k]
            if rel is not None and rel > margin and rise > MIN_ABS_RISE and rel > SAVED_FACTOR * saved:
                out.append((n, other, float(rel)))
    return out


def influence_lines(table: dict[str, Any]) -> list[str]:
    """The influence report as text lines (``msa-fed model show``, job logs)."""
    names = table["sites"]
    width = max(8, *(len(n) for n in names))
    out = [
        "influence: each site's loss with all sites, and without each other site (rows: site left out)",
        f"  {'without':<{width}} " + " ".join(f"{n:>{width}}" for n in names),
        f"  {'(none)':<{width}} " + " ".join(f"{x:>{width}.4f}" for x in table["loss_with"]),
    ]
    for j, n in enumerate(names):
        row = table["loss_without"][j]
        out.append(f"  {n:<{width}} " + " ".join(f"{x:>{width}.4f}" for x in row))
    for n in names:
        other, rel = table["worst"][n]
        mark = "  <-- FLAGGED" if n in table["flagged"] else ""
        out.append(f"  including {n} changes {other}'s loss by {100 * rel:+.1f}%{mark}")
    rounds = f" in {table['rounds']} rounds" if table.get("rounds") is not None else ""
    out.append(
        f"  (flagged above +{100 * table['margin']:.0f}%; {table['evaluations']} evaluations for the re-solves{rounds})"
    )
    return out
