"""Checks of the rows a model is given (:func:`check_X`) and of a frozen predictor's outputs where
they are used (a site's points, predict time).

The loader's probe runs a model on a few hundred synthetic rows; a hostile or broken predictor
can still answer NaN, infinity or non-probabilities elsewhere (say only when x0 > 6).  These
checks run on the very rows whose outputs are about to be used, and name the predictor and, with
``show_rows`` (the caller's own data), the first offending row.  A site passes
``show_rows=False``: its error crosses to the coordinator, and the rows of its private data that
a predictor fails on are nobody else's business (a predictor could be built as a membership test).
"""

from __future__ import annotations

import numpy as np

PROBA_ATOL = 1e-4  # float32 probabilities, summed in float64


def check_X(X, n_features: int, name: str = "X") -> np.ndarray:
    """X as a float64 (n, d) array, or a ValueError naming the problem."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim == 1 and n_features == 1:
        X = X[:, None]
    if X.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n_samples, n_features); got shape {X.shape}")
    if X.shape[1] != n_features:
        raise ValueError(f"{name} has {X.shape[1]} features; the model expects {n_features}")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{name} contains NaN or inf")
    return X


def _first_bad_rows(ok_rows: np.ndarray, show_rows: bool, where: str = "its inputs") -> str:
    if not show_rows:  # neither which rows nor how many: a count of the rows a hostile function
        return f"some of {where}"  # fails on is a counting query on private data
    bad = np.flatnonzero(~ok_rows)
    return f"{bad.size} of {ok_rows.size} rows (first row {int(bad[0])})"


def checked_values(
    values, n_rows: int, who: str, error=ValueError, show_rows: bool = True, where: str = "its inputs"
) -> np.ndarray:
    """Regression outputs as a float64 (n_rows,) array; ``error(...)`` naming ``who`` unless finite
    (without ``show_rows``: on "some of ``where``")."""
    out = np.asarray(values, dtype=np.float64).reshape(-1)
    if out.shape[0] != n_rows:
        raise error(f"{who}: predict returned {out.shape[0]} values for {n_rows} inputs")
    finite = np.isfinite(out)
    if not finite.all():
        raise error(f"{who}: predict returned NaN or inf for {_first_bad_rows(finite, show_rows, where)}")
    return out


def checked_proba(
    P, n_rows: int, n_classes: int, who: str, error=ValueError, show_rows: bool = True, where: str = "its inputs"
) -> np.ndarray:
    """Class probabilities as a float64 (n_rows, n_classes) array; ``error(...)`` naming ``who``
    unless every row is finite, in [0, 1] and sums to 1 (within PROBA_ATOL; without
    ``show_rows``: on "some of ``where``")."""
    P = np.asarray(P, dtype=np.float64)
    if P.ndim != 2 or P.shape != (n_rows, n_classes):
        raise error(f"{who}: predict_proba returned shape {P.shape}; expected ({n_rows}, {n_classes})")
    if P.size == 0:
        return P
    # the usual case in a few passes: min and max propagate NaN and see infinities, so within
    # [-atol, 1 + atol] every entry is finite and in range; the row sums as one product with ones
    # (rounding ~1e-16, far inside PROBA_ATOL).  Anything else takes the row-by-row checks below.
    lo, hi = P.min(), P.max()
    if lo >= -PROBA_ATOL and hi <= 1 + PROBA_ATOL:
        if float(np.abs(P @ np.ones(n_classes) - 1.0).max()) <= PROBA_ATOL:
            return P
    finite = np.isfinite(P).all(axis=1)
    if not finite.all():
        raise error(f"{who}: predict_proba returned NaN or inf for {_first_bad_rows(finite, show_rows, where)}")
    in_range = ((P >= -PROBA_ATOL) & (P <= 1 + PROBA_ATOL)).all(axis=1)
    if not in_range.all():
        rows = _first_bad_rows(in_range, show_rows, where)
        raise error(f"{who}: predict_proba returned values outside [0, 1] for {rows}")
    dev = np.abs(P.sum(axis=1) - 1.0)
    if float(dev.max()) > PROBA_ATOL:
        rows = _first_bad_rows(dev <= PROBA_ATOL, show_rows, where)
        # the deviation is a value a hostile function computed on the rows: said only with them
        size = f" (max deviation {float(dev.max()):.3g})" if show_rows else ""
        raise error(f"{who}: predicted probabilities do not sum to 1 for {rows}{size}")
    return P
