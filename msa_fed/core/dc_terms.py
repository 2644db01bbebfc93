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

from dataclasses import dataclass, field, fields

import numpy as np

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

    def __add__(self, other: "DCSums") -> "DCSums":
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "n":
                out["n"] = a + b
            elif a is None or b is None:
                if (a is None) != (b is None):
                    raise ValueError(f"cannot add DCSums: field {f.name!r} present in only one operand")
                out[f.name] = None
            else:
                out[f.name] = a + b
        return DCSums(**out)

    def arrays(self) -> dict[str, np.ndarray]:
        """The present arrays by name (for messages crossing a site boundary)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "n" and getattr(self, f.name) is not None}


def sum_all(parts) -> DCSums:
    """Add a non-empty iterable of :class:`DCSums`."""
    parts = list(parts)
    if not parts:
        raise ValueError("no partial sums to add")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


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

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}; got {self.loss!r}")
        self.w = np.ascontiguousarray(self.w, dtype=np.float64)
        self.pi = np.ascontiguousarray(self.pi, dtype=np.float64)
        self.H = np.ascontiguousarray(self.H, dtype=np.float64)
        if self.loss == "cross_entropy":
            self.H = np.maximum(self.H, PROB_FLOOR)
        else:
            if self.y is None:
                raise ValueError("the squared loss needs targets y")
            self.y = np.ascontiguousarray(self.y, dtype=np.float64)
            self.bound = np.max((self.H - self.y[:, None]) ** 2, axis=1)
        n, p = self.w.shape
        if self.H.shape != (n, p) or self.pi.shape != (n,):
            raise ValueError(f"shape mismatch: w {self.w.shape}, H {self.H.shape}, pi {self.pi.shape}")

    @property
    def n_points(self) -> int:
        return self.w.shape[0]

    def max_bound(self) -> float:
        """max_i M_i over this set (for the global-M variant of the squared-loss DC)."""
        return float(self.bound.max()) if self.loss == "squared" and self.n_points else 0.0

    # ------------------------------------------------------------------ core evaluation
    def evaluate(self, z: np.ndarray, eta: float, *, what: tuple[str, ...] = ("L",),
                 global_bound: float | None = None) -> DCSums:
        """Partial sums over this set at ``z``.

        what : subset of {"L", "dL", "u", "du", "v", "dv"}.
        global_bound : if given (squared loss), use this M for every point instead of M_i.
        """
        z = np.asarray(z, dtype=np.float64)
        w, pi, H = self.w, self.pi, self.H
        p = w.shape[1]
        out = DCSums(n=self.n_points)
        if self.n_points == 0:
            for name in what:
                setattr(out, name, np.zeros((p, p)) if name.startswith("d") else np.zeros(p))
            return out
        zw = w * z
        K = zw.sum(axis=1) + eta * pi
        J = (zw * H).sum(axis=1) + (eta / p) * pi * H.sum(axis=1)
        g = J / K
        need_grad_g = any(name in what for name in ("dL", "du", "dv"))
        if need_grad_g:
            # dg/dz_j = w_j (H_j - g) / K  -> (n, p)
            Dg = w * (H - g[:, None]) / K[:, None]
        if self.loss == "squared":
            r = g - self.y
            loss = r * r
            dloss = 2.0 * r
        else:
            loss = -np.log(g)
            dloss = -1.0 / g
        if "L" in what:
            out.L = w.T @ loss
        if "dL" in what:
            out.dL = w.T @ (dloss[:, None] * Dg)
        if not any(name in what for name in ("u", "du", "v", "dv")):
            return out
        C = w + (eta * pi)[:, None]  # c_k(i) = w_k(i) + eta pi_i, (n, p)
        if self.loss == "squared":
            M = np.full_like(K, global_bound) if global_bound is not None else self.bound
            logK = np.log(K)
            if "u" in what:
                out.u = C.T @ (loss - 2.0 * M * logK)
            if "du" in what:
                out.du = C.T @ (2.0 * r[:, None] * Dg - 2.0 * (M / K)[:, None] * w)
            if "v" in what:
                out.v = np.full(p, K @ loss) - 2.0 * (C.T @ (M * logK))
            if "dv" in what:
                row = w.T @ loss + (2.0 * r * K) @ Dg  # d/dz_j sum_i K r^2, (p,)
                out.dv = row[None, :] - 2.0 * C.T @ ((M / K)[:, None] * w)
        else:
            logK, logJ = np.log(K), np.log(J)
            if "u" in what:
                out.u = -(C.T @ logJ)
            if "du" in what:
                out.du = -(C.T @ (w * H / J[:, None]))
            if "v" in what:
                out.v = -(C.T @ logK) + K @ (logK - logJ)
            if "dv" in what:
                row = w.T @ (logK - logJ) + (w * (1.0 - H / g[:, None])).sum(axis=0)
                out.dv = -(C.T @ (w / K[:, None])) + row[None, :]
        return out


def gamma_from_losses(L: np.ndarray, z: np.ndarray) -> float:
    """Gamma(z) = max_k L_k(z) - sum_j z_j L_j(z)  (>= 0 on the simplex)."""
    return float(np.max(L) - np.dot(z, L))
