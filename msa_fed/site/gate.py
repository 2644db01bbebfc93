"""The one policy gate of a site's labelled half, and the table of what each request needs,
checks and costs.

:data:`LABELLED` declares, per request that touches the labelled data (as
:data:`msa_fed.control.auth.METHOD_RULES` declares access), every rule the site applies before
an aggregate leaves: reading the table tells what each request costs and checks.  :func:`gate`
applies a row, always in the order of :class:`Rule`'s fields, inside the audit record of the
request (:meth:`msa_fed.privacy.guard.SiteGuard.request`), so that what each check measured
and a refusal's rule are written to the site's audit log.  The checks named in the table are
:data:`CHECKS` (each a call into :mod:`msa_fed.privacy.rules` or :mod:`msa_fed.privacy.verify`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.core.dc_terms import DCSums
from msa_fed.errors import ConfigError, PrivacyError, missing_extra
from msa_fed.privacy import rules
from msa_fed.privacy.guard import Request
from msa_fed.privacy.influence import bounded
from msa_fed.privacy.verify import capped_to_published, own_qhat, verify_domain_model
from msa_fed.site.policy import trusts_custom_feature_maps
from msa_fed.site.published import SiteStateLost

Sizes = Callable[[Any, Any], dict]


def _ndim(v) -> int:
    """``np.ndim(v)``, without its dispatch for an array (this runs on every DC request)."""
    return v.ndim if type(v) is np.ndarray else np.ndim(v)


@dataclass(frozen=True)
class Rule:
    """What one request of the labelled half needs, checks and costs.  :func:`gate` applies the
    fields in this order (``state``, ``data`` and ``admit`` before its audit record opens, the
    rest inside it; DP's refusal just before the charge); a refusal stops it there."""

    state: str = ""  # the set-up it builds on (a worker attribute): without it, SiteStateLost (replay)
    data: bool = False  # the private data, read (from data_path: on first use)
    admit: bool = False  # the job's consortium against the policy (peers, max_sites; once per job)
    sizes: Sizes | None = None  # (worker, request) -> the sizes its audit record shows; None: not recorded
    sample: Literal["", "labelled", "unlabelled"] = ""  # the points it aggregates over: >= min_points
    before: tuple[str, ...] = ()  # checks of the request refused before it is charged
    charges: str = ""  # the budget one request counts toward (answered or refused from here on)
    cost: Callable[[Any], int] | None = None  # (request) -> how many it counts toward that budget (1)
    # (worker, request) -> the digest of a set-up's content: a set-up this site answered before
    # for the same job content, labelled data and policy (this run or an earlier run of the job:
    # the worker's :class:`SetupMemory`) is a replay, answered again but not charged again
    replay_key: Callable[[Any, Any], str] | None = None
    checks: tuple[str, ...] = ()  # checks after the charge (:data:`CHECKS`)
    quiet: bool = False  # the checks' values are not written (they repeat the sizes and the request)
    # the row's transform of the answer, applied by the gate (:class:`Call`: refused, noised,
    # public, clipped); what it does with differential privacy (policy [dp]) on:
    #   "refused": not answered (rule dp_what), before the charge
    #   "noised": only the losses L, clipped, with Gaussian noise: one DP answer spent
    #     (dp_what, dp_budget); without DP the exact sums asked for (:meth:`Call.dc_sums`)
    #   "public": answered from the published sample (no epsilon spent); without DP from the
    #     labelled points (:meth:`Call.public`)
    #   "clipped": weights clipped at the data-independent ratio_clip (in the DP losses), not at
    #     the site's own shares; without DP qhat floored at the site's own share and each point's
    #     weight capped at the policy's share (:meth:`Call.floor_qhat`, :meth:`Call.clip_weights`)
    dp: Literal["", "refused", "noised", "public", "clipped"] = ""
    # "noised" with DP on: this answer is the site's verdict on the model, paid from the answers
    # the DP plan reserves for it (dp.VERDICT_ANSWERS); any other noised answer leaves them
    verdict: bool = False


#: every request that touches the labelled data, and its rules; the published half's requests
#: are :mod:`msa_fed.site.published`'s (no labelled point, no record)
LABELLED: dict[str, Rule] = {
    "info": Rule(data=True, admit=True),
    "setup_shard": Rule(
        data=True,
        admit=True,
        sizes=lambda w, r: {"n_unlabeled": w.X_unlabeled.shape[0]},
        sample="unlabelled",
        checks=("feature_map",),
    ),
    "set_domain_model": Rule(
        data=True,
        admit=True,
        sizes=lambda w, r: {
            "n_labeled": int(w.X_labeled.shape[0]),
            "n_sources": int(r.n_sources),
            "model": str(r.kind),
        },
        sample="labelled",
        before=("n_sources",),
        charges="domain_model",
        replay_key=lambda w, r: spec_digest(r),
        checks=("feature_map", "theta", "verified", "kde"),
        dp="public",
    ),
    "set_published": Rule(data=True),
    "set_qhat": Rule(
        state="_Q",
        sizes=lambda w, r: {"n_sources": int(np.size(r.qhat))},
        charges="dc_evaluation",  # the answer (accepted or refused) depends on the labelled points
        replay_key=lambda w, r: qhat_digest(w._spec_key, r),  # the same Qhat for the same model
        checks=("eta", "qhat"),
        dp="clipped",
    ),
    "dc_evaluate": Rule(
        state="_points",
        sizes=lambda w, r: {"n_labeled": w._points.n_points, "what": list(r.what)},
        sample="labelled",
        charges="dc_evaluation",
        cost=lambda r: 1 if _ndim(r.z) == 1 else int(np.shape(r.z)[0]),  # a batch: one per z
        checks=("eta", "z", "global_bound"),
        quiet=True,  # the DC round's line: its sizes, its charge (and its DP answer) only
        dp="noised",
    ),
    # the site's verdict on the combined model: its loss at the model's z (and at the mixtures
    # re-solved without each site), and its own predictor's loss, on its labelled points
    "harm": Rule(
        state="_points",
        sizes=lambda w, r: {"n_labeled": w._points.n_points, "n_z": int(np.atleast_2d(r.z).shape[0])},
        sample="labelled",
        charges="dc_evaluation",
        cost=lambda r: int(np.atleast_2d(r.z).shape[0]),
        checks=("eta", "harm_z"),
        dp="noised",
        verdict=True,
    ),
    "max_bound": Rule(
        state="_points",
        sizes=lambda w, r: {"n_labeled": w._points.n_points},
        charges="dc_evaluation",
        dp="refused",
    ),
}


# ---------------------------------------------------------------------- the checks
def _n_sources(c: Call) -> None:
    w, r = c.worker, c.msg
    if int(r.n_sources) != len(w.predictors):
        raise PrivacyError(
            "n_sources",
            w.name,
            f"the request: a domain model of {int(r.n_sources)} sources for a job of {len(w.predictors)} sites",
        )


def _feature_map(c: Call) -> dict | None:
    """A built-in map's parameters (rules.check_feature_map) against the site's published sample
    (public: a decision on the labelled points would tell a crafted map's sender about them); a
    custom map only from an in-process caller (the site's own process)."""
    w, r = c.worker, c.msg
    state, custom = r.feature_map, r.custom_feature_map
    if state is None and custom is None:
        return None
    if state is None:
        if not trusts_custom_feature_maps(w.host, w.policy):
            raise PrivacyError(
                "feature_map",
                w.name,
                "the request: custom feature maps are accepted only from an in-process caller (the site's own process)",
            )
        return {"feature_map": "custom (in-process)"}
    return rules.check_feature_map(state, w.X_unlabeled, w.policy, w.name)


def _theta(c: Call) -> dict | None:
    r = c.msg
    return rules.check_theta(r.theta, r.n_sources, c.worker.policy, c.worker.name) if r.kind == "maxent" else None


def _verified(c: Call) -> dict:
    """The model checked on public data alone; the labelled points then reach a Maxent model
    through its map capped at the published points' largest norm (verify.capped_to_published)."""
    w = c.worker
    samples = None if w.published is None else w.published()
    got = verify_domain_model(c.msg, samples, w.policy, w.name)
    capped_to_published(c.model(), got)
    return got


def _kde(c: Call) -> dict | None:
    r = c.msg
    if r.kind != "kde":
        return None
    model = c.model()
    X = c.worker.X_unlabeled  # the published sample, as for the feature map (_feature_map)
    Phi = X if model.feature_map is None else np.asarray(model.feature_map.transform(X))
    return rules.check_kde(r.bandwidths, r.samples, Phi, r.n_sources, c.worker.policy, c.worker.name)


def _eta(c: Call) -> dict:
    return rules.check_eta(c.msg.eta, c.worker.policy, c.worker.name)


def _qhat(c: Call) -> dict:
    # a probability vector; without DP the site's own share is a floor (the body's
    # verify.own_qhat), with DP the weights are clipped (dp.py)
    w = c.worker
    return rules.check_qhat(c.msg.qhat, np.zeros_like(w._own_partial), w.name)


def _z(c: Call) -> None:
    """z, or a batch of at most p of them (the influence analysis's re-solves in lockstep; not
    with DP, whose one answer is noised for one z)."""
    w, r = c.worker, c.msg
    p = w._points.w.shape[1]
    if _ndim(r.z) != 2:
        rules.check_z(r.z, float(r.eta), p, w.policy, w.name)
        return
    zs = np.asarray(r.z)
    if not 1 <= zs.shape[0] <= p:
        raise PrivacyError("z", w.name, f"the request: a batch holds 1 to {p} values of z")
    if w.guard.dp is not None:
        raise PrivacyError(
            "dp_what", w.name, "the request: with differential privacy on, the site answers one z at a time"
        )
    for z in zs:
        rules.check_z(z, float(r.eta), p, w.policy, w.name)


def _harm_z(c: Call) -> dict:
    """The mixtures of a verdict: at most p + 1 of them (the model's z and one without each
    site), each a valid z (rules.check_z)."""
    w, r = c.worker, c.msg
    p = w._points.w.shape[1]
    zs = np.asarray(r.z)
    if zs.ndim != 2 or not 1 <= zs.shape[0] <= p + 1:
        raise PrivacyError(
            "harm_z", w.name, f"the request: a verdict is asked at 1 to {p + 1} mixtures of {p} sites (rows of z)"
        )
    for z in zs:
        rules.check_z(z, float(r.eta), p, w.policy, w.name)
    return {"n_z": int(zs.shape[0])}


def _global_bound(c: Call) -> None:
    b = c.msg.global_bound
    if b is not None and not (np.isfinite(b) and b >= 0):
        raise PrivacyError("global_bound", c.worker.name, "the request: global_bound must be a finite number >= 0")


#: the checks the table names: ``check(call) -> measured values (or None)``, with the request
#: ``call.msg``, its site ``call.worker`` and the sample of its rule ``call.X``; each refuses
#: with a PrivacyError under its own rule (or a rule of the module it calls)
CHECKS: dict[str, Callable[[Call], dict | None]] = {
    "n_sources": _n_sources,
    "feature_map": _feature_map,
    "theta": _theta,
    "verified": _verified,
    "kde": _kde,
    "eta": _eta,
    "qhat": _qhat,
    "z": _z,
    "harm_z": _harm_z,
    "global_bound": _global_bound,
}

#: what a request answers, in a refusal's words
_ANSWERS = {"max_bound": "the largest per-point bound"}


# ---------------------------------------------------------------------- the gate
def gate(worker, method: str, msg) -> Call:
    """The gate of labelled request ``method``: its rule's needs now (state, data, admission),
    its record and checks when the returned :class:`Call` is entered:
    ``with gate(self, "dc_evaluate", msg) as call: ...`` (the record is written when it ends)."""
    rule = LABELLED[method]
    if rule.state and getattr(worker, rule.state) is None:
        raise SiteStateLost(worker.name)
    if rule.data:
        worker._data()
    if rule.admit:
        worker._admit()
    return Call(worker, method, msg, rule)


class Call(Request):
    """One labelled request inside the gate: the guard's request context (its audit record:
    ``decisions``, to which the body adds what it measures), with the checks of its rule run on
    entering, the sample of its rule ``X``, and what the checks computed for the body
    (:meth:`key`, :meth:`model`).  A request whose rule records nothing (no ``sizes``) enters
    and leaves without a record."""

    __slots__ = ("worker", "msg", "rule", "X", "_key", "_model", "_replay")

    def __init__(self, worker, method: str, msg, rule: Rule):
        sizes = rule.sizes
        Request.__init__(self, worker.guard, method, {} if sizes is None else sizes(worker, msg))
        self.worker, self.msg, self.rule = worker, msg, rule
        self.X: Any = None
        self._key: str | None = None
        self._model: Any = None
        self._replay: str | None = None

    def key(self) -> str:
        """The digest of the request's domain model (:func:`spec_digest`), computed once."""
        if self._key is None:
            self._key = spec_digest(self.msg)
        return self._key

    def model(self):
        """The request's domain model, built once (a check and the answer share it)."""
        if self._model is None:
            self._model = build_domain_model(self.msg)
        return self._model

    def __enter__(self) -> Call:  # type: ignore[override]  # the call, not only its decisions
        if self.rule.sizes is not None:
            try:
                self._apply(self.rule, self.worker, self.decisions)
            except BaseException as exc:
                self.__exit__(type(exc), exc, exc.__traceback__)
                raise
        return self

    def _apply(self, rule: Rule, w, dec: dict) -> None:
        quiet = rule.quiet
        if rule.sample:
            self.X = X = w.X_labeled if rule.sample == "labelled" else w.X_unlabeled
            counted = rules.check_min_points(X.shape[0], w.policy, w.name, rule.sample)
            if not quiet:
                dec.update(counted)
        for name in rule.before:
            if (got := CHECKS[name](self)) and not quiet:
                dec.update(got)
        if rule.dp == "refused" and w.guard.dp is not None:
            raise PrivacyError(
                "dp_what",
                w.name,
                f"the request: with differential privacy on, the site does not answer "
                f"{_ANSWERS.get(self.kind, self.kind)}",
            )
        if rule.charges and not self._replayed(dec):
            dec.update(w.guard.charge(rule.charges, 1 if rule.cost is None else rule.cost(self.msg)))
        for name in rule.checks:
            if (got := CHECKS[name](self)) and not quiet:
                dec.update(got)
        if rule.dp == "noised" and (dp := w.guard.dp) is not None:
            if tuple(getattr(self.msg, "what", ("L",))) != ("L",):
                raise PrivacyError(
                    "dp_what",
                    w.name,
                    f"the request: with differential privacy on, the site answers the "
                    f"losses L only; asked for {list(self.msg.what)}",
                )
            dec.update(dp.spend(verdict=rule.verdict))

    def _replayed(self, dec: dict) -> bool:
        """Whether the request replays a set-up the site answered before (its row's
        ``replay_key``, looked up in the worker's :class:`SetupMemory`): then it is not charged,
        and its record says so."""
        rule, w = self.rule, self.worker
        if rule.replay_key is None:
            return False
        self._replay = rule.replay_key(w, self.msg)
        if not w.setups.answered(self.kind, self._replay):
            return False
        dec["replay"] = "answered before for this job: not charged again"
        return True

    def __exit__(self, etype, exc, tb) -> Literal[False]:
        if self.rule.sizes is not None:
            Request.__exit__(self, etype, exc, tb)  # the record (and the charge) first
        if etype is None and self._replay is not None:  # answered and recorded: a replay of it is free
            self.worker.setups.remember(self.kind, self._replay)
        return False

    # ------------------------------------------------------------------ the row's transform
    def _transform(self, want: str):
        if self.rule.dp != want:
            raise RuntimeError(f"request {self.kind!r}: its row's transform is {self.rule.dp!r}, not {want!r}")
        return self.worker.guard.dp

    def public(self, over: Callable[[np.ndarray], Any], labelled: Any) -> Any:
        """``dp="public"``: the answer ``labelled`` (over the labelled points), or with DP on
        ``over(the published sample)``: public data, no epsilon spent."""
        if self._transform("public") is None:
            return labelled
        return over(self.worker.X_unlabeled)

    def floor_qhat(self, qhat: np.ndarray) -> np.ndarray:
        """``dp="clipped"``: qhat floored at this site's own share (recorded); with DP on, qhat as
        sent (the DP losses clip the weights at ratio_clip, whatever qhat is)."""
        if self._transform("clipped") is not None:
            return qhat
        out, floored = own_qhat(qhat, self.worker._own_partial)
        self.decisions.update(floored)
        return out

    def clip_weights(self, ratios: np.ndarray) -> np.ndarray:
        """``dp="clipped"``: the density ratios capped at the policy's share of a point (recorded);
        with DP on, as they are (a cap that depends on the other points would let one point move
        the others' weights, beyond the sensitivity: the DP losses clip at ratio_clip)."""
        if self._transform("clipped") is not None:
            return ratios
        out, clip = bounded(ratios, self.worker.policy, "w")
        self.decisions.update(clip)
        return out

    def dc_sums(self, points):
        """``dp="noised"``: the DC sums the request asks for over ``points``, or with DP on the
        losses L only (the gate checked that only L is asked and spent one DP answer), each
        point's loss clipped, with Gaussian noise of that sensitivity."""
        msg, dp = self.msg, self._transform("noised")
        if dp is None and _ndim(msg.z) == 2:  # a batch (checked: at most p rows, never with DP)
            what, bound = tuple(msg.what), msg.global_bound
            rows = points.evaluate_batch(msg.z, float(msg.eta), what=what, global_bound=bound)
            return DCSums(**{k: np.stack([getattr(r, k) for r in rows]) for k in what}, n=rows[0].n)
        if dp is None:
            return points.evaluate(msg.z, float(msg.eta), what=tuple(msg.what), global_bound=msg.global_bound)
        from msa_fed.privacy.dp import clipped_losses

        L, sens = clipped_losses(points, msg.z, float(msg.eta), self.worker.policy)
        return DCSums(L=L + dp.noise(L.shape, sens), n=points.n_points)

    def noised_means(self, means: np.ndarray, clip: float, n: int) -> tuple[np.ndarray, bool]:
        """``dp="noised"``: means over the site's n labelled points of per-point values clipped to
        [0, clip], as they are, or with DP on with Gaussian noise (replace one point: each mean
        moves by at most clip / n, L2 sensitivity clip sqrt(m) / n); (means, noised)."""
        dp = self._transform("noised")
        if dp is None:
            return means, False
        sens = clip * float(np.sqrt(means.size)) / n
        return means + dp.noise(means.shape, sens), True


# ---------------------------------------------------------------------- domain models
def build_domain_model(spec: m.DomainModelSpec):
    try:
        return m.domain_model_from_spec(spec)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"malformed domain model: {exc}") from None
    except ModuleNotFoundError as exc:  # a site installed without the coordinator extra
        needs = missing_extra(exc, f"a {spec.kind!r} domain model at this site")
        if needs is None:
            raise
        raise needs from None


def qhat_digest(spec_key: str | None, msg: m.QhatBroadcast) -> str:
    """A digest of a Qhat broadcast's content for the domain model in force (``spec_key``)."""
    h = hashlib.sha256(str(spec_key).encode())
    h.update(np.ascontiguousarray(msg.qhat, dtype=np.float64).tobytes())
    h.update(repr(float(msg.eta)).encode())
    return h.hexdigest()


class Setups(Protocol):
    """What the gate asks of a job's memory of answered set-ups (:class:`SetupMemory`)."""

    def answered(self, method: str, key: str) -> bool: ...

    def remember(self, method: str, key: str) -> None: ...


class SetupMemory:
    """The set-ups (``set_domain_model``, ``set_qhat``) a site answered for one job, by their
    rows' ``replay_key``: a replay of one is answered again but not charged again.  This one is
    the worker's own (one run, in memory); a site process gives each job's worker one kept on
    its disk per job content, labelled data and policy
    (:class:`msa_fed.site.job_book.KeptSetups`), so that a resumed job, or a job replayed to a
    restarted site, is charged only for what is new.

    Sound because a set-up's answer is a deterministic function of the request, the labelled
    data and the policy: answering the same again tells the coordinator nothing new."""

    def __init__(self) -> None:
        self._keys: set[tuple[str, str]] = set()

    def answered(self, method: str, key: str) -> bool:
        return (method, key) in self._keys

    def remember(self, method: str, key: str) -> None:
        self._keys.add((method, key))


def spec_digest(msg: m.DomainModelSpec) -> str:
    """A digest of a domain model's content (equal specs: the same model, e.g. a replay)."""
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
