"""The cluster topology never hangs on a lost site: on a real local Ray,

- a site actor Ray cannot place ends the run within the start timeout with an error naming the
  site and what it asks for;
- a site actor that stops answering mid-solve (a lost or frozen node: Ray would wait for it for
  ever) ends the run within site_timeout_s with an error naming the site, through the data
  channel and through Ray actor calls alike.
"""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")

from fedhelpers import fit_config, local_kwargs, site_files  # noqa: E402

from msa_fed.core.domain_classifier import ClassifierConfig  # noqa: E402
from msa_fed.errors import SiteError  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.ray_sites import RaySites  # noqa: E402
from msa_fed.site.worker import SiteWorker  # noqa: E402

NAMES = ("a", "b", "c")
#: the start time-out of the run with a site Ray cannot place (the test waits it out)
START_TIMEOUT_S = 5.0


#: the local Ray of the ``local_ray`` fixture (conftest.py) carries each site's resource
RAY_RESOURCES = {"site:a": 1, "site:b": 1, "site:c": 1}


@pytest.fixture(scope="module")
def files():
    return site_files(NAMES, seed=4)


import sys  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels by value


class FreezingSite(SiteWorker):
    """A site whose node freezes once the file ``freeze_flag`` exists (checked in dc_evaluate)."""

    def __init__(self, *args, freeze_flag: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.freeze_flag = freeze_flag

    def dc_evaluate(self, msg):
        if self.freeze_flag and os.path.exists(self.freeze_flag):
            time.sleep(3600)
        return super().dc_evaluate(msg)


@ray.remote(num_cpus=0, resources={"site:a": 1})
class Hog:
    """Holds all of site a's resource: site a's actor can never be placed."""

    def ready(self):
        return True


def test_an_actor_that_cannot_be_placed_ends_the_run_naming_the_site(local_ray, files):
    hog = Hog.remote()
    ray.get(hog.ready.remote())
    kw, preds, _ = local_kwargs(files, NAMES)
    # the run names the first site (in the job's order) without an answer when the time-out
    # runs out: the site that cannot be placed is the first, so which site it names does not
    # depend on how fast b's and c's actors start on a loaded machine, and the time-out it
    # waits out can be short
    backend = RaySites(kw, start_timeout_s=START_TIMEOUT_S)
    try:
        with pytest.raises(SiteError) as info:
            Coordinator(backend, preds, fit_config()).start()
    finally:
        backend.shutdown()
        ray.kill(hog)
    text = str(info.value)
    assert info.value.site == "a" and f"Ray could not start the site's actor within {START_TIMEOUT_S:g} s" in text
    assert "site:a" in text and "site:b" not in text  # what it asks for, its own resource


@pytest.mark.parametrize("channel", ["plain", "off"])
def test_a_site_frozen_mid_solve_ends_the_run_within_the_timeout(local_ray, files, tmp_path, channel):
    kw, preds, _ = local_kwargs(files, ("a", "b"))
    flag = tmp_path / "freeze"
    kw[1]["freeze_flag"] = str(flag)
    kw[0]["freeze_flag"] = ""
    # a generous timeout for the set-up (actors starting on a loaded machine), a short one from
    # the freeze on: the run waits it out once, and an honest call answers well within it
    setup_s, timeout_s = 120.0, 10.0
    backend = RaySites(kw, worker_cls=FreezingSite, retry_timeout_s=setup_s, data_channel=channel, max_restarts=0)
    frozen_at = []

    def freeze(it, z, gamma):
        if it == 1 and not frozen_at:
            backend.retry_timeout_s = timeout_s
            if channel != "off":  # the open channels carry the set-up's timeout: opened again with the short one
                backend.set_data_channel(channel)
            flag.write_text("frozen")
            frozen_at.append(time.monotonic())

    coord = Coordinator(
        backend,
        preds,
        fit_config(classifier=ClassifierConfig(mu=1e-3), solver={"objective": "gamma", "method": "dca"}),
        solver_callback=freeze,
    )
    with pytest.raises(SiteError) as info:
        with coord:
            coord.fit()
    assert frozen_at, f"failed before the freeze: {info.value}"
    # ended on the short time-out, naming the frozen site (a hang is stopped by pytest-timeout)
    assert info.value.site == "b" and f"within {timeout_s:g} s" in str(info.value)
