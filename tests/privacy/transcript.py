"""A coordinator that reads what it is sent: honest fits of 300-point sites, their transcripts,
and a least-squares decoder of the victim site's labels.

Every number a site returns is a sum over its labelled points of a function of (x_i, y_i);
for a fixed x_i that function takes one of two values (binary labels), so a transcript is a
linear system in the label bits b_i once the attacker has candidate inputs for the points.
:func:`decode` solves it by least squares over candidate inputs ``X_guess``:

- ``X_guess`` = the true labelled inputs: the attack on a site that publishes them;
- ``X_guess`` = the site's published sample (disjoint from its labelled inputs): the best an
  attacker can do when the labelled inputs never leave the site.  It decodes "labels" for the
  published points and scores each labelled point by the decoded label of its nearest
  published point: a classifier f(x) learnt from the transcript alone.

Labels are balanced and independent of x, so any f(x) is right on 50% of the points unless
the transcript tells it about these particular points.
"""

from __future__ import annotations

import copy

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.api import SiteData
from msa_fed.boundary import messages as m
from msa_fed.core.dc_terms import PROB_FLOOR
from msa_fed.privacy.verify import capped_to_published
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.local import LocalSites
from msa_fed.site.methods import COUNTED
from msa_fed.site.worker import SiteWorker, build_domain_model
from tests.runtime.problems import site_kwargs

N = 300
D = 2


def federation(p: int = 3, n: int = N, seed: int = 0, centers=None) -> list[SiteData]:
    """p sites: inputs N(center_k, 1) in 2-D, n labelled points with balanced labels drawn
    independently of x (site 0 is the victim), a disjoint published sample of n points, and a
    logistic predictor trained on other data with an x-dependent rule (so the two labels of a
    point have different losses)."""
    rng = np.random.default_rng([seed, p, n])
    centers = (
        centers
        if centers is not None
        else [(2.0 * np.cos(2 * np.pi * k / p), 2.0 * np.sin(2 * np.pi * k / p)) for k in range(p)]
    )
    sites = []
    for k in range(p):
        c = np.asarray(centers[k], dtype=float)
        Xtr = rng.normal(c, 1.0, size=(400, D))
        ytr = ((Xtr - c) @ rng.normal(size=D) + 0.3 * rng.normal(size=400) > 0).astype(int)
        h = LogisticRegression().fit(Xtr, ytr)
        X = rng.normal(c, 1.0, size=(n, D))
        y = rng.permutation(np.arange(n) % 2)
        Xu = rng.normal(c, 1.0, size=(n, D))
        sites.append(SiteData(f"s{k}", X, y, Xu, h))
    return sites


class RecordingSite(SiteWorker):
    """A site worker that keeps every request and answer (what the coordinator holds) of every
    request a site counts (msa_fed/site/methods.py COUNTED) but ``info`` (its counts and public
    classes): whatever the coordinator asks next is in the transcript, and :func:`system` reads
    it or fails."""

    live: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transcript: list = []
        RecordingSite.live[self.name] = self

    def handle(self, method, msg):
        if method not in COUNTED or method == "info":
            return super().handle(method, msg)
        sent = copy.deepcopy(msg)  # in-process the solver reuses its arrays after the call
        out = super().handle(method, msg)
        self.transcript.append((method, sent, copy.deepcopy(out)))
        return out


def honest_fit(sites: list[SiteData], policies=None, **config):
    """fit with a job's pipeline and the influence report always on (a job makes it once a site
    is harmed: its re-solves are in the transcript the attacker reads, the most a job sends);
    returns (model, {site name: RecordingSite})."""
    predictors = [s.predictor for s in sites]
    kw = site_kwargs(sites)
    for k, d in enumerate(kw):
        d.update(policy=None if policies is None else policies[k], sites=[t.name for t in sites])
    RecordingSite.live = {}
    fit = FitConfig(**{"influence": True, **config})
    with Coordinator(LocalSites(kw, worker_cls=RecordingSite), predictors, fit) as c:
        model = c.fit()
    return model, dict(RecordingSite.live)


def _per_point(w, pi, H, z, eta, what) -> np.ndarray:
    """(m, r): each point's contribution to the answer's L and dL (cross-entropy; the formulas
    of :meth:`msa_fed.core.dc_terms.PointSet.evaluate`, one row per point instead of the sum)."""
    H = np.maximum(H, PROB_FLOOR)
    p = w.shape[1]
    WH = w * H
    K = w @ z + eta * pi
    J = WH @ z + (eta / p) * pi * H.sum(axis=1)
    g = J / K
    parts = []
    if "L" in what:
        parts.append(-w * np.log(g)[:, None])
    if "dL" in what:
        Gn = WH - w * g[:, None]
        parts.append((-(w / J[:, None])[:, :, None] * Gn[:, None, :]).reshape(w.shape[0], -1))
    return np.hstack(parts)


def _flat(sums, what, row: int | None = None) -> np.ndarray:
    """The answer's numbers for ``what``, in :func:`_per_point`'s column order; ``row``: the
    row of a batched answer (sums of shape (m, p) and (m, p, p), one row per z of the batch)."""
    parts = []
    for name in what:
        value = np.asarray(getattr(sums, name), dtype=np.float64)
        parts.append(np.ravel(value if row is None else value[row]))
    return np.concatenate(parts)


def _per_point_harm(w, pi, H, z, eta, own, clip, n) -> np.ndarray:
    """(m, r + 1): each point's share of a harm answer's means (msa_fed/core/harm.py): the
    combined model's loss at each row of z (r, p), then the site's own predictor's (column
    ``own``), each per-point loss clipped to [0, clip]; a mean over the site's n points."""
    H = np.maximum(H, PROB_FLOOR)
    p = w.shape[1]
    ratios = w / pi[:, None]  # q_k(x_i): the weights without the point's share pi_i
    g = ((ratios * H) @ z.T + (eta / p) * H.sum(axis=1)[:, None]) / (ratios @ z.T + eta)
    losses = np.column_stack([-np.log(np.maximum(g, PROB_FLOOR)), -np.log(H[:, own])])
    return np.clip(losses, 0.0, clip) / n


def public_view(model, worker: SiteWorker):
    """The domain model as the site computes with it, from public data alone: a verified Maxent
    model reaches the labelled points through its map capped at the published points' largest
    norm (msa_fed/privacy/verify.py), which the attacker computes from the published samples."""
    if getattr(model, "kind", None) != "maxent" or worker.published is None:
        return model
    Phi = np.vstack([np.asarray(model.feature_map.transform(X)) for X in worker.published()])
    return capped_to_published(model, {"verify_phi_max": float(np.linalg.norm(Phi, axis=1).max())})


def system(worker: SiteWorker, X_guess: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(A, b, source): the worker's transcript as a linear system A bits = b in the label bits
    (0/1) of the candidate inputs X_guess (from the public domain model, qhat, z, eta, the
    public predictors and policy; n = the site's number of labelled points, which it reports);
    ``source``: the request each row comes from.  A request it cannot read is an error."""
    P = worker.predictors
    p = len(P)
    Hs = [np.column_stack([h.predict_proba(X_guess)[:, lab] for h in P]) for lab in (0, 1)]
    pi = np.full(X_guess.shape[0], 1.0 / (p * n))
    rows, rhs, source = [], [], []
    model = None
    w = None
    for method, msg, out in worker.transcript:
        if method == "set_domain_model":
            model = public_view(build_domain_model(msg), worker)
        elif method == "set_qhat":
            qhat = np.asarray(msg.qhat, dtype=np.float64)
            w = pi[:, None] * model.predict_proba(X_guess) / qhat[None, :]
        elif method == "dc_evaluate":
            what = tuple(x for x in ("L", "dL") if x in msg.what)
            z, eta = np.asarray(msg.z, dtype=np.float64), float(msg.eta)
            # a lockstep round asks several z in one request (one row of z and of the sums each)
            for j, zj in enumerate(np.atleast_2d(z)):
                c0, c1 = (_per_point(w, pi, Hs[lab], zj, eta, what) for lab in (0, 1))
                rows.append((c1 - c0).T)
                rhs.append(_flat(out.sums, what, None if z.ndim == 1 else j) - c0.sum(axis=0))
                source += [method] * c0.shape[1]
        elif method == "harm":
            # the site's verdict: mean losses over its labelled points at each z, and its own
            # predictor's; each point's clipped loss takes one of two values, so these are rows too
            z, eta = np.atleast_2d(np.asarray(msg.z, dtype=np.float64)), float(msg.eta)
            clip = float(worker.policy.loss_clip)
            c0, c1 = (_per_point_harm(w, pi, Hs[lab], z, eta, worker.index, clip, n) for lab in (0, 1))
            rows.append((c1 - c0).T)
            rhs.append(np.append(out.combined, out.own) - c0.sum(axis=0))
            source += [method] * c0.shape[1]
        else:
            raise ValueError(f"the decoder does not read {method!r} answers")
    return np.vstack(rows), np.concatenate(rhs), source


def decode(worker: SiteWorker, X_guess: np.ndarray, n: int) -> np.ndarray:
    """Least-squares label bits (0/1) of the candidate inputs X_guess (:func:`system`)."""
    A, b, _source = system(worker, X_guess, n)
    sol, *_ = np.linalg.lstsq(A, b, rcond=None)
    return (np.clip(sol, 0, 1) > 0.5).astype(int)


def recovered(worker: SiteWorker, site: SiteData, X_guess: np.ndarray) -> float:
    """Fraction of the site's labelled points whose label the decoder gets right: each point
    takes the decoded label of its nearest candidate input."""
    bits = decode(worker, X_guess, site.X_labeled.shape[0])
    d2 = ((site.X_labeled[:, None, :] - X_guess[None, :, :]) ** 2).sum(axis=2)
    guess = bits[np.argmin(d2, axis=1)]
    return float(np.mean(guess == site.y_labeled))


def sweep(worker: SiteWorker, n_queries: int, seed: int = 0) -> int:
    """An active coordinator after the honest fit: more DC evaluations at z and eta it chooses
    (eta from the site's floor upwards, z anywhere on the simplex).  Returns answers received."""
    rng = np.random.default_rng(seed)
    p = len(worker.predictors)
    got = 0
    for _ in range(n_queries):
        z = rng.dirichlet(np.full(p, 0.3))
        eta = worker.policy.eta_min * 10 ** rng.uniform(0, 3)
        worker.handle("dc_evaluate", m.DCRequest(z=z, eta=eta, what=("L", "dL")))
        got += 1
    return got
