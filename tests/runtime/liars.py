"""A lying site: a :class:`SiteWorker` that forges its answers (for plausibility and influence tests).

``LIAR`` names the lying site and ``MODE`` the lie (set by the test, or by the environment
variables MSA_FED_TEST_LIAR / MSA_FED_TEST_LIE in a site process started by liar_site.py):

- ``"qhat"``: its Qhat partial times 1.5 (an honest site's sums to 1/p);
- ``"inflate"``: 3.0 added to its own domain's loss in every DC answer (consistent with the
  gradients: only the influence report can see it);
- ``"noise"``: a random number in [0, 1) added to its own domain's loss in every DC answer.
"""

from __future__ import annotations

import os

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.site.worker import SiteWorker

LIAR = os.environ.get("MSA_FED_TEST_LIAR", "")
MODE = os.environ.get("MSA_FED_TEST_LIE", "")
_rng = np.random.default_rng(0)


def _lying(worker) -> str:
    return MODE if worker.name == LIAR else ""


_set_domain_model = SiteWorker.set_domain_model
_dc_evaluate = SiteWorker.dc_evaluate


def set_domain_model(self, msg):
    out = _set_domain_model(self, msg)
    if _lying(self) == "qhat":
        return m.QhatPartial(sums=out.sums * 1.5, n=out.n, epsilon=out.epsilon)
    return out


def dc_evaluate(self, msg):
    out = _dc_evaluate(self, msg)
    lie = _lying(self)
    if lie in ("inflate", "noise") and out.sums.L is not None:
        out.sums.L = out.sums.L.copy()
        out.sums.L[..., self.index] += 3.0 if lie == "inflate" else float(_rng.random())  # one z or a batch
    return out


class LyingSite(SiteWorker):
    """SiteWorker with the lies above (in-process use)."""

    set_domain_model = set_domain_model
    dc_evaluate = dc_evaluate


def patch_site_worker() -> None:
    """Make every SiteWorker of this process lie (a site process started by liar_site.py)."""
    SiteWorker.set_domain_model = set_domain_model
    SiteWorker.dc_evaluate = dc_evaluate
