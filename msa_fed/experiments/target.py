"""Target checks on known truth: mixtures of the paper's domains with lambda drawn at random.

For a fitted combined model and each draw: lambda ~ Dirichlet(1, ..., 1), a target sample of
``n_target`` points (counts ~ Multinomial(n_target, lambda)), then

- |lambda-hat - lambda|_1 for EM and BBSE (:mod:`msa_fed.core.target`);
- whether the target's true loss sum_k lambda_k L_k^true (L_k^true: the model's log loss on a
  pool of domain k) lies in the predicted loss's interval; and whether it does once the
  interval also counts the pool's own sampling error (a pool of 181 rows, Adult's Doc test
  rows, is itself a noisy sample of its domain);
- the fraction of the (in-support) target points flagged at alpha.

And the rate at which points of a domain left out of the federation are flagged.

Cases:

- ``synthetic``: the paper's two 1-D domains (:mod:`msa_fed.experiments.synthetic`), n labelled
  and n published points per site, the paper's DMSA options; pools of fresh points; the
  left-out domain is ``D3`` = N(12, 1), a third domain that is not in the paper.
- ``adult``: the paper's Doc / NDoc domains (:mod:`msa_fed.experiments.adult`), each site's
  predictor trained on rows disjoint from its labelled and published samples; target points
  drawn with replacement from each domain's test rows (the pool, whose loss is exact).
- ``demo``: the built-in demo federation (three overlapping Gaussian sites); left out: a
  fourth blob.
- ``adult_groups``: Adult split by education (Doctorate, Masters, Bachelors, HS-grad), one
  predictor per group, each group left out of a federation of the other three in turn.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from msa_fed.artifacts.target_check import loss_standard_errors
from msa_fed.core.target import predicted_loss

Sampler = Callable[[int, np.random.Generator], tuple[np.ndarray, np.ndarray]]
ALPHA = 0.01


def log_loss(model, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-point log loss of the combined model's probabilities of the true labels."""
    P = model.predict_proba(X)
    idx = np.searchsorted(model.classes_, y)
    return -np.log(np.clip(P[np.arange(y.size), idx], 1e-300, None))


def pool_loss(model, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The model's mean log loss on a pool and that mean's standard error (the pool is itself a
    sample of its domain)."""
    loss = log_loss(model, X, y)
    return float(loss.mean()), float(loss.std() / np.sqrt(loss.size))


def pool_sampler(X: np.ndarray, y: np.ndarray) -> Sampler:
    def draw(n: int, rng: np.random.Generator):
        i = rng.integers(0, X.shape[0], n)
        return X[i], y[i]

    return draw


@functools.lru_cache(maxsize=1)
def _adult():
    from msa_fed.experiments.data import load_adult

    return load_adult()


def synthetic_case(seed: int = 0, n: int = 1000, n_pool: int = 20000):
    """(model, {domain: sampler}, {domain: (pool loss, its standard error)}, {left-out name: X})."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed import fit_dmsa
    from msa_fed.experiments import synthetic as syn

    rng = np.random.default_rng([seed, 0])
    predictors = [LogisticRegression().fit(*syn.sample(d, syn.N_TRAIN, rng)) for d in syn.DOMAINS]
    model = fit_dmsa(syn.adaptation_sites(seed, n, predictors), "classification", random_state=seed, **syn.DMSA_OPTIONS)
    prng = np.random.default_rng([seed, 32])
    pools = {d: syn.sample(d, n_pool, prng) for d in syn.DOMAINS}
    losses = {d: pool_loss(model, *pools[d]) for d in syn.DOMAINS}
    samplers = {d: (lambda m, r, d=d: syn.sample(d, m, r)) for d in syn.DOMAINS}
    left_out = {"D3 = N(12, 1)": prng.normal(12.0, 1.0, (2000, 1))}
    return model, samplers, losses, left_out


def adult_case(seed: int = 0):
    """The paper's Doc / NDoc domains; pools are the domains' test rows.  Each domain's training
    rows are split three ways: the predictor h_k, the labelled sample, the published sample
    (Doc: 413 rows, a third each; NDoc: 400 labelled, 400 published, the rest for h_NDoc), so
    that each site's loss is measured on rows its predictor never saw; published rows equal to a
    labelled one are left out (Doc keeps about 50 of its 137)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    from msa_fed import SiteData, fit_dmsa
    from msa_fed.experiments import adult
    from msa_fed.privacy.consortium import drop_shared

    data = _adult()
    rng = np.random.default_rng([seed, 6])
    sites = []
    for dom, mask in (("Doc", data.doc_train), ("NDoc", ~data.doc_train)):
        idx = rng.permutation(np.flatnonzero(mask))
        m = min(adult.N_ADAPT, idx.size // 3)
        lab, pub, rest = idx[:m], idx[m : 2 * m], idx[2 * m :]
        h = make_pipeline(adult.onehot_encoder(data.categories), LogisticRegression(max_iter=2000))
        h.fit(data.X_train[rest], data.y_train[rest])
        Xu, _ = drop_shared(data.X_train[lab], data.X_train[pub])  # rows equal to a labelled one stay home
        sites.append(SiteData(dom, data.X_train[lab], data.y_train[lab], Xu, h))
    model = fit_dmsa(sites, "classification", random_state=seed, **adult.DMSA_OPTIONS)
    masks = {"Doc": data.doc_test, "NDoc": ~data.doc_test}
    pools = {d: (data.X_test[m], data.y_test[m]) for d, m in masks.items()}
    losses = {d: pool_loss(model, *pools[d]) for d in adult.DOMAINS}
    return model, {d: pool_sampler(*pools[d]) for d in adult.DOMAINS}, losses, {}


def demo_case(seed: int = 0, n_pool: int = 20000):
    """The built-in demo federation (three overlapping 2-D Gaussian sites), 400 labelled and
    1000 published points per site; the left-out domain is a fourth blob at (0, -2)."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed import SiteData, fit_dmsa
    from msa_fed.experiments import demo_data

    fed = demo_data.make_federation(random_state=seed)
    sites = [
        SiteData(
            n,
            fed[n]["X_labeled"],
            fed[n]["y_labeled"],
            fed[n]["X_unlabeled"],
            LogisticRegression().fit(fed[n]["X_train"], fed[n]["y_train"]),
        )
        for n in demo_data.SITES
    ]
    model = fit_dmsa(sites, "classification", random_state=seed)
    prng = np.random.default_rng([seed, 34])
    pools = {n: demo_data.sample(n, n_pool, prng) for n in demo_data.SITES}
    losses = {n: pool_loss(model, *pools[n]) for n in demo_data.SITES}
    samplers = {n: (lambda m, r, n=n: demo_data.sample(n, m, r)) for n in demo_data.SITES}
    return model, samplers, losses, {"south blob N((0, -2), I)": prng.normal((0.0, -2.0), 1.0, (2000, 2))}


ADULT_GROUPS = ("Doctorate", "Masters", "Bachelors", "HS-grad")


def adult_left_out(left_out: str, seed: int = 0, n_adapt: int = 400):
    """(model of the other education groups, the left-out group's test rows, a pooled test
    sample of the groups in the federation)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    from msa_fed import SiteData, fit_dmsa
    from msa_fed.experiments import adult
    from msa_fed.experiments.data import ADULT_CATEGORICAL
    from msa_fed.privacy.consortium import drop_shared

    data = _adult()
    col = ADULT_CATEGORICAL.index("education")
    code = {g: float(data.categories[col].index(g)) for g in ADULT_GROUPS}
    rng = np.random.default_rng([seed, 5])
    sites, inside = [], []
    for g in ADULT_GROUPS:
        if g == left_out:
            continue
        pool = np.flatnonzero(data.X_train[:, col] == code[g])
        h = make_pipeline(adult.onehot_encoder(data.categories), LogisticRegression(max_iter=2000))
        h.fit(data.X_train[pool], data.y_train[pool])
        m = min(n_adapt, pool.size // 2)
        idx = rng.permutation(pool)
        lab, pub = idx[:m], idx[m : 2 * m]
        Xu, _ = drop_shared(data.X_train[lab], data.X_train[pub])
        sites.append(SiteData(g, data.X_train[lab], data.y_train[lab], Xu, h))
        inside.append(data.X_test[data.X_test[:, col] == code[g]])
    model = fit_dmsa(sites, "classification", random_state=seed, **adult.DMSA_OPTIONS)
    return model, data.X_test[data.X_test[:, col] == code[left_out]], np.vstack(inside)


def run_draws(
    model, samplers: dict, losses: dict, *, draws: int = 10, n_target: int = 2000, seed: int = 0, n_boot: int = 200
) -> dict:
    """Both estimators over ``draws`` random mixtures; per-draw rows and the summary."""
    names = list(model.site_names)
    rng = np.random.default_rng([seed, 33])
    L_true = np.array([losses[s][0] for s in names])
    pool_se = np.array([losses[s][1] for s in names])
    rows = []
    for _ in range(draws):
        lam = rng.dirichlet(np.ones(len(names)))
        counts = rng.multinomial(n_target, lam)
        X = np.vstack([samplers[s](c, rng)[0] for s, c in zip(names, counts) if c > 0])
        # the pools are samples of their domains too: 1.96 standard errors of lam . L_pool
        slack = 1.96 * float(np.sqrt(np.sum((lam * pool_se) ** 2)))
        row: dict = {"lambda": lam.tolist(), "true_loss": float(lam @ L_true), "pool_slack": slack}
        for method in ("em", "bbse"):
            t = time.perf_counter()
            est = model.estimate_mixture(X, method=method, n_boot=n_boot, random_state=seed).estimate
            loss = predicted_loss(est, model.domain_losses, loss_standard_errors(model)[0], random_state=seed)
            row[method] = {
                "lambda_hat": est.lam.tolist(),
                "l1": float(np.abs(est.lam - lam).sum()),
                "loss": loss.loss,
                "low": loss.low,
                "high": loss.high,
                "covered": bool(loss.low <= row["true_loss"] <= loss.high),
                "covered_with_pool_error": bool(
                    loss.loss - np.hypot(loss.loss - loss.low, slack)
                    <= row["true_loss"]
                    <= loss.loss + np.hypot(loss.high - loss.loss, slack)
                ),
                "seconds": time.perf_counter() - t,
            }
        t = time.perf_counter()
        row["flagged"] = flagged_rate(model, X)
        row["support_seconds"] = time.perf_counter() - t
        rows.append(row)
    return {"rows": rows, "summary": summarize(rows), "draws": draws, "n_target": n_target}


def run_independent(case: Callable, *, draws: int = 10, n_target: int = 2000, seed: int = 0, n_boot: int = 200) -> dict:
    """``draws`` independent trials: trial i fits its own model from ``case(seed + i)`` (fresh
    labelled and published samples at the sites) and draws one mixture.  The draws of
    :func:`run_draws` share one model, so one site's unlucky labelled sample misses (or covers)
    every draw that leans on that site together: their count is not a count of independent
    trials."""
    rows = []
    for i in range(draws):
        model, samplers, losses, _ = case(seed + i)
        rows.extend(
            run_draws(model, samplers, losses, draws=1, n_target=n_target, seed=seed + i, n_boot=n_boot)["rows"]
        )
    return {"rows": rows, "summary": summarize(rows), "draws": draws, "n_target": n_target, "independent": True}


def summarize(rows: list[dict]) -> dict:
    """Both estimators' mean L1, coverage counts and interval widths; the support's flag rates."""
    summary: dict[str, Any] = {
        m: {
            "mean_l1": float(np.mean([r[m]["l1"] for r in rows])),
            "covered": int(sum(r[m]["covered"] for r in rows)),
            "covered_with_pool_error": int(sum(r[m]["covered_with_pool_error"] for r in rows)),
            "mean_width": float(np.mean([r[m]["high"] - r[m]["low"] for r in rows])),
            "median_seconds": float(np.median([r[m]["seconds"] for r in rows])),
        }
        for m in ("em", "bbse")
    }
    summary["support_median_seconds"] = float(np.median([r["support_seconds"] for r in rows]))
    summary["flagged_in_support"] = float(np.mean([r["flagged"] for r in rows]))
    summary["flagged_in_support_max"] = float(np.max([r["flagged"] for r in rows]))
    return summary


def flagged_rate(model, X: np.ndarray, alpha: float = ALPHA) -> float:
    """Fraction of the rows of X whose support p-value is <= alpha."""
    return float(np.mean(model.support(X).pvalue <= alpha))
