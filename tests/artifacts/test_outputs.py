"""Output checks used where predictions are used (site points, predict time)."""

from __future__ import annotations

import numpy as np
import pytest

from msa_fed.artifacts.outputs import checked_proba, checked_values
from msa_fed.errors import ArtifactError, ConfigError

GOOD = np.array([[0.2, 0.8], [1.0, 0.0], [0.5, 0.5]])


def test_good_outputs_pass_unchanged():
    np.testing.assert_array_equal(checked_proba(GOOD, 3, 2, "h"), GOOD)
    np.testing.assert_array_equal(checked_values([1.0, -2.0, 3e30], 3, "h"), [1.0, -2.0, 3e30])
    assert checked_proba(np.zeros((0, 2)), 0, 2, "h").shape == (0, 2)


@pytest.mark.parametrize(
    "row, reason",
    [
        ([np.nan, 1.0], "NaN or inf"),
        ([np.inf, 0.0], "NaN or inf"),
        ([-0.5, 1.5], r"outside \[0, 1\]"),
        ([0.5, 0.4], "do not sum to 1"),
    ],
)
def test_bad_probabilities_name_the_predictor_and_the_row(row, reason):
    P = GOOD.copy()
    P[2] = row
    with pytest.raises(ArtifactError, match=rf"predictor 1 \(site 'b'\): .*{reason}.*1 of 3 rows \(first row 2\)"):
        checked_proba(P, 3, 2, "predictor 1 (site 'b')", ArtifactError)
    with pytest.raises(ConfigError, match=reason) as info:  # a site's version: no row of its data named
        checked_proba(P, 3, 2, "site 'b''s predictor", ConfigError, show_rows=False, where="site 'a''s labelled points")
    # nor how many, nor a value the predictor computed on them (the sums' deviation): one line
    # naming the owner and the sample
    assert str(info.value).startswith("site 'b''s predictor: ")
    assert str(info.value).endswith("for some of site 'a''s labelled points")
    assert "row" not in str(info.value) and "0.1" not in str(info.value) and "3" not in str(info.value)


def test_shapes_and_non_finite_values():
    with pytest.raises(ValueError, match=r"shape \(3, 3\); expected \(3, 2\)"):
        checked_proba(np.full((3, 3), 1 / 3), 3, 2, "h")
    with pytest.raises(ValueError, match="2 values for 3 inputs"):
        checked_values([1.0, 2.0], 3, "h")
    with pytest.raises(ValueError, match=r"NaN or inf for 1 of 3 rows \(first row 1\)"):
        checked_values([1.0, -np.inf, 3.0], 3, "h")


def _rowwise(P, atol=1e-4):
    """The rule row by row (what the checks' slow path and their messages apply)."""
    finite = np.isfinite(P).all(axis=1)
    if not finite.all():
        return "NaN or inf"
    if not ((P >= -atol) & (P <= 1 + atol)).all():
        return "outside"
    if float(np.abs(P.sum(axis=1) - 1.0).max()) > atol:
        return "do not sum to 1"
    return None


def test_the_quick_pass_accepts_exactly_what_the_row_by_row_checks_accept():
    """Many outputs at the edges of the rule (entries just inside and outside [-atol, 1 + atol],
    row sums just inside and outside 1 +- atol, NaN, infinities, 2 to 5 classes): the check
    accepts exactly those the row-by-row rule accepts, and refuses the others for its reason."""
    rng = np.random.default_rng(0)
    edges = [np.nan, np.inf, -np.inf, -1.5e-4, -0.5e-4, 1 + 0.5e-4, 1 + 1.5e-4, 0.0, 1.0]
    accepted = refused = 0
    for trial in range(3000):
        c = 2 + trial % 4
        P = rng.dirichlet(np.ones(c), size=5 + trial % 7)
        kind = trial % 5
        if kind == 1:  # one entry at an edge
            P[rng.integers(P.shape[0]), rng.integers(c)] = edges[trial % len(edges)]
        elif kind == 2:  # one row's sum moved by about the tolerance
            P[rng.integers(P.shape[0])] *= 1 + rng.choice([-1.5e-4, -0.5e-4, 0.5e-4, 1.5e-4])
        elif kind == 3:  # a row of a degenerate prediction, shifted slightly
            P[rng.integers(P.shape[0])] = np.eye(c)[0] + rng.choice([-1.5e-4, 0.0, 1.5e-4])
        elif kind == 4:  # an entry just below 0 or above 1, the row still summing to 1
            r, delta = rng.integers(P.shape[0]), rng.choice([-1.5e-4, -0.5e-4, 0.5e-4, 1.5e-4])
            if delta < 0:  # one entry below 0, the first raised to make up for it
                P[r] = 1.0 / c
                P[r, 1], P[r, 0] = delta, 2.0 / c - delta
            else:  # the first above 1, the others below 0 by less than the tolerance each
                P[r] = -delta / max(c - 1, 1)
                P[r, 0] = 1.0 + delta
        want = _rowwise(P)
        if want is None:
            accepted += 1
            np.testing.assert_array_equal(checked_proba(P, P.shape[0], c, "h"), P)
        else:
            refused += 1
            with pytest.raises(ValueError, match=want):
                checked_proba(P, P.shape[0], c, "h")
    assert accepted > 1000 and refused > 500
