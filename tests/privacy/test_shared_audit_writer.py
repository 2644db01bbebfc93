"""One audit writer and one ledger for a site process's jobs (msa_fed.privacy.guard): the jobs'
guards append to one chain in order, a guard tells per request whether it wrote (recording()),
closing a finished job leaves the writer open, and a budget check sees what the other jobs'
requests in progress are about to count."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest

from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.audit import AuditLog, verify_log
from msa_fed.privacy.guard import SiteGuard, recording
from msa_fed.privacy.ledger import Ledger
from msa_fed.privacy.policy import SitePolicy


def _writer(tmp_path, **kw) -> tuple[SitePolicy, AuditLog]:
    policy = replace(
        SitePolicy(), audit_log=str(tmp_path / "audit.jsonl"), ledger=str(tmp_path / "ledger.sqlite"), **kw
    )
    return policy, AuditLog(policy.audit_log, ledger=Ledger(policy.ledger))


def _answer(guard: SiteGuard, eta: float = 0.01) -> None:
    with guard.request("dc_evaluate", n_labeled=40, what=["L"]) as dec:
        dec.update(guard.charge("dc_evaluation"))
        dec["eta"] = eta


def test_the_jobs_guards_write_one_chain_through_one_writer_and_closing_one_leaves_it_open(tmp_path):
    policy, audit = _writer(tmp_path)
    jobs = [SiteGuard("a", policy, job=f"job{k}@abc#1", audit=audit) for k in range(3)]
    assert all(g.audit is audit and g.ledger is audit.ledger for g in jobs)
    for _ in range(4):
        for g in jobs:
            _answer(g)
    jobs[0].close()  # a finished job: the writer is the site's, not the job's
    _answer(jobs[1])
    audit.append({"site": "a", "job": "job1", "request": "end_job", "outcome": "noted"})  # the agent's line
    summary = verify_log(policy.audit_log, audit.ledger.anchor(os.path.abspath(policy.audit_log)))
    assert summary["lines"] == 3 * 4 + 2 and summary["requests"] == {"dc_evaluate": 13, "end_job": 1}
    assert [audit.ledger.job_count(f"job{k}@abc#1", "dc_evaluation") for k in range(3)] == [4, 5, 4]
    audit.close()
    audit.ledger.close()


def test_a_guard_refuses_a_shared_writer_of_another_log(tmp_path):
    policy, audit = _writer(tmp_path)
    with pytest.raises(ConfigError, match="is not the site's audit log"):
        SiteGuard("a", replace(policy, audit_log=str(tmp_path / "other.jsonl")), job="j", audit=audit)
    with pytest.raises(ConfigError, match="has no ledger"):
        SiteGuard("a", policy, job="j", audit=AuditLog(policy.audit_log))
    audit.close()
    audit.ledger.close()


def test_recording_counts_this_requests_records_not_another_jobs(tmp_path):
    """While one job's request is in progress, another job's guard writes to the same log from
    another thread: the first request's recording() sees only its own record (a count of the
    log's lines would see two)."""
    policy, audit = _writer(tmp_path)
    first, other = (SiteGuard("a", policy, job=f"{j}@abc#1", audit=audit) for j in ("first", "other"))
    inside, written = threading.Event(), threading.Event()
    seen: list[int] = []

    def other_job():
        inside.wait(30)
        with recording() as rec:
            _answer(other)
        seen.append(rec.records)
        written.set()

    t = threading.Thread(target=other_job)
    t.start()
    with recording() as rec:
        lines = audit.count
        inside.set()
        assert written.wait(30)  # the other job's line is in the log now
        assert not rec.wrote and audit.count == lines + 1
        _answer(first)
    t.join(30)
    assert rec.records == 1 and rec.wrote and seen == [1]
    with recording() as none:  # a refusal before the guard opened a record: nothing written
        pass
    assert not none.wrote
    with pytest.raises(PrivacyError), recording() as refused:
        with first.request("dc_evaluate", n_labeled=40, what=["L"]):
            raise PrivacyError("eta_min", "a", "the request: eta")
    assert refused.records == 1
    audit.close()
    audit.ledger.close()


@pytest.mark.parametrize("kind", ["day", "job"])
def test_two_requests_in_progress_cannot_both_take_a_budgets_last_query(tmp_path, kind):
    """The day's (or a job's) last query, asked by two requests at once (two jobs served
    concurrently, or a retried request): the second sees the first's count held, before either
    is written, and is refused; once written, nothing stays held."""
    if kind == "day":
        policy, audit = _writer(tmp_path, dc_evaluations_per_day=1)
        a, b = (SiteGuard("a", policy, job=f"{j}@abc#1", audit=audit) for j in ("a", "b"))
    else:
        policy, audit = _writer(tmp_path, dc_evaluations_per_job=1)
        a = SiteGuard("a", policy, job="a@abc#1", audit=audit)
        b = SiteGuard("a", policy, job="a@abc#1", audit=audit)  # the same run's key
    with a.request("dc_evaluate", n_labeled=40, what=["L"]) as dec:
        dec.update(a.charge("dc_evaluation"))  # held, not yet written
        with pytest.raises(PrivacyError, match="rule: budget"):
            _answer(b)
    records = audit.records()
    second = "b" if kind == "day" else "a"
    assert [(r["job"], r["outcome"], r.get("rule")) for r in records] == [
        (second, "refused", "budget"),
        ("a", "answered", None),
    ]
    assert audit.ledger.held() == 0
    assert audit.ledger.day_count("dc_evaluation") == 2  # the refusal over budget is counted too
    with pytest.raises(PrivacyError, match="rule: budget"):
        _answer(a)
    audit.close()
    audit.ledger.close()
