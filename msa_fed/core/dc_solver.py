"""Solving min over the simplex of Gamma(z) = max_k L_k(z) - sum_j z_j L_j(z).

The algorithms share one loss-oracle interface (sums over points for a given z, see
:mod:`msa_fed.core.dc_terms`), so they run unchanged whether the sums are computed in this
process or at the sites:

``method="dca"``
    The paper's DC algorithm (DESIGN.md section 3): from z_t solve the convex epigraph problem
    min_{z, gamma} gamma  s.t.  u_k(z) - v_k(z_t) - grad v_k(z_t).(z - z_t) <= gamma,  z in simplex
    with SLSQP.  Gamma never increases between accepted iterates.  Kept as the reference method.

``method="newton"``
    Gamma(z) = 0 exactly when every domain with z_k > 0 has the same loss c and every other
    domain has loss <= c (such a z always exists, by Nash's argument).  An active-set Newton
    method on (z_S, c) with the analytic Jacobian dL_k/dz_j (also an O(p^2) sum) and
    backtracking on Gamma.  Quadratic near a solution, but from the uniform point it often
    stalls (measured in ``benchmarks/bench_core.py``).

``method="homotopy"`` (first step of the default ``"auto"``)
    Follows the logit path from the uniform point to an equilibrium and finishes with Newton
    (:mod:`msa_fed.core.dc_homotopy`).  If it fails, ``"auto"`` runs Newton and then DCA from
    its best point, then Newton from random starts.  With ``z0`` (a checkpoint), ``"auto"``
    first tries Newton from z0; the path itself always restarts from the uniform point.

All record the history of Gamma and stop when Gamma <= ``tol``.

``objective="minmax"`` (the default)
    min over the simplex of max_k L_k(z), SLSQP on the epigraph with the analytic dL.  Every
    oracle call is one round trip to every site and one query charged to each site's budget,
    so the solve asks only what SLSQP needs: the values and Jacobian at its own iterates (one
    call per point, cached; the callback and the result read the cache), and it stops once
    max_k L_k has settled or SLSQP's own QP predicts it to fall by at most tol / 10 at the next
    point.  In the tail of a run with one domain's loss on top, Newton steps on that loss (its
    Hessian fitted to the gradients at the nearest rounds) replace SLSQP's linear tail.  The
    random starts of ``n_restarts`` run only while no start has converged (measured: 8/13/17
    rounds per fit at p = 4/8/16, n = 1e5, against 69/137/191 with every start run; max_k L_k
    within 1e-9 of the best start on bench_core's problems and the paper's experiments,
    BENCHMARKS.md).  min max_k L_k is not convex in general: a start can converge to a local
    minimum that another start would have beaten; ``all_starts=True`` runs every start to the
    end and keeps the best (the exhaustive solve, at several times the rounds).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from msa_fed.core.config import SolverConfig
from msa_fed.core.dc_homotopy import Callback, logit_path_run
from msa_fed.core.dc_steps import KKT_RIDGE, epigraph_slsqp, kkt_step, max_step_in_simplex
from msa_fed.core.dc_terms import DCSums, PointSet, gamma_from_losses, sum_all
from msa_fed.core.simplex import check_simplex, project_simplex
from msa_fed.core.threads import blas_threads_for


class LossOracle(Protocol):
    """Anything that returns the global sums at z (the solver never sees the points)."""

    n_sources: int

    def evaluate(
        self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None
    ) -> DCSums: ...

    def max_bound(self) -> float: ...


class LocalOracle:
    """Loss oracle over in-process :class:`PointSet` objects (e.g. one per site)."""

    def __init__(self, point_sets: list[PointSet]) -> None:
        if not point_sets:
            raise ValueError("LocalOracle needs at least one PointSet")
        self.point_sets = list(point_sets)
        self.n_sources = int(point_sets[0].w.shape[1])

    def evaluate(self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None = None) -> DCSums:
        return sum_all(ps.evaluate(z, eta, what=what, global_bound=global_bound) for ps in self.point_sets)

    def max_bound(self) -> float:
        return max(ps.max_bound() for ps in self.point_sets)


@dataclass
class DCResult:
    """Outcome of :func:`solve_dc`.

    z : (p,) best mixture weight found;  gamma : Gamma(z);  losses : (p,) L_k(z)
    history : Gamma after each iteration of the run that produced z (first entry: its start)
    converged : Gamma <= tol was reached;  n_iter : iterations of that run
    n_evaluations : oracle calls over all runs (each is one round trip to the sites)
    method : the algorithm that produced z
    """

    z: np.ndarray
    gamma: float
    losses: np.ndarray
    history: list[float]
    converged: bool
    n_iter: int
    n_evaluations: int
    method: str
    restarts: list[dict[str, Any]] = field(default_factory=list)
    objective: str = "gamma"
    #: the own-loss guarantee's record (``guarantee`` option; None: off): :func:`_guarantee`
    guarantee: dict[str, Any] | None = None

    @property
    def max_loss(self) -> float:
        """max_k L_k(z): the loss of g_z on the worst mixture of the domains."""
        return float(np.max(self.losses))


class _Counter:
    """Wraps an oracle, counting calls and caching the last few evaluations.

    A request hits the cache when the same z (bit for bit) was evaluated with at least the
    arrays asked for: every call that misses is one round trip to every site, so the count
    is the number of queries each site answers.
    """

    #: evaluations kept (SLSQP asks for the values and the Jacobian at the same point)
    CACHE = 4

    def __init__(self, oracle: LossOracle, eta: float, global_bound: float | None) -> None:
        self.oracle, self.eta, self.global_bound = oracle, eta, global_bound
        self.calls = 0
        self._cache: list[tuple[bytes, frozenset[str], DCSums]] = []

    def peek(self, z: np.ndarray, what: tuple[str, ...]) -> DCSums | None:
        """The cached sums at ``z`` holding ``what``, or None (never calls the oracle)."""
        key, need = np.ascontiguousarray(z, dtype=np.float64).tobytes(), set(what)
        for i, (k, has, val) in enumerate(self._cache):
            if k == key and need <= has:
                if i:  # most recent first
                    self._cache.insert(0, self._cache.pop(i))
                return val
        return None

    def __call__(self, z: np.ndarray, what: tuple[str, ...]) -> DCSums:
        val = self.peek(z, what)
        if val is None:
            z = np.array(z, dtype=np.float64)  # a copy: the caller may change its array later
            self.calls += 1
            val = self.oracle.evaluate(z, self.eta, what, self.global_bound)
            self._cache.insert(0, (z.tobytes(), frozenset(what), val))
            del self._cache[self.CACHE :]
        return val


# ---------------------------------------------------------------------------- DCA
#: SLSQP limits of one DCA step (the convex epigraph problem at z_t)
DCA_SLSQP_MAXITER = 100
DCA_SLSQP_FTOL = 1e-14


def _start_result(
    z: np.ndarray, gamma: float, losses: Any, history: list[float], converged: bool, n_iter: int, method: str
) -> DCResult:
    """The result of one start of a multi-start solve (its evaluations are counted by the caller)."""
    return DCResult(
        z=z,
        gamma=gamma,
        losses=np.asarray(losses),
        history=history,
        converged=converged,
        n_iter=n_iter,
        n_evaluations=0,
        method=method,
    )


def _convexified_terms(
    ev: _Counter, v0: np.ndarray, dv0: np.ndarray, zt: np.ndarray
) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    """u_k(z) - [v_k(z_t) + grad v_k(z_t).(z - z_t)] and its Jacobian: the DCA step's constraints."""

    def f(z: np.ndarray) -> np.ndarray:
        value: np.ndarray = ev(z, ("u", "du")).array("u") - (v0 + dv0 @ (z - zt))
        return value

    def f_jac(z: np.ndarray) -> np.ndarray:
        jac: np.ndarray = ev(z, ("u", "du")).array("du") - dv0
        return jac

    return f, f_jac


def _dca_run(
    ev: _Counter, z0: np.ndarray, tol: float, max_iter: int, callback: Callback | None, history: list[float]
) -> tuple[np.ndarray, float, np.ndarray, bool, int]:
    p = z0.size
    z = z0.copy()
    s = ev(z, ("L", "v", "dv"))
    gamma = gamma_from_losses(s.array("L"), z)
    L = s.array("L")
    history.append(gamma)
    it = 0
    for it in range(1, max_iter + 1):
        if gamma <= tol:
            return z, gamma, L, True, it - 1
        v0, dv0, zt = s.array("v"), s.array("dv"), z.copy()
        su0 = ev(zt, ("u", "du"))
        g0 = float(np.max(su0.array("u") - v0))
        res = epigraph_slsqp(
            np.append(zt, g0), *_convexified_terms(ev, v0, dv0, zt), maxiter=DCA_SLSQP_MAXITER, ftol=DCA_SLSQP_FTOL
        )
        z_new = project_simplex(res.x[:p])
        s_new = ev(z_new, ("L", "v", "dv"))
        gamma_new = gamma_from_losses(s_new.array("L"), z_new)
        if not gamma_new < gamma:  # DCA must not increase Gamma: stop at the current iterate
            history.append(gamma)
            if callback:
                callback(it, z, gamma)
            return z, gamma, L, gamma <= tol, it
        z, s, gamma, L = z_new, s_new, gamma_new, s_new.array("L")
        history.append(gamma)
        if callback:
            callback(it, z, gamma)
    return z, gamma, L, gamma <= tol, max_iter


# ---------------------------------------------------------------------------- Newton
#: step halvings tried before a Newton step counts as a stall; stalls in a row that end the run
NEWTON_BACKTRACKS = 30
NEWTON_MAX_STALLS = 2


def _newton_run(
    ev: _Counter, z0: np.ndarray, tol: float, max_iter: int, callback: Callback | None, history: list[float]
) -> tuple[np.ndarray, float, np.ndarray, bool, int]:
    z = z0.copy()
    s = ev(z, ("L", "dL"))
    gamma = gamma_from_losses(s.array("L"), z)
    history.append(gamma)
    active = z > 0
    stalls = 0
    it = 0
    for it in range(1, max_iter + 1):
        if gamma <= tol:
            return z, gamma, s.array("L"), True, it - 1
        L, dL = s.array("L"), s.array("dL")
        c_now = float(np.max(L[active])) if active.any() else float(np.max(L))
        # a domain left out of the support but worse off than the support joins it
        active |= (~active) & (L > c_now)
        S = np.flatnonzero(active)
        dz = kkt_step(dL, L[S], z, S, ridge=KKT_RIDGE, lstsq_fallback=True)
        neg = dz < 0
        alpha_max = max_step_in_simplex(z, dz)
        alpha = alpha_max
        accepted = False
        for _ in range(NEWTON_BACKTRACKS):
            z_try = np.clip(z + alpha * dz, 0.0, None)
            z_try /= z_try.sum()
            s_try = ev(z_try, ("L", "dL"))
            g_try = gamma_from_losses(s_try.array("L"), z_try)
            if g_try < gamma:
                accepted = True
                break
            alpha *= 0.5
        if alpha_max < 1.0 and accepted and alpha == alpha_max:
            blocking = neg & (np.abs(z + alpha_max * dz) <= 1e-15 + 1e-12 * np.abs(z))
            active &= ~blocking
        if not accepted:
            stalls += 1
            if stalls >= NEWTON_MAX_STALLS:
                history.append(gamma)
                return z, gamma, s.array("L"), False, it
            # drop the smallest active coordinate whose loss is below the top (it blocks progress)
            cand = [k for k in S if L[k] < c_now]
            if cand:
                k = min(cand, key=lambda j: z[j])
                active[k] = False
                z_try = z.copy()
                z_try[k] = 0.0
                z_try /= z_try.sum()
                s_try = ev(z_try, ("L", "dL"))
                g_try = gamma_from_losses(s_try.array("L"), z_try)
                if g_try >= gamma:
                    history.append(gamma)
                    continue
            else:
                history.append(gamma)
                continue
        else:
            stalls = 0
        z, s, gamma = z_try, s_try, g_try
        active &= z > 0
        history.append(gamma)
        if callback:
            callback(it, z, gamma)
    return z, gamma, s.array("L"), gamma <= tol, max_iter


# ---------------------------------------------------------------------------- min-max
#: smallest SLSQP ftol of the min-max solve (``tol`` below it is raised to it)
MINMAX_FTOL_FLOOR = 1e-15
#: SLSQP's ftol is this times ``tol``: it stops when max_k L_k moved by less than ftol in an
#: iteration.  Measured on 80 random problems (p = 2 to 16, tests/core/dc_problems.py): with
#: ftol = tol one ended 2e-9 above the best of five starts; with tol / 10 none did (within
#: 1e-9), at about one more evaluation per solve on average.
MINMAX_FTOL_FACTOR = 0.1
#: iterations in a row with max_k L_k moving by <= ftol after which the run has converged.
#: SLSQP's own test is on its epigraph variable, which near the optimum can go on moving at
#: the rounding level of the sums: measured, up to 25 more evaluations at one point (p = 4,
#: n = 3000) for a change below 1e-11 in max_k L_k.
MINMAX_SETTLED = 2
#: ... and with the epigraph variable within this many ftol below max_k L_k (seen: 2e-9 = 20
#: ftol at such an iterate; a vertex where only the epigraph variable moves: 0.1)
MINMAX_SETTLED_GAP = 1000.0
#: the run also stops at an iterate where SLSQP's QP predicts max_k L_k to fall by at most this
#: many ftol at its next point (that point is not evaluated)
MINMAX_PREDICTED = 1.0
#: once SLSQP's predicted decrease is at most this many ftol (the tail of the run), the
#: single-domain finish is tried (Newton steps on the one active L_k, :func:`_single_domain_finish`)
MINMAX_FINISH_START = 1e4


def _minmax_run(
    ev: _Counter, z0: np.ndarray, tol: float, max_iter: int, callback: Callback | None, history: list[float]
) -> tuple[np.ndarray, float, np.ndarray, bool, int]:
    """min over the simplex of max_k L_k(z), epigraph form with SLSQP and analytic dL.

    Returns like the other runs, but the value tracked in ``history`` is max_k L_k.  Every
    value read here is one SLSQP asked for (values and Jacobian at its own iterates, one
    oracle call each) or one Newton step of the single-domain finish (:func:`_single_domain_finish`):
    the callback and the result read them from the cache.  Besides the settled rule, the run stops
    before SLSQP's next point when SLSQP's own model (the QP it has just solved) predicts a decrease
    of max_k L_k by at most ftol there.
    """
    p = z0.size
    it = [0]
    what = ("L", "dL")

    s0 = ev(z0, what)
    history.append(float(s0.array("L").max()))
    visited: list[tuple[np.ndarray, DCSums]] = [(np.array(z0, dtype=np.float64), s0)]  # every point evaluated

    def at(z: np.ndarray) -> DCSums:
        """The sums at a point already evaluated (an oracle call only if it has not been)."""
        s = ev.peek(z, what)
        if s is None:
            s = ev(z, what)
            visited.append((np.array(z, dtype=np.float64), s))
        return s

    ftol = max(MINMAX_FTOL_FACTOR * tol, MINMAX_FTOL_FLOOR)
    settled = [0]  # iterations in a row that moved max_k L_k by <= ftol
    stopped = [False]  # ... enough of them, or a predicted decrease <= ftol: converged
    x_last = [np.append(z0, 0.0)]  # SLSQP's last iterate
    trials = [0]  # points SLSQP has asked for since its last iterate
    finish = [True]  # the single-domain finish may still run (until it has evaluated a point)
    finished: list[np.ndarray] = []  # its last point, where it ended the run

    def cb(x: np.ndarray) -> None:
        it[0] += 1
        x_last[0], trials[0] = np.array(x), 0
        val = float(at(x[:p]).array("L").max())
        # settled: max_k L_k stopped moving and the epigraph variable caught up with it (SLSQP
        # moves only the epigraph variable for a while when z sits at a vertex)
        feasible = val - t0 - float(x[p]) <= MINMAX_SETTLED_GAP * ftol
        settled[0] = settled[0] + 1 if feasible and abs(val - history[-1]) <= ftol else 0
        history.append(val)
        if callback:
            callback(it[0], _on_simplex(x[:p]), val)
        if settled[0] >= MINMAX_SETTLED:
            stopped[0] = True
            raise StopIteration  # SLSQP halts at this iterate

    def step_taken(z: np.ndarray, val: float) -> None:
        """An iterate of the single-domain finish: counted and reported like SLSQP's."""
        it[0] += 1
        history.append(val)
        if callback:
            callback(it[0], _on_simplex(z), val)

    def before_point(x: np.ndarray) -> None:
        """SLSQP is about to evaluate x, the first point of an iteration: the step of the QP it
        has just solved, whose epigraph variable x[p] is the max_k L_k - t0 its model predicts
        there.  The predicted decrease counts only with the epigraph variable caught up with
        max_k L_k at the iterate: a slack one is a bound, and the QP's step in it is held back by
        its own curvature (measured: a stop at max_k L_k = 3.42 where the run goes on to 2.68)."""
        if it[0] == 0 or ev.peek(x[:p], what) is not None:
            return
        trials[0] += 1
        if trials[0] > 1:  # a step of the line search
            return
        val = float(at(x_last[0][:p]).array("L").max())
        predicted = val - t0 - float(x[p])
        caught_up = abs(val - t0 - float(x_last[0][p])) <= MINMAX_SETTLED_GAP * ftol
        if caught_up and predicted <= MINMAX_PREDICTED * ftol:
            raise _Converged
        if finish[0] and predicted <= MINMAX_FINISH_START * ftol:
            n_visited = len(visited)
            z_end = _single_domain_finish(at, x_last[0][:p], val, visited, ftol, step_taken)
            if z_end is not None:
                finished.append(z_end)
                raise _Converged
            # once it has evaluated a point without ending the run, SLSQP goes on from its own iterate
            finish[0] = len(visited) == n_visited

    # the epigraph variable is t - max_k L_k(z0): it starts at 0 (the start's value cancels)
    t0 = float(s0.array("L").max())
    try:
        res = epigraph_slsqp(
            np.append(z0, 0.0),
            lambda z: at(z).array("L") - t0,
            lambda z: at(z).array("dL"),
            maxiter=max_iter,
            ftol=ftol,
            callback=cb,
            on_point=before_point,
        )
        x_end, success = res.x[:p], bool(res.success)
    except _Converged:
        x_end, success = (finished[0] if finished else x_last[0][:p]), True
        stopped[0] = True
    # the values at the last iterate; z is that iterate with its rounding off the simplex
    # (entries 1e-16 below 0, a sum 1e-16 off 1) removed: the losses move by as little
    s = at(x_end)
    z = _on_simplex(x_end)
    if s.array("L").max() > s0.array("L").max():  # never return worse than the start
        z, s = z0, s0
    return z, float(s.array("L").max()), s.array("L"), success or stopped[0], it[0]


class _Converged(Exception):
    """Raised inside SLSQP's evaluation to end the run at the last iterate (SLSQP's or the finish's)."""


#: the single-domain finish: coordinates at most this are on the simplex's face z_j = 0
FINISH_ZERO = 1e-10
#: ... points used for its Hessian fit: at most this far off the face
FINISH_OFF_FACE = 1e-8
#: ... its Hessian fit from the points nearest z on the face: this many per dimension of the face
FINISH_PAIRS = 2
#: ... the top loss at least this many ftol above the second (one domain active)
FINISH_GAP = 1e6
#: ... a step on the last positive-definite fit whose decrease over the prediction falls outside
#: this range ends it
FINISH_RATIO = (0.5, 2.0)
#: ... at most this many Newton steps
FINISH_MAX_STEPS = 20


def _single_domain_finish(
    at: Callable[[np.ndarray], DCSums],
    z: np.ndarray,
    val: float,
    visited: list[tuple[np.ndarray, DCSums]],
    ftol: float,
    step_taken: Callable[[np.ndarray, float], None],
) -> np.ndarray | None:
    """Newton steps on the one active L_k over the face of the simplex that z lies on.

    With one domain k active (its loss above all others by FINISH_GAP ftol) and the KKT signs of
    the zero coordinates right, min max_k L_k is locally min L_k on that face.  Every evaluation
    so far gave the gradient of L_k, so the points on the face (and z) give secant pairs
    (z_i - z, grad L_k(z_i) - grad L_k(z)); the Hessian of L_k on the face is the symmetric
    least-squares fit to the FINISH_PAIRS * q nearest (pair i's residual divided by |z_i - z|^2:
    the near ones dominate).  Where that fit is not positive definite the last one that was is
    kept, and a step on it whose decrease is off the prediction by more than FINISH_RATIO ends
    the finish; so does a Newton step that leaves the simplex, does not lower max_k L_k or changes
    the top domain (SLSQP goes on from its own iterate).  Returns the point where the run has
    converged (a step lowered max_k L_k by <= ftol and the model predicts <= ftol more), or None.
    """
    s = at(z)
    L, dL = s.array("L"), s.array("dL")
    k = int(np.argmax(L))
    top2 = np.sort(L)[-2:] if L.size > 1 else np.array([-np.inf, L[0]])
    face = z > FINISH_ZERO
    q = int(face.sum()) - 1
    if q < 1 or top2[1] - top2[0] < FINISH_GAP * ftol:
        return None
    # a zero coordinate whose gradient is below the face's mean would enter: not a face minimum
    if np.any(dL[k][~face] < float(dL[k][face].mean()) - 1e-12):
        return None
    basis, _ = np.linalg.qr(np.column_stack([np.ones(q + 1), np.eye(q + 1)]))
    Z = np.zeros((z.size, q))
    Z[face] = basis[:, 1 : q + 1]  # orthonormal basis of the face's directions (sum 0)
    grad = dL[k]
    decrease = np.inf
    H_last: np.ndarray | None = None
    for _ in range(FINISH_MAX_STEPS):
        pairs = [(zi, si) for zi, si in visited if np.all(zi[~face] <= FINISH_OFF_FACE) and not np.array_equal(zi, z)]
        if 2 * len(pairs) < q:
            return None
        pairs.sort(key=lambda pair: float(np.sum((pair[0] - z) ** 2)))
        del pairs[max(FINISH_PAIRS * q, 4) :]  # the nearest: L_k's Hessian changes along the run
        S = np.array([(zi - z) @ Z for zi, _ in pairs])
        Y = np.array([(si.array("dL")[k] - grad) @ Z for _, si in pairs])
        try:  # an ill-posed fit (e.g. the pairs nearly collinear) ends the finish, not the solve
            H = _symmetric_secant_fit(S, Y)
            stale = not np.all(np.isfinite(H)) or np.linalg.eigvalsh(H)[0] <= 0
            if stale:  # not positive definite: the last fit that was, if any
                if H_last is None:
                    return None
                H = H_last
            H_last = H
            g = Z.T @ grad
            w = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:
            return None
        predicted = 0.5 * float(g @ w)  # the model's decrease of L_k at its minimum z - Z w
        if decrease <= ftol and predicted <= ftol:
            return z
        z_new = z - Z @ w
        if np.any(z_new < 0):
            return None
        s_new = at(z_new)
        L_new = s_new.array("L")
        val_new = float(L_new.max())
        if not val_new < val or int(np.argmax(L_new)) != k:
            return None
        step_taken(z_new, val_new)
        # with the last fit, a decrease far from the model's: that fit is off (e.g. L_k is nearly
        # linear along the step, its minimum on a smaller face)
        if stale and predicted > ftol and not FINISH_RATIO[0] <= (val - val_new) / predicted <= FINISH_RATIO[1]:
            return None
        decrease, z, val, grad = val - val_new, z_new, val_new, s_new.array("dL")[k]
    return None


def _symmetric_secant_fit(S: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """The symmetric H minimising sum_i |H s_i - y_i|^2 / |s_i|^4 (rows of S and Y), least norm."""
    m, q = S.shape
    rows, cols = np.triu_indices(q)
    A = np.zeros((m, q, rows.size))  # d(H s_i)_a / d H[rows[c], cols[c]]
    for c, (a, b) in enumerate(zip(rows, cols)):
        A[:, a, c] += S[:, b]
        if a != b:
            A[:, b, c] += S[:, a]
    scale = 1.0 / np.maximum(np.einsum("ij,ij->i", S, S), np.finfo(float).tiny)  # 1 / |s_i|^2
    sol = np.linalg.lstsq(
        (A * scale[:, None, None]).reshape(m * q, rows.size), (Y * scale[:, None]).reshape(m * q), rcond=None
    )[0]
    H = np.zeros((q, q))
    H[rows, cols] = sol
    H[cols, rows] = sol
    return H


def _on_simplex(x: np.ndarray) -> np.ndarray:
    """An SLSQP iterate (on the simplex up to rounding) with the rounding removed."""
    z = np.clip(np.asarray(x, dtype=np.float64), 0.0, None)
    out: np.ndarray = z / z.sum()
    return out


# ---------------------------------------------------------------------------- regret
def regret_baseline(ev: _Counter, p: int) -> np.ndarray:
    """b_k = the smallest L_k over the p vertices and the uniform point (p + 1 evaluations).

    ``objective="regret"`` minimises max_k L_k(z) - b_k: a domain's loss counts by how much the
    mixture costs it against the best it gets from a single predictor or the plain average, so
    a domain that no mixture serves well (a site whose predictor is confidently wrong on its own
    rows), or a site that adds a constant to its losses, cannot pull the others' losses up to
    its level (docs/DESIGN.md, "Hostile peers")."""
    points = [np.eye(p)[k] for k in range(p)] + [np.full(p, 1.0 / p)]
    baseline: np.ndarray = np.min([ev(z, ("L", "dL")).array("L") for z in points], axis=0)
    return baseline


class _Shifted(_Counter):
    """A :class:`_Counter` whose L is shifted by ``-shift`` (the regret objective)."""

    def __init__(self, ev: _Counter, shift: np.ndarray) -> None:
        super().__init__(ev.oracle, ev.eta, ev.global_bound)
        self.ev, self.shift = ev, shift

    def _shifted(self, s: DCSums) -> DCSums:
        return DCSums(L=None if s.L is None else s.L - self.shift, dL=s.dL, u=s.u, du=s.du, v=s.v, dv=s.dv, n=s.n)

    def peek(self, z: np.ndarray, what: tuple[str, ...]) -> DCSums | None:
        s = self.ev.peek(z, what)
        return None if s is None else self._shifted(s)

    def __call__(self, z: np.ndarray, what: tuple[str, ...]) -> DCSums:
        return self._shifted(self.ev(z, what))


# ---------------------------------------------------------------------------- own-loss guarantee
#: the guarantee holds at z when every L_k(z) - b_k is at most this (loss units: SLSQP's active
#: constraints end within rounding of their bound)
GUARANTEE_FEASIBLE = 1e-7
#: weights C of the exact penalty tried in turn (the next only where the last left an excess): at
#: least the constraints' Lagrange multipliers, the min-max point under the constraints is then
#: the minimiser of max_k L_k + C max(0, max_j L_j - b_j)
GUARANTEE_PENALTIES = (1e2, 1e4)


class _Penalised(_Shifted):
    """A :class:`_Counter` whose "L" is the p (p + 1) terms L_k and L_k + C (L_j - b_j): their max
    is max_k L_k + C max(0, max_j L_j - b_j), the exact penalty of the own-loss constraints
    L_j <= b_j, and the epigraph problem of ``_minmax_run`` over them is the constrained min-max."""

    def __init__(self, ev: _Counter, bounds: np.ndarray, weight: float) -> None:
        super().__init__(ev, np.zeros_like(bounds))
        self.bounds, self.weight = bounds, weight

    def _shifted(self, s: DCSums) -> DCSums:
        L, dL = s.L, s.dL
        F = dF = None
        if L is not None:
            excess = self.weight * (L - self.bounds)
            F = np.concatenate([L, (L[:, None] + excess[None, :]).ravel()])
        if dL is not None:
            p = dL.shape[0]
            dF = np.concatenate([dL, (dL[:, None, :] + self.weight * dL[None, :, :]).reshape(p * p, p)])
        return DCSums(L=F, dL=dF, u=s.u, du=s.du, v=s.v, dv=s.dv, n=s.n)


def _guarantee(
    ev: _Counter,
    best: DCResult,
    own: np.ndarray,
    slack: float,
    tol: float,
    max_iter: int,
    callback: Callback | None,
) -> tuple[DCResult, dict[str, Any]]:
    """The min-max point ``best`` moved, where it must be, so that no L_k exceeds b_k = own_k + slack.

    1. ``best`` (the unconstrained min-max point) already satisfies every bound: kept (no round).
    2. Otherwise min over z of max_k L_k(z) - b_k from ``best.z`` (the regret machinery with the
       shift b).  Above 0: no z satisfies every bound; that point, the one with the smallest
       largest excess, is the result ("closest").
    3. Otherwise (a z satisfies them) the min-max under the bounds, from that feasible point, by
       the exact penalty (:class:`_Penalised`); a result that leaves an excess is retried with the
       next weight, and the feasible point of step 2 is kept if none does better.

    Returns the result and the record of the guarantee (``info["guarantee"]`` of the model)."""
    bounds = np.asarray(own, dtype=np.float64) + slack
    calls = ev.calls
    free = best.losses
    record: dict[str, Any] = {
        "slack": float(slack),
        "own": [float(x) for x in own],
        "max_loss_unconstrained": float(np.max(free)),
    }

    def done(res: DCResult, status: str) -> tuple[DCResult, dict[str, Any]]:
        excess = res.losses - bounds
        record.update(
            status=status,
            holds=bool(np.max(excess) <= GUARANTEE_FEASIBLE),
            losses=[float(x) for x in res.losses],
            excess=[float(x) for x in excess],
            evaluations=ev.calls - calls,
        )
        return res, record

    if np.max(free - bounds) <= GUARANTEE_FEASIBLE:
        return done(best, "holds at the min-max point")
    history: list[float] = []
    z_a, val_a, _, ok_a, it_a = _minmax_run(_Shifted(ev, bounds), best.z, tol, max_iter, callback, history)
    L_a = ev(z_a, ("L", "dL")).array("L")
    closest = replace(best, z=z_a, losses=L_a, gamma=gamma_from_losses(L_a, z_a), history=history, n_iter=it_a)
    closest.converged, closest.method = ok_a, "slsqp-minmax+closest"
    if val_a > GUARANTEE_FEASIBLE:
        return done(closest, "infeasible")
    result, z_start = closest, z_a
    for weight in GUARANTEE_PENALTIES:
        history = []
        z_b, _, _, ok_b, it_b = _minmax_run(_Penalised(ev, bounds, weight), z_start, tol, max_iter, callback, history)
        L_b = ev(z_b, ("L", "dL")).array("L")
        if np.max(L_b - bounds) <= GUARANTEE_FEASIBLE:
            if np.max(L_b) < np.max(result.losses):
                result = replace(best, z=z_b, losses=L_b, gamma=gamma_from_losses(L_b, z_b), history=history)
                result.n_iter, result.converged, result.method = it_b, ok_b, "slsqp-minmax+guarantee"
            break
        z_start = z_b
    return done(result, "constrained")


# ---------------------------------------------------------------------------- driver
#: DCA iterations of a fallback run inside method="auto" (each is one SLSQP solve: slow).
AUTO_DCA_ITER = 20
#: Newton iterations from a checkpoint's z0 inside method="auto" before the path is followed
AUTO_CHECKPOINT_NEWTON_ITER = 20


def _gamma_runs(
    ev: _Counter,
    p: int,
    method: str,
    starts: list[np.ndarray],
    z0_given: bool,
    tol: float,
    max_iter: int,
    callback: Callback | None,
    all_starts: bool = False,
) -> tuple[DCResult, list[dict[str, Any]]]:
    """Minimise Gamma with ``method``; returns the best result and a summary of every run.

    A run that converges ends the solve, unless ``all_starts`` (every start is run)."""
    best: DCResult | None = None
    runs: list[dict[str, Any]] = []

    def keep(
        start: np.ndarray | None,
        z: np.ndarray,
        g: float,
        L: np.ndarray,
        ok: bool,
        it: int,
        used: str,
        history: list[float],
    ) -> bool:
        nonlocal best
        runs.append(
            {
                "start": None if start is None else np.asarray(start).tolist(),
                "gamma": g,
                "iterations": it,
                "method": used,
            }
        )
        if best is None or g < best.gamma:
            best = _start_result(z, g, L, history, ok, it, used)
        return best.converged and not all_starts

    def result() -> tuple[DCResult, list[dict[str, Any]]]:
        assert best is not None  # keep() has run: there is at least one start or the path
        return best, runs

    if method == "homotopy" or method == "auto":
        if method == "auto" and z0_given:  # a checkpoint: Newton from it may finish at once
            history: list[float] = []
            z, g, L, ok, it = _newton_run(
                ev, starts[0], tol, min(max_iter, AUTO_CHECKPOINT_NEWTON_ITER), callback, history
            )
            if keep(starts[0], z, g, L, ok, it, "newton", history):
                return result()
        history = []
        z, g, L, ok, it = logit_path_run(ev, p, tol, max_iter, callback, history)
        used = "homotopy"
        if not ok and method == "auto":  # Newton, then the paper's DCA, from the best point
            z, g, L, ok, it2 = _newton_run(ev, z, tol, max_iter, callback, history)
            it += it2
            used = "homotopy+newton"
            if not ok:
                z, g, L, ok, it2 = _dca_run(ev, z, tol, min(max_iter, AUTO_DCA_ITER), callback, history)
                it += it2
                used = "homotopy+newton+dca"
        if keep(None, z, g, L, ok, it, used, history) or method == "homotopy":
            return result()
        starts = starts[1:]  # auto: Newton from the random starts below
    for start in starts:
        history = []
        if method == "dca":
            z, g, L, ok, it = _dca_run(ev, start, tol, max_iter, callback, history)
            used = "dca"
        else:
            z, g, L, ok, it = _newton_run(ev, start, tol, max_iter, callback, history)
            used = "newton"
        if keep(start, z, g, L, ok, it, used, history):
            break
    return result()


def _solve(
    ev: _Counter,
    p: int,
    objective: str,
    method: str,
    starts: list[np.ndarray],
    z0_given: bool,
    tol: float,
    max_iter: int,
    callback: Callback | None,
    all_starts: bool = False,
) -> tuple[DCResult | None, list[dict[str, Any]]]:
    """The runs of :func:`solve_dc` from ``starts``: the best result and a summary of each run."""
    if objective in ("minmax", "regret"):
        best: DCResult | None = None
        runs: list[dict[str, Any]] = []
        shift = regret_baseline(ev, p) if objective == "regret" else np.zeros(p)
        run_ev: _Counter = _Shifted(ev, shift) if objective == "regret" else ev
        for start in starts:
            history: list[float] = []
            z, val, L, ok, it = _minmax_run(run_ev, start, tol, max_iter, callback, history)
            L = L + shift
            val = float(np.max(L)) if objective == "minmax" else val
            g = gamma_from_losses(L, z)
            runs.append(
                {"start": start.tolist(), "max_loss": val, "gamma": g, "iterations": it, "method": "slsqp-minmax"}
            )
            if best is None or val < float(np.max(best.losses - shift)) - 1e-12:
                best = _start_result(
                    z, g, L, history, ok, it, "slsqp-" + ("minmax" if objective == "minmax" else "regret")
                )
            if ok and not all_starts:  # restarts only while not converged: each costs rounds at every site
                break
    else:
        best, runs = _gamma_runs(ev, p, method, starts, z0_given, tol, max_iter, callback, all_starts)
    return best, runs


def solve_dc(
    oracle: LossOracle,
    eta: float,
    *,
    objective: str = "minmax",
    method: str | None = None,
    tol: float = 1e-9,
    max_iter: int = 200,
    n_restarts: int = 4,
    all_starts: bool = False,
    random_state: int | np.random.Generator | None = 0,
    bound: str | None = None,
    z0: np.ndarray | None = None,
    callback: Callback | None = None,
    warn: bool = True,
    guarantee: float | None = None,
    own_losses: np.ndarray | None = None,
) -> DCResult:
    """Solve for z over the simplex: min max_k L_k(z) (default) or min Gamma(z).

    The options are those of :class:`SolverConfig` (same names, same checks).

    Parameters
    ----------
    oracle : LossOracle giving sums over all labelled points (local or distributed).
    eta : smoothing, >= 0.
    objective : "minmax" (min max_k L_k, the worst-case loss over the domains, by SLSQP on
        the epigraph) or "gamma" (the paper: min Gamma).
    method : objective "gamma" only (an error under "minmax"): "auto" (default; the logit-path
        homotopy of :mod:`msa_fed.core.dc_homotopy`; only if it fails: Newton then DCA from its
        best point, then Newton from random starts), "homotopy", "newton" (active-set Newton from
        each start) or "dca" (the paper's algorithm from each start).
    tol : stop as soon as Gamma(z) <= tol (Gamma >= 0, so this is a global optimality test).
    max_iter : iteration cap per run; hitting it gives ``converged=False`` and a ConvergenceWarning.
    n_restarts : random simplex starts tried after the first one, only while not converged.
    all_starts : run every start (the first and the ``n_restarts`` random ones) to the end and
        keep the best, even after one has converged (the exhaustive solve: each start costs
        rounds at every site).
    bound : objective "gamma", squared loss only: "pointwise" (default; M_i per point, tighter)
        or "global" (one M).
    z0 : optional first start instead of the uniform point (e.g. a checkpoint).
    callback : called as callback(iteration, z, gamma) after each accepted iterate.
    guarantee : objective "minmax" only: a slack s >= 0; z is then the min-max point subject to
        L_k(z) <= own_losses[k] + s for every k, or, where no z satisfies them all, the z with the
        smallest largest excess (:func:`_guarantee`; the record in ``DCResult.guarantee``).
    own_losses : (p,) each site's own predictor's loss (what the sites measure on their labelled
        points); required with ``guarantee``.
    """
    cfg = SolverConfig(
        objective=objective,
        method=method,
        tol=tol,
        max_iter=max_iter,
        n_restarts=n_restarts,
        all_starts=all_starts,
        bound=bound,
        z0=None if z0 is None else tuple(np.asarray(z0, dtype=np.float64).reshape(-1)),
        guarantee=guarantee,
    ).validate()
    objective, tol, max_iter, n_restarts = cfg.objective, cfg.tol, cfg.max_iter, cfg.n_restarts
    all_starts = cfg.all_starts
    method, bound = cfg.method or "auto", cfg.bound or "pointwise"
    if not (np.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta must be a finite number >= 0; got {eta!r}")
    p = int(oracle.n_sources)
    own = None
    if cfg.guarantee is not None:
        own = np.asarray(own_losses if own_losses is not None else [], dtype=np.float64).reshape(-1)
        if own.size != p or not np.all(np.isfinite(own)):
            raise ValueError(f"guarantee needs own_losses: {p} finite numbers, each site's own predictor's loss")
    rng = np.random.default_rng(random_state)
    global_bound = oracle.max_bound() if bound == "global" else None
    ev = _Counter(oracle, eta, global_bound)
    if z0 is not None:
        z0 = check_simplex(z0, "z0")
        if z0.size != p:
            raise ValueError(f"z0 must have {p} entries (one per source); got {z0.size}")
    starts = [np.full(p, 1.0 / p) if z0 is None else z0]
    starts += [rng.dirichlet(np.ones(p)) for _ in range(n_restarts)]
    # one BLAS thread for the whole solve: its own products are (p, p), and an idle second
    # thread spins between the oracle's calls (msa_fed/core/threads.py)
    with blas_threads_for(p * p):
        best, runs = _solve(ev, p, objective, method, starts, z0 is not None, tol, max_iter, callback, all_starts)
        assert best is not None  # there is at least one start
        if own is not None and cfg.guarantee is not None:
            best, best.guarantee = _guarantee(ev, best, own, cfg.guarantee, tol, max_iter, callback)
    best.n_evaluations = ev.calls
    best.restarts = runs
    best.objective = objective
    if not best.converged and warn:
        what = "Gamma" if objective == "gamma" else "max_k L_k"
        value = best.gamma if objective == "gamma" else best.max_loss
        from sklearn.exceptions import ConvergenceWarning  # scikit-learn's class; importing it costs ~1 s

        warnings.warn(
            f"DC solver ({best.method}) stopped without converging: {what}={value:.3g} "
            f"(tol={tol:g}, max_iter={max_iter})",
            ConvergenceWarning,
            stacklevel=2,
        )
    return best


def gamma_at(oracle: LossOracle, z: np.ndarray, eta: float) -> float:
    """Gamma(z) from one oracle call (for grids and tests)."""
    z = check_simplex(np.asarray(z, dtype=float), "z")
    return gamma_from_losses(oracle.evaluate(z, eta, ("L",)).array("L"), z)
