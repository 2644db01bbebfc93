"""Helpers for points of the probability simplex."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

SIMPLEX_ATOL = 1e-6


def check_simplex(z: np.ndarray, name: str = "z", atol: float = SIMPLEX_ATOL) -> np.ndarray:
    """Return ``z`` as a float array if it lies on the simplex, else raise a ValueError naming it."""
    z = np.asarray(z, dtype=np.float64)
    if z.ndim != 1 or z.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array; got shape {z.shape}")
    if not np.all(np.isfinite(z)):
        raise ValueError(f"{name} must be finite; got {z}")
    if np.any(z < -atol):
        raise ValueError(f"{name} must lie on the simplex; got a negative entry {z.min():.3g}")
    if abs(z.sum() - 1.0) > atol:
        raise ValueError(f"{name} must lie on the simplex; got sum={z.sum():.6g}")
    z = np.clip(z, 0.0, None)
    out: np.ndarray = z / z.sum()
    return out


def project_simplex(v: np.ndarray) -> np.ndarray:
    """Euclidean projection of ``v`` onto the probability simplex (sort-based algorithm)."""
    v = np.asarray(v, dtype=np.float64)
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    idx = np.arange(1, v.size + 1)
    rho = np.nonzero(u - css / idx > 0)[0][-1]
    theta = css[rho] / (rho + 1.0)
    out: np.ndarray = np.maximum(v - theta, 0.0)
    return out


def simplex_grid(p: int, step: float) -> np.ndarray:
    """All points of the simplex in dimension p whose coordinates are multiples of ``step``."""
    n = int(round(1.0 / step))
    if abs(n * step - 1.0) > 1e-9:
        raise ValueError(f"step must divide 1; got {step}")

    def rec(k: int, left: int) -> Iterator[tuple[int, ...]]:
        if k == 1:
            yield (left,)
            return
        for a in range(left + 1):
            for rest in rec(k - 1, left - a):
                yield (a,) + rest

    return np.array(list(rec(p, n)), dtype=np.float64) / n
