"""`job cancel` and `job log` against a real server on port 0 (memory and SQLite stores): a
cancelled job's relay calls are refused with who cancelled it, opening it again too, and a later
run of the same job is served; a job's log keeps the driver's lines in order, within its limits, sent over
one connection."""

from __future__ import annotations

import pytest

from msa_fed.control.ops.client import OpsClient
from msa_fed.control.ops.service import MAX_LOG_LINE_CHARS, MAX_LOG_LINES_PER_CALL
from msa_fed.errors import JobCancelled, RegistryError
from msa_fed.federation.relay_client import RelayClient


@pytest.fixture
def admin(registry, connect):
    token = registry.issue_token("admin", "admin")
    client = connect(token)
    return token, OpsClient(client)


def test_a_cancelled_job_is_refused_at_the_relay_and_says_by_whom(admin, registry, connect, server):
    token, ops = admin
    site = connect(registry.issue_token("site", "east"))
    site.register("east")
    ops.start_job("20260101-000000-aaaaaaaa", "ward-study", ["east"], "federated")
    with RelayClient(server.address, token, insecure=True) as relay:
        relay.open_job("ward-study", ["east"])
        record = ops.finish_job("20260101-000000-aaaaaaaa", "cancelled", 0, "wrong cohort")
        assert record.status == "cancelled"
        assert record.error.startswith("cancelled by admin at ") and record.error.endswith(": wrong cohort")
        with pytest.raises(JobCancelled) as err:  # its calls: refused, naming who cancelled it
            relay.call("ward-study", [], 5.0)
        assert str(err.value).startswith("job ward-study (20260101-000000-aaaaaaaa) was cancelled by admin at ")
        with pytest.raises(JobCancelled):  # and opening it again (a registry restarted since: the same)
            relay.open_job("ward-study", ["east"])
        # the driver's own record of its end does not undo the cancellation
        assert ops.finish_job("20260101-000000-aaaaaaaa", "failed", 0, "JobCancelled").status == "cancelled"
        assert ops.finish_job("20260101-000000-aaaaaaaa", "cancelled", 0, "").error == record.error  # idempotent
        # a new run of the same job (a new record) is served again; a job that ended cannot be cancelled
        ops.start_job("20260101-000001-bbbbbbbb", "ward-study", ["east"], "federated")
        assert relay.open_job("ward-study", ["east"]) == []
        ops.finish_job("20260101-000001-bbbbbbbb", "succeeded", 0, "")
        with pytest.raises(RegistryError) as err:
            ops.finish_job("20260101-000001-bbbbbbbb", "cancelled", 0, "")
        assert err.value.code == "FAILED_PRECONDITION" and "not running (it is succeeded)" in err.value.message
    with pytest.raises(RegistryError) as err:
        ops.finish_job("20260101-000009-cccccccc", "cancelled", 0, "")
    assert err.value.code == "NOT_FOUND"


def test_a_jobs_log_keeps_the_drivers_lines(admin, registry, connect):
    _, ops = admin
    ops.start_job("20260101-000000-aaaaaaaa", "ward-study", ["east"], "federated")
    assert ops.append_job_log("20260101-000000-aaaaaaaa", ["first", "second\nline"]) == (2, 0)
    ops.append_job_log("20260101-000000-aaaaaaaa", ["x" * (MAX_LOG_LINE_CHARS + 50)])
    lines, total, dropped = ops.job_log("20260101-000000-aaaaaaaa")
    assert [(s, t) for s, _, t in lines][:2] == [(1, "first"), (2, "second line")]  # one line each
    assert len(lines[2][2]) == MAX_LOG_LINE_CHARS and (total, dropped) == (3, 0)
    assert [t for _, _, t in ops.job_log("20260101-000000-aaaaaaaa", after=2)[0]] == [lines[2][2]]
    with pytest.raises(RegistryError) as err:
        ops.append_job_log("20260101-000000-aaaaaaaa", ["y"] * (MAX_LOG_LINES_PER_CALL + 1))
    assert err.value.code == "INVALID_ARGUMENT"
    for bad in ("20260101-000009-cccccccc",):  # no such job: nothing stored for it
        with pytest.raises(RegistryError) as err:
            ops.append_job_log(bad, ["z"])
        assert err.value.code == "NOT_FOUND"
    # a site's token reads and writes no job's log
    site = OpsClient(connect(registry.issue_token("site", "east")))
    for call in (lambda: site.job_log("20260101-000000-aaaaaaaa"), lambda: site.append_job_log("x", ["z"])):
        with pytest.raises(RegistryError) as err:
            call()
        assert err.value.code == "PERMISSION_DENIED"


def test_a_jobs_log_stops_at_its_limit(registry):
    from msa_fed.control.ops.service import MAX_LOG_LINES

    store = registry.store
    assert store.append_job_log("j", ["a"] * (MAX_LOG_LINES - 1), 1.0, MAX_LOG_LINES) == (MAX_LOG_LINES - 1, 0)
    assert store.append_job_log("j", ["b", "c", "d"], 2.0, MAX_LOG_LINES) == (MAX_LOG_LINES, 2)
    lines, total, dropped = store.job_log("j", MAX_LOG_LINES - 2, 10)
    assert [(s, t) for s, _, t in lines] == [(MAX_LOG_LINES - 1, "a"), (MAX_LOG_LINES, "b")] and dropped == 2


def test_the_jobs_log_is_sent_over_one_connection(admin, registry, connect, capsys):
    """The driver's lines reach the job's log in batches, all over the job's one connection to the
    registry (not one per batch); a batch the registry refuses keeps its lines and the connection."""
    from msa_fed.control.registry.client import SharedClient
    from msa_fed.jobs.operations import JobLogSender, JobTracker

    token, ops = admin
    opened = []

    def counting():
        opened.append(connect(token))  # a real client of the real server, with its own channel
        return opened[-1]

    shared = SharedClient(counting)
    tracker = JobTracker(shared, "20260101-000000-aaaaaaaa", name="ward-study", topology="federated")
    with shared() as client:
        tracker.start(client, ["east"])
    with JobLogSender(shared, tracker, interval=3600) as sender:  # the batches are sent by hand here
        for k in range(3):
            print(f"round {k}")
            sender.flush()
        print("done")
    lines, total, _ = ops.job_log("20260101-000000-aaaaaaaa")
    assert [t for _, _, t in lines] == ["round 0", "round 1", "round 2", "done"] and total == 4
    assert len(opened) == 1
    # a batch refused (a job the registry does not know): the line is kept, the connection too
    lost = JobTracker(shared, "20260101-000009-cccccccc")
    lost.started = True
    with JobLogSender(shared, lost, interval=3600) as sender:
        print("kept")
        sender.flush()
        assert sender._pending == ["kept"]
    assert len(opened) == 1
    with shared() as client:
        assert client is opened[0] and client.health()
    capsys.readouterr()
