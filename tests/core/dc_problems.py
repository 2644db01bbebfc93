"""Random DC problems (sets of sites' points) for the core tests and ``benchmarks/bench_core.py``.

Two families, both built with the library's own :func:`site_point_set`:

``kind="coupled"`` (realistic)
    Site k's inputs x ~ N(mu_k, I_d); Q(k | x) is a tempered Gaussian posterior; the target
    (regression: f(x) + noise; classification: a label drawn from sigmoid(f(x))) is one
    function of x, and predictor h_k is accurate near mu_k and worse away from it.
``kind="harsh"``
    Q(k | x_i) has logits biased towards the point's own site plus independent noise, and
    H_k(i) is good only when k is the point's site: the classifier carries no information
    about where each h_k is good, which gives several equilibria with narrow basins
    (the hard case for local solvers).
"""

from __future__ import annotations

import numpy as np

from msa_fed.core.combination import qhat_partial, site_point_set
from msa_fed.core.dc_terms import PointSet


def _split(n: int, p: int, rng) -> np.ndarray:
    return rng.multinomial(n - 2 * p, np.ones(p) / p) + 2


def make_dc_problem(p: int, n: int, loss: str, *, kind: str = "coupled", random_state=0, d: int = 3) -> list[PointSet]:
    """p sites' point sets with n labelled points in all; returns a list of p PointSets."""
    rng = np.random.default_rng(random_state)
    sizes = _split(n, p, rng)
    Qs, Hs, ys = [], [], []
    if kind == "coupled":
        mus = rng.normal(scale=1.5, size=(p, d))
        a = rng.normal(size=d)
        dirs = rng.normal(size=(p, d))
        phase = rng.uniform(0, 2 * np.pi, size=p)
        for s, ns in enumerate(sizes):
            X = rng.normal(size=(ns, d)) + mus[s]
            logits = -0.5 * 0.7 * ((X[:, None, :] - mus[None]) ** 2).sum(-1)  # tempered posterior
            Q = np.exp(logits - logits.max(1, keepdims=True))
            Q /= Q.sum(1, keepdims=True)
            f = np.sin(X @ a) + 0.5 * X[:, 0]
            dist = np.sqrt(((X[:, None, :] - mus[None]) ** 2).sum(-1) / d)  # (ns, p)
            bias = 0.3 * dist * np.cos(X @ dirs.T + phase)  # h_k's error
            if loss == "squared":
                y = f + 0.1 * rng.normal(size=ns)
                H = f[:, None] + bias
                ys.append(y)
            else:
                lab = rng.random(ns) < 1.0 / (1.0 + np.exp(-2.0 * f))
                P1 = 1.0 / (1.0 + np.exp(-2.0 * (f[:, None] + 2.0 * bias)))
                H = np.where(lab[:, None], P1, 1.0 - P1)
                ys.append(None)
            Qs.append(Q)
            Hs.append(H)
    elif kind == "harsh":
        for s, ns in enumerate(sizes):
            logits = rng.normal(size=(ns, p))
            logits[:, s] += 2.0
            Q = np.exp(logits)
            Q /= Q.sum(1, keepdims=True)
            if loss == "squared":
                y = rng.normal(size=ns)
                scale = np.where(np.arange(p) == s, 0.2, 1.0) * rng.uniform(0.5, 1.5, size=p)
                H = y[:, None] + rng.normal(size=(ns, p)) * scale
                ys.append(y)
            else:
                t = np.where(np.arange(p) == s, 2.0, -0.5) + rng.normal(size=(ns, p))
                H = 1.0 / (1.0 + np.exp(-t))
                ys.append(None)
            Qs.append(Q)
            Hs.append(H)
    else:
        raise ValueError(f"kind must be 'coupled' or 'harsh'; got {kind!r}")
    qhat = sum(qhat_partial(Q, p) for Q in Qs)
    return [site_point_set(Q, qhat, H, loss, y=y) for Q, H, y in zip(Qs, Hs, ys)]
