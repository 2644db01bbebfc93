"""Two jobs with DP at one site, answering at once, share one lifetime epsilon.

The budget check and the write of the answer's event are one step under the ledger's lock:
threads that each ask for one more Gaussian answer when the lifetime budget has room for
exactly ``room`` more get exactly ``room`` answers, whatever the interleaving (DC answers
leave the verdict's reserve: ``room - VERDICT_ANSWERS`` of them, then the verdict).
"""

from __future__ import annotations

import threading

import pytest

from msa_fed.errors import PrivacyError
from msa_fed.privacy.dp import VERDICT_ANSWERS, DPAccountant, epsilon_of
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy


@pytest.mark.parametrize("ledger_file", [False, True], ids=["memory", "file"])
def test_concurrent_jobs_cannot_overspend_the_lifetime_epsilon(tmp_path, ledger_file):
    policy = SitePolicy(dp_enabled=True, epsilon_per_job=1.0, dp_dc_evaluations=4, epsilon_lifetime=2.0)
    ledger = Ledger(str(tmp_path / "ledger.sqlite") if ledger_file else "")
    nm = DPAccountant(policy, ledger, "probe", "a").noise_multiplier
    # earlier jobs' answers, leaving room in the lifetime budget for exactly `room` more
    fits = 0
    while epsilon_of([(nm, fits + 1)], policy.delta) <= policy.epsilon_lifetime:
        fits += 1
    room = 3
    assert fits > room
    ledger.add_dp_event("earlier", nm, fits - room)
    accountants = [DPAccountant(policy, ledger, f"job{i}", "a") for i in range(8)]
    start = threading.Barrier(len(accountants))
    outcomes: list[str] = []

    def answer(acc):
        start.wait()
        try:
            acc.spend()
            outcomes.append("answered")
        except PrivacyError as e:
            assert e.rule == "dp_budget"
            outcomes.append("refused")

    threads = [threading.Thread(target=answer, args=(a,)) for a in accountants]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    dc = room - VERDICT_ANSWERS  # DC answers: each must leave the verdict's reserve in the budget
    assert outcomes.count("answered") == dc and outcomes.count("refused") == len(accountants) - dc
    assert sum(n for _, n in ledger.dp_events(None)) == fits - VERDICT_ANSWERS
    # the reserve pays for a verdict, and then nothing is left
    accountants[0].spend(verdict=True)
    with pytest.raises(PrivacyError, match="epsilon_lifetime"):
        accountants[1].spend(verdict=True)
    assert sum(n for _, n in ledger.dp_events(None)) == fits  # the earlier answers and `room` new ones
    assert epsilon_of(ledger.dp_events(None), policy.delta) <= policy.epsilon_lifetime
