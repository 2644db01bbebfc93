"""A site: private labelled data, the published frozen predictors, and the sums it computes.

:class:`SiteWorker` is a plain class (tested without Ray).  The local runtime calls it
directly; the Ray runtime wraps it with ``ray.remote(...)(SiteWorker)``.  Every public method
takes one request message (or None) and returns one response message from
:mod:`msa_fed.runtime.messages`: that is the whole surface of a site.  :class:`ShardWorker` is
a site's helper for data-parallel classifier training (``workers_per_site > 1``).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np

from msa_fed.artifacts.outputs import checked_proba, checked_values
from msa_fed.core.combination import qhat_partial, site_point_set
from msa_fed.errors import ConfigError, MsaFedError, PrivacyError
from msa_fed.runtime import messages as m
from msa_fed.runtime.node import current_node_id


class SiteStateLost(MsaFedError):
    """The site restarted and lost the state the coordinator had sent; replay the setup."""


def predictor_outputs(predictor, X: np.ndarray, task: str, classes: np.ndarray | None, who: str) -> np.ndarray:
    """Validated outputs of a frozen predictor on X (NaN, inf or non-probabilities: ConfigError
    naming ``who``, never the offending rows: the message leaves the site).

    regression: (n,) values.  classification: (n, c) probabilities over ``classes`` (the union
    of all predictors' classes, in order); columns of classes the predictor lacks are 0.
    """
    X = np.asarray(X, dtype=np.float64)
    if task == "regression":
        return checked_values(predictor.predict(X), X.shape[0], who, ConfigError, show_rows=False)
    own = np.asarray(predictor.classes_)
    P = checked_proba(predictor.predict_proba(X), X.shape[0], own.size, who, ConfigError, show_rows=False)
    if classes is None:
        return P
    out = np.zeros((X.shape[0], classes.size))
    cols = np.searchsorted(classes, own)
    out[:, cols] = np.clip(P, 0.0, None)
    return out


def build_domain_model(spec: m.DomainModelSpec):
    try:
        return m.domain_model_from_spec(spec)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"malformed domain model: {exc}") from None


SITE_DATA_KEYS = ("X_labeled", "y_labeled", "X_unlabeled")
#: on a site's node, the directory its relative data paths are read from (see cluster/README.md)
SITE_DATA_ENV = "MSA_FED_SITE_DATA"


def resolve_site_path(name: str, data_path) -> Path:
    """``data_path`` as a path on this node: relative paths are under ``$MSA_FED_SITE_DATA``."""
    path = Path(os.path.expanduser(str(data_path)))
    if not path.is_absolute():
        base = os.environ.get(SITE_DATA_ENV)
        if not base:
            raise ConfigError(f"site {name!r}: data_path {str(data_path)!r} is relative but {SITE_DATA_ENV} "
                              "is not set on the site's node; give an absolute path or set it")
        path = Path(base) / path
    return path


def load_site_data(name: str, data_path) -> dict[str, np.ndarray]:
    """Read a site's private data from an .npz on this node (never unpickles).

    Returns {"X_labeled": (n, d), "y_labeled": (n,), "X_unlabeled": (m, d)}.
    """
    path = resolve_site_path(name, data_path)
    if not path.is_file():
        raise ConfigError(f"site {name!r}: data file {str(path)!r} not found on the site's node")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in SITE_DATA_KEYS if k not in npz.files]
            if missing:
                raise ConfigError(f"site {name!r}: data file {str(path)!r} lacks arrays {missing}; "
                                  f"expected {list(SITE_DATA_KEYS)}")
            out = {k: npz[k] for k in SITE_DATA_KEYS}
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"site {name!r}: cannot read data file {str(path)!r}: {exc}") from None
    Xl, y, Xu = out["X_labeled"], out["y_labeled"], out["X_unlabeled"]
    if Xl.ndim != 2 or Xu.ndim != 2 or y.shape != (Xl.shape[0],) or Xu.shape[1] != Xl.shape[1]:
        raise ConfigError(f"site {name!r}: data file {str(path)!r} has inconsistent shapes: X_labeled {Xl.shape}, "
                          f"y_labeled {y.shape}, X_unlabeled {Xu.shape}; expected (n, d), (n,), (m, d)")
    for key in ("X_labeled", "X_unlabeled"):
        if out[key].dtype.kind not in "biuf" or not np.all(np.isfinite(out[key])):
            raise ConfigError(f"site {name!r}: data file {str(path)!r}: {key} must be finite numbers")
    return out


def _make_shard(fmap_msg: m.ShardSetup, X: np.ndarray, index: int, start: int, n_total: int):
    from msa_fed.core.domain_classifier import shard_seed
    from msa_fed.runtime.shards import RowShard

    fmap = m.feature_map_of(fmap_msg.feature_map, fmap_msg.custom_feature_map)
    Phi = np.asarray(fmap.transform(X), dtype=np.float64)
    return RowShard(Phi, index, start, n_total, fmap_msg.n_sources, device=fmap_msg.device,
                    dtype=fmap_msg.dtype, seed=shard_seed(fmap_msg.seed, index))


class SiteWorker:
    """One site.  ``predictors`` are all p published frozen predictors, in site order.

    The private data are given as arrays (in-process) or as ``data_path``, an .npz with
    X_labeled, y_labeled, X_unlabeled read on the node where the worker runs (relative paths
    under ``$MSA_FED_SITE_DATA``), lazily, so that a missing file is an ordinary error.
    """

    def __init__(self, name: str, index: int, X_labeled=None, y_labeled=None, X_unlabeled=None,
                 predictors=(), task: str = "classification", loss: str = "cross_entropy", classes=None,
                 min_points: int = 20, data_path=None):
        self.name = name
        self.index = index
        self.data_path = None if data_path is None else str(data_path)
        if self.data_path is None and (X_labeled is None or y_labeled is None or X_unlabeled is None):
            raise ConfigError(f"site {name!r}: give X_labeled, y_labeled and X_unlabeled, or data_path")
        if self.data_path is None:
            self._set_data(X_labeled, y_labeled, X_unlabeled)
        else:
            self.X_labeled = self.y_labeled = self.X_unlabeled = None
        self.predictors = list(predictors)
        self.task = task
        self.loss = loss
        self.classes = None if classes is None else np.asarray(classes)
        self.min_points = int(min_points)
        self.incarnation = uuid.uuid4().hex
        self._H = None
        self._Q = None
        self._points = None
        self._shard = None

    @classmethod
    def from_path(cls, name: str, index: int, data_path, predictors, task: str, loss: str, classes=None,
                  min_points: int = 20) -> "SiteWorker":
        """A site whose data are read from ``data_path`` on this node."""
        worker = cls(name, index, predictors=predictors, task=task, loss=loss, classes=classes,
                     min_points=min_points, data_path=data_path)
        worker._data()
        return worker

    # ------------------------------------------------------------------ helpers
    def _set_data(self, X_labeled, y_labeled, X_unlabeled):
        self.X_labeled = np.asarray(X_labeled, dtype=np.float64)
        self.y_labeled = np.asarray(y_labeled)
        self.X_unlabeled = np.asarray(X_unlabeled, dtype=np.float64)

    def _data(self):
        if self.X_labeled is None:
            d = load_site_data(self.name, self.data_path)
            self._set_data(d["X_labeled"], d["y_labeled"], d["X_unlabeled"])

    def _require(self, count: int, what: str):
        if count < self.min_points:
            raise PrivacyError(
                f"site {self.name!r} refuses to aggregate over {count} {what} points: fewer than "
                f"the configured minimum of {self.min_points}")

    def _outputs(self):
        """H (n, p): each predictor on this site's labelled points (true-label probability for
        classification)."""
        if self._H is None:
            cols = []
            for k, h in enumerate(self.predictors):
                # the unlabelled sample too: the combined model will be used on points like them
                predictor_outputs(h, self.X_unlabeled, self.task, self.classes,
                                  who=f"site {self.name!r}, predictor {k}, on the site's unlabelled points")
                out = predictor_outputs(h, self.X_labeled, self.task, self.classes,
                                        who=f"site {self.name!r}, predictor {k}, on the site's labelled points")
                if self.task == "regression":
                    cols.append(out)
                else:
                    idx = np.searchsorted(self.classes, self.y_labeled)
                    if np.any(idx >= self.classes.size) or np.any(self.classes[np.minimum(idx, self.classes.size - 1)] != self.y_labeled):
                        raise ConfigError(f"site {self.name!r}: labels outside the predictors' classes {self.classes.tolist()}")
                    cols.append(out[np.arange(out.shape[0]), idx])
            self._H = np.column_stack(cols)
        return self._H

    # ------------------------------------------------------------------ public surface
    def info(self, _=None) -> m.SiteInfo:
        self._data()
        own = self.predictors[self.index]
        classes = np.asarray(own.classes_) if self.task == "classification" else None
        return m.SiteInfo(name=self.name, n_features=int(self.X_labeled.shape[1]),
                          n_labeled=int(self.X_labeled.shape[0]), n_unlabeled=int(self.X_unlabeled.shape[0]),
                          task=self.task, classes=classes)

    def unlabeled_sample(self, _=None) -> m.UnlabeledSample:
        self._data()
        return m.UnlabeledSample(X=self.X_unlabeled)

    def unlabeled_rows(self, msg: m.RowRange) -> m.UnlabeledSample:
        """Rows of the published unlabelled sample, for a helper worker on this site's node (with
        Ray the answer goes to the helper by reference, never through the coordinator)."""
        self._data()
        return m.UnlabeledSample(X=self.X_unlabeled[msg.start:msg.stop])

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        self._data()
        mk = self.X_unlabeled.shape[0]
        self._require(mk, "unlabelled")
        from msa_fed.runtime.shards import split_rows

        start, stop = split_rows(mk, msg.workers_per_site)[0]
        self._shard = _make_shard(msg, self.X_unlabeled[start:stop], self.index, start, mk)
        return m.Ack(self.incarnation)

    def classifier_loss_grad(self, msg: m.ThetaRequest) -> m.GradSum:
        return _loss_grad(self._shard, self.name, msg)

    def set_domain_model(self, msg: m.DomainModelSpec) -> m.QhatPartial:
        """Compute Q(k | x_i) on the labelled points; answer this site's share of Qhat."""
        self._data()
        self._require(self.X_labeled.shape[0], "labelled")
        model = build_domain_model(msg)
        self._Q = model.predict_proba(self.X_labeled)
        self._points = None
        return m.QhatPartial(sums=qhat_partial(self._Q, msg.n_sources), n=int(self._Q.shape[0]))

    def set_qhat(self, msg: m.QhatBroadcast) -> m.Ack:
        if self._Q is None:
            raise SiteStateLost(self.name)
        y = self.y_labeled.astype(np.float64) if self.task == "regression" else None
        self._points = site_point_set(self._Q, msg.qhat, self._outputs(), self.loss, y=y)
        return m.Ack(self.incarnation)

    def dc_evaluate(self, msg: m.DCRequest) -> m.DCPartial:
        if self._points is None:
            raise SiteStateLost(self.name)
        self._require(self._points.n_points, "labelled")
        sums = self._points.evaluate(msg.z, msg.eta, what=tuple(msg.what), global_bound=msg.global_bound)
        return m.DCPartial(sums=sums)

    def max_bound(self, _=None) -> m.BoundMax:
        if self._points is None:
            raise SiteStateLost(self.name)
        return m.BoundMax(self._points.max_bound())

    def ping(self, _=None) -> m.Ack:
        return m.Ack(self.incarnation, node_id=current_node_id())

    def open_channel(self, msg: m.ChannelOffer) -> m.ChannelAddress:
        """Listen for the coordinator on the direct data channel (:mod:`msa_fed.runtime.channel`)."""
        from msa_fed.runtime.channel import serve_channel

        return serve_channel(self, self.name, msg)


def _loss_grad(shard, name: str, msg: m.ThetaRequest) -> m.GradSum:
    if shard is None:
        raise SiteStateLost(name)
    theta = np.array(msg.theta)  # a writable copy (Ray hands out read-only buffers)
    if msg.step is None:
        loss, grad = shard.loss_grad(theta)
    else:
        loss, grad = shard.minibatch_loss_grad(theta, msg.step, msg.batch_size)
    return m.GradSum(loss=loss, grad=grad, n=shard.n_points)


class ShardWorker:
    """A helper of site ``name`` for data-parallel classifier training: holds rows
    [start, stop) of the site's published unlabelled sample (n_total points), sent to it by the
    site itself (:meth:`load_rows`).  Runs on the site's node (same ``site:<name>`` resource)
    and answers only gradient sums."""

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
        self._shard = _make_shard(msg, self.X_rows, self.index, self.start, self.n_total)
        return m.Ack(self.incarnation)

    def classifier_loss_grad(self, msg: m.ThetaRequest) -> m.GradSum:
        return _loss_grad(self._shard, self.name, msg)

    def ping(self, _=None) -> m.Ack:
        return m.Ack(self.incarnation, node_id=current_node_id())

    open_channel = SiteWorker.open_channel
