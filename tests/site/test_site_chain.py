"""The site's one request chain (msa_fed/site/chain.py), driven as the site process drives it:
sealed frames made by a real JobSealer go into SiteApp.handle, sealed answers come out and are
opened by the job; the site's job book, audit log and ledger are real files.  The transport
(the registry's FetchSample) is this test's: it hands in what a hostile registry would."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn, sha256_hex
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as bpb
from msa_fed.crypto.sealing import JobKey, JobSealer, SiteKey, SiteOpener, job_content
from msa_fed.errors import ConfigError
from msa_fed.federation.serve_ops import JobLines
from msa_fed.privacy.audit import AuditLog
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy
from msa_fed.runtime.exclusions import ExclusionBook
from msa_fed.site.admission import sample_sha256
from msa_fed.site.chain import CHAIN, SITE_METHODS, SiteApp
from msa_fed.site.job_book import JobBook

SITES = ("north", "east")


class _Registry:
    """The chain's transport: the published samples as a registry would hand them out."""

    def __init__(self, samples: dict[str, np.ndarray]):
        self.samples = samples
        self.fetched: list[str] = []

    def fetch_predictor(self, job, site):
        raise AssertionError("both sites publish the same predictor: nothing to fetch")

    def fetch_sample(self, job, site):
        self.fetched.append(site)
        data = np.ascontiguousarray(self.samples[site], dtype="<f4").tobytes()
        import hashlib

        rows, cols = self.samples[site].shape
        return data, hashlib.sha256(data).hexdigest(), rows, cols  # consistent with itself


@pytest.fixture
def site(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    y = (X[:, 0] > 0).astype(np.int64)
    predictor = export_sklearn(LogisticRegression().fit(X, y), n_features=2)
    published = {n: rng.normal(size=(60, 2)).astype(np.float32).astype(np.float64) for n in SITES}
    data = {"X_labeled": X[:80], "y_labeled": y[:80], "X_unlabeled": published["north"]}
    key, job_key = SiteKey.generate(), JobKey.generate()
    book = JobBook(tmp_path / "jobs.sqlite")
    ledger = Ledger(str(tmp_path / "ledger.db"))
    audit = AuditLog(str(tmp_path / "audit.jsonl"), ledger=ledger)
    registry = _Registry(dict(published))
    lines: list[str] = []
    app = SiteApp(
        "north",
        data,
        predictor,
        policy=SitePolicy(audit_log=str(tmp_path / "audit.jsonl"), ledger=str(tmp_path / "ledger.db")),
        audit=audit,
        book=book,
        opener=SiteOpener("north", key, {job_key.fingerprint}, floor=book.seal_floor, remember=book.set_seal_floor),
        accept_jobs="all",
        excluded=ExclusionBook(tmp_path / "excluded.json", "site 'north'"),
        lines=JobLines("north", lines.append),
        transport=registry,
    )
    content = job_content(
        "job-1",
        [
            dict(
                name=n,
                key_fingerprint=key.public.fingerprint if n == "north" else SiteKey.generate().public.fingerprint,
                sample_sha256=sample_sha256(published[n]),
                predictor_sha256=sha256_hex(predictor),
            )
            for n in SITES
        ],
        task="classification",
        loss="cross_entropy",
        planned_queries=3,
        min_points=20,
    )
    yield dict(app=app, key=key, job_key=job_key, content=content, registry=registry, tmp=tmp_path, pred=predictor)
    app.close()
    book.close()
    audit.close()
    ledger.close()


def _sealer(site):
    keys = {"north": site["key"].public}
    content = site["content"]
    # the job seals for north only; east's pin is a key the job never uses here
    east = SiteKey.generate().public
    content["sites"][1]["key_fingerprint"] = east.fingerprint
    return JobSealer(site["job_key"], content, {**keys, "east": east})


def _join_msg(site):
    return m.JobSetup(
        job_id="job-1",
        sites=SITES,
        index=0,
        predictor_sha256=(sha256_hex(site["pred"]),) * 2,
        task="classification",
        loss="cross_entropy",
        classes=np.array([0, 1]),
        min_points=20,
    )


def _ask(site, sealer, method, msg):
    plain = wire.to_proto(method, msg, wire.REQUESTS).SerializeToString()
    frame, seq = sealer.seal("north", plain)
    response, sealed = site["app"].handle("job-1", "admin", sealed=frame)
    if not sealed:
        return frame, None, response
    answer = bpb.SiteResponse.FromString(sealer.open("north", seq, sealed, plain, method))
    return frame, wire.from_proto(answer, wire.RESPONSES)[1], None


def _audit(site) -> list[dict]:
    return [json.loads(x) for x in (site["tmp"] / "audit.jsonl").read_text().splitlines()]


def test_the_chain_answers_a_sealed_join_and_refuses_what_each_step_refuses(site):
    assert CHAIN == ("open_seal", "allowlist", "admit", "gate", "body", "audit", "seal")
    sealer = _sealer(site)
    app = site["app"]
    # a request before the job joined: admit refuses (the job lost, or never had, the site's state)
    _, got, _ = _ask(site, sealer, "info", None)
    assert isinstance(got, wire.RemoteError) and got.kind == "SiteStateLost"
    frame, info, _ = _ask(site, sealer, "join_job", _join_msg(site))
    assert isinstance(info, m.SiteInfo) and info.n_labeled == 80 and "job-1" in app.jobs
    # open_seal: the same frame again is refused in the clear, "replayed" in the audit log
    response, sealed = app.handle("job-1", "admin", sealed=frame)
    assert not sealed and response.WhichOneof("body") == "failure" and "replayed" in response.failure.text
    assert _audit(site)[-1]["rule"] == "tampered" and "replayed" in _audit(site)[-1]["detail"]
    # open_seal: an unsealed request at a sealed site
    response, sealed = app.handle("job-1", "admin", request=bpb.SiteRequest(method="ping", empty=bpb.Empty()))
    assert not sealed and (response.failure.rule, response.failure.site) == ("sealed", "north")
    # allowlist: a request of the published half, sealed and authentic, is not a site process's
    _, got, _ = _ask(site, sealer, "unlabeled_sample", None)
    assert isinstance(got, wire.RemoteError) and got.rule == "methods", got
    assert _audit(site)[-1]["outcome"] == "refused" and _audit(site)[-1]["rule"] == "methods"
    assert "unlabeled_sample" not in SITE_METHODS
    # the gate and the body: an answer, audited
    _, info2, _ = _ask(site, sealer, "info", None)
    assert isinstance(info2, m.SiteInfo) and _audit(site)[-1]["outcome"] == "answered"


def test_peer_samples_are_checked_against_the_signed_content_not_only_the_registry(site):
    """The registry hands out another sample for east, consistent with its own record (its sha256
    matches the bytes): the site refuses it because the job's signed content pins east's real one,
    and keeps nothing of that fetch.  A sample fetched and checked against a sealed job's pin is
    not fetched again for a job pinning the same one (read-only): a swap at the registry then
    reaches nothing."""
    sealer = _sealer(site)
    registry = site["registry"]
    honest_east = registry.samples["east"]
    registry.samples["east"] = np.zeros((60, 2))  # the registry swaps east's sample
    _ask(site, sealer, "join_job", _join_msg(site))
    with pytest.raises(ConfigError, match="the sample of site 'east' .* not the one the job's signed content pins"):
        site["app"].jobs["job-1"].published()
    assert set(registry.fetched) == set(SITES)  # (by the prefetch after the join, and by the request)
    before = len(registry.fetched)
    registry.samples["east"] = honest_east
    _ask(site, sealer, "join_job", _join_msg(site))  # a new join fetches again
    honest = site["app"].jobs["job-1"].published()
    assert [s.shape for s in honest] == [(60, 2), (60, 2)] and registry.fetched[before:] == list(SITES)
    np.testing.assert_array_equal(honest[1], honest_east)
    registry.samples["east"] = np.zeros((60, 2))  # swapped again
    _ask(site, sealer, "join_job", _join_msg(site))  # the same pins: the samples checked before
    again = site["app"].jobs["job-1"].published()
    assert len(registry.fetched) == before + 2 and all(a is b for a, b in zip(again, honest))
    assert not any(a.flags.writeable for a in again)


@pytest.mark.parametrize("limit, rounds", [(1920, 1), (1919, 2)])
def test_samples_kept_between_jobs_are_bounded_in_bytes(site, monkeypatch, limit, rounds):
    """The two 60 x 2 float64 samples (1920 bytes) are kept for the next job within a limit of
    1920 bytes; above the limit, every job fetches them again."""
    monkeypatch.setattr("msa_fed.site.chain.KEEP_SAMPLES_BYTES", limit)
    sealer = _sealer(site)
    for _ in range(2):
        _ask(site, sealer, "join_job", _join_msg(site))
        assert [s.shape for s in site["app"].jobs["job-1"].published()] == [(60, 2), (60, 2)]
    assert site["registry"].fetched == list(SITES) * rounds


def test_after_a_join_the_samples_and_outputs_are_got_ready_and_a_failure_stays_the_requests(site, monkeypatch):
    """Once a join is admitted the site fetches the job's published samples and evaluates the
    predictors on its rows in the background: the samples are fetched once (the request that
    needs them takes them), the outputs are the ones the request would compute, and a
    predictor whose outputs fail the check fails the request that needs them (the background
    raises nothing of its own)."""
    sealer = _sealer(site)
    _ask(site, sealer, "join_job", _join_msg(site))
    worker = site["app"].jobs["job-1"]
    assert worker.published() is worker.published() and site["registry"].fetched == list(SITES)
    H = worker._outputs()
    assert worker._pending_H is None and H.shape == (80, 2)
    np.testing.assert_array_equal(H, worker._compute_outputs())  # the same numbers, computed now

    class Broken:  # the site's own predictor gives NaN on its rows
        classes_ = np.array([0, 1])

        def predict_proba(self, X):
            return np.full((len(X), 2), np.nan)

    own = worker.predictors[0]
    monkeypatch.setattr(site["app"], "_predictor", lambda job, name, sha, kind: Broken() if name == "north" else own)
    _ask(site, sealer, "join_job", _join_msg(site))  # joined again: outputs computed ahead, failing
    broken = site["app"].jobs["job-1"]
    assert broken is not worker and broken._pending_H is not None
    with pytest.raises(ConfigError, match="site 'north''s own predictor"):
        broken._outputs()


def test_no_peer_predictor_runs_ahead_for_a_consortium_the_policy_refuses(site):
    """A join whose consortium the site's policy does not admit (a peer outside its roster) is
    refused and leaves no job behind; and a worker of such a job evaluates nothing ahead (no
    peer's predictor runs on the site's rows for it)."""
    from dataclasses import replace

    from msa_fed.site.worker import SiteWorker

    app = site["app"]
    app.policy = replace(app.policy, peers=("west",))  # east is not a peer of north
    _, refused, _ = _ask(site, _sealer(site), "join_job", _join_msg(site))
    assert isinstance(refused, wire.RemoteError) and refused.rule == "peers" and "job-1" not in app.jobs
    d = app.data
    worker = SiteWorker(
        "north", 0, d["X_labeled"], d["y_labeled"], d["X_unlabeled"], predictors=[object(), object()],
        classes=np.array([0, 1]), policy=app.policy, sites=SITES,
    )  # fmt: skip
    worker._start_outputs()  # predictors that would fail if called: none is
    assert worker._pending_H is None and worker._H is None
