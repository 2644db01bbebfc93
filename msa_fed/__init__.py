"""msa_fed: federated discriminative multiple-source adaptation (DMSA).

Public in-process API: :class:`SiteData`, :func:`fit_dmsa`, :func:`fit_gmsa`,
:func:`load_model`, :class:`CombinedModel`.
"""
__version__ = "0.1.0"

from msa_fed.api import SiteData, fit_dmsa, fit_gmsa  # noqa: E402
from msa_fed.model import CombinedModel, load_model  # noqa: E402

__all__ = ["SiteData", "fit_dmsa", "fit_gmsa", "load_model", "CombinedModel", "__version__"]
