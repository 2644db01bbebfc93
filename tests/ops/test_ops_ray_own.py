"""The cluster configs stop only the Ray they started: `python -m msa_fed.runtime.ray_own stop
--temp-dir DIR` signals exactly the Ray processes whose command line names DIR."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from ops_helpers import REPO, env

SLEEPER = "import sys, time; time.sleep(600)"


def _fake_ray(folder: Path, *args: str) -> subprocess.Popen:
    """A process whose command line looks like one of Ray's: a script under a ray/ folder."""
    script = folder / "ray" / "_private" / "workers" / "default_worker.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SLEEPER)
    return subprocess.Popen([sys.executable, str(script), *args])


def _stop(temp_dir: Path, grace: int | None = None) -> subprocess.CompletedProcess:
    """``python -m msa_fed.runtime.ray_own stop --temp-dir TEMP_DIR [--grace GRACE]``, run to its end."""
    extra = [] if grace is None else ["--grace", str(grace)]
    return subprocess.run(
        [sys.executable, "-m", "msa_fed.runtime.ray_own", "stop", "--temp-dir", str(temp_dir), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
    )


def test_only_the_ray_of_its_temp_dir_is_stopped(tmp_path):
    ours, theirs = tmp_path / "msa-fed-ray", tmp_path / "other-ray"
    mine = [
        _fake_ray(tmp_path, f"--temp-dir={ours}"),
        _fake_ray(tmp_path, f"--session-dir={ours}/session_2026_1/logs"),
    ]
    others = [
        _fake_ray(tmp_path, f"--temp-dir={theirs}"),
        _fake_ray(tmp_path, f"--temp-dir={ours}-2"),  # a neighbour whose name starts the same
        subprocess.Popen([sys.executable, "-c", SLEEPER, f"{ours}/session_2026_1/logs/raylet.out"]),  # not Ray
    ]
    try:
        done = _stop(ours, 5)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"stopped 2 process(es) of the Ray in {ours}"
        for p in mine:
            assert p.wait(30) is not None
        assert all(p.poll() is None for p in others)
        again = _stop(ours)
        assert again.stdout.strip() == f"no Ray of {ours} was running"
    finally:
        for p in mine + others:
            p.kill()
            p.wait()


#: a Ray process that goes argv[3] seconds after SIGTERM, noting argv[2] in the file argv[1] then
SLOW_TO_GO = """
import signal, sys, time
def bye(*_):
    time.sleep(float(sys.argv[3]))
    with open(sys.argv[1], "a") as f:
        f.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
time.sleep(600)
"""


def test_the_gcs_server_is_stopped_after_the_rest_of_its_ray(tmp_path):
    """Signalled together, Ray's GCS server outlives the raylet's shutdown by the whole grace
    period; ray_own signals it once the other processes are gone.  (Here the GCS would go first
    if it were signalled with the raylet, which takes a second.)"""
    ours, log = tmp_path / "msa-fed-ray", tmp_path / "went.txt"
    (tmp_path / "ray" / "_private" / "workers").mkdir(parents=True)
    raylet_script = tmp_path / "ray" / "_private" / "workers" / "raylet_like.py"
    raylet_script.write_text(SLOW_TO_GO)
    gcs = tmp_path / "ray" / "core" / "src" / "ray" / "gcs" / "gcs_server"  # the program's name is what counts
    gcs.parent.mkdir(parents=True)
    gcs.symlink_to(Path(sys.executable).resolve())
    procs = [
        subprocess.Popen([str(gcs), "-I", "-c", SLOW_TO_GO, str(log), "gcs", "0", f"--log_dir={ours}/session_1/logs"]),
        subprocess.Popen([sys.executable, str(raylet_script), str(log), "raylet", "1", f"--temp-dir={ours}"]),
    ]
    try:
        deadline = time.monotonic() + 60  # both have set their SIGTERM handler (a started interpreter)
        while not all(_catches_sigterm(p.pid) for p in procs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        done = _stop(ours, 60)
        assert done.returncode == 0 and done.stdout.strip() == f"stopped 2 process(es) of the Ray in {ours}"
        assert [p.wait(30) for p in procs] == [0, 0]  # both went on SIGTERM (none was killed)
        assert log.read_text().split() == ["raylet", "gcs"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _catches_sigterm(pid: int) -> bool:
    caught = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def _commands(cfg: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    return [c for k in keys for c in cfg.get(k) or []]


def test_cluster_configs_never_stop_a_ray_they_did_not_start():
    for rel in ("cluster/onprem.yaml", "cluster/aws-example.yaml"):
        cfg = yaml.safe_load((REPO / rel).read_text())
        commands = _commands(cfg)
        text = "\n".join(commands)
        # their own Ray: started with its own temp dir, stopped by it; `ray down`'s own `ray stop`
        # goes through the login shell's function that does the same
        assert "ray_own stop --temp-dir /tmp/msa-fed-ray" in text, rel
        for c in commands:
            for part in c.replace(";", "\n").replace("&&", "\n").splitlines():
                words = part.split()
                if "stop" in words and "ray" in words:
                    assert "ray_own" in part or "command ray" in part, (rel, part)
        starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
        assert starts and all("--temp-dir=/tmp/msa-fed-ray" in c for c in starts), rel
        init = "\n".join(cfg["initialization_commands"])
        assert "ray() {" in init and "msa_fed.runtime.ray_own stop --temp-dir /tmp/msa-fed-ray" in init, rel


def test_the_ray_client_server_and_the_children_of_its_ray_are_stopped_too(tmp_path):
    """`ray start --head` also starts `python -m ray.util.client.server --address=HOST:GCS_PORT`,
    whose command line names no temp dir, only the GCS's port; the raylet's agents and workers
    rename themselves (``ray::IDLE``).  The stop finds the client server by the port its GCS
    listens on, and the children of the Ray's processes; another Ray's client server stays."""
    ours = tmp_path / "msa-fed-ray"
    fake = tmp_path / "fakeray"
    pkg = fake / "ray" / "util" / "client"
    pkg.mkdir(parents=True)
    for folder in (fake / "ray", fake / "ray" / "util", pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "server.py").write_text(SLEEPER)
    renamed = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    )
    gcs = _fake_ray(tmp_path, f"--log_dir={ours}/session_1/logs", "--gcs_server_port=29911")
    raylet_script = tmp_path / "ray" / "raylet.py"
    raylet_script.write_text(renamed)
    raylet = subprocess.Popen([sys.executable, str(raylet_script), f"--temp-dir={ours}"])

    def client_server(port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ray.util.client.server", f"--address=192.0.2.2:{port}", "--port=29912"],
            env={**env(), "PYTHONPATH": str(fake)},
        )

    mine, theirs = client_server(29911), client_server(29921)
    try:
        deadline = time.monotonic() + 60  # the raylet's child is started (seconds on a loaded machine)
        while not (child := _children(raylet.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(child) == 1
        done = _stop(ours, 5)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"stopped 4 process(es) of the Ray in {ours}", done.stdout
        for p in (gcs, raylet, mine):
            assert p.wait(30) is not None
        assert not Path(f"/proc/{child[0]}").exists() or _state(child[0]) == "Z"
        assert theirs.poll() is None  # another Ray's client server
    finally:
        for p in (gcs, raylet, mine, theirs):
            p.kill()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
