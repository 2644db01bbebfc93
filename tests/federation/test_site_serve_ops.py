"""`msa-fed site serve` for its operator, with real processes: one process per site (a second is
refused naming the first; a killed one leaves no stale lock), a line per job joined, ended and
refused, and approve mode waiting for the operator's approval with the command to run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from cli_runner import run_cli  # noqa: E402
from fedhelpers import job_config, output_dir, site_files  # noqa: E402

from msa_fed.errors import PrivacyError  # noqa: E402
from msa_fed.federation.local import LocalFederation  # noqa: E402
from msa_fed.jobs.run import run_job  # noqa: E402


@pytest.fixture(scope="module")
def files():
    return site_files()


@pytest.fixture(scope="module")
def strict_east(tmp_path_factory, files):
    """Sites east and north in admin mode, east's policy asking one labelled point more than it
    holds (its jobs are refused); shared by the tests that need only two connected sites."""
    two = {n: files[n] for n in ("east", "north")}
    strict = f"[limits]\nmin_points = {files['east'].X_labeled.shape[0] + 1}\n"
    with LocalFederation(tmp_path_factory.mktemp("strict"), two, policies={"east": strict}) as fed:
        fed.wait_connected(timeout=180)
        yield fed


def _cli(*args) -> tuple[int, str, str]:
    """An operator's ``msa-fed ARGS`` (site approve, site status) in this process (tests/cli_runner.py)."""
    return run_cli(*args)


def _wait_for(fed, name, pattern, timeout=180.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, fed.log_text(name), re.M)
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no line matching {pattern!r} in {name}'s log:\n{fed.log_text(name)[-3000:]}")
        time.sleep(0.2)


def test_one_site_serve_per_site(strict_east):
    fed = strict_east
    first = fed.procs["east"]
    second = subprocess.run(
        [sys.executable, "-m", "msa_fed.cli", "site", "serve", "--config", str(fed.config_path("east"))],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stderr.startswith("error: site east is already served by another process (pid ")
    assert f"(pid {first.pid}, started " in second.stderr and second.stderr.count("\n") == 1
    assert "one 'msa-fed site serve' per site" in second.stderr
    assert first.poll() is None and "east" in fed.connected()  # the first one kept its connection
    # killed, not stopped: the kernel drops its lock, and a new process starts
    fed.kill("east")
    fed.spawn("east")
    fed.wait_connected(["east"], timeout=180)
    assert fed.procs["east"].pid != first.pid and fed.procs["east"].poll() is None


def test_approve_mode_waits_for_the_operator_and_serve_logs_each_job(tmp_path, files):
    two = {n: files[n] for n in ("east", "north")}
    with LocalFederation(tmp_path, two, accept_jobs="approve") as fed:
        fed.wait_connected(timeout=180)
        job = job_config(
            "wait-for-me", fed.address, insecure=True, site_timeout_s=60, approval_wait_s=300, **fed.sealing()
        )
        lines, result = [], {}

        def run():
            try:
                result["out"] = run_job(
                    job, fed.admin_token, verbose=False, log=lines.append, output_dir=output_dir(tmp_path)
                )
            except BaseException as exc:  # noqa: BLE001 - checked below
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        for name in two:  # each site prints, once, the exact command its operator runs
            found = _wait_for(fed, name, r"^site \w+: job wait-for-me waits for approval; to admit it run: (.*)$")
            command = shlex.split(found.group(1))
            assert command[:3] == ["msa-fed", "site", "approve"] and command[-1] == str(fed.config_path(name))
            rc, _, err = _cli(*command[1:])
            assert rc == 0, err
        thread.join(600)
        assert "error" not in result, result.get("error")
        assert result["out"][1].site_names == ["east", "north"]
        assert not ray.is_initialized()  # samples this small: the coordinator trains, no stand-in actors
        waits = [line for line in lines if "waits for its operator to approve job wait-for-me" in line]
        assert 1 <= len(waits) <= 2 and all("msa-fed site approve wait-for-me --config site.toml" in w for w in waits)
        for name in two:
            log = fed.log_text(name)
            assert log.count("job wait-for-me waits for approval") == 1, log
            assert re.search(
                rf"^site {name}: joined job wait-for-me \(opened by operator; sites east, north\)$", log, re.M
            )
            assert re.search(
                rf"^site {name}: job wait-for-me ended; answered \d+ \(.*dc_evaluate x\d+.*\); refused 0; "
                r"charged to the rolling day: \d+ dc evaluations, 1 domain model$",
                log,
                re.M,
            ), log

        # site status: its process, the registry, budgets with their refill, the job's outcome
        rc, text, err = _cli("site", "status", "--config", fed.config_path("east"))
        assert rc == 0, err
        assert f"process:  serving, pid {fed.procs['east'].pid}, started " in text, text
        assert "reachable; registered as east; published predictor matches site.toml's predictor" in text, text
        assert re.search(r"domain models: 1 of 10 used in the rolling day, 9 left; 1 come back at 20", text), text
        assert re.search(
            r"job wait-for-me: ended, last seen \S+; answered \d+, refused 0 \(waited for approval\)", text
        ), text
        assert "['" not in text and "{" not in text

        # not approved within the wait: one line with the command, and the site's refusal line
        late = job_config(
            "never-approved", fed.address, insecure=True, site_timeout_s=60, approval_wait_s=3, **fed.sealing()
        )
        with pytest.raises(PrivacyError) as info:
            run_job(late, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(tmp_path))
        text = str(info.value)
        assert "was not approved within 3 s" in text and "msa-fed site approve never-approved" in text
        assert "\n" not in text


def test_a_refusal_is_one_line_in_site_serve(tmp_path, strict_east):
    fed = strict_east
    fed.wait_connected(timeout=180)
    job = job_config("too-strict", fed.address, insecure=True, site_timeout_s=60, **fed.sealing())
    with pytest.raises(PrivacyError):
        run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(tmp_path))
    found = _wait_for(fed, "east", r"^site east: refused (\w+) for job too-strict \(min_points\): (.+)$")
    assert "['" not in found.group(0)
