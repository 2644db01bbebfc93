"""msa_fed: federated discriminative multiple-source adaptation (DMSA).

Public in-process API: :class:`SiteData`, :func:`fit_dmsa`, :func:`fit_gmsa`, the estimators
:class:`DMSA` and :class:`GMSA` (scikit-learn's conventions), :func:`load_model`,
:class:`CombinedModel`.  They are imported on first use, so that
the command line (registry, admin, site commands) starts without loading torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "SiteData": "msa_fed.api",
    "fit_dmsa": "msa_fed.api",
    "fit_gmsa": "msa_fed.api",
    "DMSA": "msa_fed.estimators",
    "GMSA": "msa_fed.estimators",
    "load_model": "msa_fed.artifacts.model",
    "CombinedModel": "msa_fed.artifacts.model",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        from msa_fed.errors import missing_extra

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:  # a site install (no coordinator extra)
            needs = missing_extra(exc, f"msa_fed.{name}")
            if needs is None:
                raise
            raise needs from None
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'msa_fed' has no attribute {name!r}")
