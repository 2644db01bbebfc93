"""The paper's synthetic experiment (Section 6, Figures 2 and 3).

Two one-dimensional domains:

    D1 = 0.9 N(-20, 8) + 0.1 N(0, 0.1)
    D2 = 0.75 N(3, 0.1) + 0.25 N(5, 0.1) + 0.05 N(0, 0.1)   (weights renormalised: they sum to 1.05)

reading the second parameter of N as a standard deviation.  Labels are
f(x) = -1 on [-0.5, 0.5] and on [3.5, inf), +1 elsewhere.  Per seed, one logistic
regression h_k is trained on 1000 points of each domain and frozen; then for each
adaptation sample size n, DMSA (conditional Maxent domain classifier) and GMSA
(cross-validated KDE) are fitted on n labelled points per domain and every method
is scored on 20000 fresh test points per domain and on their uniform mixture.
``DMSA`` uses the feature map chosen on validation seeds (``DMSA_OPTIONS``);
``DMSA-threshold`` is the paper's threshold-feature Maxent, reported alongside.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.experiments.baselines import UniformCombination
from msa_fed.experiments.report import summarise, uniform_mixtures

COMPONENTS = {
    "D1": ((0.9, -20.0, 8.0), (0.1, 0.0, 0.1)),
    "D2": ((0.75, 3.0, 0.1), (0.25, 5.0, 0.1), (0.05, 0.0, 0.1)),
}
DOMAINS = ("D1", "D2")
TARGETS = ("D1", "D2", "D1-D2")
MIXTURES = {"D1": ("D1",), "D2": ("D2",), "D1-D2": ("D1", "D2")}
SIZES = (50, 100, 200, 500, 1000)
QUICK_SIZES = (100, 1000)
N_TRAIN = 1000  # points per domain for the frozen h_k
N_TEST = 20000  # test points per domain
#: DMSA's domain-classifier options, chosen by their mean accuracy on validation seeds
#: 100-104 (fresh draws, disjoint from the evaluation seeds 0..N-1): conditional Maxent on
#: random Fourier features of a Gaussian kernel (gamma=10 on the standardised input).
DMSA_OPTIONS = {"features": ("rff", {"gamma": 10.0, "n_components": 1000})}
#: The paper's (and the issue's) variant, kept as its own row: Maxent on threshold features.
THRESHOLD_OPTIONS = {"features": "threshold"}
# Read off the paper's Figure 3 (accuracy at 1000 samples, approximately): DMSA is close to
# 100% on both domains; the figure gives no exact values, so only DMSA's claim is listed.
PAPER = {"DMSA-threshold": {"D1": 1.0, "D2": 1.0, "D1-D2": 1.0}}
NOTE = (
    "N(m, s): s read as a standard deviation; D2's mixture weights 0.75/0.25/0.05 "
    "renormalised to sum to 1. Paper row: '~100%' as stated in the text (Figure 3 has no table).\n"
    "DMSA: Maxent on random Fourier features (gamma=10), chosen on validation seeds; "
    "DMSA-threshold: the paper's threshold features."
)


def _weights(domain: str) -> np.ndarray:
    w = np.array([c[0] for c in COMPONENTS[domain]])
    return w / w.sum()


def sample(domain: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n points of a domain: X of shape (n, 1) and labels y in {-1, +1} of shape (n,)."""
    comps = COMPONENTS[domain]
    which = rng.choice(len(comps), size=n, p=_weights(domain))
    means = np.array([c[1] for c in comps])[which]
    stds = np.array([c[2] for c in comps])[which]
    x = rng.normal(means, stds)
    return x[:, None], label(x)


def label(x: np.ndarray) -> np.ndarray:
    """f(x) = -1 on [-0.5, 0.5] and [3.5, inf), +1 elsewhere."""
    x = np.asarray(x).ravel()
    return np.where((np.abs(x) <= 0.5) | (x >= 3.5), -1, 1)


def density(domain: str, x: np.ndarray) -> np.ndarray:
    """True density of a domain at x (shape (n,))."""
    x = np.asarray(x, dtype=float)
    out = np.zeros_like(x)
    for w, (_, m, s) in zip(_weights(domain), COMPONENTS[domain]):
        out += w * np.exp(-0.5 * ((x - m) / s) ** 2) / (s * np.sqrt(2 * np.pi))
    return out


def _accuracy(model, X, y) -> float:
    return float(np.mean(model.predict(X) == y))


def adaptation_sites(seed: int, n: int, predictors) -> list:
    """Each domain's site: n labelled points (for z) and, as its published unlabelled sample, n
    other points of the domain (a site never publishes its labelled inputs: an unlabelled point
    equal to a labelled one in the published float32 form is dropped, as `site publish
    --drop-shared` drops it; D2's narrow components make a few such pairs at n = 1000)."""
    from msa_fed import SiteData
    from msa_fed.privacy.consortium import drop_shared

    arng = np.random.default_rng([seed, 1, n])
    urng = np.random.default_rng([seed, 2, n])
    sites = []
    for dom, h in zip(DOMAINS, predictors):
        X, y = sample(dom, n, arng)
        Xu, _ = drop_shared(X, sample(dom, n, urng)[0])
        sites.append(SiteData(dom, X, y, Xu, h))
    return sites


def run_seed(
    seed: int,
    sizes=SIZES,
    *,
    runtime: str = "local",
    n_test: int = N_TEST,
    dmsa_options: dict | None = None,
    with_threshold: bool = True,
) -> dict:
    """One seed: ``{n: {method: {target: accuracy}}}`` for every adaptation size n."""
    from msa_fed import fit_dmsa, fit_gmsa

    rng = np.random.default_rng([seed, 0])
    predictors = []
    for dom in DOMAINS:
        X, y = sample(dom, N_TRAIN, rng)
        predictors.append(LogisticRegression().fit(X, y))
    test = {dom: sample(dom, n_test, rng) for dom in DOMAINS}
    unif = UniformCombination(predictors, "classification")
    fixed = {f"h_{d}": h for d, h in zip(DOMAINS, predictors)}
    fixed["unif"] = unif
    fixed_acc = {m: {d: _accuracy(h, *test[d]) for d in DOMAINS} for m, h in fixed.items()}
    out = {}
    for n in sizes:
        sites = adaptation_sites(seed, n, predictors)
        models = {
            "GMSA": fit_gmsa(sites, "classification", random_state=seed, runtime=runtime),
            "DMSA": fit_dmsa(
                sites, "classification", random_state=seed, runtime=runtime, **{**DMSA_OPTIONS, **(dmsa_options or {})}
            ),
        }
        if with_threshold:
            models["DMSA-threshold"] = fit_dmsa(
                sites, "classification", random_state=seed, runtime=runtime, **THRESHOLD_OPTIONS
            )
        res = {m: uniform_mixtures(acc, MIXTURES) for m, acc in fixed_acc.items()}
        for m, model in models.items():
            res[m] = uniform_mixtures({d: _accuracy(model, *test[d]) for d in DOMAINS}, MIXTURES)
        out[n] = res
    return out


def run(seeds: int = 10, *, runtime: str = "local", quick: bool = False, plot_dir=None, log=print) -> dict:
    """All seeds; returns results for the largest size plus ``by_size`` (keys are sizes as str)."""
    sizes = QUICK_SIZES if quick else SIZES
    n_test = 5000 if quick else N_TEST
    per_seed = []
    for s in range(seeds):
        per_seed.append(run_seed(s, sizes, runtime=runtime, n_test=n_test))
        log(f"synthetic: seed {s + 1}/{seeds} done")
    by_size = {str(n): summarise([r[n] for r in per_seed]) for n in sizes}
    results = dict(by_size[str(max(sizes))])
    results["by_size"] = by_size
    if plot_dir is not None:
        plot(results, plot_dir, seed=0)
    return results


def plot(results: dict, plot_dir, seed: int = 0) -> list[Path]:
    """Figure 2 (true densities vs GMSA's 5-fold CV KDE, 1000 points) and Figure 3 (accuracy vs n); returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from msa_fed.core.density import gaussian_kde_log_density, select_bandwidth

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    kdes = {}
    for i, dom in enumerate(DOMAINS):
        X, _ = sample(dom, 1000, np.random.default_rng([seed, 2, i]))
        # the same 5-fold CV bandwidth search as GMSA's density model
        kdes[dom] = (X, select_bandwidth(X, random_state=seed))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (lo, hi) in zip(axes, ((-45, 10), (-1.5, 1.5))):
        grid = np.linspace(lo, hi, 2000)
        for dom, color in zip(DOMAINS, ("tab:blue", "tab:orange")):
            ax.plot(grid, density(dom, grid), color=color, label=f"{dom} true")
            sample_x, bw = kdes[dom]
            ax.plot(
                grid,
                np.exp(gaussian_kde_log_density(grid[:, None], sample_x, bw)[:, 0]),
                "--",
                color=color,
                label=f"{dom} KDE (bandwidth {bw:.2g})",
            )
        for a, b in ((-0.5, 0.5), (3.5, hi)):
            if b > lo and a < hi:
                ax.axvspan(max(a, lo), min(b, hi), color="green", alpha=0.1)
        ax.set_xlabel("x")
        ax.set_ylabel("density")
        ax.legend(fontsize=7)
    axes[0].set_title("True densities and KDE estimates (1000 samples)")
    axes[1].set_title("Zoom at x = 0 (label -1 in green)")
    fig.tight_layout()
    f2 = plot_dir / "synthetic_fig2_densities.png"
    fig.savefig(f2, dpi=120)
    plt.close(fig)

    by_size = results["by_size"]
    sizes = sorted(int(n) for n in by_size)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, target in zip(axes, DOMAINS):
        for method in ("GMSA", "DMSA", "DMSA-threshold"):
            m = [by_size[str(n)][method][target]["mean"] for n in sizes]
            s = [by_size[str(n)][method][target]["std"] for n in sizes]
            ax.errorbar(sizes, m, yerr=s, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        ax.set_xlabel("adaptation samples per domain")
        ax.set_ylabel(f"accuracy on {target}")
        ax.legend()
    fig.tight_layout()
    f3 = plot_dir / "synthetic_fig3_accuracy.png"
    fig.savefig(f3, dpi=120)
    plt.close(fig)
    return [f2, f3]
