"""The verdict rules of ``core/harm.py`` on hand-made losses."""

import numpy as np

from msa_fed.core.harm import harm_lines, site_check


def _check(noisy):
    names = ["north", "south", "evil"]
    # south is harmed at the model's z (2.0 against its own 0.3) and not without evil (column 1 + 2)
    combined = np.array(
        [
            [0.30, 0.30, 0.30, 0.30],
            [2.00, 2.00, 2.00, 0.35],
            [0.20, 0.20, 0.20, 0.20],
        ]
    )
    own = np.array([0.28, 0.30, 0.19])
    return site_check(names, combined, own, np.full(3, 4.0), noisy, [True] * 3)


def test_a_harmed_site_names_the_peer_whose_exclusion_removes_it():
    check = _check([False, False, False])
    assert check["harmed"] == [False, True, False]
    assert check["suspects"] == ["evil"] and check["removed_by"] == {"south": ["evil"]}
    assert any("south" in line and "HARMED" in line for line in harm_lines(check))


def test_a_noisy_verdict_is_shown_but_not_judged():
    """Under DP a site's answer carries noise that alone can pass its tolerance: the verdict is
    shown (marked ~) but names nobody."""
    check = _check([False, True, False])
    assert check["harmed"] == [False, False, False] and check["suspects"] == []
    lines = harm_lines(check)
    assert any(line.startswith("  south:") and "~2.0000" in line and "not judged" in line for line in lines)
    assert not any("HARMED" in line for line in lines)
