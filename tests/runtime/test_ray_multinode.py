"""Three Ray nodes on one machine, each carrying its ``site:<name>`` resource and its own data
directory (``MSA_FED_SITE_DATA`` in that node's environment): every site actor runs on its
node and reads its private data from that node's disk; the driver never opens the files."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import msa_fed  # noqa: E402
from msa_fed.errors import ConfigError, SiteError  # noqa: E402
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.ray_actors import ray_children, stop_processes  # noqa: E402
from msa_fed.runtime.ray_sites import SITE_RESOURCE_PREFIX, RaySites  # noqa: E402
import numpy_predictors  # noqa: E402
from numpy_predictors import numpy_sites  # noqa: E402
from problems import site_kwargs  # noqa: E402
from problems import make_sites as sklearn_sites  # noqa: E402

# the sites' predictors travel to the actors by value, as numpy code (numpy_predictors.py)
ray.cloudpickle.register_pickle_by_value(numpy_predictors)


def make_sites(**kwargs):
    return numpy_sites(sklearn_sites(**kwargs))


NAMES = ("a", "b", "c")


#: tries at starting the three nodes, and how long the nodes may take to register: on a loaded
#: machine a raylet can miss Ray's fixed 30 s start-up wait, or join long after it started
START_TRIES = 3
NODES_TIMEOUT_S = 180


def start_cluster(node_args) -> Cluster:
    """Three local nodes (127.0.0.1, see tests/conftest.py); retried from scratch when a node
    does not come up."""
    last: Exception | None = None
    for _ in range(START_TRIES):
        c = None
        before = ray_children()
        try:
            c = Cluster(initialize_head=True, head_node_args=dict(node_args("a"), include_dashboard=False))
            for n in NAMES[1:]:
                c.add_node(wait=False, **node_args(n))
            c.wait_for_nodes(timeout=NODES_TIMEOUT_S)
            return c
        except Exception as e:  # Ray raises a bare Exception when a node misses its start-up wait
            last = e
            if c is not None:
                c.shutdown()
            # a head that never finished starting (Cluster() raised) has no handle to shut it
            # down: its GCS, dashboard and monitors would run on for the rest of this process
            stop_processes(set(ray_children()) - set(before))
    raise RuntimeError(f"a 3-node Ray cluster did not start in {START_TRIES} tries") from last


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("nodes")
    dirs = {n: base / f"node-{n}" for n in NAMES}
    for d in dirs.values():
        d.mkdir()

    def node_args(n):
        # a slow dashboard agent must not make the raylet give up on it (Ray's default is short)
        env = {"MSA_FED_SITE_DATA": str(dirs[n]), "RAY_agent_register_timeout_ms": "120000"}
        return dict(num_cpus=1, resources={SITE_RESOURCE_PREFIX + n: 1}, env_vars=env)

    c = start_cluster(node_args)
    ray.init(address=c.address, log_to_driver=False)
    yield dirs
    ray.shutdown()
    c.shutdown()


def test_each_site_runs_on_its_node_and_reads_its_data_there(cluster):
    sites = make_sites(names=list(NAMES))
    for s in sites:  # the same relative file name on every node, different contents
        np.savez(cluster[s.name] / "site.npz", X_labeled=s.X_labeled, y_labeled=s.y_labeled, X_unlabeled=s.X_unlabeled)
    kwargs = site_kwargs(sites)
    for kw in kwargs:
        for key in ("X_labeled", "y_labeled", "X_unlabeled"):
            del kw[key]
        kw["data_path"] = "site.npz"  # resolved on the site's node, under its MSA_FED_SITE_DATA
    assert "MSA_FED_SITE_DATA" not in os.environ
    node_of = {
        key[len(SITE_RESOURCE_PREFIX) :]: node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
        for key in node["Resources"]
        if key.startswith(SITE_RESOURCE_PREFIX)
    }
    assert len(set(node_of.values())) == 3

    backend = RaySites(kwargs)
    with Coordinator(backend, [s.predictor for s in sites], FitConfig()) as coordinator:
        assert [a.node_id for a in coordinator.call_all("ping", None)] == [node_of[n] for n in NAMES]
        assert [(i.n_labeled, i.n_unlabeled) for i in coordinator.infos] == [
            (len(s.y_labeled), len(s.X_unlabeled)) for s in sites
        ]
        model = coordinator.fit()
        # the pings above and every round went over the TLS data channel to the site's node
        assert backend.channel_status() == {n: True for n in NAMES}
        np.testing.assert_allclose(model.z, msa_fed.fit_dmsa(sites).z, atol=1e-6)

        # plaintext is for loopback only: sites on other nodes than the coordinator are refused
        # when their channel opens (the same actors, their channels opened again in plain mode:
        # new actors would cost a start-up on every node for the same check)
        backend.set_data_channel("plain")
        with pytest.raises(ConfigError, match="runs on another node than the coordinator"):
            coordinator.call_all("ping", None)


def test_a_site_without_a_node_is_named(cluster):
    sites = make_sites(names=["a", "b", "zz"])
    with pytest.raises(SiteError, match=r"site 'zz': no Ray node carries the resource 'site:zz'"):
        with Coordinator(RaySites(site_kwargs(sites)), [s.predictor for s in sites], FitConfig()):
            pass


def test_a_missing_data_file_on_a_node_names_the_site(cluster):
    sites = make_sites(names=["a", "b"], n_labeled=(41, 53), n_unlabeled=(60, 72))
    np.savez(
        cluster["a"] / "only-a.npz",
        X_labeled=sites[0].X_labeled,
        y_labeled=sites[0].y_labeled,
        X_unlabeled=sites[0].X_unlabeled,
    )
    kwargs = site_kwargs(sites)
    for kw in kwargs:
        for key in ("X_labeled", "y_labeled", "X_unlabeled"):
            del kw[key]
        kw["data_path"] = "only-a.npz"
    node_b = re.escape(str(cluster["b"] / "only-a.npz"))
    with pytest.raises(ConfigError, match=rf"^site 'b': data file '{node_b}' not found on the site's node$"):
        with Coordinator(RaySites(kwargs), [s.predictor for s in sites], FitConfig()):
            pass
