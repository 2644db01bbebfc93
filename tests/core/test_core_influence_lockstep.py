"""The influence report's p re-solves in lockstep: the same table as one re-solve after another,
in as many rounds as its longest re-solve (one batched request per site per round)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dc_problems import make_dc_problem  # noqa: E402

from msa_fed.core.dc_solver import LocalOracle, solve_dc  # noqa: E402
from msa_fed.core.dc_terms import batch_rows  # noqa: E402
from msa_fed.core.influence import CachedOracle, influence_table, losses_without  # noqa: E402


class BatchingOracle(LocalOracle):
    """The in-process oracle with a batched call, counting calls and batches."""

    def __init__(self, point_sets):
        super().__init__(point_sets)
        self.batches: list[int] = []
        self.whats: set[tuple[str, ...]] = set()
        self.singles = 0

    def evaluate(self, z, eta, what, global_bound=None):
        self.singles += 1
        return super().evaluate(z, eta, what, global_bound)

    def evaluate_batch(self, zs, eta, what, global_bound=None):
        self.batches.append(len(zs))
        self.whats.add(tuple(what))
        return [LocalOracle.evaluate(self, z, eta, what, global_bound) for z in zs]


@pytest.mark.parametrize("p", [3, 5])
def test_lockstep_gives_the_sequential_table_in_fewer_rounds(p):
    sets = make_dc_problem(p, 300, "cross_entropy", random_state=p)
    oracle = BatchingOracle(sets)
    res = solve_dc(oracle, 0.01, n_restarts=0)
    oracle.singles = 0
    table = influence_table(oracle, 0.01, res.z, res.losses, [f"s{k}" for k in range(p)])
    assert oracle.singles == 0  # every evaluation of the report went in a batch
    assert oracle.whats == {("L", "dL")}  # no request for the losses alone at a re-solve's end
    # one after another, through a plain cache (the report as it was computed before)
    cached = CachedOracle(LocalOracle(sets))
    for j in range(p):
        zj, Lj = losses_without(cached, 0.01, res.z, j)
        np.testing.assert_allclose(table["z_without"][j], zj, atol=1e-9)
        np.testing.assert_allclose(table["loss_without"][j], Lj, atol=1e-9)
    # each row's losses are those at its z (read from the re-solve's last evaluation, not asked again)
    plain = LocalOracle(sets)
    for j in range(p):
        at = plain.evaluate(np.asarray(table["z_without"][j]), 0.01, ("L",)).array("L")
        np.testing.assert_allclose(table["loss_without"][j], at, rtol=1e-12, atol=1e-12)
    assert table["rounds"] == len(oracle.batches) and max(oracle.batches) <= p
    assert table["evaluations"] == sum(oracle.batches) == cached.calls
    # the rounds are those of the longest re-solve, fewer than the evaluations of all of them
    assert table["rounds"] < table["evaluations"]


def test_a_failing_round_fails_the_report_and_ends_every_re_solve():
    sets = make_dc_problem(3, 200, "cross_entropy", random_state=0)
    oracle = BatchingOracle(sets)
    res = solve_dc(oracle, 0.01, n_restarts=0)

    def broken(zs, eta, what, global_bound=None):
        raise RuntimeError("a site went away")

    oracle.evaluate_batch = broken
    with pytest.raises(RuntimeError, match="went away"):
        influence_table(oracle, 0.01, res.z, res.losses, ["a", "b", "c"])


def test_batched_sums_split_into_one_per_z():
    sets = make_dc_problem(3, 100, "cross_entropy", random_state=1)
    ps = sets[0]
    zs = np.array([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
    rows = [ps.evaluate(z, 0.01, what=("L", "dL")) for z in zs]
    from msa_fed.core.dc_terms import DCSums

    stacked = DCSums(L=np.stack([r.L for r in rows]), dL=np.stack([r.dL for r in rows]), n=rows[0].n)
    for got, want in zip(batch_rows(stacked), rows):
        np.testing.assert_array_equal(got.L, want.L)
        np.testing.assert_array_equal(got.dL, want.dL)
        assert got.n == want.n and got.u is None


@pytest.mark.parametrize("loss", ["cross_entropy", "squared"])
@pytest.mark.parametrize("n", [100, 6000])  # one block; blocks of 1024 points (about 1500 at the site)
def test_a_batch_at_a_site_gives_each_z_its_own_sums_bit_for_bit(n, loss, monkeypatch):
    from msa_fed.core import dc_terms

    monkeypatch.setattr(dc_terms, "BLOCK_ELEMENTS", 4096)
    sets = make_dc_problem(4, n, loss, random_state=2)
    ps = sets[1]
    zs = np.array([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for what in (("L",), ("dL",), ("L", "dL"), ("L", "dL", "u", "du", "v", "dv")):
        got = ps.evaluate_batch(zs, 0.01, what=what)
        assert len(got) == len(zs)
        for z, g in zip(zs, got):
            want = ps.evaluate(z, 0.01, what=what)
            assert set(g.arrays()) == set(want.arrays()) == set(what)
            for name in what:
                np.testing.assert_array_equal(getattr(g, name), getattr(want, name))
            assert g.n == want.n
    with pytest.raises(ValueError, match="shape"):
        ps.evaluate_batch(zs[:, :3], 0.01, what=("L", "dL"))


@pytest.mark.parametrize(("p", "seed", "loss"), [(4, 2, "cross_entropy"), (6, 5, "cross_entropy"), (6, 11, "squared")])
def test_a_re_solve_known_without_asking_is_not_run_and_gives_the_re_solves_answer(p, seed, loss):
    """A site with no weight in the min-max z whose domain is below the top: the problem without
    it has z as a local minimum; its row is z and L(z), in no evaluation, and equals what the
    re-solve (run here as the reference) finds."""
    from msa_fed.core.influence import known_without

    sets = make_dc_problem(p, 300, loss, random_state=seed)
    oracle = BatchingOracle(sets)
    res = solve_dc(oracle, 0.01, n_restarts=0)
    assert res.converged
    known = [j for j in range(p) if known_without(res.z, res.losses, j)]
    assert known  # the problems are chosen with such a site
    names = [f"s{k}" for k in range(p)]
    oracle.batches.clear()
    skipped = influence_table(oracle, 0.01, res.z, res.losses, names, minmax_point=True)
    asked_skipping = sum(oracle.batches)
    oracle.batches.clear()
    full = influence_table(oracle, 0.01, res.z, res.losses, names)
    assert full["known"] == [] and skipped["known"] == [names[j] for j in known]
    cached = CachedOracle(LocalOracle(sets))
    for j in range(p):
        zj, Lj = losses_without(cached, 0.01, res.z, j)  # the re-solve, one after another
        # a known row is z itself, where the re-solve from z stops at its first point
        np.testing.assert_allclose(skipped["z_without"][j], zj, atol=1e-9)
        np.testing.assert_allclose(skipped["loss_without"][j], Lj, atol=1e-11)
        np.testing.assert_allclose(full["z_without"][j], zj, atol=1e-9)
    for j in known:  # exactly z (z_j = 0) and L(z)
        np.testing.assert_array_equal(skipped["loss_without"][j], res.losses)
        assert skipped["z_without"][j][j] == 0.0
    assert skipped["flagged"] == full["flagged"]
    assert skipped["evaluations"] == asked_skipping < full["evaluations"]
    # a domain at the top with no weight (its multiplier may be positive) is re-solved
    top = int(np.argmax(res.losses))
    assert not known_without(np.where(np.arange(p) == top, 0.0, res.z), res.losses, top)


def test_the_re_solves_threads_keep_one_blas_thread_while_any_of_them_runs():
    """The re-solve threads run on one BLAS thread from start to end, inside their own
    one-thread sections (a solve's) and outside them: a thread's own setting is ignored by
    OpenBLAS once the main thread has set one (as the fit's solve and the outer limit here
    have), so the caller holds it for all of them; the caller's setting comes back after."""
    from threadpoolctl import threadpool_limits

    from msa_fed.core.influence import run_threads
    from msa_fed.core.threads import one_blas_thread

    def blas_threads() -> int:
        return max(lib.get_num_threads() for lib in one_blas_thread().libs)

    seen: dict[int, tuple[int, int]] = {}

    def resolve(j: int) -> None:
        outside = blas_threads()
        with one_blas_thread():  # as each solve opens its own
            seen[j] = (outside, blas_threads())

    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() == 2  # the outer setting: two threads
        with one_blas_thread():  # the fit's solve in this thread, before the report
            pass
        run_threads(resolve, [0, 1, 2], "test")
        assert seen == {j: (1, 1) for j in range(3)}
        assert blas_threads() == 2  # given back once every thread has ended
