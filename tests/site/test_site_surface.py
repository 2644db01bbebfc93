"""The site's surface: every request is either the published half's (the unlabelled sample and the
classifier shard, msa_fed.site.published) or declared in the labelled half's table with its gate
(msa_fed.site.worker.LABELLED); the stand-in and the helpers answer no labelled request."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.site.published import PublishedHalf, PublishedSample, ShardWorker, SiteStateLost
from msa_fed.site.worker import LABELLED, SiteWorker

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs  # noqa: E402


def public(cls) -> set[str]:
    """The requests of a site class: its public methods but the entry point (handle) itself."""
    return {
        n
        for n in dir(cls)
        if not n.startswith("_") and n.isidentifier() and callable(getattr(cls, n)) and n != "handle"
    } - {"ANSWERS"}


def test_every_request_of_a_site_is_published_or_gated():
    published = public(PublishedHalf)
    assert published == {"classifier_loss_grad", "ping", "open_channel", "unlabeled_sample", "unlabeled_rows"}
    assert public(SiteWorker) == published | set(LABELLED)
    assert not published & set(LABELLED)


def test_each_host_asks_through_one_entry_point_that_answers_only_the_sites_list():
    """Every host (in-process, Ray, the data channel, the site process's chain) calls
    ``site.handle(method, msg)``: it answers exactly the methods of the class's own list and
    refuses anything else (a private method, the class's constructor, another holder's request)
    in one line under the rule ``methods``, before any data is read."""
    from msa_fed.errors import PrivacyError
    from msa_fed.site.methods import HELPER_METHODS, HOST_METHODS, PUBLISHED_METHODS

    for cls, allowed in (
        (SiteWorker, HOST_METHODS),
        (PublishedSample, PUBLISHED_METHODS),
        (ShardWorker, HELPER_METHODS),
    ):
        assert cls.ANSWERS == allowed and public(cls) == set(allowed), cls
    sites = make_sites()
    worker = SiteWorker(**site_kwargs(sites)[0])
    before = worker.guard.audit.count
    for method in ("load_rows", "_outputs", "__init__", "join_job", "guard"):
        with pytest.raises(PrivacyError) as info:
            worker.handle(method, None)
        assert info.value.rule == "methods" and "\n" not in str(info.value), str(info.value)
    assert worker.guard.audit.count == before
    assert worker.handle("ping", None).incarnation == worker.incarnation


def test_the_stand_in_and_the_helpers_answer_no_labelled_request():
    labelled_only = set(LABELLED) - {"info", "setup_shard"}  # both answer these for the published sample
    assert not public(PublishedSample) & labelled_only
    assert not public(ShardWorker) & set(LABELLED) - {"setup_shard"}


@pytest.mark.parametrize("method", ["set_qhat", "dc_evaluate", "max_bound"])
def test_a_request_without_its_set_up_asks_for_a_replay(method):
    sites = make_sites()
    worker = SiteWorker(**site_kwargs(sites)[0])
    requests = {
        "set_qhat": m.QhatBroadcast(qhat=np.full(3, 1 / 3), eta=1e-2),
        "dc_evaluate": m.DCRequest(z=np.full(3, 1 / 3), eta=1e-2, what=("L",)),
        "max_bound": None,
    }
    before = worker.guard.audit.count
    with pytest.raises(SiteStateLost):
        getattr(worker, method)(requests[method])
    assert worker.guard.audit.count == before  # nothing was asked of the labelled data
