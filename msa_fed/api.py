"""The in-process public API: ``SiteData``, ``fit_dmsa``, ``fit_gmsa``.

    >>> model = msa_fed.fit_dmsa(sites, task="classification")
    >>> model.z, model.gamma, model.predict(X)

``runtime="local"`` runs the sites as objects in this process; ``runtime="ray"`` runs each
site as a Ray actor (attaching to ``RAY_ADDRESS`` if set, else starting a local Ray) and gives
the same model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from msa_fed.artifacts.model import CombinedModel
from msa_fed.core.combination import class_union
from msa_fed.errors import require_coordinator
from msa_fed.runtime import topology
from msa_fed.runtime.config import FitConfig, api_signature, from_keywords
from msa_fed.runtime.coordinator import Coordinator


def _as_2d(X, name: str) -> np.ndarray:
    raw = np.asarray(X)
    if raw.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a numeric array (bool, int or float); got dtype {raw.dtype}")
    X = raw.astype(np.float64, copy=False)
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
    X_unlabeled : (m_k, d) unlabelled inputs (train the domain classifier; published): no row may
        be a labelled input too (ValueError naming how many are).
    predictor : the site's frozen h_k: ``predict`` (regression) or ``predict_proba`` and
        ``classes_`` (classification).
    policy : the site's :class:`msa_fed.privacy.policy.SitePolicy` (None: the defaults, or the
        file named by ``$MSA_FED_SITE_POLICY``).  In-process the caller is the site itself, so it
        may set its own policy; a Ray site actor only lets it tighten its node's policy.
    """

    name: str
    X_labeled: Any
    y_labeled: Any
    X_unlabeled: Any
    predictor: Any
    policy: Any = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"site name must be a non-empty string; got {self.name!r}")
        if self.policy is not None:
            from msa_fed.privacy.policy import SitePolicy

            if not isinstance(self.policy, SitePolicy):
                raise TypeError(
                    f"site {self.name!r}: policy must be a SitePolicy or None; got {type(self.policy).__name__}"
                )
        self.X_labeled = _as_2d(self.X_labeled, f"site {self.name!r}: X_labeled")
        self.X_unlabeled = _as_2d(self.X_unlabeled, f"site {self.name!r}: X_unlabeled")
        y = np.asarray(self.y_labeled)
        if y.ndim != 1 or y.shape[0] != self.X_labeled.shape[0]:
            raise ValueError(
                f"site {self.name!r}: y_labeled must have shape ({self.X_labeled.shape[0]},); got {y.shape}"
            )
        if y.dtype.kind in "fc" and not np.all(np.isfinite(y)):
            raise ValueError(f"site {self.name!r}: y_labeled contains NaN or inf")
        self.y_labeled = y
        if self.X_unlabeled.shape[0] == 0:
            raise ValueError(f"site {self.name!r} has no unlabelled data (X_unlabeled is empty)")
        if self.X_labeled.shape[0] == 0:
            raise ValueError(f"site {self.name!r} has no labelled data (X_labeled is empty)")
        if self.X_unlabeled.shape[1] != self.X_labeled.shape[1]:
            raise ValueError(
                f"site {self.name!r}: X_unlabeled has {self.X_unlabeled.shape[1]} features but "
                f"X_labeled has {self.X_labeled.shape[1]}"
            )
        from msa_fed.privacy.consortium import shared_rows

        # the unlabelled sample is published (it trains the domain classifier at the coordinator):
        # with the labelled inputs known, a site's answers are linear in its labels
        shared = shared_rows(self.X_labeled, self.X_unlabeled)
        if shared:
            raise ValueError(
                f"site {self.name!r}: {shared} of the {self.X_unlabeled.shape[0]} rows of X_unlabeled are "
                "labelled inputs too; a site never publishes its labelled inputs: drop them from X_unlabeled "
                "(msa_fed.privacy.consortium.shared_mask(X_labeled, X_unlabeled) marks them)"
            )


def _check_sites(sites: Sequence[SiteData], task: str) -> list[SiteData]:
    if isinstance(sites, (str, bytes, SiteData)) or not isinstance(sites, Sequence):
        raise TypeError(f"sites must be a list of SiteData; got {type(sites).__name__}")
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


def build_config(method: str, task: str = "classification", **options: Any) -> FitConfig:
    """The :class:`msa_fed.runtime.config.FitConfig` of :func:`fit_dmsa` / :func:`fit_gmsa`'s
    keyword arguments: every value checked (TypeError / ValueError naming the argument)."""
    try:
        _SIGNATURES[method].bind(None, task, **options)
    except TypeError as exc:  # an unknown keyword, in Python's words
        raise TypeError(f"fit_{method}() {exc}") from None
    return from_keywords(method, {"task": task, **options})


def make_backend(sites: list[SiteData], config: FitConfig):
    """The sites' backend for ``config.runtime`` (:func:`msa_fed.runtime.topology.make_backend`):
    in-process workers or Ray actors."""
    from msa_fed.site.admission import host_content

    predictors = [s.predictor for s in sites]
    classes = class_union(h.classes_ for h in predictors) if config.task == "classification" else None
    # the job's content: each site checks the published samples it is handed against its pins
    content = host_content(
        "fit",
        [s.name for s in sites],
        [s.X_unlabeled for s in sites],
        task=config.task,
        loss=config.loss,
        min_points=config.min_points,
    )
    kwargs = [
        dict(
            name=s.name,
            index=k,
            X_labeled=s.X_labeled,
            y_labeled=s.y_labeled,
            X_unlabeled=s.X_unlabeled,
            predictors=predictors,
            task=config.task,
            loss=config.loss,
            classes=classes,
            min_points=config.min_points,
            policy=s.policy,
            sites=[t.name for t in sites],
            content=content,
        )
        for k, s in enumerate(sites)
    ]
    return topology.make_backend(config.runtime, config, kwargs)


log = logging.getLogger(__name__)

#: whether this process has said that Ray's start-up dominated a fit (it says so once)
_RAY_HINT = {"given": False}


def ray_startup_hint(startup_s: float, fit_s: float) -> str | None:
    """The line for a ``runtime="ray"`` fit whose start-up (Ray, the site actors) took longer
    than the fit itself, or None."""
    if startup_s <= fit_s:
        return None
    return f"Ray start-up {startup_s:.1f} s, fit {fit_s:.2f} s: runtime='local' is faster for a problem this size"


def _fit(sites, task, method, *, recorder=None, solver_callback=None, **options) -> CombinedModel:
    require_coordinator(f"fit_{method}")  # one line naming the extra, not an import error deep inside
    config = build_config(method, task, **options)
    if config.runtime == "ray":
        require_coordinator(f"fit_{method}(runtime='ray')", ("ray",))
    sites = _check_sites(sites, config.task)
    backend = make_backend(sites, config)
    t0 = time.perf_counter()
    with Coordinator(
        backend, [s.predictor for s in sites], config, recorder=recorder, solver_callback=solver_callback
    ) as coordinator:
        t1 = time.perf_counter()
        model = coordinator.fit()
        t2 = time.perf_counter()
    if config.runtime == "ray":
        model.info["ray_startup_s"], model.info["ray_fit_s"] = t1 - t0, t2 - t1
        hint = ray_startup_hint(t1 - t0, t2 - t1)
        if hint is not None and not _RAY_HINT["given"]:
            _RAY_HINT["given"] = True
            log.warning("%s", hint)
    return model


#: the signatures of fit_dmsa and fit_gmsa, made from the configuration tree (its options, each
#: declared once in msa_fed.runtime.config), with the two observers of a run
_SIGNATURES = {
    method: api_signature(method, ("sites",), ("recorder", "solver_callback")) for method in ("dmsa", "gmsa")
}


def fit_dmsa(sites: Sequence[SiteData], task: str = "classification", **options: Any) -> CombinedModel:
    """Discriminative MSA: conditional-Maxent domain classifier + DC solve for z.

    The keyword arguments are the options of the configuration tree
    (:class:`msa_fed.runtime.config.FitConfig`; every one with its default, check and meaning
    in docs/OPTIONS.md): ``features``, ``mu``, ``eta``, ``random_state``, ``runtime``,
    ``min_points``, ``verbose``, ``bandwidth``, ``checkpoint_dir``, ``influence``, and the
    mappings ``classifier_options`` (fields of :class:`msa_fed.core.config.ClassifierConfig`),
    ``solver_options`` (:class:`msa_fed.core.config.SolverConfig`) and ``ray_options``
    (runtime="ray" only: :class:`msa_fed.runtime.config.RayConfig`).  Besides them:

    recorder : a :class:`msa_fed.boundary.messages.Recorder` capturing every boundary message.
    solver_callback : called as callback(iteration, z, value) after each solver iteration.

    A wrong type is a TypeError and a value out of range, an unknown option key or an option
    that does not apply (``ray_options`` with runtime="local", ``solver_options={"method":
    "dca"}`` under the default objective "minmax") a ValueError, each naming the argument.
    """
    return _fit(sites, task, "dmsa", **options)


def fit_gmsa(sites: Sequence[SiteData], task: str = "classification", **options: Any) -> CombinedModel:
    """Generative MSA (the baseline): per-domain Gaussian KDEs in place of the classifier.

    Same signature as :func:`fit_dmsa`; ``bandwidth`` (None: 5-fold CV per domain) and
    ``features`` (None: raw inputs) apply to the KDEs, ``mu`` is unused.
    """
    return _fit(sites, task, "gmsa", **options)


fit_dmsa.__signature__ = _SIGNATURES["dmsa"]  # type: ignore[attr-defined]
fit_gmsa.__signature__ = _SIGNATURES["gmsa"]  # type: ignore[attr-defined]
