"""The cluster configs stop only the Ray they started: `python -m msa_fed.runtime.ray_own stop
--temp-dir DIR` signals exactly the Ray processes whose command line names DIR."""

from __future__ import annotations

import subprocess
import sys
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
        done = subprocess.run(
            [sys.executable, "-m", "msa_fed.runtime.ray_own", "stop", "--temp-dir", str(ours), "--grace", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env(),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"stopped 2 process(es) of the Ray in {ours}"
        for p in mine:
            assert p.wait(30) is not None
        assert all(p.poll() is None for p in others)
        again = subprocess.run(
            [sys.executable, "-m", "msa_fed.runtime.ray_own", "stop", "--temp-dir", str(ours)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env(),
        )
        assert again.stdout.strip() == f"no Ray of {ours} was running"
    finally:
        for p in mine + others:
            p.kill()
            p.wait()


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
