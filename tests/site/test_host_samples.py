"""A site handed the job's published samples by its host (in-process and Ray topologies; the
cluster's actors the same way) checks every one against the sha256 the job's content pins for its
site: a host that swaps a peer's sample is refused, the peer named, before any domain model is
verified with it (the federated topology's site process checks its fetches the same way:
admission.checked_sample)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from problems import make_sites, site_kwargs  # noqa: E402

from msa_fed.api import SiteData, build_config, make_backend  # noqa: E402
from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.errors import ConfigError  # noqa: E402
from msa_fed.runtime.config import FitConfig  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402
from msa_fed.site.admission import host_content, sample_sha256  # noqa: E402
from msa_fed.site.worker import SiteWorker  # noqa: E402


@pytest.fixture(scope="module")
def sites() -> list[SiteData]:
    return make_sites(random_state=3)


def swapped(samples, k: int) -> list[np.ndarray]:
    """The samples with site k's replaced by a crafted one (its points moved: the verification
    would then check a domain model against points the site never published)."""
    out = [np.array(X, dtype=np.float64) for X in samples]
    out[k] = out[k] + 0.5
    return out


class SwappingLocalSites(LocalSites):
    """An in-process host that hands its sites another sample for site ``victim``."""

    victim = 1

    def share_samples(self, samples) -> None:
        self.served = list(self.workers)  # kept past shutdown, to read their audit records
        LocalSites.share_samples(self, swapped(samples, self.victim))


def test_the_api_pins_every_sites_sample_in_the_job_content(sites):
    backend = make_backend(sites, build_config("dmsa"))
    content = backend.site_kwargs[0]["content"]
    assert all(kw["content"] is content for kw in backend.site_kwargs)
    assert [s["name"] for s in content["sites"]] == [s.name for s in sites]
    assert [s["sample_sha256"] for s in content["sites"]] == [sample_sha256(s.X_unlabeled) for s in sites]


def test_a_swapped_peer_sample_is_refused_naming_the_peer(sites):
    samples = [s.X_unlabeled for s in sites]
    for k, kw in enumerate(site_kwargs(sites)):
        worker = SiteWorker(**kw)
        for victim in range(len(sites)):
            with pytest.raises(ConfigError) as err:
                worker.set_published(m.PublishedSamples(tuple(swapped(samples, victim))))
            text = str(err.value)
            assert "\n" not in text
            if victim == k:  # its own sample: it knows it holds another
                assert "its own sample" in text
            else:
                assert f"site {sites[k].name!r} refuses the published sample of site {sites[victim].name!r}" in text
            assert worker.published is None  # nothing was kept to verify models with
        worker.set_published(m.PublishedSamples(tuple(samples)))  # the pinned samples are taken
        assert [np.array_equal(a, b) for a, b in zip(worker.published(), samples)] == [True] * len(sites)


def test_the_content_must_pin_the_sites_own_sample_and_every_peer(sites):
    samples = [s.X_unlabeled for s in sites]
    kw = site_kwargs(sites)[0]
    names = [s.name for s in sites]
    # a content that pins another sample for this site itself: the site holds its own
    other = host_content("t", names, swapped(samples, 0), task="classification", loss="cross_entropy")
    with pytest.raises(ConfigError, match="pins published sample .* for this site"):
        SiteWorker(**{**kw, "content": other}).set_published(m.PublishedSamples(tuple(samples)))
    # a content that pins nothing for a peer: refused, not taken as "anything goes"
    bare = host_content("t", names, samples, task="classification", loss="cross_entropy")
    bare["sites"][2]["sample_sha256"] = ""
    with pytest.raises(ConfigError, match=f"sample of site {names[2]!r}.*pins none"):
        SiteWorker(**{**kw, "content": bare}).set_published(m.PublishedSamples(tuple(samples)))
    # a content of other sites, or of fewer sites than the samples handed in
    with pytest.raises(ConfigError, match="the job's content names sites"):
        SiteWorker(**{**kw, "sites": ["x", "y", "z"]}).set_published(m.PublishedSamples(tuple(samples)))
    with pytest.raises(ConfigError, match="the job's content names sites"):
        SiteWorker(**kw).set_published(m.PublishedSamples(tuple(samples[:2])))


def test_an_in_process_host_that_swaps_a_peer_sample_stops_the_fit(sites):
    backend = SwappingLocalSites(site_kwargs(sites))
    with pytest.raises(ConfigError) as err:
        with Coordinator(backend, [s.predictor for s in sites], FitConfig()) as c:
            c.fit()
    assert f"site {sites[0].name!r} refuses the published sample of site {sites[1].name!r}" in str(err.value)
    # the refusal came before any domain model: the first site refused, the host stopped there
    assert [w.published is None for w in backend.served] == [True] * len(sites)
    assert [w._spec_key for w in backend.served] == [None] * len(sites)
