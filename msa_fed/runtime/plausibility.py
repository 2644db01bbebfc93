"""Plausibility checks, at the coordinator, on every answer a site gives.

A site is another party: besides its answers' types and shapes (checked where they arrive), an
honest site's sums satisfy invariants that follow from their definitions (docs/DESIGN.md
sections 2 and 3), whatever its private data:

- a Qhat partial: sum_{i in s} pi_i Q(k|x_i) over k is n_s / (p n_s) = 1/p, every entry >= 0,
  and ``n`` is the site's labelled count announced when it joined;
- a DC partial: L_k >= 0 for both losses and, for the cross-entropy,
  L_k <= (mass of w_k on the site) * (-log PROB_FLOOR), the mass being the site's own Qhat
  partial over Qhat(k) (g_z is a convex combination of floored probabilities);
- along the solver's path, the losses agree with the returned gradients: for two evaluations at
  nearby z (every coordinate within :data:`PATH_STEP`), L(z2) - L(z1) is near the trapezoid
  0.5 (dL(z1) + dL(z2)) (z2 - z1) (the slack is wide: without the points there is no bound on
  the curvature, so only losses that do not follow their gradients at all are caught);
- the same request gives the same answer (a repeated z, eta and ``what``).

A violation raises :class:`ImplausibleAnswer` (a :class:`msa_fed.errors.PeerFault`) naming the
site that answered.  Answers with differential-privacy noise (a site that reports epsilon > 0)
satisfy none of these exactly and are not checked.
"""

from __future__ import annotations

import numpy as np

from msa_fed.core.dc_terms import PROB_FLOOR, DCSums
from msa_fed.errors import PeerFault

#: absolute slack of the equality checks (float64 sums of up to millions of points)
ATOL = 1e-8
#: relative slack of the Qhat partial's mass
MASS_RTOL = 1e-6
#: path check: only pairs of evaluations whose z differ by at most this in every coordinate
PATH_STEP = 0.02
#: path check: the change of L may miss the trapezoid of the gradients by PATH_SLACK times the
#: directional derivatives' size plus PATH_RTOL times the losses (measured: SLSQP's steps on
#: confident predictors miss by up to 3x the trapezoid; a fabricated L misses by far more)
PATH_SLACK = 2.0
PATH_RTOL = 0.05
#: how many past evaluations per site the path check compares with
PATH_MEMORY = 64


class ImplausibleAnswer(PeerFault):
    """A site's answer breaks an invariant every honest answer satisfies; ``site`` names it."""


class AnswerChecker:
    """Checks the answers of the sites of one job (the coordinator owns one per fit).

    names : the sites, in order;  n_labeled : their announced labelled counts;
    loss : "cross_entropy" or "squared".
    """

    def __init__(self, names, n_labeled, loss: str):
        self.names = [str(n) for n in names]
        self.n_labeled = [int(n) for n in n_labeled]
        self.p = len(self.names)
        self.loss = loss
        self.mass: np.ndarray | None = None  # (sites, p): the mass of w_k on each site
        self._dp = [False] * self.p  # sites whose Qhat partial carried DP noise
        self._seen: list[dict] = [{} for _ in self.names]
        self._path: list[_PathRing | None] = [None for _ in self.names]
        self._block: _PathBlock | None = None  # the paths of the common shape, in one array each

    def _fault(self, s: int, method: str, why: str) -> ImplausibleAnswer:
        name = self.names[s]
        return ImplausibleAnswer(name, f"site {name!r}'s answer to {method} is implausible: {why}")

    # ------------------------------------------------------------------ Qhat
    def qhat_partials(self, parts) -> None:
        """Check each site's Qhat partial (a QhatPartial per site, in order)."""
        sums = []
        for s, r in enumerate(parts):
            x = np.asarray(r.sums, dtype=np.float64)
            sums.append(x)
            if float(getattr(r, "epsilon", 0.0) or 0.0) > 0:
                continue
            if int(r.n) != self.n_labeled[s]:
                raise self._fault(s, "set_domain_model", f"n={int(r.n)}, but it joined with {self.n_labeled[s]}")
            if np.any(x < -ATOL):
                raise self._fault(s, "set_domain_model", "a negative Qhat partial")
            total = float(x.sum())
            if abs(total - 1.0 / self.p) > MASS_RTOL / self.p + ATOL:
                raise self._fault(
                    s, "set_domain_model", f"its Qhat partial sums to {total:.9g}, not 1/p = {1.0 / self.p:.9g}"
                )

    def qhat(self, parts, qhat: np.ndarray) -> None:
        """Note the mass of each w_k on each site (the bounds of its later losses)."""
        partial = np.array([np.asarray(r.sums, dtype=np.float64) for r in parts])
        self.mass = np.clip(partial, 0.0, None) / np.asarray(qhat, dtype=np.float64)[None, :]
        self._dp = [float(getattr(r, "epsilon", 0.0) or 0.0) > 0 for r in parts]

    # ------------------------------------------------------------------ DC sums
    def dc_partials(self, parts, z, eta: float, what) -> None:
        """Check each site's DC partial for the request (z, eta, what), as
        :meth:`dc_partials_batch` checks an answer of one row (the same answers refused, naming
        the same site with the same message), with the sites' answers checked together: their
        losses and gradients stacked and compared with every site's path in a few array
        operations (:meth:`_sites_at_once`), instead of one round of vector operations per site.
        A site whose answer or path is not of the common shape is checked on its own."""
        z = np.asarray(z, dtype=np.float64)
        zs, what = z[None, :], tuple(what)
        found: dict[int, tuple[int, str] | None] = {}
        together: dict[int, dict[str, np.ndarray]] = {}
        for s, r in enumerate(parts):
            if float(getattr(r, "epsilon", 0.0) or 0.0) > 0 or (self.mass is not None and self._dp[s]):
                continue
            arrays = {k: np.asarray(v, dtype=np.float64) for k, v in r.sums.arrays().items()}
            if self._joins(s, arrays, z.size):
                together[s] = arrays
            else:
                found[s] = self._batch_one(s, _OneRow(r).sums, zs, float(eta), what)
        if together:
            found.update(self._sites_at_once(together, z, float(eta), what))
        refused = [s for s in sorted(found) if found[s] is not None]
        if refused:
            s = refused[0]  # the first site in order (every answer has one row: row 0)
            why = found[s]
            assert why is not None
            raise self._fault(s, "dc_evaluate", why[1])

    def _joins(self, s: int, arrays: dict[str, np.ndarray], q: int) -> bool:
        """Whether site s's answer (its arrays) is checked with the others (:meth:`_sites_at_once`):
        L (k,) and dL (k, q) of the common shape (k = q, the sources), a path kept in the
        common block (or none yet), and the bound on the mass of that shape where it applies."""
        L, dL = arrays.get("L"), arrays.get("dL")
        if L is None or dL is None or L.shape != (q,) or dL.shape != (q, q):
            return False
        if self.loss == "cross_entropy" and self.mass is not None and self.mass.shape[1:] != (q,):
            return False
        ring = self._path[s]
        if ring is None:
            return self._block is None or self._block.q == q
        return ring.block is not None and ring.block.q == q

    def _sites_at_once(
        self, together: dict[int, dict[str, np.ndarray]], z: np.ndarray, eta: float, what: tuple
    ) -> dict[int, tuple[int, str] | None]:
        """The checks of :meth:`_batch_one` (one row) for the sites in ``together`` (site -> its
        answer's arrays, L and dL of the common shape): the bounds and negative losses, a repeated
        request, then the path check against every site's last answers, as array operations
        over the sites.  Returns site -> (0, why) or None; the sites kept are added to their paths
        and to what they answered (as :meth:`_batch_one` adds them)."""
        sites = np.fromiter(together, dtype=np.intp, count=len(together))
        L = np.stack([together[s]["L"] for s in sites])  # (g, k)
        why: dict[int, str] = {}
        if self.loss == "cross_entropy" and self.mass is not None:
            top = self.mass[sites] * -np.log(PROB_FLOOR)  # (g, k)
            ks = np.argmax(L - top, axis=1)
            rows = np.arange(sites.size)
            over = L[rows, ks] > top[rows, ks] * (1 + 1e-9) + ATOL
            for i in np.flatnonzero(over).tolist():
                k = int(ks[i])
                why[int(sites[i])] = (
                    f"loss {L[i, k]:.6g} for domain {k}, above its bound {top[i, k]:.6g} on the site's mass"
                )
        for i in np.flatnonzero(np.any(L < -ATOL, axis=1)).tolist():
            why[int(sites[i])] = "a negative loss"
        key = (z.tobytes(), eta, what)
        for s, arrays in together.items():
            before = None if s in why else self._seen[s].get(key)
            if before is None:
                continue
            changed = [
                n for n, arr in arrays.items() if n in before and not np.allclose(arr, before[n], rtol=1e-9, atol=ATOL)
            ]
            if changed:
                why[s] = f"two different {changed[0]} for the same z"
        out: dict[int, tuple[int, str] | None] = {s: (0, w) for s, w in why.items()}
        path = [s for s in together if s not in why]
        if path:
            out.update(self._paths_at_once(path, z, eta, {s: together[s] for s in path}))
        for s, arrays in together.items():
            if out.get(s) is None:
                out[s] = None
                self._seen[s][key] = {k: v.copy() for k, v in arrays.items()}
        return out

    def _paths_at_once(
        self, sites: list[int], z: np.ndarray, eta: float, answers: dict[int, dict[str, np.ndarray]]
    ) -> dict[int, tuple[int, str] | None]:
        """:meth:`_path_batch` for one row at each of ``sites`` (their answers' L and dL of the
        common shape), computed over the common block of paths at once: the same pairs compared
        (the entries each site's path holds, near z, of the same eta) with the same arithmetic,
        the same first refusal per site (its oldest disagreeing entry, the first domain there).
        The sites kept are added to their paths."""
        q = z.size
        block = self._block
        if block is None:
            block = self._block = _PathBlock(self.p, q)
        for s in sites:
            if self._path[s] is None:
                self._path[s] = block.ring(s)
        rings = [self._path[s] for s in sites]
        count = np.zeros(self.p, dtype=np.intp)
        slot = np.zeros(self.p, dtype=np.intp)
        for s, ring in zip(sites, rings):
            assert ring is not None
            count[s], slot[s] = ring.count, ring.slot
        R = int(count.max())
        out: dict[int, tuple[int, str] | None] = {s: None for s in sites}
        if R:
            Lnew = np.zeros((self.p, q))
            dLnew = np.zeros((self.p, q, q))
            for s in sites:
                Lnew[s], dLnew[s] = answers[s]["L"], answers[s]["dL"]
            Z, Lc, dLc = block.Z[:, :R], block.L[:, :R], block.dL[:, :R]
            dz = z[None, None, :] - Z  # (sites, R, q)
            near = (np.arange(R)[None, :] < count[:, None]) & (block.eta[:, :R] == eta)
            near &= np.abs(dz).max(axis=2) <= PATH_STEP
            if near.any():
                change = Lnew[:, None, :] - Lc
                base = PATH_RTOL * (np.abs(Lnew)[:, None, :] + np.abs(Lc))
                bad: np.ndarray = np.zeros(near.shape + (q,), dtype=bool)
                predicted: np.ndarray = np.zeros(near.shape + (q,))
                # most pairs are settled by the change of the losses alone, most of the rest by the
                # new gradients' products (:func:`_kept_whatever`); the held gradients' products, a
                # pass over every site's path, only for the pairs left: the same pairs refused
                pairs = np.nonzero(near & ~_kept_whatever(change, 0.0, base).all(axis=2))
                if pairs[0].size:
                    # the pairs' products as the per-site check makes them: (k, q) by (q,), summed over q
                    d2 = np.einsum("nkj,nj->nk", dLnew[pairs[0]], dz[pairs])
                    left = ~_kept_whatever(change[pairs], d2, base[pairs]).all(axis=1)
                    pairs, d2 = tuple(a[left] for a in pairs), d2[left]
                if pairs[0].size:
                    d1 = np.einsum("nkj,nj->nk", dLc[pairs], dz[pairs])
                    predicted[pairs] = 0.5 * (d1 + d2)
                    slack = PATH_SLACK * (np.abs(d1) + np.abs(d2) + np.abs(d2 - d1)) + base[pairs]
                    bad[pairs] = np.abs(change[pairs] - predicted[pairs]) > slack + ATOL
                hit = np.any(bad, axis=2)  # (sites, R)
                for s in np.flatnonzero(hit.any(axis=1)).tolist():
                    cs = np.flatnonzero(hit[s])
                    c = int(cs[np.argmin((cs - slot[s]) % PATH_MEMORY)])  # the oldest entry refused
                    k = int(np.argmax(bad[s, c]))
                    out[s] = (
                        0,
                        f"its losses disagree with its gradients along the solver's path (domain {k}: "
                        f"change {Lnew[s, k] - Lc[s, c, k]:.6g}, gradients say {predicted[s, c, k]:.6g})",
                    )
        for s, ring in zip(sites, rings):
            if out[s] is None:
                assert ring is not None
                ring.add(z, eta, answers[s]["L"], answers[s]["dL"])
        return out

    def dc_partials_batch(self, parts, zs, eta: float, what) -> None:
        """Check each site's answer to a batched request (zs (m, p): each answer's arrays have
        one row per z), as :meth:`dc_partials` would checking the rows one after another (the
        same rows refused, with the same message), in a few vector operations per site."""
        zs = np.atleast_2d(np.asarray(zs, dtype=np.float64))
        first: tuple[int, int, str] | None = None  # (row, site, why) of the first refusal
        for s, r in enumerate(parts):
            if float(getattr(r, "epsilon", 0.0) or 0.0) > 0 or (self.mass is not None and self._dp[s]):
                continue
            found = self._batch_one(s, r.sums, zs, float(eta), tuple(what))
            if found is not None and (first is None or found[0] < first[0]):
                first = (found[0], s, found[1])
        if first is not None:
            raise self._fault(first[1], "dc_evaluate", first[2])

    def _batch_one(
        self, s: int, sums: DCSums | _OneRow, zs: np.ndarray, eta: float, what: tuple
    ) -> tuple[int, str] | None:
        """(row, why) of the first row of site s's batched answer that the row-by-row check
        refuses (its checks in their order); None: every row is kept, as that check keeps them."""
        m = zs.shape[0]
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in sums.arrays().items()}
        L = arrays.get("L")
        why: dict[int, str] = {}  # rows refused before the path check: bounds, then repeats
        if L is not None:
            if self.loss == "cross_entropy" and self.mass is not None:
                if L.ndim != 2 or L.shape[1:] != self.mass.shape[1:]:
                    return 0, f"losses of shape {L.shape[1:]} for {self.mass.shape[1]} domains"
                top = self.mass[s] * -np.log(PROB_FLOOR)
                ks = np.argmax(L - top[None, :], axis=1)
                for r in np.flatnonzero(L[np.arange(m), ks] > top[ks] * (1 + 1e-9) + ATOL).tolist():
                    k = int(ks[r])
                    why[r] = f"loss {L[r, k]:.6g} for domain {k}, above its bound {top[k]:.6g} on the site's mass"
            for r in np.flatnonzero(np.any(L < -ATOL, axis=1)).tolist():
                why[r] = "a negative loss"  # checked first, row by row
        seen = self._seen[s]
        keys = [(zs[i].tobytes(), eta, what) for i in range(m)]
        batch: dict[tuple, int] = {}  # a z asked twice in the batch: its earlier row
        for i in range(min(why, default=m)):
            j = batch.setdefault(keys[i], i)
            before = seen.get(keys[i]) if j == i else {n: arr[j] for n, arr in arrays.items()}
            if before is None:
                continue
            changed = [
                n
                for n, arr in arrays.items()
                if n in before and not np.allclose(arr[i], before[n], rtol=1e-9, atol=ATOL)
            ]
            if changed:
                why[i] = f"two different {changed[0]} for the same z"
                break
        stop = min(why, default=m)  # the rows before it pass the checks before the path check
        if L is not None and "dL" in arrays and stop > 0:
            found = self._path_batch(s, zs[:stop], eta, L[:stop], arrays["dL"][:stop])
            if found is not None:
                return found
        if stop < m:
            return stop, why[stop]
        for i in range(m):
            seen[keys[i]] = {k: v[i].copy() for k, v in arrays.items()}
        return None

    def _path_batch(self, s: int, zs: np.ndarray, eta: float, L: np.ndarray, dL: np.ndarray) -> tuple[int, str] | None:
        """:meth:`_along_path` for rows (zs, L, dL) one after another, each compared with the
        ring's entries and the rows before it that a row-by-row check would hold (the last
        :data:`PATH_MEMORY`): (row, why) of the first row refused, or None (the rows are added)."""
        m, q = zs.shape
        ring = self._path[s]
        if ring is None:
            if L.shape[1] == q and (self._block is None or self._block.q == q):  # the common shape
                if self._block is None:
                    self._block = _PathBlock(self.p, q)
                ring = self._path[s] = self._block.ring(s)
            else:
                ring = self._path[s] = _PathRing(q, L.shape[1])
        if not (L.shape == (m, ring.k) and dL.shape == (m, ring.k, ring.q) and q == ring.q):
            return 0, "its losses or gradients changed shape along the solver's path"
        order = (ring.slot - ring.count + np.arange(ring.count)) % PATH_MEMORY
        R = order.size
        Zc = np.concatenate([ring.Z[order], zs])  # every candidate, oldest first
        Lc = np.concatenate([ring.L[order], L])
        dLc = np.concatenate([ring.dL[order], dL])
        etac = np.concatenate([ring.eta[order], np.full(m, eta)])
        c = np.arange(R + m)[None, :]
        i = np.arange(m)[:, None]
        held = (c < R + i) & (c >= R + i - PATH_MEMORY)  # what the ring holds when row i comes
        near = held & (etac[None, :] == eta) & (np.abs(zs[:, None, :] - Zc[None, :, :]).max(axis=2) <= PATH_STEP)
        rows, cols = np.nonzero(near)  # row-major: by row, then oldest first
        if rows.size:
            dz = zs[rows] - Zc[cols]
            d1 = np.einsum("nkj,nj->nk", dLc[cols], dz)
            d2 = np.einsum("nkj,nj->nk", dL[rows], dz)
            predicted = 0.5 * (d1 + d2)
            slack = PATH_SLACK * (np.abs(d1) + np.abs(d2) + np.abs(d2 - d1)) + PATH_RTOL * (
                np.abs(L[rows]) + np.abs(Lc[cols])
            )
            bad = np.abs((L[rows] - Lc[cols]) - predicted) > slack + ATOL
            hit = np.flatnonzero(bad.any(axis=1))
            if hit.size:
                n = int(hit[0])  # the first row refused, against its oldest disagreeing entry
                r, k = int(rows[n]), int(np.argmax(bad[n]))
                return r, (
                    f"its losses disagree with its gradients along the solver's path (domain {k}: "
                    f"change {L[r, k] - Lc[cols[n], k]:.6g}, gradients say {predicted[n, k]:.6g})"
                )
        for r in range(m):
            ring.add(zs[r], eta, L[r], dL[r])
        return None

    def bound(self, parts) -> None:
        for s, r in enumerate(parts):
            if not float(r.value) >= 0:
                raise self._fault(s, "max_bound", "a negative bound")

    def harm(self, parts, rows: int) -> None:
        """Each site's verdict (a HarmAnswer per site): ``rows`` finite losses and a finite own
        loss, non-negative without DP noise, its count as announced, a tolerance >= 0."""
        for s, r in enumerate(parts):
            c = np.asarray(r.combined)
            if c.shape != (rows,) or c.dtype.kind != "f" or not np.all(np.isfinite(c)):
                raise self._fault(s, "harm", f"{rows} finite losses were asked for")
            if not (np.isfinite(r.own) and np.isfinite(r.tolerance) and r.tolerance >= 0):
                raise self._fault(s, "harm", "a loss or a tolerance that is not a finite number")
            if not r.noisy and (float(r.own) < 0 or float(c.min()) < 0):
                raise self._fault(s, "harm", "a negative loss")
            if int(r.n) != self.n_labeled[s]:
                raise self._fault(s, "harm", f"{int(r.n)} labelled points where it announced {self.n_labeled[s]}")


#: relative room :func:`_kept_whatever` leaves for the rounding of the check's own arithmetic
KEPT_ROOM = 1e-9


def _kept_whatever(change: np.ndarray, d, base: np.ndarray) -> np.ndarray:
    """Where the path check keeps a pair whatever the products it has not computed are.  With
    ``change`` = L(z2) - L(z1), d1 and d2 the held and the new gradients times the step and
    ``base`` = PATH_RTOL (|L(z2)| + |L(z1)|), the check refuses where
    |change - (d1 + d2) / 2| > PATH_SLACK (|d1| + |d2| + |d2 - d1|) + base + ATOL.  The left side
    is at most |change - d / 2| + |d1| / 2 (+ |d2| / 2 where d2 is not known either: d = 0) and
    the right side at least PATH_SLACK (|d1| + |d2|) + base, with PATH_SLACK >= 1/2: so
    |change - d / 2| <= PATH_SLACK |d| + base keeps the pair for any value of what is not known
    (``d``: d2, or 0 where neither is known).  Asked with :data:`KEPT_ROOM` to spare (the rounding
    of either side is a few units of its largest term, each at most about the right side where
    the two meet; below that ATOL covers it): a pair kept here is kept by the full check."""
    if PATH_SLACK < 0.5:  # the bound above needs it: every pair goes to the full check
        return np.zeros(np.shape(change), dtype=bool)
    return np.abs(change - 0.5 * d) <= (PATH_SLACK * np.abs(d) + base) * (1.0 - KEPT_ROOM)


class _PathRing:
    """A site's last :data:`PATH_MEMORY` evaluations (z, eta, L, dL) in preallocated arrays, so
    that the path check compares a new answer with all of them in a few vector operations.
    ``block``: the :class:`_PathBlock` whose rows the arrays are (None: arrays of its own)."""

    def __init__(self, q: int, k: int, block: _PathBlock | None = None, s: int = 0):
        self.q, self.k = q, k
        self.block = block
        if block is None:
            self.Z = np.empty((PATH_MEMORY, q))
            self.eta = np.empty(PATH_MEMORY)
            self.L = np.empty((PATH_MEMORY, k))
            self.dL = np.empty((PATH_MEMORY, k, q))
        else:
            self.Z, self.eta, self.L, self.dL = block.Z[s], block.eta[s], block.L[s], block.dL[s]
        self.count = 0  # entries held
        self.slot = 0  # where the next one goes

    def add(self, z: np.ndarray, eta: float, L: np.ndarray, dL: np.ndarray) -> None:
        self.Z[self.slot], self.eta[self.slot], self.L[self.slot], self.dL[self.slot] = z, eta, L, dL
        self.count = min(self.count + 1, PATH_MEMORY)
        self.slot = (self.slot + 1) % PATH_MEMORY


class _PathBlock:
    """The paths of every site whose answers have the common shape (k = q sources), one array
    each with a leading axis of sites, so that one answer of each site is compared with all their
    paths at once (:meth:`AnswerChecker._paths_at_once`).  Zero-filled: the rows of a site
    whose path is kept elsewhere are never held entries (pages untouched are not allocated)."""

    def __init__(self, sites: int, q: int):
        self.q = q
        self.Z = np.zeros((sites, PATH_MEMORY, q))
        self.eta = np.zeros((sites, PATH_MEMORY))
        self.L = np.zeros((sites, PATH_MEMORY, q))
        self.dL = np.zeros((sites, PATH_MEMORY, q, q))

    def ring(self, s: int) -> _PathRing:
        """Site s's path, in row s of the block."""
        return _PathRing(self.q, self.q, self, s)


class _OneRow:
    """A site's answer to one z seen as a batched answer of one row (its arrays with a leading
    axis of 1), for :meth:`AnswerChecker.dc_partials`."""

    def __init__(self, answer):
        self.epsilon = getattr(answer, "epsilon", 0.0)
        self.sums = self
        self._sums = answer.sums

    def arrays(self) -> dict:
        return {k: np.asarray(v)[None] for k, v in self._sums.arrays().items()}
