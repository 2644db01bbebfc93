"""A site: private labelled data, the published frozen predictors, and the sums it computes.

:class:`SiteWorker` is a plain class (tested without Ray).  The local runtime calls it
directly; the Ray runtime wraps it with ``ray.remote(...)(SiteWorker)``.  Every public method
takes one request message and returns one response message from
:mod:`msa_fed.runtime.messages`: that is the whole surface of a site.
"""
from __future__ import annotations

import uuid

import numpy as np

from msa_fed.core.combination import qhat_partial, site_point_set
from msa_fed.core.density import KDEDomainModel
from msa_fed.core.domain_classifier import DomainClassifier, MaxentShard
from msa_fed.core.features import feature_map_from_state
from msa_fed.errors import ConfigError, MsaFedError, PrivacyError
from msa_fed.runtime import messages as m

PROBA_ATOL = 1e-4


class SiteStateLost(MsaFedError):
    """The site restarted and lost the state the coordinator had sent; replay the setup."""


def predictor_outputs(predictor, X: np.ndarray, task: str, classes: np.ndarray | None, who: str) -> np.ndarray:
    """Validated outputs of a frozen predictor on X.

    regression: (n,) values.  classification: (n, c) probabilities over ``classes`` (the union
    of all predictors' classes, in order); columns of classes the predictor lacks are 0.
    """
    X = np.asarray(X, dtype=np.float64)
    if task == "regression":
        out = np.asarray(predictor.predict(X), dtype=np.float64).reshape(-1)
        if out.shape[0] != X.shape[0]:
            raise ConfigError(f"{who}: predict returned {out.shape[0]} values for {X.shape[0]} inputs")
        if not np.all(np.isfinite(out)):
            raise ConfigError(f"{who}: predict returned NaN or inf")
        return out
    P = np.asarray(predictor.predict_proba(X), dtype=np.float64)
    own = np.asarray(predictor.classes_)
    if P.ndim != 2 or P.shape != (X.shape[0], own.size):
        raise ConfigError(f"{who}: predict_proba returned shape {P.shape}; expected ({X.shape[0]}, {own.size})")
    if not np.all(np.isfinite(P)) or P.min() < -PROBA_ATOL:
        raise ConfigError(f"{who}: predict_proba returned NaN, inf or negative values")
    dev = float(np.max(np.abs(P.sum(axis=1) - 1.0))) if P.size else 0.0
    if dev > PROBA_ATOL:
        raise ConfigError(f"{who}: predicted probabilities do not sum to 1 (max deviation {dev:.3g})")
    if classes is None:
        return P
    out = np.zeros((X.shape[0], classes.size))
    cols = np.searchsorted(classes, own)
    out[:, cols] = np.clip(P, 0.0, None)
    return out


def build_domain_model(spec: m.DomainModelSpec):
    fmap = spec.custom_feature_map
    if spec.feature_map is not None:
        fmap = feature_map_from_state(*spec.feature_map)
    if spec.kind == "maxent":
        return DomainClassifier(fmap, spec.theta, spec.n_sources, mu=0.0)
    if spec.kind == "kde":
        return KDEDomainModel.from_state(spec.bandwidths, list(spec.samples), feature_map=fmap)
    raise ConfigError(f"unknown domain model kind {spec.kind!r}")


class SiteWorker:
    """One site.  ``predictors`` are all p published frozen predictors, in site order."""

    def __init__(self, name: str, index: int, X_labeled, y_labeled, X_unlabeled, predictors,
                 task: str, loss: str, classes=None, min_points: int = 20):
        self.name = name
        self.index = index
        self.X_labeled = np.asarray(X_labeled, dtype=np.float64)
        self.y_labeled = np.asarray(y_labeled)
        self.X_unlabeled = np.asarray(X_unlabeled, dtype=np.float64)
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

    # ------------------------------------------------------------------ helpers
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
                out = predictor_outputs(h, self.X_labeled, self.task, self.classes,
                                        who=f"site {self.name!r}, predictor {k}")
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
        own = self.predictors[self.index]
        classes = np.asarray(own.classes_) if self.task == "classification" else None
        return m.SiteInfo(name=self.name, n_features=int(self.X_labeled.shape[1]),
                          n_labeled=int(self.X_labeled.shape[0]), n_unlabeled=int(self.X_unlabeled.shape[0]),
                          task=self.task, classes=classes)

    def unlabeled_sample(self, _=None) -> m.UnlabeledSample:
        return m.UnlabeledSample(X=self.X_unlabeled)

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        self._require(self.X_unlabeled.shape[0], "unlabelled")
        fmap = msg.custom_feature_map if msg.feature_map is None else feature_map_from_state(*msg.feature_map)
        Phi = np.asarray(fmap.transform(self.X_unlabeled), dtype=np.float64)
        mk = Phi.shape[0]
        self._shard = MaxentShard(Phi, np.full(mk, self.index), np.full(mk, 1.0 / (msg.n_sources * mk)),
                                  msg.n_sources, device=msg.device, dtype=msg.dtype,
                                  seed=msg.seed * 1000 + self.index)
        return m.Ack(self.incarnation)

    def classifier_loss_grad(self, msg: m.ThetaRequest) -> m.GradSum:
        if self._shard is None:
            raise SiteStateLost(self.name)
        if msg.step is None:
            loss, grad = self._shard.loss_grad(np.array(msg.theta))
        else:
            loss, grad = self._shard.minibatch_loss_grad(np.array(msg.theta), msg.step, msg.batch_size)
        return m.GradSum(loss=loss, grad=grad, n=self._shard.n_points)

    def set_domain_model(self, msg: m.DomainModelSpec) -> m.QhatPartial:
        """Compute Q(k | x_i) on the labelled points; answer this site's share of Qhat."""
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
        return m.Ack(self.incarnation)
