"""Per-point quantities of the DC problem and their sums (DESIGN.md sections 2 and 3).

Everything the DC solver needs is a sum over labelled points, so a set of points (one site's,
or all of them) turns a mixture weight ``z`` into a :class:`DCSums` of size O(p^2) that can be
added to other sites' sums.  This module is the only place where the formulas live; the solver
(:mod:`msa_fed.core.dc_solver`) and the distributed runtime both call it.

Notation (DESIGN.md section 2), for the points i of this set:

- ``w``  : ndarray (n, p), domain weights w_k(i) = pi_i q_k(x_i) (sum over *all* sites' points is 1)
- ``pi`` : ndarray (n,), point masses pi_i = 1 / (p n_s(i))
- ``H``  : ndarray (n, p), H_k(i) = h_k(x_i) (regression) or h_k(x_i, y_i) (probability model)
- ``y``  : ndarray (n,), targets (regression only)
- K_z(i) = sum_k z_k w_k(i) + eta pi_i,  J_z(i) = sum_k (z_k w_k(i) + eta pi_i / p) H_k(i),
  g_z(i) = J_z(i) / K_z(i).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np

from msa_fed.core.threads import one_blas_thread

LOSSES = ("squared", "cross_entropy")
#: Floor on probabilities given to the true label, so that -log stays finite.
PROB_FLOOR = 1e-12


@dataclass
class DCSums:
    """Sums over a set of points for one value of z; sites' sums add up to the global ones.

    Attributes (p = number of sources; every array is optional and present only when asked):
    L   : (p,)   L_k(z) = sum_i w_k(i) loss(g_z(i), y_i)
    dL  : (p, p) dL[k, j] = d L_k / d z_j
    u   : (p,)   convex part u_k(z);  du : (p, p) du[k, j] = d u_k / d z_j
    v   : (p,)   convex part v_k(z);  dv : (p, p)
    n   : number of points summed over
    """

    L: np.ndarray | None = None
    dL: np.ndarray | None = None
    u: np.ndarray | None = None
    du: np.ndarray | None = None
    v: np.ndarray | None = None
    dv: np.ndarray | None = None
    n: int = 0

    def __add__(self, other: DCSums) -> DCSums:
        out: dict[str, Any] = {"n": self.n + other.n}
        for name in WHAT:  # the array fields (dataclasses.fields per call: most of an addition's time)
            a, b = getattr(self, name), getattr(other, name)
            if a is None or b is None:
                if (a is None) != (b is None):
                    raise ValueError(f"cannot add DCSums: field {name!r} present in only one operand")
                out[name] = None
            else:
                out[name] = a + b
        return DCSums(**out)

    def array(self, name: str) -> np.ndarray:
        """The array ``name`` (one of ``WHAT``); a ValueError if it was not asked for."""
        value = getattr(self, name) if name in WHAT else None
        if not isinstance(value, np.ndarray):
            raise ValueError(f"DCSums has no {name!r}: ask for it in `what`")
        return value

    def arrays(self) -> dict[str, np.ndarray]:
        """The present arrays by name (for messages crossing a site boundary)."""
        return {name: value for name in WHAT if (value := getattr(self, name)) is not None}


def batch_rows(s: DCSums) -> list[DCSums]:
    """The per-z sums of a batched :class:`DCSums` (every array with a leading axis of one row
    per z: L (m, p), dL (m, p, p), ...)."""
    arrays = s.arrays()
    m = next(iter(arrays.values())).shape[0] if arrays else 0
    return [DCSums(**{k: v[r] for k, v in arrays.items()}, n=s.n) for r in range(m)]


def sum_all(parts: Iterable[DCSums]) -> DCSums:
    """Add a non-empty iterable of :class:`DCSums`."""
    parts = list(parts)
    if not parts:
        raise ValueError("no partial sums to add")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


WHAT = ("L", "dL", "u", "du", "v", "dv")
# DCSums's arrays are these, in this order (its addition and ``arrays`` go through WHAT)
assert tuple(f.name for f in fields(DCSums) if f.name != "n") == WHAT
#: Rows per block in :meth:`PointSet.evaluate` (at least; the rows are cut into equal blocks of
#: fewer than twice that): temporaries of about BLOCK_ELEMENTS floats stay in cache.
BLOCK_ELEMENTS = 1 << 16


@dataclass
class PointSet:
    """A set of labelled points with what the DC sums need (see module docstring).

    ``bound`` is the per-point majoriser constant M_i >= max_k (H_k(i) - y_i)^2 used by the
    squared-loss decomposition; it is computed here from ``H`` and ``y``.
    """

    w: np.ndarray
    pi: np.ndarray
    H: np.ndarray
    loss: str
    y: np.ndarray | None = None
    bound: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}; got {self.loss!r}")
        # (n, p) arrays column-major: the per-point factors multiply whole columns (measured: the
        # L + dL sums 1.1x to 2x faster than row-major at p = 32 to 4)
        self.w = np.asfortranarray(self.w, dtype=np.float64)
        self.pi = np.ascontiguousarray(self.pi, dtype=np.float64)
        self.H = np.asfortranarray(self.H, dtype=np.float64)
        if self.w.ndim != 2:
            raise ValueError(f"w must be a 2-D array (n_points, n_sources); got shape {self.w.shape}")
        n, p = self.w.shape
        if self.H.shape != (n, p) or self.pi.shape != (n,):
            raise ValueError(f"shape mismatch: w {self.w.shape}, H {self.H.shape}, pi {self.pi.shape}")
        if self.loss == "cross_entropy":
            self.H = np.maximum(self.H, PROB_FLOOR)
        else:
            if self.y is None:
                raise ValueError("the squared loss needs targets y")
            self.y = np.ascontiguousarray(self.y, dtype=np.float64)
            if self.y.shape != (n,):
                raise ValueError(f"shape mismatch: y {self.y.shape}, expected ({n},)")
            self.bound = np.max((self.H - self.y[:, None]) ** 2, axis=1)
        # products that do not depend on z or eta, computed once
        self._WH = self.w * self.H  # (n, p) w_k(i) H_k(i)
        self._piH = self.pi * self.H.sum(axis=1)  # (n,)  pi_i sum_k H_k(i)
        self._wsum = self.w.sum(axis=0)  # (p,)
        self._eta: tuple[float, np.ndarray, np.ndarray] | None = None

    @property
    def n_points(self) -> int:
        return int(self.w.shape[0])

    def max_bound(self) -> float:
        """max_i M_i over this set (for the global-M variant of the squared-loss DC)."""
        if self.loss != "squared" or self.bound is None or not self.n_points:
            return 0.0
        return float(self.bound.max())

    # ------------------------------------------------------------------ core evaluation
    def evaluate(
        self, z: np.ndarray, eta: float, *, what: tuple[str, ...] = ("L",), global_bound: float | None = None
    ) -> DCSums:
        """Partial sums over this set at ``z``.

        what : subset of {"L", "dL", "u", "du", "v", "dv"}.
        global_bound : if given (squared loss), use this M for every point instead of M_i.

        The points are processed in blocks of rows (so that the (rows, p) temporaries stay in
        cache) with one BLAS thread; the sums of the blocks are added.
        """
        return self._evaluate(z, eta, what, global_bound, pinned=False)

    def _evaluate(
        self, z: np.ndarray, eta: float, what: tuple[str, ...], global_bound: float | None, pinned: bool
    ) -> DCSums:
        """:meth:`evaluate`; ``pinned``: the caller already holds BLAS on one thread."""
        z = np.asarray(z, dtype=np.float64)
        what = tuple(what)
        unknown = [name for name in what if name not in WHAT]
        if unknown:
            raise ValueError(f"what must be a subset of {WHAT}; got {what!r}")
        n, p = self.w.shape
        if z.shape != (p,):
            raise ValueError(f"z must have shape ({p},); got {z.shape}")
        out = {name: np.zeros((p, p)) if name.startswith("d") else np.zeros(p) for name in what}
        if n == 0:
            return DCSums(n=n, **out)
        # blocks of rows .. 2 rows - 1 (no short last block: a small product runs at a fraction of
        # the speed of a full one; measured at p = 64, 1562 rows: one block 0.55 ms, 1024 + 538 0.66 ms)
        rows = max(256, BLOCK_ELEMENTS // p)
        blocks = max(1, n // rows)
        edges = [(i * n) // blocks for i in range(blocks + 1)]
        block: Callable[[slice], None]
        if set(what) <= {"L", "dL"}:  # what the default solver asks: one product per block
            buf = np.empty((-(-n // blocks), p), order="F") if "dL" in what else None
            block = partial(self._losses_block, z=z, eta=float(eta), grad="dL" in what, buf=buf, out=out)
        else:
            block = partial(self._block, z=z, eta=float(eta), what=what, global_bound=global_bound, out=out)
        if n * p < 4096:  # tiny: BLAS stays on one thread anyway, skip the 0.1 ms switch
            block(slice(0, n))
        else:
            with contextlib.nullcontext() if pinned else one_blas_thread():
                for a, b in zip(edges[:-1], edges[1:]):
                    block(slice(a, b))
        if "dv" in what and self.loss == "cross_entropy":
            out["dv"] += self._wsum[None, :]
        return DCSums(n=n, **out)

    def evaluate_batch(
        self, zs: np.ndarray, eta: float, *, what: tuple[str, ...] = ("L",), global_bound: float | None = None
    ) -> list[DCSums]:
        """:meth:`evaluate` at each row of ``zs`` (m, p), under one BLAS-thread setting for the
        whole batch (entering it costs about as much as the sums of a small site at one z)."""
        zs = np.asarray(zs, dtype=np.float64)
        with one_blas_thread():
            return [self._evaluate(z, eta, tuple(what), global_bound, pinned=True) for z in zs]

    def _eta_terms(self, eta: float) -> tuple[np.ndarray, np.ndarray]:
        """(eta pi_i, (eta / p) pi_i sum_k H_k(i)) for the last eta asked (the solver keeps eta)."""
        if self._eta is None or self._eta[0] != eta:
            p = self.w.shape[1]
            self._eta = (eta, eta * self.pi, (eta / p) * self._piH)
        return self._eta[1], self._eta[2]

    def _losses_block(
        self,
        sl: slice,
        z: np.ndarray,
        eta: float,
        grad: bool,
        buf: np.ndarray | None,
        out: dict[str, np.ndarray],
    ) -> None:
        """Add L (and dL when ``grad``) over rows ``sl`` to ``out``: one product each per block.

        dL[k, j] = sum_i w_k(i) loss'(g(i)) (H_j(i) - g(i)) w_j(i) / K(i) = (w^T T)[k, j] with
        T_ij = a_i (H_j(i) - g(i)) w_j(i) (squared: a = 2r / K; cross-entropy: -1 / J).
        ``buf`` is a (rows, p) column-major scratch array reused by every block: with the arrays
        column-major, each of the three passes that build T in it runs over whole columns.
        """
        w, WH = self.w[sl], self._WH[sl]
        m, p = w.shape
        eta_pi, eta_piH = self._eta_terms(eta)
        K = w @ z
        K += eta_pi[sl]  # K_z(i)
        J = WH @ z
        J += eta_piH[sl]  # J_z(i)
        g = J / K
        if self.loss == "squared":
            assert self.y is not None  # set for the squared loss in __post_init__
            r = g - self.y[sl]
            loss = r * r
            a = np.divide(r, K, out=r)
            a *= 2.0  # dloss/dg / K
            sign = 1.0
        else:
            loss = np.log(g)
            a = np.reciprocal(J, out=J)  # -dloss/dg / K = 1 / J
            sign = -1.0
        if "L" in out:
            out["L"] += sign * (loss @ w)
        if not grad:
            return
        assert buf is not None
        T = buf[:m]
        np.multiply(w, g[:, None], out=T)
        np.subtract(WH, T, out=T)  # (H_j - g) w_j
        T *= a[:, None]
        prod = w.T @ T
        if sign < 0:
            out["dL"] -= prod
        else:
            out["dL"] += prod

    def _block(
        self,
        sl: slice,
        z: np.ndarray,
        eta: float,
        what: tuple[str, ...],
        global_bound: float | None,
        out: dict[str, np.ndarray],
    ) -> None:
        """Add the sums over rows ``sl`` to the arrays of ``out`` (formulas of DESIGN.md section 3)."""
        w, pi, WH = self.w[sl], self.pi[sl], self._WH[sl]
        p = w.shape[1]
        K = w @ z + eta * pi  # K_z(i)
        J = WH @ z + (eta / p) * self._piH[sl]  # J_z(i)
        g = J / K
        need_grad = "dL" in what or "du" in what or "dv" in what
        if need_grad:
            # dg/dz_j = w_j (H_j - g) / K = Gn / K[:, None]
            Gn = WH - w * g[:, None]
        if self.loss == "squared":
            assert self.y is not None and self.bound is not None  # set for the squared loss in __post_init__
            r = g - self.y[sl]
            loss = r * r
            if "L" in what:
                out["L"] += w.T @ loss
            if "dL" in what:
                out["dL"] += (w * (2.0 * r / K)[:, None]).T @ Gn
            if not ("u" in what or "du" in what or "v" in what or "dv" in what):
                return
            M = self.bound[sl] if global_bound is None else np.full(K.shape, float(global_bound))
            logK = np.log(K)
            MK = M / K
            # C.T @ x with C = w + eta pi 1^T (c_k(i) = w_k(i) + eta pi_i), without forming C
            if "u" in what:
                x = loss - 2.0 * M * logK
                out["u"] += w.T @ x + eta * (pi @ x)
            if "du" in what:
                X = Gn * (2.0 * r / K)[:, None] - w * (2.0 * MK)[:, None]
                out["du"] += w.T @ X + eta * (pi @ X)[None, :]
            if "v" in what:
                x = M * logK
                out["v"] += (K @ loss) - 2.0 * (w.T @ x + eta * (pi @ x))
            if "dv" in what:
                row = w.T @ loss + (2.0 * r) @ Gn  # d/dz_j sum_i K r^2
                X = w * MK[:, None]
                out["dv"] += row[None, :] - 2.0 * (w.T @ X + eta * (pi @ X)[None, :])
        else:
            if "L" in what:
                out["L"] -= w.T @ np.log(g)
            if "dL" in what:
                out["dL"] -= (w / J[:, None]).T @ Gn  # dloss/dg = -1/g, Dg = Gn / K
            if not ("u" in what or "du" in what or "v" in what or "dv" in what):
                return
            logK, logJ = np.log(K), np.log(J)
            if "u" in what:
                out["u"] -= w.T @ logJ + eta * (pi @ logJ)
            if "du" in what:
                X = WH / J[:, None]
                out["du"] -= w.T @ X + eta * (pi @ X)[None, :]
            if "v" in what:
                out["v"] += K @ (logK - logJ) - (w.T @ logK + eta * (pi @ logK))
            if "dv" in what:
                # row_j = sum_i w_j (logK - logJ) + w_j (1 - H_j / g); the sum of w_j is added once
                row = w.T @ (logK - logJ) - WH.T @ (1.0 / g)
                X = w / K[:, None]
                out["dv"] += row[None, :] - (w.T @ X + eta * (pi @ X)[None, :])


def gamma_from_losses(L: np.ndarray, z: np.ndarray) -> float:
    """Gamma(z) = max_k L_k(z) - sum_j z_j L_j(z)  (>= 0 on the simplex)."""
    return float(np.max(L) - np.dot(z, L))
