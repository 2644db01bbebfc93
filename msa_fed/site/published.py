"""The published half of a site: its unlabelled sample and the classifier shard trained on it.

Everything here touches the published sample only (no labelled point, no label), so it is
written once and served by three holders:

- :class:`msa_fed.site.worker.SiteWorker`, the real site (its published sample beside its
  labelled data);
- :class:`PublishedSample`, a site's stand-in in the coordinator's cluster in the federated
  topology (the sample as the site published it to the registry, nothing else);
- :class:`ShardWorker`, a site's helper for data-parallel classifier training
  (``workers_per_site > 1``), holding one block of the sample's rows (:mod:`msa_fed.site.shards`).

Each answers the classifier shard's gradient sums, a ping and the direct data channel
(:mod:`msa_fed.boundary.channel`) the same way (:class:`ShardHost`).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.boundary.node import current_node_id
from msa_fed.core.config import MIN_POINTS
from msa_fed.errors import ConfigError, MsaFedError, PrivacyError
from msa_fed.site.methods import HELPER_METHODS, PUBLISHED_METHODS, SHARD_METHODS, answer
from msa_fed.site.shards import split_rows


class SiteStateLost(MsaFedError):
    """The site restarted and lost the state the coordinator had sent; replay the setup."""


def make_shard(fmap_msg: m.ShardSetup, X: np.ndarray, index: int, start: int, n_total: int):
    """The classifier shard of rows [start, start + len(X)) of site ``index``'s sample of n_total
    points, in the feature map the request names."""
    from msa_fed.core.domain_classifier import shard_seed
    from msa_fed.site.shards import RowShard

    fmap = m.feature_map_of(fmap_msg.feature_map, fmap_msg.custom_feature_map)
    Phi = np.asarray(fmap.transform(X), dtype=np.float64)
    return RowShard(
        Phi,
        index,
        start,
        n_total,
        fmap_msg.n_sources,
        device=fmap_msg.device,
        dtype=fmap_msg.dtype,
        seed=shard_seed(fmap_msg.seed, index),
    )


def loss_grad(shard, name: str, msg: m.ThetaRequest) -> m.GradSum:
    """A shard's loss and gradient sums at the request's theta (SiteStateLost when it has none)."""
    if shard is None:
        raise SiteStateLost(name)
    theta = np.array(msg.theta)  # a writable copy (Ray hands out read-only buffers)
    if msg.step is None:
        loss, grad = shard.loss_grad(theta)
    else:
        loss, grad = shard.minibatch_loss_grad(theta, msg.step, msg.batch_size)
    return m.GradSum(loss=loss, grad=grad, n=shard.n_points)


class ShardHost:
    """What every holder of published rows answers (see the module docstring)."""

    name: str
    index: int
    incarnation: str
    _shard: Any
    #: the requests this kind of holder answers (:mod:`msa_fed.site.methods`)
    ANSWERS: frozenset = SHARD_METHODS

    def handle(self, method: str, msg):
        """The one entry point of every host: the answer to ``method`` if this holder's list
        (``ANSWERS``) has it, else a refusal naming the rule ``methods``."""
        return answer(self, method, msg, self.ANSWERS)

    def _set_shard(self, msg: m.ShardSetup, X: np.ndarray, start: int, n_total: int) -> m.Ack:
        self._shard = make_shard(msg, X, self.index, start, n_total)
        return m.Ack(self.incarnation)

    def classifier_loss_grad(self, msg: m.ThetaRequest) -> m.GradSum:
        return loss_grad(self._shard, self.name, msg)

    def ping(self, _=None) -> m.Ack:
        return m.Ack(self.incarnation, node_id=current_node_id())

    def open_channel(self, msg: m.ChannelOffer) -> m.ChannelAddress:
        """Listen for the coordinator on the direct data channel (:mod:`msa_fed.boundary.channel`)."""
        from msa_fed.boundary.channel import serve_channel

        return serve_channel(self, self.name, msg)


class PublishedHalf(ShardHost):
    """A whole published sample: its rows on request, and block 0 of it as the classifier shard
    (the other blocks go to :class:`ShardWorker` helpers)."""

    ANSWERS = PUBLISHED_METHODS

    def _published(self) -> np.ndarray:
        raise NotImplementedError

    def unlabeled_sample(self, _=None) -> m.UnlabeledSample:
        return m.UnlabeledSample(X=self._published())

    def unlabeled_rows(self, msg: m.RowRange) -> m.UnlabeledSample:
        """Rows of the published unlabelled sample, for a helper worker on this site's node (with
        Ray the answer goes to the helper by reference, never through the coordinator)."""
        return m.UnlabeledSample(X=self._published()[msg.start : msg.stop])

    def _first_block(self, msg: m.ShardSetup) -> m.Ack:
        X = self._published()
        mk = X.shape[0]
        start, stop = split_rows(mk, msg.workers_per_site)[0]
        return self._set_shard(msg, X[start:stop], start, mk)


class PublishedSample(PublishedHalf):
    """A site's stand-in in the coordinator's cluster: its published unlabelled sample only.

    Answers the published half (and ``info``/``ping`` for the Ray runtime's bookkeeping); it
    has no labelled data and cannot answer anything that needs some.
    """

    def __init__(self, name: str, index: int, X_unlabeled, min_points: int = MIN_POINTS):
        self.name, self.index = name, int(index)
        self.X_unlabeled = np.asarray(X_unlabeled, dtype=np.float64)
        if self.X_unlabeled.ndim != 2:
            raise ConfigError(
                f"site {name!r}: the published sample must be a matrix; got shape {self.X_unlabeled.shape}"
            )
        self.min_points = int(min_points)
        self.incarnation = uuid.uuid4().hex
        self._shard = None
        # load the classifier's libraries (torch) while the actors start, not in the first step
        import msa_fed.core.domain_classifier  # noqa: F401

    def _published(self) -> np.ndarray:
        return self.X_unlabeled

    def info(self, _=None) -> m.SiteInfo:
        return m.SiteInfo(
            name=self.name,
            n_features=int(self.X_unlabeled.shape[1]),
            n_labeled=0,
            n_unlabeled=int(self.X_unlabeled.shape[0]),
            task="",
        )

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        mk = self.X_unlabeled.shape[0]
        if mk < self.min_points:
            raise PrivacyError(
                "min_points",
                self.name,
                f"its published sample: {mk} unlabelled points, fewer than min_points={self.min_points}",
            )
        return self._first_block(msg)


class ShardWorker(ShardHost):
    """A helper of site ``name`` for data-parallel classifier training: holds rows
    [start, stop) of the site's published unlabelled sample (n_total points), sent to it by the
    site itself (:meth:`load_rows`).  Runs on the site's node (same ``site:<name>`` resource)
    and answers only gradient sums."""

    X_rows: Any  # None until load_rows
    ANSWERS = HELPER_METHODS

    def __init__(self, name: str, index: int, start: int, stop: int, n_total: int):
        self.name = name
        self.index = index
        self.start, self.stop, self.n_total = int(start), int(stop), int(n_total)
        self.incarnation = uuid.uuid4().hex
        self.X_rows = None
        self._shard = None

    def load_rows(self, rows: m.UnlabeledSample) -> m.Ack:
        X = np.asarray(rows.X, dtype=np.float64)
        if X.shape[0] != self.stop - self.start:
            raise ConfigError(f"site {self.name!r}: helper for rows [{self.start}, {self.stop}) got {X.shape[0]} rows")
        self.X_rows = X
        return m.Ack(self.incarnation)

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        if self.X_rows is None:
            raise SiteStateLost(self.name)
        return self._set_shard(msg, self.X_rows, self.start, self.n_total)
