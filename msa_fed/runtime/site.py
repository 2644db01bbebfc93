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
from typing import Any

import numpy as np

from msa_fed.artifacts.outputs import checked_proba, checked_values
from msa_fed.core.combination import qhat_partial, site_point_set
from msa_fed.core.threads import blas_threads_for
from msa_fed.errors import ConfigError, MsaFedError, PrivacyError
from msa_fed.privacy import rules
from msa_fed.privacy.consortium import check_consortium, check_disjoint
from msa_fed.privacy.guard import SiteGuard
from msa_fed.privacy.influence import bounded, shares
from msa_fed.privacy.policy import SitePolicy, policy_from_env, tighten
from msa_fed.privacy.verify import SampleSource, own_qhat, pinned_samples, verify_domain_model
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
        with blas_threads_for(X.size):
            return checked_values(predictor.predict(X), X.shape[0], who, ConfigError, show_rows=False)
    own = np.asarray(predictor.classes_)
    with blas_threads_for(X.size * own.size):
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
            raise ConfigError(
                f"site {name!r}: data_path {str(data_path)!r} is relative but {SITE_DATA_ENV} "
                "is not set on the site's node; give an absolute path or set it"
            )
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
                raise ConfigError(
                    f"site {name!r}: data file {str(path)!r} lacks arrays {missing}; expected {list(SITE_DATA_KEYS)}"
                )
            out = {k: npz[k] for k in SITE_DATA_KEYS}
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"site {name!r}: cannot read data file {str(path)!r}: {exc}") from None
    Xl, y, Xu = out["X_labeled"], out["y_labeled"], out["X_unlabeled"]
    if Xl.ndim != 2 or Xu.ndim != 2 or y.shape != (Xl.shape[0],) or Xu.shape[1] != Xl.shape[1]:
        raise ConfigError(
            f"site {name!r}: data file {str(path)!r} has inconsistent shapes: X_labeled {Xl.shape}, "
            f"y_labeled {y.shape}, X_unlabeled {Xu.shape}; expected (n, d), (n,), (m, d)"
        )
    for key in ("X_labeled", "X_unlabeled"):
        if out[key].dtype.kind not in "biuf" or not np.all(np.isfinite(out[key])):
            raise ConfigError(f"site {name!r}: data file {str(path)!r}: {key} must be finite numbers")
    check_disjoint(name, Xl, Xu)  # a data file is a deployed site's: its labelled inputs stay private
    return out


def in_ray_actor() -> bool:
    """True inside a Ray actor (a process that receives its arguments from another party)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def site_policy(given: SitePolicy | None, job_request=None) -> SitePolicy:
    """The policy a site enforces.  In-process, the caller is the site itself and may pass its
    policy; inside a Ray actor the arguments come from the job, so the policy is the one named
    by ``$MSA_FED_SITE_POLICY`` on this node (else the defaults) and a passed policy can only
    tighten it.  ``job_request`` (the job's own values, e.g. min_points) only tightens."""
    if given is not None and not isinstance(given, SitePolicy):
        raise ConfigError(f"policy must be a SitePolicy; got {type(given).__name__}")
    if in_ray_actor():
        base = tighten(policy_from_env(), given)
    else:
        base = given if given is not None else policy_from_env()
    return tighten(base, job_request)


def _make_shard(fmap_msg: m.ShardSetup, X: np.ndarray, index: int, start: int, n_total: int):
    from msa_fed.core.domain_classifier import shard_seed
    from msa_fed.runtime.shards import RowShard

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


class SiteWorker:
    """One site.  ``predictors`` are all p published frozen predictors, in site order.

    The private data are given as arrays (in-process) or as ``data_path``, an .npz with
    X_labeled, y_labeled, X_unlabeled read on the node where the worker runs (relative paths
    under ``$MSA_FED_SITE_DATA``), lazily, so that a missing file is an ordinary error.

    Every request is checked against the site's privacy policy before any aggregate leaves
    (:mod:`msa_fed.privacy`, docs/DESIGN.md section 9), counted in its ledger and written to
    its audit log.  ``policy``: the site's :class:`SitePolicy` (in-process callers; inside a
    Ray actor the policy is read from ``$MSA_FED_SITE_POLICY`` on the node and a passed one
    only tightens it); ``min_points`` and ``privacy`` (a dict of policy values) are the job's
    requests and only tighten; ``job_id`` names the job in the ledger and the log.
    """

    # None until set: the private data (given, or read from data_path on first use) and the
    # state of the domain model in force
    X_labeled: Any
    y_labeled: Any
    X_unlabeled: Any
    _H: Any
    _Q: Any
    _points: Any
    _shard: Any
    _spec_key: Any
    _own_partial: Any

    def __init__(
        self,
        name: str,
        index: int,
        X_labeled=None,
        y_labeled=None,
        X_unlabeled=None,
        predictors=(),
        task: str = "classification",
        loss: str = "cross_entropy",
        classes=None,
        min_points: int = 20,
        data_path=None,
        policy: SitePolicy | None = None,
        job_id: str = "",
        privacy: dict | None = None,
        sites=None,
    ):
        self.name = name
        self.sites = None if sites is None else [str(s) for s in sites]  # the job's sites, in order
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
        # the site's own policy; the job's min_points and privacy requests can only tighten it
        self.policy = site_policy(policy, {**(privacy or {}), "min_points": int(min_points)})
        self.min_points = self.policy.min_points
        self.guard = SiteGuard(name, self.policy, job_id)
        self.incarnation = uuid.uuid4().hex
        self._H = None
        self._Q = None
        self._points = None
        self._shard = None
        self._spec_key = None  # digest of the domain model in force (replays are not new models)
        self._own_partial = None  # this site's Qhat partial (influence-bounded) for that model
        self._admitted = False
        # the job's published samples, to verify domain models: set by the host (set_published, the site agent)
        self.published: SampleSource | None = None

    @classmethod
    def from_path(
        cls,
        name: str,
        index: int,
        data_path,
        predictors,
        task: str,
        loss: str,
        classes=None,
        min_points: int = 20,
        policy: SitePolicy | None = None,
        job_id: str = "",
    ) -> "SiteWorker":
        """A site whose data are read from ``data_path`` on this node."""
        worker = cls(
            name,
            index,
            predictors=predictors,
            task=task,
            loss=loss,
            classes=classes,
            min_points=min_points,
            data_path=data_path,
            policy=policy,
            job_id=job_id,
        )
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

    def _admit(self):
        """The job's consortium against the site's policy (peers, max_sites), once per job."""
        if self._admitted:
            return
        try:
            check_consortium(self.name, self.sites, len(self.predictors), self.policy)
        except PrivacyError:
            with self.guard.request("join", n_sources=len(self.predictors), sites=self.sites):
                raise  # audited as refused (an admitted job adds no line of its own)
        self._admitted = True

    def _require(self, count: int, what: str):
        return rules.check_min_points(count, self.policy, self.name, what)

    def _outputs(self):
        """H (n, p): each predictor on this site's labelled points (true-label probability for
        classification)."""
        if self._H is None:
            cols = []
            # the unlabelled sample is checked too (the combined model will be used on points like
            # them): one call per predictor on both samples, the labelled rows first
            n = self.X_labeled.shape[0]
            both = np.concatenate([self.X_labeled, self.X_unlabeled])
            for k, h in enumerate(self.predictors):
                out = self._checked_outputs(k, h, both, n)
                if self.task == "regression":
                    cols.append(out)
                else:
                    assert self.classes is not None  # classification: the job's classes
                    idx = np.searchsorted(self.classes, self.y_labeled)
                    if np.any(idx >= self.classes.size) or np.any(
                        self.classes[np.minimum(idx, self.classes.size - 1)] != self.y_labeled
                    ):
                        raise ConfigError(
                            f"site {self.name!r}: labels outside the predictors' classes {self.classes.tolist()}"
                        )
                    cols.append(out[np.arange(out.shape[0]), idx])
            self._H = np.column_stack(cols)
        return self._H

    def _checked_outputs(self, k: int, h, both: np.ndarray, n: int) -> np.ndarray:
        """Predictor k's checked outputs on the first n rows of ``both``; a failing check names the
        sample it failed on (the check is run again on each, on this error path only)."""
        try:
            return predictor_outputs(h, both, self.task, self.classes, who="")[:n]
        except ConfigError:
            for rows, what in ((slice(0, n), "labelled"), (slice(n, None), "unlabelled")):
                who = f"site {self.name!r}, predictor {k}, on the site's {what} points"
                predictor_outputs(h, both[rows], self.task, self.classes, who=who)
            raise ConfigError(f"site {self.name!r}, predictor {k}: its outputs failed the check") from None

    # ------------------------------------------------------------------ public surface
    def info(self, _=None) -> m.SiteInfo:
        self._data()
        self._admit()
        own = self.predictors[self.index]
        classes = np.asarray(own.classes_) if self.task == "classification" else None
        return m.SiteInfo(
            name=self.name,
            n_features=int(self.X_labeled.shape[1]),
            n_labeled=int(self.X_labeled.shape[0]),
            n_unlabeled=int(self.X_unlabeled.shape[0]),
            task=self.task,
            classes=classes,
        )

    def unlabeled_sample(self, _=None) -> m.UnlabeledSample:
        self._data()
        return m.UnlabeledSample(X=self.X_unlabeled)

    def unlabeled_rows(self, msg: m.RowRange) -> m.UnlabeledSample:
        """Rows of the published unlabelled sample, for a helper worker on this site's node (with
        Ray the answer goes to the helper by reference, never through the coordinator)."""
        self._data()
        return m.UnlabeledSample(X=self.X_unlabeled[msg.start : msg.stop])

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        self._data()
        self._admit()
        mk = self.X_unlabeled.shape[0]
        with self.guard.request("setup_shard", n_unlabeled=mk) as dec:
            dec.update(self._require(mk, "unlabelled"))
            self._check_fmap(msg.feature_map, msg.custom_feature_map, self.X_unlabeled, dec)
        from msa_fed.runtime.shards import split_rows

        start, stop = split_rows(mk, msg.workers_per_site)[0]
        self._shard = _make_shard(msg, self.X_unlabeled[start:stop], self.index, start, mk)
        return m.Ack(self.incarnation)

    def classifier_loss_grad(self, msg: m.ThetaRequest) -> m.GradSum:
        return _loss_grad(self._shard, self.name, msg)

    def _check_fmap(self, state, custom, X, dec: dict):
        if state is None and custom is None:
            return
        if state is None:
            if not (self.policy.allow_custom_feature_map and not in_ray_actor()):
                raise PrivacyError(
                    "feature_map",
                    self.name,
                    "the request: custom feature maps are accepted only from an "
                    "in-process caller (the site's own process)",
                )
            dec["feature_map"] = "custom (in-process)"
            return
        dec.update(rules.check_feature_map(state, X, self.policy, self.name))

    def set_domain_model(self, msg: m.DomainModelSpec) -> m.QhatPartial:
        """Compute Q(k | x_i) on the labelled points; answer this site's share of Qhat."""
        self._data()
        self._admit()
        n = int(self.X_labeled.shape[0])
        with self.guard.request(
            "set_domain_model", n_labeled=n, n_sources=int(msg.n_sources), model=str(msg.kind)
        ) as dec:
            dec.update(self._require(n, "labelled"))
            if int(msg.n_sources) != len(self.predictors):
                raise PrivacyError(
                    "n_sources",
                    self.name,
                    f"the request: a domain model of {int(msg.n_sources)} sources for a job of "
                    f"{len(self.predictors)} sites",
                )
            key = _spec_digest(msg)
            if key != self._spec_key:  # a replay of the model in force is not a new query
                dec.update(self.guard.charge("domain_model"))
            self._check_fmap(msg.feature_map, msg.custom_feature_map, self.X_labeled, dec)
            if msg.kind == "maxent":
                dec.update(rules.check_theta(msg.theta, msg.n_sources, self.policy, self.name))
            samples = None if self.published is None else self.published()
            dec.update(verify_domain_model(msg, samples, self.X_labeled, self.policy, self.name))
            model = build_domain_model(msg)
            if msg.kind == "kde":
                Phi = (
                    self.X_labeled
                    if model.feature_map is None
                    else np.asarray(model.feature_map.transform(self.X_labeled))
                )
                dec.update(rules.check_kde(msg.bandwidths, msg.samples, Phi, msg.n_sources, self.policy, self.name))
            Q = model.predict_proba(self.X_labeled)
            self._Q = self._points = self._own_partial = self._spec_key = None
            # no label enters a Qhat partial and one point adds at most pi_i = 1 / (p n) to it;
            # the partials must add up to a probability vector, so they are not clipped
            dec["qhat_share"] = float(shares(Q, self.policy.weight_floor).max(initial=0.0))
            sums = qhat_partial(Q, msg.n_sources)
            self._Q, self._own_partial, self._spec_key = Q, sums, key
            dp = self.guard.dp
            if dp is not None:  # the same estimate over the published sample: public, no epsilon spent
                sums = qhat_partial(model.predict_proba(self.X_unlabeled), msg.n_sources)
        return m.QhatPartial(sums=sums, n=n, epsilon=self.guard.epsilon_spent(), dp=dp is not None)

    def set_published(self, msg: m.PublishedSamples) -> m.Ack:
        """The job's published samples, from this worker's host (in-process and cluster
        topologies; a site process fetches them from the registry itself)."""
        self._data()
        samples = pinned_samples(msg.samples, self.index, self.X_unlabeled, self.name)
        self.published = lambda: samples
        return m.Ack(self.incarnation)

    def set_qhat(self, msg: m.QhatBroadcast) -> m.Ack:
        if self._Q is None:
            raise SiteStateLost(self.name)
        with self.guard.request("set_qhat", n_sources=int(np.size(msg.qhat))) as dec:
            # the answer (accepted or refused) depends on the labelled points: it is a query
            dec.update(self.guard.charge("dc_evaluation"))
            dec.update(rules.check_eta(msg.eta, self.policy, self.name))
            # a probability vector; without DP floored at this site's own share (verify.own_qhat),
            # with DP the weights are clipped (dp.py)
            dec.update(rules.check_qhat(msg.qhat, np.zeros_like(self._own_partial), self.name))
            qhat = msg.qhat
            if self.guard.dp is None:
                qhat, floored = own_qhat(msg.qhat, self._own_partial)
                dec.update(floored)
            self._points = None
            y = self.y_labeled.astype(np.float64) if self.task == "regression" else None
            qhat = np.asarray(qhat, dtype=np.float64)
            # w_k(i) = pi_i q_k(x_i) with the density ratios q_k capped at the policy's share; the
            # u_k / v_k weights and K_z mix these columns with eta pi_i (influence.py)
            ratios = self._Q / qhat[None, :]
            if self.guard.dp is None:
                ratios, clip = bounded(ratios, self.policy, "w")
                dec.update(clip)
            # with DP the cap is the data-independent ratio_clip (dp.py): a cap that depends on the
            # other points would let one point move the others' weights, beyond the sensitivity
            self._points = site_point_set(ratios * qhat[None, :], qhat, self._outputs(), self.loss, y=y)
        return m.Ack(self.incarnation)

    def dc_evaluate(self, msg: m.DCRequest) -> m.DCPartial:
        if self._points is None:
            raise SiteStateLost(self.name)
        pts = self._points
        what = tuple(msg.what)
        with self.guard.request("dc_evaluate", n_labeled=pts.n_points, what=list(what)) as dec:
            self._require(pts.n_points, "labelled")
            dec.update(self.guard.charge("dc_evaluation"))
            eta = float(msg.eta)
            rules.check_eta(eta, self.policy, self.name)
            rules.check_z(msg.z, eta, pts.w.shape[1], self.policy, self.name)
            if msg.global_bound is not None and not (np.isfinite(msg.global_bound) and msg.global_bound >= 0):
                raise PrivacyError("global_bound", self.name, "the request: global_bound must be a finite number >= 0")
            dp = self.guard.dp
            if dp is None:
                sums = pts.evaluate(msg.z, eta, what=what, global_bound=msg.global_bound)
            else:
                from msa_fed.core.dc_terms import DCSums
                from msa_fed.privacy.dp import clipped_losses

                if what != ("L",):
                    raise PrivacyError(
                        "dp_what",
                        self.name,
                        f"the request: with differential privacy on, the site answers the "
                        f"losses L only; asked for {list(what)}",
                    )
                dec.update(dp.spend())
                L, sens = clipped_losses(pts, msg.z, eta, self.policy)
                sums = DCSums(L=L + dp.noise(L.shape, sens), n=pts.n_points)
        return m.DCPartial(sums=sums, epsilon=self.guard.epsilon_spent())

    def max_bound(self, _=None) -> m.BoundMax:
        if self._points is None:
            raise SiteStateLost(self.name)
        with self.guard.request("max_bound", n_labeled=self._points.n_points) as dec:
            if self.guard.dp is not None:
                raise PrivacyError(
                    "dp_what",
                    self.name,
                    "the request: with differential privacy on, the site does not answer the largest per-point bound",
                )
            dec.update(self.guard.charge("dc_evaluation"))
            value = self._points.max_bound()
        return m.BoundMax(value)

    def ping(self, _=None) -> m.Ack:
        return m.Ack(self.incarnation, node_id=current_node_id())

    def open_channel(self, msg: m.ChannelOffer) -> m.ChannelAddress:
        """Listen for the coordinator on the direct data channel (:mod:`msa_fed.runtime.channel`)."""
        from msa_fed.runtime.channel import serve_channel

        return serve_channel(self, self.name, msg)


def _spec_digest(msg: m.DomainModelSpec) -> str:
    """A digest of a domain model's content (equal specs: the same model, e.g. a replay)."""
    import hashlib

    h = hashlib.sha256(repr((msg.kind, msg.n_sources)).encode())

    def feed(v):
        if isinstance(v, np.ndarray):
            h.update(str((v.dtype.str, v.shape)).encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(repr(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(b"(")
            for x in v:
                feed(x)
            h.update(b")")
        else:
            h.update(repr(v).encode())

    feed(msg.feature_map)
    feed(None if msg.theta is None else np.asarray(msg.theta))
    feed(None if msg.bandwidths is None else np.asarray(msg.bandwidths))
    feed([np.asarray(x) for x in msg.samples])
    h.update(str(id(msg.custom_feature_map) if msg.custom_feature_map is not None else "").encode())
    return h.hexdigest()


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

    X_rows: Any  # None until load_rows
    _shard: Any

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
