"""The site's host hands in where its policy comes from (msa_fed.site.policy): the site's own
process gives its policy and may hand over a custom feature map; an actor of the job's Ray
cluster reads its node's policy file, and a policy passed with the job only tightens it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.core.features import StandardFeatures
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.policy import POLICY_ENV, SitePolicy
from msa_fed.site.policy import site_policy
from msa_fed.site.worker import SiteWorker

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs  # noqa: E402


@pytest.fixture
def node_policy(tmp_path, monkeypatch):
    path = tmp_path / "site_policy.toml"
    path.write_text("[limits]\nmin_points = 50\n")
    monkeypatch.setenv(POLICY_ENV, str(path))
    return path


def test_the_sites_own_process_enforces_the_policy_it_gives(node_policy):
    assert site_policy(SitePolicy(min_points=5), host="process").min_points == 5
    assert site_policy(None, host="process").min_points == 50  # none given: the node's file
    assert site_policy(SitePolicy(min_points=5), {"min_points": 30}, host="process").min_points == 30


def test_a_ray_actor_enforces_its_nodes_policy_and_the_job_only_tightens_it(node_policy):
    assert site_policy(SitePolicy(min_points=5), host="ray").min_points == 50  # cannot loosen
    assert site_policy(SitePolicy(min_points=80), host="ray").min_points == 80  # may tighten
    assert site_policy(None, {"min_points": 70}, host="ray").min_points == 70


def test_an_unknown_host_or_policy_type_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"host must be one of \['process', 'ray'\]; got 'spark'"):
        site_policy(None, host="spark")
    with pytest.raises(ConfigError, match="policy must be a SitePolicy; got dict"):
        site_policy({"min_points": 1}, host="process")


@pytest.mark.parametrize("host", ["process", "ray"])
def test_only_the_sites_own_process_accepts_a_custom_feature_map(host, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    kw = site_kwargs(make_sites())[0]
    worker = SiteWorker(**{**kw, "policy": SitePolicy(allow_custom_feature_map=True), "host": host})
    assert worker.policy.allow_custom_feature_map  # the policy allows it: the host decides
    fmap = StandardFeatures().fit(np.vstack([kw["X_labeled"], kw["X_unlabeled"]]))
    setup = m.ShardSetup(feature_map=None, custom_feature_map=fmap, n_sources=3)
    if host == "process":
        assert worker.setup_shard(setup).incarnation == worker.incarnation
        shard = worker._shard
        assert shard is not None and shard.n_points == worker.X_unlabeled.shape[0]
    else:
        with pytest.raises(PrivacyError) as err:
            worker.setup_shard(setup)
        assert err.value.rule == "feature_map" and "in-process caller" in str(err.value)
