"""Estimators in scikit-learn's conventions beside :func:`msa_fed.fit_dmsa` / :func:`fit_gmsa`.

    >>> est = msa_fed.DMSA(mu=1e-3, solver_options={"tol": 1e-8}).fit(sites)
    >>> est.z_, est.gamma_, est.domain_losses_, est.predict_proba(X)

The parameters are the keyword arguments of the functions, that is the fields of the
configuration tree (:class:`msa_fed.runtime.config.FitConfig`, with ``mu`` and the
``classifier_options`` / ``solver_options`` / ``ray_options`` of its sub-configurations), each
documented there once; ``__init__``'s signature is made from that tree
(:func:`msa_fed.runtime.config.api_signature`).  ``__init__`` only stores them; ``fit`` checks them (TypeError /
ValueError naming the parameter) and the sites, runs the fit and returns ``self`` with:

z_ : ndarray of shape (n_sources,)
    the mixture weights on the simplex.
gamma_ : float
    the objective at ``z_``.
domain_losses_ : ndarray of shape (n_sources,) or None
    each source's loss of the combined model, L_k(z_).
model_ : :class:`msa_fed.artifacts.model.CombinedModel`
    the fitted model (``save``, ``manifest``, ...); ``predict`` and ``predict_proba`` delegate to it.
classes_, n_features_in_, site_names_ : as the model has them.

``get_params`` / ``set_params`` / ``clone`` work as for any scikit-learn estimator; the sites are
the data, so they go to ``fit``, never to ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from msa_fed.api import SiteData, _fit
from msa_fed.artifacts.model import CombinedModel
from msa_fed.boundary.messages import Recorder
from msa_fed.runtime.config import FitConfig, api_signature

__all__ = ["DMSA", "GMSA"]


def _init(method: str, root: type = FitConfig) -> Callable[..., None]:
    """The estimator's ``__init__``: its signature made from the configuration tree (the same
    keywords and defaults as ``fit_dmsa`` / ``fit_gmsa``; scikit-learn reads the parameters from
    it), and it only stores them."""
    signature = api_signature(method, ("self",), root=root)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:  # an unknown parameter, in Python's words
            raise TypeError(f"{type(self).__name__}() {exc}") from None
        bound.apply_defaults()
        for name, value in list(bound.arguments.items())[1:]:
            setattr(self, name, value)

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    return __init__


class _MSA(BaseEstimator):
    """What DMSA and GMSA share: ``fit`` and the delegating predictions."""

    _method = ""

    def fit(
        self,
        sites: Sequence[SiteData],
        y: None = None,
        *,
        recorder: Recorder | None = None,
        solver_callback: Callable | None = None,
    ) -> _MSA:
        """Fit on ``sites`` (a list of :class:`msa_fed.SiteData`); returns self.

        ``y`` is not used (each site carries its labels); it is there so that scikit-learn's
        tools may call ``fit(X, y)``.  ``recorder`` and ``solver_callback`` observe the run as
        for :func:`msa_fed.fit_dmsa`; they are not parameters of the estimator."""
        if y is not None:
            raise ValueError(f"{type(self).__name__}.fit takes the sites only (each carries its labels); got y={y!r}")
        params = self.get_params()
        model = _fit(
            sites,
            params.pop("task"),
            self._method,
            recorder=recorder,
            solver_callback=solver_callback,
            **params,
        )
        self.model_: CombinedModel = model
        self.z_ = np.array(model.z, copy=True)
        self.gamma_ = float(model.gamma)
        self.domain_losses_ = None if model.domain_losses is None else np.array(model.domain_losses, copy=True)
        self.classes_ = model.classes_
        self.n_features_in_ = model.n_features_in_
        self.site_names_ = list(model.site_names)
        return self

    def predict(self, X: Any) -> np.ndarray:
        """Class labels (classification) or values (regression) of the combined model, shape (n_samples,)."""
        check_is_fitted(self, "model_")
        return self.model_.predict(X)

    def predict_proba(self, X: Any) -> np.ndarray:
        """Class probabilities of the combined model, shape (n_samples, n_classes); classification only."""
        check_is_fitted(self, "model_")
        if self.model_.task != "classification":
            raise AttributeError(
                f"predict_proba is for task='classification'; this model's task is {self.model_.task!r}"
            )
        return self.model_.predict_proba(X)


class DMSA(_MSA):
    """Discriminative MSA: a conditional-Maxent domain classifier, then the DC solve for z
    (:func:`msa_fed.fit_dmsa` as an estimator; see the module docstring)."""

    _method = "dmsa"
    __init__ = _init("dmsa")


class GMSA(_MSA):
    """Generative MSA (the baseline): a kernel density estimate per domain in place of the
    classifier (:func:`msa_fed.fit_gmsa` as an estimator; ``mu`` is unused, ``features`` None
    means the raw inputs)."""

    _method = "gmsa"
    __init__ = _init("gmsa")
