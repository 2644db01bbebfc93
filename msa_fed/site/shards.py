"""Rows of one site's classifier shard, for data-parallel training with several workers per site.

By default a site's actor holds its whole unlabelled sample as one :class:`MaxentShard`.  With
``workers_per_site = w > 1`` the sample's rows are cut into ``w`` contiguous blocks
(:func:`split_rows`); the site's actor keeps block 0 and ``w - 1`` helper actors on the same
node hold the others.  A :class:`RowShard` answers exactly the sums its block contributes to
the site's shard, so the blocks' answers add up to the site's (and the sites' to the pooled
objective):

- full batch: each block sums over its rows with the site's weights 1 / (p m_k);
- mini-batch: every block draws the *same* mini-batch of the whole site sample (same seed and
  step, same permutation of range(m_k)) and sums over the chosen rows that fall in its block,
  with the site's scale m_k / b.  The union over blocks is the site's mini-batch.
"""

from __future__ import annotations

import numpy as np


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, stop) blocks covering range(n), sizes differing by <= 1."""
    if parts < 1:
        raise ValueError(f"workers_per_site must be >= 1; got {parts!r}")
    edges = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def minibatch_indices(seed: int, step: int, n_total: int, batch_size: int):
    """The mini-batch of a whole site shard at ``step``: a torch LongTensor of row indices.

    Mirrors :meth:`msa_fed.core.domain_classifier.MaxentShard.minibatch_loss_grad` (same
    generator seed, same permutation); ``tests/runtime/test_runtime_local.py`` checks they agree.
    """
    import torch

    b = min(batch_size, n_total)
    gen = torch.Generator().manual_seed(hash((seed, step)) & 0x7FFFFFFF)
    return torch.randperm(n_total, generator=gen)[:b]


class RowShard:
    """Rows [start, stop) of site ``index``'s shard of ``n_total`` unlabelled points.

    Phi : ndarray (stop - start, D), the feature map applied to those rows.
    """

    def __init__(
        self,
        Phi: np.ndarray,
        index: int,
        start: int,
        n_total: int,
        n_sources: int,
        device: str = "cpu",
        dtype: str = "float64",
        seed: int = 0,
    ):
        from msa_fed.core.domain_classifier import MaxentShard

        rows = Phi.shape[0]
        self.start, self.stop, self.n_total = int(start), int(start) + rows, int(n_total)
        if not (0 <= self.start <= self.stop <= self.n_total):
            raise ValueError(f"rows [{self.start}, {self.stop}) do not fit a shard of {self.n_total} points")
        self.seed = seed
        self.shard = MaxentShard(
            Phi,
            np.full(rows, index),
            np.full(rows, 1.0 / (n_sources * n_total)),
            n_sources,
            device=device,
            dtype=dtype,
            seed=seed,
        )
        self.whole = rows == n_total

    @property
    def n_points(self) -> int:
        return self.stop - self.start

    def loss_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """This block's share of the site's weighted loss sum and its gradient."""
        return self.shard.loss_grad(theta)

    def minibatch_loss_grad(self, theta: np.ndarray, step: int, batch_size: int) -> tuple[float, np.ndarray]:
        """This block's share of the site's mini-batch estimate at ``step``."""
        if self.whole:  # one worker per site: exactly the single-process computation
            return self.shard.minibatch_loss_grad(theta, step, batch_size)
        if self.n_total == 0:
            return 0.0, np.zeros_like(theta)
        idx = minibatch_indices(self.seed, step, self.n_total, batch_size)
        local = idx[(idx >= self.start) & (idx < self.stop)] - self.start
        b = int(idx.numel())
        if local.numel() == 0:
            return 0.0, np.zeros_like(theta, dtype=np.float64)
        sh = self.shard
        # MaxentShard has no public "rows" entry point; its private one is the shared kernel.
        return sh._loss_grad(theta, sh.Phi[local], sh.s[local], sh._subset_labels(local), scale=self.n_total / b)
