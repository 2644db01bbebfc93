"""Numerical helpers in plain numpy, so that what a site computes needs numpy only."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def logsumexp(a: ArrayLike, axis: int | None = None, keepdims: bool = False) -> np.ndarray:
    """log(sum(exp(a))) along ``axis``, without overflow (scipy.special.logsumexp's result for real
    arrays): the largest finite entry is factored out; a slice of -inf alone gives -inf, one
    holding +inf gives +inf."""
    a = np.asarray(a, dtype=np.float64)
    top = np.max(a, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out: np.ndarray = np.log(np.sum(np.exp(a - top), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis) if axis is not None else out.reshape(())
