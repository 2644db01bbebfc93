"""Honest federations of small sites under the default policy: no refusal, and the worst
domain's accuracy within 0.02 of the same fit without any policy (the full grid:
``python -m msa_fed.experiments.policy_sweep``)."""

from msa_fed.experiments import policy_sweep as S


def test_small_honest_sites_are_never_refused_and_lose_no_accuracy():
    out = S.run(ps=(3, 5), sizes=(30,), layouts=("separated", "overlapping"), seeds=(1,), log=lambda _: None)
    s = out["summary"]
    assert s["fits"] == 4 and s["refused"] == 0
    assert all(f["plain"]["refused"] is None for f in out["fits"])
    assert s["max_worst_drop"] <= S.TOLERANCE


def test_the_plain_policy_never_clips():
    from msa_fed.privacy.influence import share_bound

    assert share_bound(S.no_limits()) == 1.0
