"""ensure_ray starts a local Ray again once when Ray's own start-up waits run out (a loaded machine,
or a new head's GCS beside another Ray that never wrote its port file), and only then."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from msa_fed.runtime import ray_actors  # noqa: E402


@pytest.fixture
def fake_init(monkeypatch):
    calls: list[dict] = []
    errors: list[Exception] = []

    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return calls, errors


@pytest.mark.parametrize(
    "message",
    [
        "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0a1b",
        "The current node timed out during startup. This could happen because ...",
    ],
)
def test_a_start_that_timed_out_is_tried_again_once(fake_init, message):
    calls, errors = fake_init
    errors.append(RuntimeError(message))
    ray_actors.ensure_ray(num_cpus=2)
    assert len(calls) == 2 and all(c["address"] == "local" and c["num_cpus"] == 2 for c in calls)


def test_a_second_time_out_and_any_other_error_are_raised(fake_init):
    calls, errors = fake_init
    errors.extend([RuntimeError("Timed out waiting for file a"), RuntimeError("Timed out waiting for file b")])
    with pytest.raises(RuntimeError, match="file b"):
        ray_actors.ensure_ray()
    assert len(calls) == ray_actors.RAY_START_ATTEMPTS
    calls.clear()
    errors.append(ValueError("bad argument"))
    with pytest.raises(ValueError):
        ray_actors.ensure_ray()
    assert len(calls) == 1


def test_a_dashboard_that_fails_to_start_is_one_info_line_not_ray_errors(fake_init, monkeypatch, caplog):
    """Ray starts its dashboard process even with include_dashboard=False and, when that process
    dies at start, logs ERROR lines (the failure and the dashboard log's tail) on the user's
    terminal, then runs on without it: ensure_ray turns them into one INFO line. Any other Ray
    error still reaches Ray's handlers, and the filter is gone after the start."""
    import logging

    calls, _ = fake_init
    services = logging.getLogger("ray._private.services")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    services.addHandler(handler)

    def init(**kwargs):  # what Ray 2.60's services.start_api_server logs when the process dies
        calls.append(kwargs)
        services.error("Failed to start the dashboard , return code -6")
        services.error("Error should be written to 'dashboard.log' or 'dashboard.err'. We are printing ...")
        services.error("The last 20 lines of /tmp/ray/session_x/logs/dashboard.log (it contains the error ...")
        services.error("GCS did something else")

    monkeypatch.setattr(ray, "init", init)
    try:
        with caplog.at_level(logging.INFO, logger="msa_fed.runtime.ray_actors"):
            ray_actors.ensure_ray(num_cpus=2)
        assert calls[-1]["include_dashboard"] is False
        assert seen == ["GCS did something else"], seen
        assert [r.getMessage() for r in caplog.records if r.name == "msa_fed.runtime.ray_actors"] == [
            "Ray's dashboard process did not start (not used: started with include_dashboard=False)"
        ]
        services.error("Failed to start the dashboard , return code -6")  # after the start: not filtered
        assert seen[-1].startswith("Failed to start the dashboard")
    finally:
        services.removeHandler(handler)


def test_a_new_local_ray_keeps_its_token_readable_by_the_user_only(tmp_path, monkeypatch, fake_init):
    """Ray's token check is on for a new local Ray (RAY_AUTH_MODE unset or "token"); the token
    file Ray would write 0644 is made 0600 first, or narrowed to 0600; a token named in the
    environment, or the check turned off, leaves the home untouched."""
    import os
    import stat

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    token = tmp_path / ".ray" / "auth_token"
    ray_actors.ensure_ray(num_cpus=1)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    first = token.read_text()
    os.chmod(token, 0o644)  # left by an earlier Ray
    ray_actors.ensure_ray(num_cpus=1)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == first  # narrowed, kept
    token.unlink()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "given"))
    assert ray_actors.private_token_file() is None
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_actors.ensure_ray(num_cpus=1)
    assert not token.exists()
    # attaching to a running Ray (an address) never writes the user's token
    monkeypatch.delenv("RAY_AUTH_MODE")
    ray_actors.ensure_ray(address="127.0.0.1:1")
    assert not token.exists() and fake_init[0][-1]["address"] == "127.0.0.1:1"


def _ray_like(tmp_path, name: str):
    """A child process whose command line runs a file of a ray/ package (as a local Ray's GCS or
    monitors do)."""
    import subprocess
    import sys

    script = tmp_path / name / "ray" / "_private" / "log_monitor.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, str(script)])
    # Popen can return before the kernel has set the new program's command line (a vfork'd
    # child's parent resumes before execve writes the arguments): wait until it shows, as a
    # Ray process's does long before anyone looks for it
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while str(script).encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_the_ray_processes_of_this_process_are_found_and_no_other(tmp_path):
    """ray_children: a child that runs a file of a ray/ package, alive; not another child, and not
    one that has exited but is not yet waited for."""
    import os
    import subprocess
    import sys

    plain = tmp_path / "sleeper.py"
    plain.write_text("import time; time.sleep(600)")
    procs = [_ray_like(tmp_path, "a"), subprocess.Popen([sys.executable, str(plain)])]
    try:
        found = ray_actors.ray_children()
        assert procs[0].pid in found and found[procs[0].pid].endswith("ray/_private/log_monitor.py")
        assert procs[1].pid not in found
        procs[0].kill()
        os.waitid(os.P_PID, procs[0].pid, os.WEXITED | os.WNOWAIT)  # exited, still to be reaped
        assert procs[0].pid not in ray_actors.ray_children()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_start_that_timed_out_leaves_no_process_of_its_node(fake_init, tmp_path):
    """A local Ray whose start failed half-way (its GCS and monitors up, its raylet too slow) is out
    of ray.shutdown's reach: ensure_ray stops the Ray processes the failed start left, before it
    tries again (and when it gives up), and leaves the ones that ran before alone."""
    from pathlib import Path

    calls, errors = fake_init
    earlier = _ray_like(tmp_path, "earlier")  # another Ray of this process, running before
    left: list = []

    def half_started(**kwargs):
        calls.append(kwargs)
        if errors:
            left.append(_ray_like(tmp_path, f"attempt{len(calls)}"))
            raise errors.pop(0)

    ray.init = half_started  # (fake_init's monkeypatch puts the real one back)
    try:
        errors.append(RuntimeError("The current node timed out during startup."))
        ray_actors.ensure_ray(num_cpus=2)
        assert len(calls) == 2 and len(left) == 1
        assert not Path(f"/proc/{left[0].pid}").exists()  # stopped and waited for
        errors.extend([RuntimeError("Timed out waiting for file a"), RuntimeError("Timed out waiting for file b")])
        with pytest.raises(RuntimeError, match="file b"):
            ray_actors.ensure_ray(num_cpus=2)
        assert len(left) == 3 and not any(Path(f"/proc/{p.pid}").exists() for p in left[1:])
        assert earlier.poll() is None and earlier.pid in ray_actors.ray_children()
    finally:
        earlier.kill()
        earlier.wait()
