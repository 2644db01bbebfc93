"""The in-process public API: ``SiteData``, ``fit_dmsa``, ``fit_gmsa``.

    >>> model = msa_fed.fit_dmsa(sites, task="classification")
    >>> model.z, model.gamma, model.predict(X)

``runtime="local"`` runs the sites as objects in this process; ``runtime="ray"`` runs each
site as a Ray actor (attaching to ``RAY_ADDRESS`` if set, else starting a local Ray) and gives
the same model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from msa_fed.core.domain_classifier import ClassifierConfig
from msa_fed.errors import ConfigError
from msa_fed.artifacts.model import CombinedModel
from msa_fed.runtime.coordinator import Coordinator, RunConfig
from msa_fed.runtime.messages import Recorder


def _as_2d(X, name: str) -> np.ndarray:
    try:
        X = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric array") from None
    if X.ndim == 1:
        X = X[:, None]
    if X.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n_samples, n_features); got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{name} contains NaN or inf")
    return X


@dataclass
class SiteData:
    """One source domain as seen in-process.

    name : the site's name.
    X_labeled : (n_k, d) labelled inputs;  y_labeled : (n_k,) labels or targets.
    X_unlabeled : (m_k, d) unlabelled inputs (train the domain classifier).
    predictor : the site's frozen h_k: ``predict`` (regression) or ``predict_proba`` and
        ``classes_`` (classification).
    """

    name: str
    X_labeled: Any
    y_labeled: Any
    X_unlabeled: Any
    predictor: Any

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"site name must be a non-empty string; got {self.name!r}")
        self.X_labeled = _as_2d(self.X_labeled, f"site {self.name!r}: X_labeled")
        self.X_unlabeled = _as_2d(self.X_unlabeled, f"site {self.name!r}: X_unlabeled")
        y = np.asarray(self.y_labeled)
        if y.ndim != 1 or y.shape[0] != self.X_labeled.shape[0]:
            raise ValueError(f"site {self.name!r}: y_labeled must have shape ({self.X_labeled.shape[0]},); "
                             f"got {y.shape}")
        if y.dtype.kind in "fc" and not np.all(np.isfinite(y)):
            raise ValueError(f"site {self.name!r}: y_labeled contains NaN or inf")
        self.y_labeled = y
        if self.X_unlabeled.shape[0] == 0:
            raise ValueError(f"site {self.name!r} has no unlabelled data (X_unlabeled is empty)")
        if self.X_labeled.shape[0] == 0:
            raise ValueError(f"site {self.name!r} has no labelled data (X_labeled is empty)")
        if self.X_unlabeled.shape[1] != self.X_labeled.shape[1]:
            raise ValueError(f"site {self.name!r}: X_unlabeled has {self.X_unlabeled.shape[1]} features but "
                             f"X_labeled has {self.X_labeled.shape[1]}")


def _check_sites(sites: Sequence[SiteData], task: str):
    if task not in ("classification", "regression"):
        raise ValueError(f"task must be 'classification' or 'regression'; got {task!r}")
    sites = list(sites)
    if len(sites) < 2:
        raise ValueError(f"multiple-source adaptation needs at least two sites; got {len(sites)}")
    for s in sites:
        if not isinstance(s, SiteData):
            raise TypeError(f"sites must be SiteData objects; got {type(s).__name__}")
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ValueError(f"site names must be unique; got {names}")
    widths = {s.name: s.X_labeled.shape[1] for s in sites}
    if len(set(widths.values())) != 1:
        raise ValueError(f"feature widths differ between sites: {widths}")
    for s in sites:
        h = s.predictor
        if task == "regression" and not callable(getattr(h, "predict", None)):
            raise ValueError(f"site {s.name!r}: a regression predictor needs a predict method")
        if task == "classification" and not (callable(getattr(h, "predict_proba", None)) and hasattr(h, "classes_")):
            raise ValueError(f"site {s.name!r}: a classification predictor needs predict_proba and classes_")
    return sites


def _classes_union(sites, task):
    if task != "classification":
        return None
    return np.unique(np.concatenate([np.asarray(s.predictor.classes_) for s in sites]))


def make_backend(sites: list[SiteData], task: str, runtime: str, min_points: int, ray_options: dict | None):
    predictors = [s.predictor for s in sites]
    classes = _classes_union(sites, task)
    loss = "cross_entropy" if task == "classification" else "squared"
    kwargs = [dict(name=s.name, index=k, X_labeled=s.X_labeled, y_labeled=s.y_labeled, X_unlabeled=s.X_unlabeled,
                   predictors=predictors, task=task, loss=loss, classes=classes, min_points=min_points)
              for k, s in enumerate(sites)]
    if runtime == "local":
        from msa_fed.runtime.local import LocalSites
        return LocalSites(kwargs)
    if runtime == "ray":
        import inspect

        from msa_fed.runtime.ray_sites import RaySites
        allowed = set(inspect.signature(RaySites).parameters) - {"site_kwargs", "worker_cls"}
        unknown = sorted(set(ray_options or {}) - allowed)
        if unknown:
            raise ValueError(f"ray_options: unknown key(s) {unknown}; expected some of {sorted(allowed)}")
        return RaySites(kwargs, **(ray_options or {}))
    raise ValueError(f"runtime must be 'local' or 'ray'; got {runtime!r}")


def _fit(sites, task, method, *, features, mu, eta, random_state, runtime, min_points, verbose,
         classifier_options, solver_options, bandwidth, checkpoint_dir, recorder, ray_options,
         solver_callback) -> CombinedModel:
    sites = _check_sites(sites, task)
    try:
        ccfg = replace(ClassifierConfig(mu=mu), **(classifier_options or {}))
    except TypeError as exc:
        raise ValueError(f"classifier_options: {exc}") from None
    config = RunConfig(task=task, method=method, features=features, eta=eta, random_state=random_state,
                       min_points=min_points, classifier=ccfg, solver=dict(solver_options or {}),
                       bandwidth=bandwidth, checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
                       verbose=verbose)
    try:
        config.validate()
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    backend = make_backend(sites, task, runtime, min_points, ray_options)
    with Coordinator(backend, [s.predictor for s in sites], config, recorder=recorder,
                     solver_callback=solver_callback) as coordinator:
        return coordinator.fit()


def fit_dmsa(sites: Sequence[SiteData], task: str = "classification", *, features="standard",
             mu: float = 1e-3, eta: float = 1e-2, random_state: int = 0, runtime: str = "local",
             min_points: int = 20, verbose: bool = False, classifier_options: dict | None = None,
             solver_options: dict | None = None, bandwidth=None, checkpoint_dir=None,
             recorder: Recorder | None = None, ray_options: dict | None = None,
             solver_callback: Callable | None = None) -> CombinedModel:
    """Discriminative MSA: conditional-Maxent domain classifier + DC solve for z.

    features : domain-classifier feature map: "standard", "onehot", "threshold", "rff",
        ("rff", {"n_components": 1000, "gamma": 0.1}) or a scikit-learn transformer.
    mu : L2 weight of the classifier (paper eq. LogisticRegression).
    eta : smoothing added to the combination's denominator (>= 0).
    runtime : "local" (in-process sites) or "ray" (one actor per site).
    min_points : a site refuses to aggregate over fewer points (privacy contract).
    classifier_options : fields of :class:`msa_fed.core.domain_classifier.ClassifierConfig`.
    solver_options : keyword arguments of :func:`msa_fed.core.dc_solver.solve_dc`
        (method, tol, max_iter, n_restarts, bound).
    checkpoint_dir : write the DC state after every iteration; a later run with the same
        directory and data resumes from it.
    recorder : a :class:`msa_fed.runtime.messages.Recorder` capturing every boundary message.
    ray_options : for runtime="ray", keyword arguments of
        :class:`msa_fed.runtime.ray_sites.RaySites`: ``address`` (else ``RAY_ADDRESS``, else a new
        local Ray), ``num_cpus`` per site actor, ``max_restarts``, ``retry_timeout_s``,
        ``start_timeout_s``, ``workers_per_site`` (actors per site for classifier training),
        ``data_channel`` ("tls" default: the per-round calls go over a direct mutual-TLS
        connection to each site actor; "plain": loopback only; "off": through Ray) and
        ``init_kwargs`` (of ``ray.init``).  An unknown key is a ValueError.
    """
    return _fit(sites, task, "dmsa", features=features, mu=mu, eta=eta, random_state=random_state,
                runtime=runtime, min_points=min_points, verbose=verbose, classifier_options=classifier_options,
                solver_options=solver_options, bandwidth=bandwidth, checkpoint_dir=checkpoint_dir,
                recorder=recorder, ray_options=ray_options, solver_callback=solver_callback)


def fit_gmsa(sites: Sequence[SiteData], task: str = "classification", *, features=None,
             mu: float = 1e-3, eta: float = 1e-2, random_state: int = 0, runtime: str = "local",
             min_points: int = 20, verbose: bool = False, classifier_options: dict | None = None,
             solver_options: dict | None = None, bandwidth=None, checkpoint_dir=None,
             recorder: Recorder | None = None, ray_options: dict | None = None,
             solver_callback: Callable | None = None) -> CombinedModel:
    """Generative MSA (the baseline): per-domain Gaussian KDEs in place of the classifier.

    Same signature as :func:`fit_dmsa`; ``bandwidth`` (None: 5-fold CV per domain) and
    ``features`` (None: raw inputs) apply to the KDEs, ``mu`` is unused.
    """
    return _fit(sites, task, "gmsa", features=features, mu=mu, eta=eta, random_state=random_state,
                runtime=runtime, min_points=min_points, verbose=verbose, classifier_options=classifier_options,
                solver_options=solver_options, bandwidth=bandwidth, checkpoint_dir=checkpoint_dir,
                recorder=recorder, ray_options=ray_options, solver_callback=solver_callback)
