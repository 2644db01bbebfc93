"""Jobs against a registry that restarts, with real processes: a job's end that could not be
recorded is recorded when the registry is back, or the job prints the command that records it.
(A job that goes on after a registry restart mid-job, the relay's job opened again and the sites
reconnected: tests/ops/test_ops_walkthrough.py, whose job lives through one.)"""

from __future__ import annotations

import shlex
import threading
import time

from ops_helpers import RegistryProcess, cli, issue_tokens

from msa_fed.control.ops.client import OpsClient
from msa_fed.control.registry.client import RegistryClient
from msa_fed.jobs.operations import JobTracker


def test_a_jobs_end_is_recorded_when_the_registry_is_back(tmp_path):
    db = tmp_path / "registry.db"
    tokens = issue_tokens(db, [])
    with RegistryProcess(db) as reg:
        address = reg.address

        def connect():
            return RegistryClient(address, tokens["admin"], insecure=True, retries=0)

        lines: list[str] = []
        tracker = JobTracker(connect, name="late", topology="federated", log=lines.append, finish_retry_s=120)
        with connect() as client:
            tracker.start(client, ["a", "b"])
        reg.stop()
        ended = threading.Thread(target=tracker.failed, args=(RuntimeError("a site went away"),))
        ended.start()
        deadline = time.monotonic() + 120  # the registry is back once the job found it away
        while not any("the registry is unreachable; retrying" in line for line in lines):
            assert time.monotonic() < deadline and ended.is_alive(), lines
            time.sleep(0.05)
        reg.start()
        ended.join(180)
        assert not ended.is_alive()
        with connect() as client:
            record = OpsClient(client).get_job(tracker.job_id)
        assert record.status == "failed" and "a site went away" in record.error
        assert any("the registry is unreachable; retrying" in line for line in lines)
        assert not any(line.startswith("warning:") for line in lines), lines

        # the registry stays away past the retry: one line with the command that records the end
        tracker = JobTracker(
            connect,
            name="later",
            topology="federated",
            log=lines.append,
            finish_retry_s=2,
            flags=["--registry", address, "--insecure", "--admin-token-file", str(tmp_path / "admin")],
        )
        with connect() as client:
            tracker.start(client, ["a", "b"])
        reg.stop()
        tracker.failed(RuntimeError("gone"))
        warning = lines[-1]
        assert warning.startswith(f"warning: the end of job {tracker.job_id} could not be recorded in the registry (")
        assert "'msa-fed job list' shows it as running until it is" in warning
        reg.start()
        (tmp_path / "admin").write_text(tokens["admin"])
        command = shlex.split(warning.split("Record it with: ", 1)[1])
        assert command[:3] == ["msa-fed", "job", "finish"]
        rc, printed, err = cli(*command[1:])
        assert rc == 0 and f"job {tracker.job_id} recorded as failed" in printed, err
        with connect() as client:
            assert OpsClient(client).get_job(tracker.job_id).status == "failed"
