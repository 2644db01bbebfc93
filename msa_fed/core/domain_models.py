"""Domain models Q(k | x) as plain state: one place that knows the kinds.

A domain model (:class:`msa_fed.core.domain_classifier.DomainClassifier`, ``kind="maxent"``, or
:class:`msa_fed.core.density.KDEDomainModel`, ``kind="kde"``) writes itself as
``get_state() -> (params, arrays)`` (JSON-able params, numeric arrays) and reads itself back
with ``from_state(params, arrays, feature_map, n_sources)``; its feature map does the same
(:mod:`msa_fed.core.features`).  The saved model, the coordinator's message to the sites and
the site itself all go through :func:`domain_model_state` / :func:`domain_model_from_state`.
"""

from __future__ import annotations

import importlib
from typing import Any

#: kind -> (module, class); imported on first use, so that a site loads only what its domain
#: model needs (the Maxent classifier's module imports torch, the KDE's scikit-learn)
KINDS = {
    "maxent": ("msa_fed.core.domain_classifier", "DomainClassifier"),
    "kde": ("msa_fed.core.density", "KDEDomainModel"),
}


def domain_model_class(kind: str) -> Any:
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"unknown domain model kind {kind!r}; expected one of {sorted(KINDS)}")
    module, name = KINDS[kind]
    return getattr(importlib.import_module(module), name)


def domain_model_state(model: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(kind, params, arrays) of a fitted domain model (its feature map is not included)."""
    kind = getattr(type(model), "kind", None)
    if kind not in KINDS or not callable(getattr(model, "get_state", None)):
        raise ValueError(f"cannot serialise a domain model of type {type(model).__name__}")
    params, arrays = model.get_state()
    return kind, params, arrays


def domain_model_from_state(
    kind: str, params: dict[str, Any], arrays: dict[str, Any], feature_map: Any, n_sources: int
) -> Any:
    """The domain model written by :func:`domain_model_state`."""
    return domain_model_class(kind).from_state(params, arrays, feature_map, n_sources)
