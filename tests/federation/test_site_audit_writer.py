"""One audit writer per site process: two jobs served at once by one real `msa-fed site serve`
process (through a real registry's relay) write one hash-chained log, its length anchored in the
site's one ledger, with exactly one record per request (the policy guard's where it checked the
request, else the agent's), and `msa-fed site audit --log F --ledger L` accepts it.  A refusal
is recorded once, whether the policy's checks refused (eta_min, peers) or the agent (a request
without the state it builds on)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
from fedhelpers import cli_here, site_files

from msa_fed.boundary import messages as m
from msa_fed.boundary.wire import RemoteError
from msa_fed.core.density import KDEDomainModel
from msa_fed.federation.local import LocalFederation
from msa_fed.federation.relay_client import RelayClient
from msa_fed.privacy.audit import verify_log
from msa_fed.privacy.ledger import Ledger

PAIR = ("east", "north")
ROUNDS = 6  # DC evaluations per job: enough for the two jobs' lines to interleave


@pytest.fixture(scope="module")
def files():
    return site_files()


@pytest.fixture(scope="module")
def fed(tmp_path_factory, files):
    # east federates with north only: a job that names west is refused at its join
    strict = '[limits]\npeers = ["north"]\n'
    with LocalFederation(tmp_path_factory.mktemp("onelog"), files, sealed=False, policies={"east": strict}) as fed:
        fed.wait_connected(timeout=180)
        yield fed


def _setup(fed, job: str, sites, site: str) -> m.JobSetup:
    shas = tuple(hashlib.sha256(fed.sites[n].predictor).hexdigest() for n in sites)
    return m.JobSetup(
        job_id=job, sites=tuple(sites), index=list(sites).index(site), predictor_sha256=shas,
        task="classification", loss="cross_entropy", classes=np.array([0, 1]), min_points=20,
    )  # fmt: skip


def _one(relay: RelayClient, job: str, site: str, method: str, msg, sent: Counter):
    sent[(site, method)] += 1
    return relay.call(job, [(site, method, msg)], 120)[0]


def _serve_one_job(fed, files, job: str, sent: Counter, errors: list, rounds: threading.Barrier) -> None:
    """A job's honest requests at both sites, one refused by east's policy (eta_min) and one
    refused by north's process (no Qhat yet: its state is missing).  The two jobs' joins, domain
    models and DC rounds go in lockstep (``rounds``): each step's two requests are in flight at
    once."""
    try:
        with RelayClient(fed.address, fed.admin_token, insecure=True) as relay:
            relay.open_job(job, list(PAIR))
            rounds.wait()  # both jobs join at once (each site fetches its peer's predictor)
            for site in PAIR:
                info = _one(relay, job, site, "join_job", _setup(fed, job, PAIR, site), sent)
                assert isinstance(info, m.SiteInfo), (site, str(info))
            model = KDEDomainModel(bandwidth=1.0).fit([files[n].X_unlabeled for n in PAIR])
            spec = m.domain_model_spec(model, len(PAIR))
            rounds.wait()  # both jobs' models at once (each site fetches the job's published samples)
            parts = [_one(relay, job, site, "set_domain_model", spec, sent) for site in PAIR]
            assert all(isinstance(p, m.QhatPartial) for p in parts), parts
            qhat = sum(p.sums for p in parts)
            qhat = qhat / qhat.sum()
            assert isinstance(_one(relay, job, "east", "set_qhat", m.QhatBroadcast(qhat=qhat, eta=0.01), sent), m.Ack)
            z = np.array([0.5, 0.5])
            for _ in range(ROUNDS):
                rounds.wait()
                out = _one(relay, job, "east", "dc_evaluate", m.DCRequest(z=z, eta=0.01, what=("L",)), sent)
                assert isinstance(out, m.DCPartial), out
            refused = _one(relay, job, "east", "dc_evaluate", m.DCRequest(z=z, eta=1e-9, what=("L",)), sent)
            assert isinstance(refused, RemoteError) and refused.rule == "eta_min", refused
            assert isinstance(_one(relay, job, "east", "max_bound", None, sent), m.BoundMax)
            assert isinstance(_one(relay, job, "east", "ping", None, sent), m.Ack)
            lost = _one(relay, job, "north", "max_bound", None, sent)  # north has no point set: no Qhat
            assert isinstance(lost, RemoteError) and lost.kind == "SiteStateLost", lost
            relay.close_job(job)
            for site in PAIR:
                sent[(site, "end_job")] += 1
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        errors.append(exc)
        rounds.abort()


def _records(fed, site: str) -> list[dict]:
    return [json.loads(x) for x in (fed.workdir / site / "audit.jsonl").read_text().splitlines()]


def _wait_for(predicate, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_two_concurrent_jobs_write_one_chained_log_with_one_record_per_request(fed, files):
    before = {site: len(_records(fed, site)) for site in PAIR}
    jobs = ("onelog-a", "onelog-b")
    sent = {job: Counter() for job in jobs}
    errors: list = []
    rounds = threading.Barrier(len(jobs), timeout=300)
    threads = [
        threading.Thread(target=_serve_one_job, args=(fed, files, job, sent[job], errors, rounds)) for job in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    ends = sum(sent[job][(site, "end_job")] for job in jobs for site in PAIR)
    _wait_for(lambda: sum(r["request"] == "end_job" for s in PAIR for r in _records(fed, s)[before[s] :]) == ends)

    for site in PAIR:
        records = _records(fed, site)[before[site] :]
        for job in jobs:
            got = Counter(r["request"] for r in records if r["job"] == job)
            want = Counter({method: n for (s, method), n in sent[job].items() if s == site})
            # one each: the policy guard's (set_domain_model, set_qhat, dc_evaluate, max_bound) and
            # the agent's (join_job, ping, end_job, and north's refused max_bound)
            assert got == want, (site, job, got, want)
        first = [r for r in records if r["job"] == jobs[0]]
        if site == "east":
            (refused,) = [r for r in first if r["outcome"] == "refused"]
            assert (refused["request"], refused["rule"]) == ("dc_evaluate", "eta_min")
            assert "run" in refused  # written by the job's policy guard
        else:
            (lost,) = [r for r in first if r["outcome"] == "refused"]
            assert (lost["request"], lost["rule"]) == ("max_bound", "SiteStateLost") and "run" not in lost
        # the two jobs' DC rounds were answered at the same time: their lines interleave in the log
        order = [r["job"] for r in records if r["job"] in jobs and r["request"] == "dc_evaluate"]
        if site == "east":
            assert sum(a != b for a, b in zip(order, order[1:])) >= ROUNDS, order

        # one chain, anchored in the one ledger; the operator's verifier accepts it
        path, ledger_path = fed.workdir / site / "audit.jsonl", fed.workdir / site / "audit.ledger.db"
        ledger = Ledger(str(ledger_path))
        try:
            anchor = ledger.anchor(str(path.resolve()))
            for job in jobs:  # each job's charges are in the shared ledger, under its run
                (run,) = {r["run"] for r in records if r["job"] == job and "run" in r}
                if site == "east":
                    assert ledger.job_count(run, "dc_evaluation") == 1 + ROUNDS + 1 + 1  # qhat, DC, refused, max
                assert ledger.job_count(run, "domain_model") == 1
        finally:
            ledger.close()
        summary = verify_log(path, anchor)
        assert anchor is not None and anchor[0] == summary["lines"] == len(_records(fed, site))
        out = cli_here("site", "audit", "--log", path, "--ledger", ledger_path)
        assert out.returncode == 0 and "chain intact" in out.stdout and "matches the ledger" in out.stdout, out


def test_a_join_refused_by_the_policy_is_recorded_once(fed):
    """east's policy refuses a job that names west (peers): its guard records the refused join
    (rule peers, the job's sizes), and the agent adds no second record of the same request."""
    before = len(_records(fed, "east"))
    job, sites = "onelog-stranger", ("east", "north", "west")
    with RelayClient(fed.address, fed.admin_token, insecure=True) as relay:
        relay.open_job(job, list(sites))
        out = relay.call(job, [("east", "join_job", _setup(fed, job, sites, "east"))], 120)[0]
        relay.close_job(job)
    assert isinstance(out, RemoteError) and (out.rule, out.site) == ("peers", "east"), out
    records = [r for r in _records(fed, "east")[before:] if r["job"] == job]
    assert len(records) == 1, records
    (rec,) = records
    assert (rec["request"], rec["outcome"], rec["rule"]) == ("join", "refused", "peers")
    assert rec["sizes"] == {"n_sources": 3, "sites": list(sites)}
    verify_log(fed.workdir / "east" / "audit.jsonl")
