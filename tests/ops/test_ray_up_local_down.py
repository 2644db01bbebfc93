"""``deploy/ray-up-local.sh down FOLDER`` leaves no process behind, with a real Ray on 127.0.0.1.

``up`` needs root and OpenSSH's sshd (tests/ops/test_ops_ray_up.py runs the whole recipe where
they are); what ``down`` must stop is what ``ray up`` starts on the head.  So this runs the
recipe's own ``FOLDER/cluster.yaml`` (written by the script's generator, as ``up`` writes it)
``head_start_ray_commands`` in the environment its login's ``~/.bashrc`` gives them (this
Python on PATH, RAY_AUTH_MODE=token with the token in FOLDER/home/.ray), then ``down``: every
process of that Ray (the GCS, the raylet, its agents and workers, and the Ray client server,
which names only the GCS's port) is gone, and no socket listens on the recipe's ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ops_helpers import REPO, env, free_recipe_ports

SCRIPT = REPO / "deploy" / "ray-up-local.sh"
LOGIN = "msafed-down-test"  # no such login: `down` removes none


def _cluster_yaml(folder: Path, base: int) -> dict:
    """FOLDER/cluster.yaml as ``up`` writes it: the script's own generator (its Python here-doc)."""
    text = SCRIPT.read_text()
    generator = text.split('"$SITE_RESOURCES" "$PY" <<\'EOF\'\n', 1)[1].split("\nEOF\n", 1)[0]
    resources = '{"site:north": 1}'
    args = [str(folder), LOGIN, "0", str(base + 1), str(base), resources, sys.executable]
    subprocess.run([sys.executable, "-c", generator, *args], check=True, timeout=60)
    return json.loads((folder / "cluster.yaml").read_text())


def _processes() -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            out[int(entry.name)] = [w.decode("utf-8", "replace") for w in words if w]
    return out


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _this_ray(folder: Path, gcs: int) -> set[int]:
    """The processes of the Ray started in FOLDER: those whose command line names FOLDER, the
    Ray client server of its GCS port, and their children."""
    procs = _processes()
    found = {
        pid
        for pid, words in procs.items()
        if any(str(folder) in w for w in words)
        or ("ray.util.client.server" in words[1:3] and any(w.endswith(f":{gcs}") for w in words))
    }
    parents = {pid: _parent(pid) for pid in procs}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found and pid not in found}
        found |= more
        grew = bool(more)
    return {pid for pid in found if pid != os.getpid()}


def _listening(ports: set[int]) -> set[int]:
    """Which of ``ports`` a TCP socket of this machine listens on (/proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port in ports:  # 0A: LISTEN
                out.add(port)
    return out


def test_down_stops_every_process_of_the_recipes_ray_and_frees_its_ports():
    folder = Path(tempfile.mkdtemp(prefix="mfrd.", dir="/tmp"))  # short: Ray's socket paths live under it
    base = free_recipe_ports(31600)
    gcs = base + 1
    ports = {*range(base, base + 9), *range(base + 100, base + 200)}
    started: set[int] = set()
    try:
        config = _cluster_yaml(folder, base)
        home = folder / "home"
        (home / ".ray").mkdir(parents=True)
        token = home / ".ray" / "auth_token"
        token.write_text(os.urandom(32).hex() + "\n")
        token.chmod(0o600)
        login_env = {
            **env(),
            "HOME": str(home),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "RAY_AUTH_MODE": "token",
            # a loaded two-core machine starts a node's dashboard agent slowly
            "RAY_agent_register_timeout_ms": "120000",
        }
        # `ray up` runs these in order (the first stops what an earlier start left); `ray start`
        # gives up when its raylet has not registered within 30 s (fixed in Ray), which a loaded
        # machine can take: the recipe starts once more, and this test runs the list up to 3 times
        for _ in range(3):
            for command in config["head_start_ray_commands"]:
                done = subprocess.run(
                    ["bash", "-c", command], env=login_env, capture_output=True, text=True, timeout=400, check=False
                )
                if done.returncode != 0:
                    break
            if done.returncode == 0:
                break
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        started = _this_ray(folder, gcs)
        words = _processes()
        programs = {Path(words[p][0]).name for p in started if words.get(p)}
        assert "gcs_server" in programs and "raylet" in programs, programs
        client_servers = [p for p in started if "ray.util.client.server" in words.get(p, [])[1:3]]
        assert client_servers, "ray start --head started no client server (the process `down` once left behind)"
        assert {gcs, base + 2} <= _listening(ports)  # the GCS and the client server

        down = subprocess.run(
            ["bash", str(SCRIPT), "down", str(folder)],
            env={**env(), "PY": sys.executable, "LOGIN": LOGIN},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stopped: sshd, the Ray of" in down.stdout
        left = {p for p in started | _this_ray(folder, gcs) if _alive(p)}
        assert not left, {p: _processes().get(p) for p in left}
        assert not _listening(ports), _listening(ports)
    finally:
        for pid in started | _this_ray(folder, gcs):  # what this test started, if the check failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(folder, ignore_errors=True)
