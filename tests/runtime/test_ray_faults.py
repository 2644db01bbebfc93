"""Fault tolerance on a real local Ray: a site actor killed mid-solve restarts and the run gives
the same z; a site killed for good fails the run naming it; a stopped run resumes from its
checkpoint directory to the same z."""
from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import msa_fed  # noqa: E402
from msa_fed.errors import SiteError  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator, RunConfig  # noqa: E402
from msa_fed.runtime.ray_sites import RaySites, actor_status  # noqa: E402
from problems import make_sites, site_kwargs  # noqa: E402

DCA = {"objective": "gamma", "method": "dca"}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def sites():
    return make_sites(random_state=3)


@pytest.fixture(scope="module")
def warm(local_ray, sites):
    backend = RaySites(site_kwargs(sites), max_restarts=2, retry_timeout_s=120)
    _coordinator(backend, sites)  # starts the actors
    yield backend
    backend.shutdown()


def _coordinator(backend, sites, callback=None, **config):
    return Coordinator(backend, [s.predictor for s in sites], RunConfig(**config), solver_callback=callback).start()


def test_site_killed_mid_solve_restarts_and_the_run_continues(warm, sites):
    before = ray.get(warm.actors[1].ping.remote()).incarnation
    killed = []

    def kill_b(it, z, gamma):
        if it == 2 and not killed:
            ray.kill(warm.actors[1], no_restart=False)
            killed.append(it)

    model = _coordinator(warm, sites, kill_b).fit()
    assert killed == [2]
    after = ray.get(warm.actors[1].ping.remote()).incarnation
    assert after != before  # a new worker process answered the rest of the solve
    assert actor_status(warm.actors[1])[0] == "ALIVE"
    np.testing.assert_allclose(model.z, msa_fed.fit_dmsa(sites).z, atol=1e-6)


def test_stopped_run_resumes_from_its_checkpoint(warm, sites, tmp_path):
    class Stop(Exception):
        pass

    def stop_after_2(it, z, gamma):
        if it == 2:
            raise Stop

    with pytest.raises(Stop):
        _coordinator(warm, sites, stop_after_2, solver=DCA, checkpoint_dir=str(tmp_path)).fit()
    state = json.loads((tmp_path / "dc_state.json").read_text())
    assert state["iteration"] == 2 and "theta" in state and not state.get("done")
    resumed = _coordinator(warm, sites, solver=DCA, checkpoint_dir=str(tmp_path)).fit()
    full = msa_fed.fit_dmsa(sites, solver_options=DCA)  # uninterrupted, in-process
    assert resumed.info["classifier"]["resumed"] is True
    assert resumed.info["solver"]["n_iter"] == full.info["solver"]["n_iter"] - 2
    np.testing.assert_allclose(resumed.z, full.z, atol=1e-6)
    assert abs(resumed.gamma - full.gamma) <= 1e-9
    assert json.loads((tmp_path / "dc_state.json").read_text())["done"] is True


def test_site_killed_for_good_fails_the_run_naming_it(warm, sites):
    def kill_c(it, z, gamma):
        if it == 2:
            ray.kill(warm.actors[2], no_restart=True)

    with pytest.raises(SiteError, match=r"^site 'c': the site's actor died and will not be restarted: .*ray.kill") as err:
        _coordinator(warm, sites, kill_c).fit()
    assert err.value.site == "c"
    assert actor_status(warm.actors[2])[0] == "DEAD"
