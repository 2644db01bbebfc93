"""The coordinator's path check (msa_fed/runtime/plausibility.py): a site's losses must follow
its gradients between nearby evaluations.  The check compares each answer with the site's last
PATH_MEMORY answers in a few vector operations; here it is held against the pairwise rule
written out as a loop, on a real site's sums along a path and on fabricated answers."""

from __future__ import annotations

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.core.dc_terms import DCSums, PointSet
from msa_fed.runtime import plausibility as pl
from msa_fed.runtime.plausibility import AnswerChecker, ImplausibleAnswer


def reference(history, z, eta, L, dL):
    """The rule pair by pair, oldest first: the first (entry, domain) that breaks it, or None."""
    for z1, eta1, L1, dL1 in history[-pl.PATH_MEMORY :]:
        if eta1 != eta or float(np.max(np.abs(z - z1))) > pl.PATH_STEP:
            continue
        dz = z - z1
        d1, d2 = dL1 @ dz, dL @ dz
        predicted = 0.5 * (d1 + d2)
        slack = pl.PATH_SLACK * (np.abs(d1) + np.abs(d2) + np.abs(d2 - d1)) + pl.PATH_RTOL * (np.abs(L) + np.abs(L1))
        bad = np.abs((L - L1) - predicted) > slack + pl.ATOL
        if np.any(bad):
            k = int(np.argmax(bad))
            return f"(domain {k}: change {L[k] - L1[k]:.6g}, gradients say {predicted[k]:.6g})"
    return None


def point_set(p: int, n: int, seed: int) -> PointSet:
    rng = np.random.default_rng(seed)
    Q = rng.dirichlet(np.ones(p), size=n)
    H = rng.random((n, p)) * 0.9 + 0.05
    return PointSet(w=Q / Q.sum(axis=0) / p, pi=np.full(n, 1.0 / n), H=H, loss="cross_entropy")


def checker() -> AnswerChecker:
    return AnswerChecker(["a"], [10], "cross_entropy")  # no Qhat noted: the bound on the mass is off


@pytest.mark.parametrize("p,seed", [(3, 0), (8, 1), (16, 2)])
def test_the_vectorised_check_agrees_with_the_pairwise_rule(p, seed):
    """A random walk of small and large steps, two etas, a few hundred answers: honest sums from a
    real point set, and every fifth answer a lie (L scaled, shifted or one domain moved).  After
    each answer the check raises exactly when the pairwise rule finds a pair, with its message."""
    rng = np.random.default_rng(seed)
    pts = point_set(p, 500, seed)
    ch, history, caught = checker(), [], 0
    z = np.full(p, 1.0 / p)
    for step in range(300):
        z = np.abs(z + rng.normal(scale=0.004 if step % 7 else 0.05, size=p))
        z /= z.sum()
        eta = 0.01 if step % 11 else 0.02
        s = pts.evaluate(z, eta, what=("L", "dL"))
        L, dL = np.array(s.L), np.array(s.dL)
        if step % 5 == 4:
            lie = step % 3
            if lie == 0:
                L = L * 1.5
            elif lie == 1:
                L = L + 0.05
            else:
                L[step % p] += 0.2
        want = reference(history, z, eta, L, dL)
        sums = DCSums(L=L, dL=dL, n=500)
        if want is None:
            ch.dc_partials([m.DCPartial(sums=sums)], z, eta, ("L", "dL"))
            history.append((z.copy(), eta, L.copy(), dL.copy()))
        else:
            caught += 1
            with pytest.raises(ImplausibleAnswer) as err:
                ch.dc_partials([m.DCPartial(sums=sums)], z, eta, ("L", "dL"))
            assert str(err.value).endswith(want)  # and the refused answer is not kept
    assert caught >= 10  # the lies near earlier answers were caught
    assert len(history) > pl.PATH_MEMORY  # and the ring wrapped around


def test_only_the_last_answers_are_compared():
    """An answer that contradicts one older than PATH_MEMORY answers only is not compared with it
    (as before: the memory is bounded), one that contradicts a recent one is refused."""
    pts = point_set(4, 300, 7)
    ch = checker()
    z0 = np.full(4, 0.25)
    s0 = pts.evaluate(z0, 0.01, what=("L", "dL"))
    ch.dc_partials([m.DCPartial(sums=s0)], z0, 0.01, ("L", "dL"))
    far = np.array([0.7, 0.1, 0.1, 0.1])
    for _ in range(pl.PATH_MEMORY):  # far from z0: pushes it out of the ring
        ch.dc_partials([m.DCPartial(sums=pts.evaluate(far, 0.01, what=("L", "dL")))], far, 0.01, ("L", "dL"))
    z1 = z0 + np.array([0.005, -0.005, 0.0, 0.0])
    s1 = pts.evaluate(z1, 0.01, what=("L", "dL"))
    lie = DCSums(L=np.asarray(s1.L) * 2.0, dL=s1.dL, n=300)
    ch.dc_partials([m.DCPartial(sums=lie)], z1, 0.01, ("L", "dL"))  # z0 is out of memory
    z2 = z1 + np.array([0.0, 0.0, 0.005, -0.005])
    s2 = pts.evaluate(z2, 0.01, what=("L", "dL"))
    with pytest.raises(ImplausibleAnswer, match="disagree with its gradients"):  # but z1 is in it
        ch.dc_partials([m.DCPartial(sums=s2)], z2, 0.01, ("L", "dL"))


def test_answers_that_change_shape_are_implausible():
    pts = point_set(3, 200, 3)
    ch = checker()
    z = np.full(3, 1.0 / 3)
    ch.dc_partials([m.DCPartial(sums=pts.evaluate(z, 0.01, what=("L", "dL")))], z, 0.01, ("L", "dL"))
    s = pts.evaluate(z, 0.01, what=("L", "dL"))
    odd = DCSums(L=np.append(s.L, 0.0), dL=np.vstack([s.dL, np.zeros(3)]), n=200)
    with pytest.raises(ImplausibleAnswer, match="changed shape"):
        ch.dc_partials([m.DCPartial(sums=odd)], z + 0.001, 0.01, ("L", "dL"))


def outcome(ch: AnswerChecker, rows) -> str | None:
    """Feed ``rows`` [(z, eta, [L per site], [dL per site])] to the checker one by one: the first
    refusal's message (with the site it names), or None."""
    for z, eta, Ls, dLs in rows:
        parts = [m.DCPartial(sums=DCSums(L=L, dL=dL, n=500)) for L, dL in zip(Ls, dLs)]
        try:
            ch.dc_partials(parts, z, eta, ("L", "dL"))
        except ImplausibleAnswer as err:
            return f"{err.site}: {err}"
    return None


def batch_outcome(ch: AnswerChecker, rows) -> str | None:
    """The same rows as one batched answer per site (what the influence report's rounds send)."""
    eta = rows[0][1]
    zs = np.stack([r[0] for r in rows])
    parts = [
        m.DCPartial(sums=DCSums(L=np.stack([r[2][s] for r in rows]), dL=np.stack([r[3][s] for r in rows]), n=500))
        for s in range(len(rows[0][2]))
    ]
    try:
        ch.dc_partials_batch(parts, zs, eta, ("L", "dL"))
    except ImplausibleAnswer as err:
        return f"{err.site}: {err}"
    return None


@pytest.mark.parametrize("p,seed", [(3, 3), (8, 4), (16, 5)])
def test_a_batched_answer_is_checked_as_its_rows_one_by_one(p, seed):
    """Two sites with real sums; after an honest history of random length, a batch of up to p
    rows near it and near each other, some with a lie (a loss moved, a negative loss, a loss above
    the site's bound, or another answer for a z answered before): the batched check refuses
    exactly what the row-by-row check refuses, naming the same site with the same message, and
    keeps what it keeps (the next batch is judged alike)."""
    rng = np.random.default_rng(seed)
    sets = [point_set(p, 200, seed), point_set(p, 150, seed + 100)]
    eta = 0.01

    def answer(z, lie=None, site=0):
        Ls, dLs = [], []
        for s, pts in enumerate(sets):
            out = pts.evaluate(z, eta, what=("L", "dL"))
            L, dL = np.array(out.L), np.array(out.dL)
            if lie is not None and s == site:
                L = lie(L)
            Ls.append(L)
            dLs.append(dL)
        return (z, eta, Ls, dLs)

    walk, z = [], rng.dirichlet(np.ones(p))  # one honest path; each trial starts with a prefix of it
    for _ in range(pl.PATH_MEMORY + 12):  # the ring wraps around for the longer prefixes
        z = np.abs(z + rng.normal(scale=0.005, size=p))
        z /= z.sum()
        walk.append(answer(z.copy()))
    kinds = {"honest": 0, "refused": 0}
    for trial in range(16):
        row_ch = AnswerChecker(["a", "b"], [10, 10], "cross_entropy")
        batch_ch = AnswerChecker(["a", "b"], [10, 10], "cross_entropy")
        for ch in (row_ch, batch_ch):  # the bound on each site's mass is on in most trials
            ch.mass = np.full((2, p), 0.5) if trial % 4 else None
        history = walk[: int(rng.integers(1, len(walk) + 1))]
        z = history[-1][0]
        assert outcome(row_ch, history) is None and batch_outcome(batch_ch, history) is None
        batch = []
        for _ in range(int(rng.integers(1, p + 1))):
            zi = np.abs(z + rng.normal(scale=0.01, size=p))
            zi /= zi.sum()
            lie, site = None, int(rng.integers(0, 2))
            roll = rng.random()
            if roll < 0.08:
                lie = lambda L: L + 0.3  # noqa: E731
            elif roll < 0.12:
                lie = lambda L: np.where(np.arange(p) == 0, -1.0, L)  # noqa: E731
            elif roll < 0.16:
                lie = lambda L: L + 30.0  # noqa: E731  (above the mass bound where it is on)
            elif roll < 0.2:
                old = history[int(rng.integers(0, len(history)))]
                batch.append((old[0], eta, [x * 1.01 for x in old[2]], old[3]))
                continue
            batch.append(answer(zi, lie, site))
        want = outcome(row_ch, batch)
        got = batch_outcome(batch_ch, batch)
        assert got == want
        kinds["refused" if want else "honest"] += 1
        if want is None:  # both kept the batch: a following lie near it is judged alike
            follow = [answer(batch[-1][0] + 0.0, lambda L: L * 1.3)]
            assert batch_outcome(batch_ch, follow) == outcome(row_ch, follow)
    assert kinds["honest"] >= 3 and kinds["refused"] >= 3


def state(ch: AnswerChecker) -> list:
    """What the checker keeps of each site: its path's entries (oldest first) and the requests it
    answered."""
    out = []
    for s in range(ch.p):
        ring = ch._path[s]
        held = []
        if ring is not None:
            for c in (ring.slot - ring.count + np.arange(ring.count)) % pl.PATH_MEMORY:
                held.append((ring.Z[c].tobytes(), float(ring.eta[c]), ring.L[c].tobytes(), ring.dL[c].tobytes()))
        seen = {key: {n: a.tobytes() for n, a in v.items()} for key, v in ch._seen[s].items()}
        out.append((held, seen))
    return out


def edge(history, z, eta, L, dL, k):
    """The two losses for domain k on either side of the path rule's edge (adjacent floats: the
    largest shift of L_k the rule keeps and the smallest it refuses), or None."""
    lo, hi = 0.0, 1.0

    def shifted(t):
        out = L.copy()
        out[k] = L[k] + t
        return out

    if reference(history, z, eta, L, dL) is not None or reference(history, z, eta, shifted(hi), dL) is None:
        return None
    while np.nextafter(lo, hi) < hi:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if reference(history, z, eta, shifted(mid), dL) is None else (lo, mid)
    return shifted(lo), shifted(hi)


@pytest.mark.parametrize("sites,p,seed", [(5, 4, 11), (12, 8, 12)])
def test_the_sites_checked_together_agree_with_each_site_checked_alone(sites, p, seed):
    """The one-row check of every site's answer at once (AnswerChecker.dc_partials) against the
    row-by-row check of each site on its own (dc_partials_batch with one row, the check before
    the sites were stacked): along a walk of a few hundred requests, real sums from each site's
    points, and lies at random sites: losses scaled or moved, a negative loss, a loss above the
    site's bound, another answer to a request answered before, two liars at once, answers of
    another shape, a site with DP noise, requests without gradients, and losses on either side of
    the path rule's edge (adjacent floats, found by bisection on the rule written out pair by
    pair).  Every answer is refused or kept alike, naming the same site with the same message,
    and both keep the same paths and answers, bit for bit."""
    rng = np.random.default_rng(seed)
    sets = [point_set(p, 120 + 10 * s, seed + s) for s in range(sites)]
    names = [f"s{s}" for s in range(sites)]
    together = AnswerChecker(names, [10] * sites, "cross_entropy")
    alone = AnswerChecker(names, [10] * sites, "cross_entropy")
    for ch in (together, alone):
        ch.mass = np.full((sites, p), 1.0 / sites)
        ch._dp = [False] * sites

    def alone_check(parts, z, eta, what):
        alone.dc_partials_batch([pl._OneRow(r) for r in parts], np.asarray(z)[None, :], eta, what)

    def run(check, parts, z, eta, what):
        try:
            check(parts, z, eta, what)
        except ImplausibleAnswer as err:
            return f"{err.site}: {err}"
        return None

    z, asked, counts = np.full(p, 1.0 / p), [], {"kept": 0, "refused": 0, "edge": 0}
    for step in range(150):
        if step % 17 == 16 and asked:  # a request answered before
            z, eta = asked[int(rng.integers(0, len(asked)))]
        else:
            z = np.abs(z + rng.normal(scale=0.003 if step % 9 else 0.04, size=p))
            z /= z.sum()
            eta = 0.01 if step % 13 else 0.02
            asked.append((z.copy(), eta))
        what = ("L",) if step % 23 == 22 else ("L", "dL")
        outs = [pts.evaluate(z, eta, what=what) for pts in sets]
        Ls = [np.array(o.L) for o in outs]
        dLs = [None if o.dL is None else np.array(o.dL) for o in outs]
        eps = [0.0] * sites
        liar = int(rng.integers(0, sites))
        roll = rng.random()
        if roll < 0.05:
            Ls[liar] = Ls[liar] * 1.3
        elif roll < 0.1:
            Ls[liar][step % p] += 0.05
        elif roll < 0.13:
            Ls[liar][0] = -1.0
        elif roll < 0.16:
            Ls[liar] = Ls[liar] + 30.0  # above the bound on the site's mass
        elif roll < 0.19:  # two liars: the first in order is named
            Ls[liar][0] = -1.0
            Ls[(liar + 1) % sites] = Ls[(liar + 1) % sites] * 2.0
        elif roll < 0.22 and step % 17 == 16:
            Ls[liar] = Ls[liar] * 1.01  # another answer to a request answered before
        elif roll < 0.24 and dLs[liar] is not None:  # another shape
            Ls[liar] = np.append(Ls[liar], 0.1)
            dLs[liar] = np.vstack([dLs[liar], np.zeros(p)])
        elif roll < 0.27:
            eps[liar] = 0.5  # DP noise: not checked
            Ls[liar] = -Ls[liar]
        elif roll < 0.4 and dLs[liar] is not None:  # on either side of the path rule's edge
            ring = alone._path[liar]
            history = []
            if ring is not None and ring.block is not None:
                for c in (ring.slot - ring.count + np.arange(ring.count)) % pl.PATH_MEMORY:
                    history.append((ring.Z[c].copy(), float(ring.eta[c]), ring.L[c].copy(), ring.dL[c].copy()))
            sides = edge(history, z, eta, Ls[liar], dLs[liar], step % p) if history else None
            if sides is not None:
                Ls[liar] = sides[step % 2]
                counts["edge"] += 1
        parts = []
        for s in range(sites):
            arrays = {"L": Ls[s]} if dLs[s] is None else {"L": Ls[s], "dL": dLs[s]}
            parts.append(m.DCPartial(sums=DCSums(**arrays, n=100), epsilon=eps[s]))
        want = run(alone_check, parts, z, eta, what)
        got = run(together.dc_partials, parts, z, eta, what)
        assert got == want, step
        if step % 10 == 9 or want is not None:
            assert state(together) == state(alone), step
        counts["refused" if want else "kept"] += 1
    assert state(together) == state(alone)
    assert counts["refused"] >= 15 and counts["kept"] >= 60 and counts["edge"] >= 10, counts
    assert together._path[0].count == pl.PATH_MEMORY  # the paths wrapped around
