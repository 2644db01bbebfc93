"""A malicious coordinator: only the allowed request types, sent to a real SiteWorker.

Helpers shared by the attack tests.  The victim site holds 60 labelled points with balanced
labels drawn independently of x, so guessing gives 50%; an attack "recovers" a label when it
decodes it from the site's answers (points it could not attack are guessed as 0).
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.boundary import messages as m
from msa_fed.errors import PrivacyError
from msa_fed.site.worker import SiteWorker

N = 60


def predictors(d: int, seed: int = 0):
    """Two public predictors whose probabilities depend on x (so the two labels give different losses)."""
    rng = np.random.default_rng([seed, 99])
    out = []
    for shift in (-1.0, 1.0):
        X = rng.normal(shift, 1.0, size=(400, d))
        y = (X.sum(axis=1) + rng.normal(0, 1.0, 400) > shift * d).astype(int)
        out.append(LogisticRegression().fit(X, y))
    return out


def victim_data(d: int, n: int = N, seed: int = 0):
    rng = np.random.default_rng([seed, d])
    X = rng.normal(size=(n, d))
    y = rng.permutation(np.arange(n) % 2)
    Xu = rng.normal(size=(200, d))
    return X, y, Xu


def victim(d: int, n: int = N, seed: int = 0, **kw) -> tuple[SiteWorker, np.ndarray, np.ndarray]:
    """A site that runs the rules, budgets and DP of its policy, but does not verify domain
    models (these attacks exercise the other layers; tests/privacy/test_verify.py sends crafted
    models to a site that verifies them)."""
    X, y, Xu = victim_data(d, n, seed)
    from dataclasses import replace

    from msa_fed.privacy.policy import SitePolicy

    kw["policy"] = replace(kw.get("policy") or SitePolicy(), verify_domain_models=False)
    return binary_site("victim", X, y, Xu, predictors(d, seed), **kw), X, y


def binary_site(name: str, X, y, Xu, predictors, **kw) -> SiteWorker:
    """Site 0, ``name``, of a binary classification job (classes 0 and 1, cross-entropy): labelled
    points (X, y), published sample Xu, the job's ``predictors``; ``kw`` as SiteWorker takes them."""
    return SiteWorker(
        name,
        0,
        X,
        y,
        Xu,
        predictors=predictors,
        task="classification",
        loss="cross_entropy",
        classes=np.array([0, 1]),
        **kw,
    )


class Coordinator:
    """Sends requests; records refusals (by rule) instead of stopping."""

    def __init__(self, worker: SiteWorker):
        self.w = worker
        self.refusals: dict[str, int] = {}
        self.answers = 0

    def ask(self, method: str, msg):
        try:
            out = getattr(self.w, method)(msg)
        except PrivacyError as exc:
            assert exc.site == self.w.name and exc.rule
            self.refusals[exc.rule] = self.refusals.get(exc.rule, 0) + 1
            return None
        self.answers += 1
        return out


def threshold_spec(thresholds, coefs, intercept0: float) -> m.DomainModelSpec:
    """Q(0|x) = sigmoid(sum_j coefs_j 1[x <= t_j] + intercept0); class 1 has zero weights."""
    t = np.asarray(thresholds, dtype=np.float64)
    theta = np.zeros(2 * (t.size + 1))
    theta[: t.size] = coefs
    theta[t.size] = intercept0
    return m.DomainModelSpec(
        kind="maxent",
        n_sources=2,
        feature_map=("threshold", {"n_thresholds": int(t.size)}, {"thresholds": t}),
        theta=theta,
    )


def standard_spec(mean, scale, w0, b0) -> m.DomainModelSpec:
    """Q(0|x) = sigmoid(w0 . (x - mean) / scale + b0)."""
    d = len(mean)
    theta = np.zeros(2 * (d + 1))
    theta[:d] = w0
    theta[d] = b0
    return m.DomainModelSpec(
        kind="maxent",
        n_sources=2,
        feature_map=("standard", {}, {"mean": np.asarray(mean, float), "scale": np.asarray(scale, float)}),
        theta=theta,
    )


def decode(loss_sum: float, weights: np.ndarray, i: int, X: np.ndarray, h0, known: dict) -> int:
    """The label of point i that best explains sum_j weights_j * (-log h0(x_j, y_j)).

    Points other than i contribute with their known label when already decoded, else their
    mean loss over both labels (their weights are tiny by construction of the attack).
    """
    P = h0.predict_proba(X)
    loss = -np.log(np.maximum(P, 1e-300))  # (n, 2): loss under label 0 / 1
    rest = 0.0
    for j in range(X.shape[0]):
        if j != i:
            rest += weights[j] * (loss[j, known[j]] if j in known else loss[j].mean())
    err = [abs(loss_sum - rest - weights[i] * loss[i, y]) for y in (0, 1)]
    return int(np.argmin(err))


def score(decoded: dict, y: np.ndarray) -> int:
    """Correct labels among the attacker's 60 guesses (undecoded points guessed as 0)."""
    guess = np.zeros(y.size, dtype=int)
    for i, v in decoded.items():
        guess[i] = v
    return int(np.sum(guess == y))
