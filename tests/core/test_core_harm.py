"""The verdict rules of ``core/harm.py`` on hand-made losses."""

import numpy as np

from msa_fed.core.harm import WITNESSES, harm_lines, site_check


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


def test_a_lone_harmed_site_accuses_the_peer_whose_exclusion_removes_it_and_names_nobody():
    """South's word alone: it reads the same whether evil harmed south or south lies about evil."""
    check = _check([False, False, False])
    assert check["harmed"] == [False, True, False]
    assert check["suspects"] == [] and check["removed_by"] == {"south": ["evil"]} and check["not_named"] == ["evil"]
    lines = harm_lines(check)
    assert any("south" in line and "HARMED" in line for line in lines)
    assert "  south's harm goes away without evil" in lines
    assert f"  suspects (sites whose exclusion removes the harm of {WITNESSES} or more other sites): none" in lines


def test_two_harmed_sites_that_accuse_the_same_peer_name_it():
    """North is harmed too and cleared without evil: two sites say so, so at least one honest site
    is harmed by evil's presence (one hostile site cannot corroborate itself)."""
    names = ["north", "south", "evil"]
    combined = np.array(
        [
            [2.00, 2.00, 2.00, 0.30],  # north: harmed, not without evil
            [2.00, 2.00, 2.00, 0.35],  # south: the same
            [3.00, 0.20, 3.00, 3.00],  # evil says it is harmed, not without north: one word against north
        ]
    )
    own = np.array([0.28, 0.30, 0.19])
    check = site_check(names, combined, own, np.full(3, 4.0), [False] * 3, [True] * 3)
    assert check["harmed"] == [True, True, True]
    assert check["removed_by"] == {"north": ["evil"], "south": ["evil"], "evil": ["north"]}
    assert check["suspects"] == ["evil"] and check["not_named"] == ["north"]
    assert any(line.startswith("  not named: north (fewer than 2 harmed sites say so") for line in harm_lines(check))


def test_a_noisy_verdict_is_shown_but_not_judged():
    """Under DP a site's answer carries noise that alone can pass its tolerance: the verdict is
    shown (marked ~) but names nobody."""
    check = _check([False, True, False])
    assert check["harmed"] == [False, False, False] and check["suspects"] == []
    lines = harm_lines(check)
    assert any(line.startswith("  south:") and "~2.0000" in line and "not judged" in line for line in lines)
    assert not any("HARMED" in line for line in lines)
