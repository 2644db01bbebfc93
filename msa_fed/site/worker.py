"""A site: private labelled data, the published frozen predictors, and the sums it computes.

:class:`SiteWorker` is a plain class (tested without Ray).  The local runtime calls it
directly; the Ray runtime wraps it with ``ray.remote(...)(SiteWorker)``; the site process
(:mod:`msa_fed.federation.agent`) calls it for the requests the relay carries.  Every public
method takes one request message (or None) and returns one response message from
:mod:`msa_fed.boundary.messages`: that is the whole surface of a site.  Its published half (the
unlabelled sample and the classifier shard) is :mod:`msa_fed.site.published`; its labelled
half passes one policy gate, whose table says what each request needs, checks and costs
(:mod:`msa_fed.site.gate`); its host hands in where its policy comes from
(:mod:`msa_fed.site.policy`) and, in a site process, the process's one audit writer.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

import numpy as np

from msa_fed.artifacts.isolated import answered_together, prestart
from msa_fed.artifacts.outputs import PROBA_ATOL, checked_proba, checked_values
from msa_fed.boundary import messages as m
from msa_fed.core.combination import qhat_partial, site_point_set
from msa_fed.core.config import MIN_POINTS
from msa_fed.core.threads import blas_threads_for
from msa_fed.errors import ConfigError, PeerFault, PrivacyError
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.consortium import check_consortium
from msa_fed.privacy.guard import SiteGuard
from msa_fed.privacy.influence import shares
from msa_fed.privacy.policy import SitePolicy
from msa_fed.privacy.verify import SampleSource
from msa_fed.site.admission import checked_host_samples
from msa_fed.site.data import load_site_data
from msa_fed.site.gate import LABELLED, Rule, SetupMemory, Setups, build_domain_model, gate
from msa_fed.site.methods import HOST_METHODS
from msa_fed.site.policy import check_host, site_policy
from msa_fed.site.published import PublishedHalf

__all__ = [
    "LABELLED",
    "Background",
    "PositiveClass",
    "Rule",
    "SiteWorker",
    "build_domain_model",
    "predictor_outputs",
]


def predictor_outputs(
    predictor, X: np.ndarray, task: str, classes: np.ndarray | None, who: str, where: str = "its inputs"
) -> np.ndarray:
    """Validated outputs of a frozen predictor on X (NaN, inf or non-probabilities: ConfigError
    naming ``who`` and ``where`` X comes from, never the offending rows nor how many: the message
    leaves the site).

    regression: (n,) values.  classification: (n, c) probabilities over ``classes`` (the union
    of all predictors' classes, in order); columns of classes the predictor lacks are 0.
    """
    X = np.asarray(X, dtype=np.float64)
    # an answer its host already computed (_Answered): no call, so no BLAS setting to make for it
    given = isinstance(predictor, _Answered) and X is predictor.rows
    if task == "regression":
        with contextlib.nullcontext() if given else blas_threads_for(X.size):
            return checked_values(predictor.predict(X), X.shape[0], who, ConfigError, show_rows=False, where=where)
    own = np.asarray(predictor.classes_)
    with contextlib.nullcontext() if given else blas_threads_for(X.size * own.size):
        P = checked_proba(
            predictor.predict_proba(X), X.shape[0], own.size, who, ConfigError, show_rows=False, where=where
        )
    if classes is None:
        return P
    out = np.zeros((X.shape[0], classes.size))
    cols = np.searchsorted(classes, own)
    out[:, cols] = np.clip(P, 0.0, None)
    return out


class PositiveClass:
    """A two-class predictor's answer handed by an in-process host as its second column alone:
    the answer is [1 - p, p] (the (n, 2) array scikit-learn's binary models stack), made only
    where something asks for the array itself (:attr:`full`)."""

    __slots__ = ("_full", "p")

    def __init__(self, p: np.ndarray):
        self.p = p
        self._full: np.ndarray | None = None

    @property
    def full(self) -> np.ndarray:
        if self._full is None:
            self._full = np.stack([1 - self.p, self.p], axis=1)
        return self._full


class _Answered:
    """A predictor with its answer to one call already given: on exactly ``rows`` (the same array)
    its ``predict_proba`` / ``predict`` returns ``out``, any other call goes to the predictor.
    ``answer`` is the array or a :class:`PositiveClass` (``out``: its array)."""

    def __init__(self, predictor, rows: np.ndarray, answer: np.ndarray | PositiveClass):
        self.predictor, self.rows, self.answer = predictor, rows, answer

    @property
    def out(self):
        return self.answer.full if isinstance(self.answer, PositiveClass) else self.answer

    @property
    def classes_(self):
        return self.predictor.classes_

    def predict_proba(self, X):
        return self.out if X is self.rows else self.predictor.predict_proba(X)

    def predict(self, X):
        return self.out if X is self.rows else self.predictor.predict(X)


class Background:
    """``fn()`` run on a daemon thread; :meth:`result` waits for it and returns its value or raises
    its exception (the same object, as the call itself would have raised it)."""

    def __init__(self, fn, name: str):
        self._fn = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the request that waits for it
            self._error = exc

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class SiteWorker(PublishedHalf):
    """One site.  ``predictors`` are all p published frozen predictors, in site order.

    The private data are given as arrays (in-process) or as ``data_path``, an .npz with
    X_labeled, y_labeled, X_unlabeled read on the node where the worker runs (relative paths
    under ``$MSA_FED_SITE_DATA``), lazily, so that a missing file is an ordinary error.

    Every request is checked against the site's privacy policy before any aggregate leaves
    (:mod:`msa_fed.privacy`, docs/DESIGN.md section 9), counted in its ledger and written to
    its audit log.  ``policy``: the site's :class:`SitePolicy` as its host passes it, ``host``:
    who runs the worker, ``"process"`` (the site's own process: the policy given is the site's)
    or ``"ray"`` (an actor of the job's Ray cluster: the policy is read from
    ``$MSA_FED_SITE_POLICY`` on the node and a passed one only tightens it; see
    :mod:`msa_fed.site.policy`); ``min_points`` and ``privacy`` (a dict of policy values) are the
    job's requests and only tighten; ``job_id`` names the job in the ledger and the log;
    ``audit``: the host's one audit writer (a site process's, shared by its jobs), else the
    worker's guard opens the policy's log; ``setups``: the set-ups the site answered for this
    job before (:class:`msa_fed.site.gate.SetupMemory`: a replay is not charged again), else
    the worker's own.  ``prestart_peers``: the peers' predictors' worker starts and their
    models load now, in the background (False: a host that starts the outputs itself at
    admission, :meth:`_start_outputs`, where the models cross with the rows in one request).
    """

    ANSWERS = HOST_METHODS  # what its host may ask (msa_fed/site/methods.py)
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
    _qhat: Any

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
        min_points: int = MIN_POINTS,
        data_path=None,
        policy: SitePolicy | None = None,
        job_id: str = "",
        privacy: dict | None = None,
        sites=None,
        host: str = "process",
        audit: AuditLog | None = None,
        setups: Setups | None = None,
        content: dict | None = None,
        prestart_peers: bool = True,
    ):
        self.name = name
        # the job's content as its host gave it (admission.host_content): the published samples
        # the host hands in later must have the sha256 it pins for each site (set_published)
        self.content = content
        self.host = check_host(host)
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
        if prestart_peers:  # peers' predictors: their worker starts, their models load, while the job sets up
            prestart(self.predictors)
        self.task = task
        self.loss = loss
        self.classes = None if classes is None else np.asarray(classes)
        # the site's own policy; the job's min_points and privacy requests can only tighten it
        self.policy = site_policy(policy, {**(privacy or {}), "min_points": int(min_points)}, host=self.host)
        self.min_points = self.policy.min_points
        self.guard = SiteGuard(name, self.policy, job_id, audit=audit)
        self.incarnation = uuid.uuid4().hex
        self._H = None
        self._pending_H: Background | None = None  # H being computed in the background (_start_outputs)
        self._handed: tuple[np.ndarray, dict[int, np.ndarray | PositiveClass]] | None = None  # _hand_outputs
        self._Q = None
        self._points = None
        self._shard = None
        self._spec_key = None  # digest of the domain model in force (replays are not new models)
        self._own_partial = None  # this site's Qhat partial (influence-bounded) for that model
        self._qhat = None  # the Qhat in force (floored at this site's own share without DP)
        self._admitted = False
        self.setups: Setups = SetupMemory() if setups is None else setups
        # the job's published samples, to verify domain models: set by the host (set_published, the site agent)
        self.published: SampleSource | None = None

    # ------------------------------------------------------------------ helpers
    def _published(self) -> np.ndarray:
        self._data()
        return self.X_unlabeled

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

    def _predictor_rows(self) -> np.ndarray:
        """The rows its predictors are evaluated on: its labelled points, then its unlabelled
        sample (the latter checked too: the combined model will be used on points like them)."""
        self._data()
        return np.concatenate([self.X_labeled, self.X_unlabeled])

    def _hand_outputs(self, rows: np.ndarray, outputs: dict[int, np.ndarray | PositiveClass]) -> None:
        """Raw outputs of its predictors (k -> outputs) on ``rows``, computed by an in-process
        host in one call over every site's rows (:meth:`msa_fed.runtime.local.LocalSites.call_all`):
        where ``rows`` equal :meth:`_predictor_rows`, predictor k's answer to this site's own call
        on them, checked as that answer would be (:meth:`_outputs`).  Not a request (no host
        outside the site's process can call it: it is not in the site's list of methods)."""
        self._handed = (rows, dict(outputs))

    def _start_outputs(self) -> None:
        """Start computing :meth:`_outputs` in the background (a site process does it once the job
        is admitted: the predictors' outputs on this site's rows depend on neither the domain
        model nor Qhat, so they are ready by the time set_qhat needs them instead of costing that
        request a round trip to the isolated peers' worker).  Nothing leaves the site: the first
        :meth:`_outputs` waits for the result, and a failure (a peer's broken limit, an own
        predictor's bad output) is raised there, in that request, as if computed then."""
        if self._H is not None or self._pending_H is not None:
            return
        try:  # only for a consortium the site's policy admits (peers, max_sites): else no peer's
            # predictor runs on its rows before the first labelled request refuses the job (_admit)
            check_consortium(self.name, self.sites, len(self.predictors), self.policy)
        except PrivacyError:
            return
        self._data()
        self._pending_H = Background(self._compute_outputs, f"site-{self.name}-outputs")

    def _outputs(self):
        """H (n, p): each predictor on this site's labelled points (true-label probability for
        classification)."""
        if self._H is None:
            pending, self._pending_H = self._pending_H, None
            self._H = pending.result() if pending is not None else self._compute_outputs()
        return self._H

    def _compute_outputs(self) -> np.ndarray:
        """H computed now (see :meth:`_outputs`)."""
        # the unlabelled sample is checked too (the combined model will be used on points like
        # them): one call per predictor on both samples, the labelled rows first
        n = self.X_labeled.shape[0]
        both = self._predictor_rows()
        # column-major, as the DC sums use it (core/dc_terms.py): no copy on the way there
        cols = np.empty((n, len(self.predictors)), order="F")
        rows = idx = None
        predictors = answered_together(self.predictors, both)  # peers': one request
        handed, self._handed = self._handed, None
        if handed is not None and handed[0].shape == both.shape and np.array_equal(handed[0], both):
            for k, out in handed[1].items():  # the host's answers, on exactly these rows
                if 0 <= k < len(predictors):
                    predictors[k] = _Answered(predictors[k], both, out)
        done = self._handed_columns(predictors, both, n, cols)
        for k, h in enumerate(predictors):
            if k in done:
                continue
            out = self._checked_outputs(k, h, both, n)
            if self.task == "regression":
                cols[:, k] = out
                continue
            if idx is None:  # the labels' columns, the same for every predictor
                assert self.classes is not None  # classification: the job's classes
                idx = np.searchsorted(self.classes, self.y_labeled)
                if np.any(idx >= self.classes.size) or np.any(
                    self.classes[np.minimum(idx, self.classes.size - 1)] != self.y_labeled
                ):
                    raise ConfigError(
                        f"site {self.name!r}: labels outside the predictors' classes {self.classes.tolist()}"
                    )
                rows = np.arange(n)
            cols[:, k] = out[rows, idx]
        return cols

    def _handed_columns(self, predictors: list, both: np.ndarray, n: int, cols: np.ndarray) -> set[int]:
        """The host's answers (:meth:`_hand_outputs`) of the predictors over exactly the job's
        classes, checked together: the checks :func:`predictor_outputs` makes on each (every entry
        finite and in [-PROBA_ATOL, 1 + PROBA_ATOL], every row summing to 1 within PROBA_ATOL),
        a few array passes per answer; where they all pass, their columns of H (the labels'
        probabilities, clipped at 0, as :meth:`_outputs` takes them) are written to ``cols`` and
        their indices returned.  Anything else (regression, other classes or shapes, a failed
        check): none, and each predictor is checked on its own as before (its error, if any,
        names it)."""
        if self.task != "classification" or self.classes is None or both.dtype != np.float64:
            return set()  # (rows not in float64: predictor_outputs's call would not be the answer's)
        c = self.classes.size
        answered = [
            k
            for k, h in enumerate(predictors)
            if isinstance(h, _Answered)
            and h.rows is both
            and np.array_equal(np.asarray(h.predictor.classes_), self.classes)
        ]
        pairs = [
            k
            for k in answered
            if c == 2
            and isinstance(predictors[k].answer, PositiveClass)
            and predictors[k].answer.p.shape == both.shape[:1]
        ]
        ks = [
            k
            for k in answered
            if isinstance(predictors[k].answer, np.ndarray) and predictors[k].answer.shape == (both.shape[0], c)
        ]
        if len(ks) + len(pairs) < 2:
            return set()
        idx = np.searchsorted(self.classes, self.y_labeled)
        if np.any(idx >= c) or np.any(self.classes[np.minimum(idx, c - 1)] != self.y_labeled):
            return set()  # the per-predictor loop says it
        done = self._handed_pairs(predictors, pairs, idx, n, cols)
        if len(ks) < 2:
            return done
        # each answer checked where it lies and its column written straight into H (a stacked copy
        # of all the answers first, 3.6 MB per site at p = 64, made this 2.6x slower; measured)
        outs = [np.asarray(predictors[k].out, dtype=np.float64) for k in ks]
        lows, highs, sums = np.empty(len(ks)), np.empty(len(ks)), np.empty(len(ks))
        ones = np.ones(c)
        for j, out in enumerate(outs):
            lows[j], highs[j] = out.min(), out.max()
            sums[j] = np.abs(out @ ones - 1.0).max()
        if not (lows.min() >= -PROBA_ATOL and highs.max() <= 1 + PROBA_ATOL):
            return done
        if not float(sums.max()) <= PROBA_ATOL:
            return done
        rows = np.arange(n)
        at = rows * c + idx  # the labels' entries of the labelled rows in a row-major (rows, c) array
        for k, out in zip(ks, outs):
            label = np.take(out.reshape(-1), at) if out.flags.c_contiguous else out[rows, idx]
            np.clip(label, 0.0, None, out=cols[:, k])
        return done | set(ks)

    @staticmethod
    def _handed_pairs(predictors: list, ks: list[int], idx: np.ndarray, n: int, cols: np.ndarray) -> set[int]:
        """The host's answers of two-class predictors handed as their second column p alone
        (:class:`PositiveClass`: the answer [1 - p, p]), checked where they lie: where every p lies
        in [0, 1] (so does 1 - p, and each row's 1 - p + p is 1 within a rounding unit) the checks
        of :func:`predictor_outputs` pass on every answer, and their columns of H are written to
        ``cols``: p where the label is the second class, 1 - p where it is the first, as f + s p
        with (f, s) = (0, 1) or (1, -1), the answer's entries bit for bit (1 + (-p) is 1 - p, 0 + p
        is p); their indices returned.  Any p outside (NaN included): none, and each such predictor
        is checked on its own array as before (its error, if any, names it)."""
        answers = [predictors[k].answer.p for k in ks]
        if not all(float(p.min()) >= 0.0 and float(p.max()) <= 1.0 for p in answers):  # (NaN fails)
            return set()
        first = (idx == 0).astype(np.float64)
        sign = 1.0 - 2.0 * first
        for k, p in zip(ks, answers):
            out = cols[:, k]
            np.multiply(p[:n], sign, out=out)
            out += first
        return set(ks)

    def _owner(self, k: int) -> str:
        """The site whose predictor is predictor k of the job (its index where the host gave no names)."""
        if self.sites is not None and 0 <= k < len(self.sites):
            return self.sites[k]
        return self.name if k == self.index else f"#{k}"

    def _checked_outputs(self, k: int, h, both: np.ndarray, n: int) -> np.ndarray:
        """Predictor k's checked outputs on the first n rows of ``both``.  A failing check is one
        line naming the predictor's owner and the sample it failed on (the check is run again on
        each, on this error path only), never which rows nor how many: a peer's predictor is a
        :class:`PeerFault` of its owner (as a broken limit is, msa_fed.artifacts.isolated), the
        site's own a ConfigError."""
        try:
            return predictor_outputs(h, both, self.task, self.classes, who="")[:n]
        except ConfigError:
            owner = self._owner(k)
            own = k == self.index
            who = f"site {owner!r}'s {'own ' if own else ''}predictor"
            whose = "its" if own else f"site {self.name!r}'s"
            try:
                for rows, what in ((slice(0, n), "labelled"), (slice(n, None), "unlabelled")):
                    where = f"{whose} {what} points"
                    predictor_outputs(h, both[rows], self.task, self.classes, who=who, where=where)
                raise ConfigError(f"{who}: its outputs on site {self.name!r}'s points failed the check")
            except ConfigError as exc:
                if own:
                    raise ConfigError(str(exc)) from None
                raise PeerFault(owner, str(exc)) from None

    # ------------------------------------------------------------------ public surface
    # each request passes the one gate (msa_fed.site.gate: its row of LABELLED says what it
    # needs, checks and costs); the bodies below compute the answer
    def info(self, _=None) -> m.SiteInfo:
        with gate(self, "info", _):
            own = self.predictors[self.index]
            classes = np.asarray(own.classes_) if self.task == "classification" else None
            return m.SiteInfo(
                name=self.name,
                n_features=int(self.X_labeled.shape[1]),
                n_labeled=int(self.X_labeled.shape[0]),
                n_unlabeled=int(self.X_unlabeled.shape[0]),
                task=self.task,
                classes=classes,
                sample_in_model=self.policy.model_carries_sample,
            )

    def setup_shard(self, msg: m.ShardSetup) -> m.Ack:
        with gate(self, "setup_shard", msg):
            pass  # recorded before the shard is built (published data only)
        return self._first_block(msg)

    def set_domain_model(self, msg: m.DomainModelSpec) -> m.QhatPartial:
        """Compute Q(k | x_i) on the labelled points; answer this site's share of Qhat."""
        with gate(self, "set_domain_model", msg) as call:
            model = call.model()
            Q = model.predict_proba(self.X_labeled)
            self._Q = self._points = self._own_partial = self._spec_key = None
            # no label enters a Qhat partial and one point adds at most pi_i = 1 / (p n) to it;
            # the partials must add up to a probability vector, so they are not clipped
            call.decisions["qhat_share"] = float(shares(Q, self.policy.weight_floor).max(initial=0.0))
            sums = qhat_partial(Q, msg.n_sources)
            self._Q, self._own_partial, self._spec_key = Q, sums, call.key()
            # the row's transform: with DP on, the same estimate over the published sample
            sums = call.public(lambda X: qhat_partial(model.predict_proba(X), msg.n_sources), sums)
        n = int(self.X_labeled.shape[0])
        return m.QhatPartial(sums=sums, n=n, epsilon=self.guard.epsilon_spent(), dp=self.guard.dp is not None)

    def set_published(self, msg: m.PublishedSamples) -> m.Ack:
        """The job's published samples, from this worker's host (in-process, Ray and cluster
        topologies; a site process fetches them from the registry itself), checked against the
        sha256 the job's content pins for each site (admission.checked_host_samples)."""
        with gate(self, "set_published", msg):
            samples = checked_host_samples(
                self.name, self.index, msg.samples, self.X_unlabeled, self.content, self.sites
            )
            self.published = lambda: samples
        return m.Ack(self.incarnation)

    def set_qhat(self, msg: m.QhatBroadcast) -> m.Ack:
        with gate(self, "set_qhat", msg) as call:
            qhat = call.floor_qhat(msg.qhat)  # the row's transform (gate.py, dp="clipped")
            self._points = None
            y = self.y_labeled.astype(np.float64) if self.task == "regression" else None
            qhat = np.asarray(qhat, dtype=np.float64)
            self._qhat = qhat
            # w_k(i) = pi_i q_k(x_i) with the density ratios q_k capped by the row's transform; the
            # u_k / v_k weights and K_z mix these columns with eta pi_i (influence.py)
            ratios = call.clip_weights(self._Q / qhat[None, :])
            self._points = site_point_set(ratios * qhat[None, :], qhat, self._outputs(), self.loss, y=y)
        return m.Ack(self.incarnation)

    def dc_evaluate(self, msg: m.DCRequest) -> m.DCPartial:
        with gate(self, "dc_evaluate", msg) as call:
            sums = call.dc_sums(self._points)  # the row's transform (gate.py, dp="noised")
        return m.DCPartial(sums=sums, epsilon=self.guard.epsilon_spent())

    def harm(self, msg: m.HarmRequest) -> m.HarmAnswer:
        """The site's verdict on the combined model (msa_fed/core/harm.py): the model's mean loss
        on this site's labelled points at each requested z and its own predictor's, each point's
        loss clipped to loss_clip; with DP, Gaussian noise on the m + 1 means (one DP answer)."""
        from msa_fed.core.harm import harmed, measured_losses

        with gate(self, "harm", msg) as call:
            pol = self.policy
            y = self.y_labeled.astype(np.float64) if self.task == "regression" else None
            combined, own = measured_losses(
                self._Q,
                self._qhat,
                self._outputs(),
                np.asarray(msg.z),
                float(msg.eta),
                self.loss,
                self.index,
                y=y,
                loss_clip=pol.loss_clip,
            )
            # the row's transform: with DP on, Gaussian noise on the m + 1 means (one DP answer)
            means, noisy = call.noised_means(np.append(combined, own), pol.loss_clip, self._points.n_points)
            combined, own = means[:-1], float(means[-1])
            signs_off = pol.accept_harm or not harmed(float(combined[0]), own, pol.harm_tolerance)
            call.decisions["signs_off"] = signs_off
        return m.HarmAnswer(
            combined=np.asarray(combined, dtype=np.float64),
            own=float(own),
            n=int(self.X_labeled.shape[0]),
            epsilon=self.guard.epsilon_spent(),
            noisy=noisy,
            tolerance=float(pol.harm_tolerance),
            signs_off=bool(signs_off),
        )

    def max_bound(self, _=None) -> m.BoundMax:
        with gate(self, "max_bound", _):
            value = self._points.max_bound()
        return m.BoundMax(value)
