"""One function picks the backend of every topology (msa_fed.runtime.topology.make_backend), and
the API's backend is the one it returns."""

from __future__ import annotations

import numpy as np
import pytest
from problems import make_sites, site_kwargs

from msa_fed.api import build_config
from msa_fed.api import make_backend as api_backend
from msa_fed.errors import ConfigError
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.federated import STAND_IN_START_S, FederatedSites
from msa_fed.runtime.local import LocalSites
from msa_fed.runtime.ray_sites import RaySites
from msa_fed.runtime.topology import TOPOLOGIES, RelayedSites, make_backend


def test_the_local_topology_runs_the_sites_in_this_process():
    sites = make_sites()
    backend = make_backend("local", FitConfig(), site_kwargs(sites))
    assert isinstance(backend, LocalSites)
    infos = backend.start()
    assert [i.name for i in infos] == [s.name for s in sites]
    assert [i.n_labeled for i in infos] == [len(s.y_labeled) for s in sites]


def test_the_api_gets_its_backend_from_the_same_function():
    sites = make_sites()
    assert isinstance(api_backend(sites, build_config("dmsa", "classification")), LocalSites)
    ray_backend = make_backend("ray", FitConfig(), site_kwargs(sites))  # what the API gets for its Ray runtime
    assert isinstance(ray_backend, RaySites) and ray_backend.sites == []  # nothing started yet
    assert ray_backend.site_host_kwargs == {"host": "ray"}  # the actors read their node's policy


def test_the_sites_must_fit_the_topology():
    kw = site_kwargs(make_sites())
    relayed = RelayedSites(["a", "b"], object(), [np.zeros((3, 2))] * 2, job_id="j", predictor_sha256=["0", "1"])
    with pytest.raises(ConfigError, match=r"topology must be one of \['local', 'ray', 'cluster', 'federated'\]"):
        make_backend("spark", FitConfig(), kw)
    with pytest.raises(TypeError, match="the federated topology's sites are RelayedSites; got list"):
        make_backend("federated", FitConfig(), kw)
    for topology in ("local", "ray", "cluster"):
        with pytest.raises(TypeError, match=f"the {topology} topology's sites are a list"):
            make_backend(topology, FitConfig(), relayed)
    assert TOPOLOGIES == ("local", "ray", "cluster", "federated")


class Relay:
    """A relay client that is never called here: the test checks who closes it."""

    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def test_the_federated_topology_takes_the_fits_options_and_owns_its_relay():
    fit = FitConfig(min_points=7, site_timeout_s=12.5, task="classification")
    relay = Relay()
    samples = [np.zeros((30, 2)), np.ones((40, 2))]
    messages: list[str] = []
    sites = RelayedSites(
        ["a", "b"],
        relay,
        samples,
        job_id="study-1",
        predictor_sha256=["aa", "bb"],
        classes=np.array([0, 1]),
        approval_wait_s=3.0,
        echo=messages.append,
    )
    backend = make_backend("federated", fit, sites)
    assert isinstance(backend, FederatedSites)
    assert backend.site_timeout_s == 12.5 and backend.approval_wait_s == 3.0 and backend.echo == messages.append
    assert [j.min_points for j in backend.join] == [7, 7] and [j.index for j in backend.join] == [0, 1]
    assert backend.join[0].predictor_sha256 == ("aa", "bb") and backend.join[0].job_id == "study-1"
    assert backend.stand_ins.site_host_kwargs == {}  # the stand-ins hold published samples only
    # the stand-ins' calls are this machine's work: a short site timeout does not cut them short
    assert backend.stand_ins.retry_timeout_s == STAND_IN_START_S > backend.site_timeout_s
    backend.shutdown()  # never opened: nothing to close at the relay, but the job's client is closed
    assert relay.closed == 1
