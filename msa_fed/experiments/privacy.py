"""What differential privacy at the sites costs: DMSA against epsilon (``msa-fed experiment privacy``).

Each site answers with the Gaussian mechanism of its privacy policy (docs/DESIGN.md section 9:
clipped density ratios and losses, noise calibrated with dp-accounting so that one job spends
``epsilon`` at delta = 1e-6) and the coordinator picks z from few noisy evaluations
(:mod:`msa_fed.privacy.solver`).  For epsilon in {0.5, 1, 2, 4, 8, inf} (inf: DP off, the exact
solver) on synthetic, Adult and sentiment, it reports the accuracy on the uniform mixture of
the domains (synthetic, Adult; as a fraction) and the test MSE on the uniform mixture of the
four sentiment domains.  ``by_size``: on the synthetic problem, DP at epsilon = 1 against DP
off as the number of labelled points per site grows.

The sites are the experiments' own (same predictors, data and DMSA options); the domain
classifier is trained once per data set and seed (a checkpoint) and reused for every epsilon,
so the rows differ only by the DC step.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from msa_fed.experiments.report import summarise

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, float("inf"))
TARGETS = ("synthetic", "adult", "sentiment")
PAPER: dict = {}
BY_SIZE_METHODS = ("eps=inf", "eps=1")
SIZES = (100, 300, 1000, 3000)
#: seeds of the by-size sweep (at most this many; each size refits the classifier)
BY_SIZE_SEEDS = 5
QUICK_SIZES = (100, 1000)
DELTA = 1e-6
DP_EVALUATIONS = 30
#: cross-entropy clipped at 5 (a true-label probability below e^-5 = 0.7% counts as 0.7%)
LOSS_CLIP = 5.0
NOTE = (
    "synthetic, adult: accuracy on the uniform mixture of the domains (a fraction); "
    "sentiment: test MSE on the uniform mixture of the four domains; eps=inf: DP off; by size: at most 5 seeds"
)


def method_name(eps: float) -> str:
    return "eps=inf" if not np.isfinite(eps) else f"eps={eps:g}"


@contextmanager
def site_policy(eps: float, loss_clip: float, ratio_clip: float):
    """Every in-process site of the fits inside reads this policy (``$MSA_FED_SITE_POLICY``)."""
    from msa_fed.privacy.policy import POLICY_ENV

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "policy.toml"
        if np.isfinite(eps):
            f.write_text(
                f"[dp]\nenabled = true\nepsilon_per_job = {eps!r}\nepsilon_lifetime = 1e9\n"
                f"delta = {DELTA!r}\ndc_evaluations = {DP_EVALUATIONS}\nloss_clip = {loss_clip!r}\n"
                f"ratio_clip = {ratio_clip!r}\n"
            )
        else:
            f.write_text("")
        old = os.environ.get(POLICY_ENV)
        os.environ[POLICY_ENV] = str(f)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(POLICY_ENV, None)
            else:
                os.environ[POLICY_ENV] = old


def _fits(sites, task, options, seed, metric, loss_clip, epsilons=EPSILONS, runtime="local") -> dict:
    # the sites' clipping: density ratios q_k = Q(k|x) / Qhat(k) at p (Qhat(k) is about 1 / p)
    """{method: metric} for each epsilon, the classifier trained once (checkpoint)."""
    from msa_fed import fit_dmsa

    out = {}
    with tempfile.TemporaryDirectory() as ckpt:
        for eps in sorted(epsilons, key=lambda e: -e):  # inf first: it writes the classifier checkpoint
            with site_policy(eps, loss_clip, float(len(sites))):
                model = fit_dmsa(sites, task, random_state=seed, runtime=runtime, checkpoint_dir=ckpt, **options)
            out[method_name(eps)] = metric(model)
    return {method_name(e): out[method_name(e)] for e in epsilons}


# ------------------------------------------------------------------ the three data sets
def synthetic_seed(seed: int, n: int, n_test: int, epsilons=EPSILONS, runtime="local") -> dict:
    from sklearn.linear_model import LogisticRegression

    from msa_fed.experiments import synthetic as S

    rng = np.random.default_rng([seed, 0])
    predictors = []
    for dom in S.DOMAINS:
        X, y = S.sample(dom, S.N_TRAIN, rng)
        predictors.append(LogisticRegression().fit(X, y))
    test = {dom: S.sample(dom, n_test, rng) for dom in S.DOMAINS}
    sites = S.adaptation_sites(seed, n, predictors)

    def metric(model):
        return float(np.mean([np.mean(model.predict(X) == y) for X, y in test.values()]))

    return _fits(sites, "classification", S.DMSA_OPTIONS, seed, metric, LOSS_CLIP, epsilons, runtime)


def adult_seed(seed: int, data, predictors, epsilons=EPSILONS, runtime="local") -> dict:
    from msa_fed.experiments import adult as A

    test = {"Doc": data.doc_test, "NDoc": ~data.doc_test}
    sites = A.adaptation_sites(data, predictors, seed)

    def metric(model):
        return float(np.mean([np.mean(model.predict(data.X_test[mk]) == data.y_test[mk]) for mk in test.values()]))

    return _fits(sites, "classification", A.DMSA_OPTIONS, seed, metric, LOSS_CLIP, epsilons, runtime)


def sentiment_seed(seed: int, corpus, quick: bool, epsilons=EPSILONS, runtime="local") -> dict:
    from msa_fed.experiments import sentiment as T

    n_train, n_test = (400, 200) if quick else (T.N_TRAIN, T.N_TEST)
    _, split = T.prepare_split(corpus, seed, n_train, n_test)
    predictors = {k: T.make_svr().fit(Xtr, ytr) for k, (Xtr, ytr, _, _) in split.items()}
    sites = T.adaptation_sites(split, predictors)

    def metric(model):
        return float(np.mean([np.mean((model.predict(Xte) - yte) ** 2) for _, _, Xte, yte in split.values()]))

    # ratings 1..5: a squared error is at most 16, so clipping at 16 changes nothing
    return _fits(sites, "regression", T.DMSA_OPTIONS, seed, metric, 16.0, epsilons, runtime)


def run(seeds: int = 10, *, runtime: str = "local", quick: bool = False, plot_dir=None, log=print) -> dict:
    from msa_fed.experiments import adult as A
    from msa_fed.experiments.data import load_adult, load_sentiment

    n_syn, n_test = (300, 2000) if quick else (1000, 20000)
    runs: dict[str, list] = {t: [] for t in TARGETS}
    data = load_adult()
    adult_predictors = A.train_predictors(data)
    corpus = load_sentiment()
    for s in range(seeds):
        runs["synthetic"].append(synthetic_seed(s, n_syn, n_test, runtime=runtime))
        runs["adult"].append(adult_seed(s, data, adult_predictors, runtime=runtime))
        runs["sentiment"].append(sentiment_seed(s, corpus, quick, runtime=runtime))
        log(f"privacy: seed {s + 1}/{seeds} done")
    per_target = {t: summarise([{"x": r} for r in rs])["x"] for t, rs in runs.items()}
    results = {method_name(e): {t: per_target[t][method_name(e)] for t in TARGETS} for e in EPSILONS}
    by_size = {}
    for n in QUICK_SIZES if quick else SIZES:
        rs = [
            synthetic_seed(s, n, n_test, epsilons=(1.0, float("inf")), runtime=runtime)
            for s in range(min(seeds, BY_SIZE_SEEDS))
        ]
        summ = summarise([{"x": r} for r in rs])["x"]
        by_size[str(n)] = {m: {"synthetic": summ[m]} for m in BY_SIZE_METHODS}
        log(f"privacy: synthetic n={n} per site done")
    results["by_size"] = by_size
    if plot_dir is not None:
        plot(results, plot_dir)
    return results


def points_for_one_point_of_accuracy(by_size: dict) -> int | None:
    """The smallest n (labelled points per site) from which DP at epsilon = 1 costs < 0.01 accuracy."""
    ok = [
        int(n) for n, r in by_size.items() if r["eps=inf"]["synthetic"]["mean"] - r["eps=1"]["synthetic"]["mean"] < 0.01
    ]
    sizes = sorted(int(n) for n in by_size)
    for n in sizes:  # from n on, every larger size also passes
        if all(m in ok for m in sizes if m >= n):
            return n
    return None


def plot(results: dict, plot_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    finite = [e for e in EPSILONS if np.isfinite(e)]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, t in zip(axes, TARGETS):
        mean = np.array([results[method_name(e)][t]["mean"] for e in finite])
        std = np.array([results[method_name(e)][t]["std"] for e in finite])
        ax.errorbar(finite, mean, yerr=std, marker="o", capsize=3, label="DP (site-level Gaussian mechanism)")
        ax.axhline(results["eps=inf"][t]["mean"], color="k", ls="--", label="no DP")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("epsilon per job (delta = 1e-6)")
        ax.set_ylabel("test MSE" if t == "sentiment" else "accuracy (uniform mixture)")
        ax.set_title(t)
    axes[0].legend(fontsize=8)
    sizes = sorted(results["by_size"], key=int)
    ax = axes[3]
    for m in BY_SIZE_METHODS:
        ax.errorbar(
            [int(n) for n in sizes],
            [results["by_size"][n][m]["synthetic"]["mean"] for n in sizes],
            yerr=[results["by_size"][n][m]["synthetic"]["std"] for n in sizes],
            marker="o",
            capsize=3,
            label="no DP" if m == "eps=inf" else "DP, epsilon = 1",
        )
    ax.set_xscale("log")
    ax.set_xlabel("labelled points per site")
    ax.set_ylabel("accuracy (uniform mixture)")
    ax.set_title("synthetic: DP cost against n")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = plot_dir / "privacy_epsilon.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
