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
        checked_proba(P, 3, 2, "site 'a', predictor 1", ConfigError, show_rows=False)
    assert "row" not in str(info.value)


def test_shapes_and_non_finite_values():
    with pytest.raises(ValueError, match=r"shape \(3, 3\); expected \(3, 2\)"):
        checked_proba(np.full((3, 3), 1 / 3), 3, 2, "h")
    with pytest.raises(ValueError, match="2 values for 3 inputs"):
        checked_values([1.0, 2.0], 3, "h")
    with pytest.raises(ValueError, match=r"NaN or inf for 1 of 3 rows \(first row 1\)"):
        checked_values([1.0, -np.inf, 3.0], 3, "h")
