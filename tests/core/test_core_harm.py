"""The verdict rules of ``core/harm.py`` on hand-made losses."""

import numpy as np

from msa_fed.core.harm import SUSPECTS_HEAD, harm_lines, site_check


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
    assert f"  {SUSPECTS_HEAD}: none" in lines


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
    assert any(
        line.startswith("  not named: north (one other site, hostile, would account") for line in harm_lines(check)
    )


def test_a_noisy_verdict_is_shown_but_not_judged():
    """Under DP a site's answer carries noise that alone can pass its tolerance: the verdict is
    shown (marked ~) but names nobody."""
    check = _check([False, True, False])
    assert check["harmed"] == [False, False, False] and check["suspects"] == []
    lines = harm_lines(check)
    assert any(line.startswith("  south:") and "~2.0000" in line and "not judged" in line for line in lines)
    assert not any("HARMED" in line for line in lines)


def test_a_hostile_site_cannot_second_an_honest_sites_accusation_of_an_honest_peer():
    """The poisoning attack's verdicts (tests/runtime/test_site_verdicts.py: north harmed, its harm
    gone without south, whose predictor took north's region, and without evil, whose rows
    poisoned north's estimate), with evil lying that its own harm goes away without south: two
    harmed sites accuse honest south.  Evil alone accounts for both (its own word, and north's
    harm, which goes away without evil too), so south is not named; nor is evil, on north's word
    alone."""
    names = ["north", "south", "evil"]
    own = np.array([0.088, 0.686, 0.0])
    combined = np.array([[0.87], [0.686], [3.0]])
    table = np.array(
        [
            [1.04, 0.092, 0.174],  # north, without each site and its data (measured)
            [0.715, 1.44, 0.521],
            [3.0, 0.0, 3.0],  # evil's lie: harmed, and not without south
        ]
    )
    check = site_check(names, combined, own, np.full(3, 0.4), [False] * 3, [True] * 3, without_sites=table)
    assert check["removed_by"] == {"north": ["south", "evil"], "evil": ["south"]}
    assert check["suspects"] == [] and check["not_named"] == ["south", "evil"]
    # the price: south harmed too and cleared without evil alone still names nobody, since south,
    # hostile, would account for both (its own word, and north's harm that goes away without it)
    combined = np.array([[0.87], [2.0], [3.0]])
    table[1] = [2.0, 2.0, 0.5]
    check = site_check(names, combined, own, np.full(3, 0.4), [False] * 3, [True] * 3, without_sites=table)
    assert check["removed_by"]["south"] == ["evil"]
    assert check["suspects"] == [] and check["not_named"] == ["south", "evil"]
    # once north's harm goes away without evil only, north and south accuse evil alone: evil is named
    table[0] = [1.04, 0.9, 0.174]
    check = site_check(names, combined, own, np.full(3, 0.4), [False] * 3, [True] * 3, without_sites=table)
    assert check["removed_by"] == {"north": ["evil"], "south": ["evil"], "evil": ["south"]}
    assert check["suspects"] == ["evil"] and check["not_named"] == ["south"]


def test_on_one_word_a_lone_accusation_names_and_an_accused_seconder_still_does_not():
    """``suspects="any"`` (``lone``): a harmed site nobody accuses names whom it accuses alone (the
    hostile peer one honest site sees, and an honest peer one lying site frames just as well); a
    seconder that is itself accused accounts for nothing more than under the default rule."""
    check = site_check(
        ["north", "south", "evil"],
        np.array([[0.30, 0.30, 0.30, 0.30], [2.00, 2.00, 2.00, 0.35], [0.20, 0.20, 0.20, 0.20]]),
        np.array([0.28, 0.30, 0.19]),
        np.full(3, 4.0),
        [False] * 3,
        [True] * 3,
        lone=True,
    )
    assert check["suspects"] == ["evil"] and check["not_named"] == [] and check["rule"] == "any"
    assert check["accusers"] == {"evil": ["south"]}
    assert f"  {SUSPECTS_HEAD}: evil (on south's word alone)" in harm_lines(check)
    # the hostile seconding: evil (accused by north) seconds north's accusation of honest south
    names, own = ["north", "south", "evil"], np.array([0.088, 0.686, 0.0])
    table = np.array([[1.04, 0.092, 0.174], [0.715, 1.44, 0.521], [3.0, 0.0, 3.0]])
    combined = np.array([[0.87], [0.686], [3.0]])
    for lone in (False, True):
        check = site_check(names, combined, own, np.full(3, 0.4), [False] * 3, [True] * 3, table, lone=lone)
        assert check["removed_by"] == {"north": ["south", "evil"], "evil": ["south"]}
        assert check["suspects"] == [] and check["not_named"] == ["south", "evil"]
