"""``ray up`` + ``ray submit`` for real on one machine, with the recipe of docs/OPERATIONS.md:
``deploy/ray-up-local.sh up FOLDER`` (a login whose ``~/.bashrc`` puts this environment on PATH,
a private sshd on loopback reached through ``auth.ssh_proxy_command``, FOLDER/cluster.yaml with
Ray on non-default ports and its own temp dir), then ``ray up`` and ``ray submit`` as documented,
then ``deploy/ray-up-local.sh down FOLDER``.  Needs root, OpenSSH's sshd and rsync (it is skipped
without them).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ops_helpers import REPO, RegistryProcess, env, free_recipe_ports, issue_tokens, publish_sites

LOGIN = "msafedtest"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
RAY = str(Path(sys.executable).parent / "ray")
SCRIPT = REPO / "deploy" / "ray-up-local.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates a login and runs sshd)"),
    pytest.mark.skipif(
        not (Path(SSHD).is_file() and shutil.which("rsync") and shutil.which("ssh-keygen")),
        reason="needs OpenSSH sshd, ssh-keygen and rsync (apt-get install openssh-server rsync)",
    ),
]


def _run(*args, timeout=None, **kwargs):
    """Run a command; on timeout, return what it printed (a CompletedProcess with returncode -9)."""
    try:
        return subprocess.run(
            [str(a) for a in args], capture_output=True, text=True, check=False, timeout=timeout, **kwargs
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return subprocess.CompletedProcess(exc.cmd, -9, out, err + f"\n(timed out after {timeout} s)")


@pytest.fixture
def ray_up_folder():
    """FOLDER set up by deploy/ray-up-local.sh (short: Ray's socket paths live under it); down afterwards."""
    try:
        pwd.getpwnam(LOGIN)
        pytest.skip(f"a login {LOGIN!r} exists already (a previous run's?); remove it with userdel -f {LOGIN}")
    except KeyError:
        pass
    folder = Path(tempfile.mkdtemp(prefix="mfru.", dir="/tmp"))
    base = free_recipe_ports(27600)
    script_env = {**env(), "PY": sys.executable, "LOGIN": LOGIN, "BASE_PORT": str(base)}
    try:
        up = _run("bash", SCRIPT, "up", folder, timeout=120, env=script_env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"Ray GCS to be on 127.0.0.1:{base + 1}" in up.stdout
        yield folder, base + 1
    finally:
        down = _run("bash", SCRIPT, "down", folder, timeout=120, env=script_env)
        assert down.returncode == 0, down.stdout + down.stderr
        with pytest.raises(KeyError):
            pwd.getpwnam(LOGIN)
        for state in Path("/tmp").glob("cluster-msafed-local-*"):
            state.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_ray_up_and_ray_submit_run_the_job(ray_up_folder):
    tmp, gcs = ray_up_folder
    # the federation: a registry (this process's user) and three sites' data, readable by the login
    db = tmp / "registry.db"
    tokens = issue_tokens(db, ("north", "east", "west"))
    for sub in ("site-data", "out"):
        (tmp / sub).mkdir()
    token_file = tmp / "jobs" / "admin_token"
    token_file.write_text(tokens["admin"])
    token_file.chmod(0o600)
    with RegistryProcess(db) as reg:
        publish_sites(reg.address, tokens, tmp / "site-data")
        (tmp / "jobs" / "job.toml").write_text(
            f'name = "ray-up"\n[registry]\naddress = "{reg.address}"\ninsecure = true\n'
            f'admin_token_file = "{token_file}"\n[run]\nsite_data = "{tmp}/site-data/{{site}}.npz"\n'
            f'topology = "cluster"\nray_address = "127.0.0.1:{gcs}"\ndata_channel = "tls"\n'
        )
        cluster_env = {**env(), "HOME": str(tmp / "launcher-home")}
        (tmp / "launcher-home").mkdir()
        up = _run(
            RAY,
            "up",
            "-y",
            "--no-config-cache",
            "--log-style=record",
            tmp / "cluster.yaml",
            timeout=300,
            env=cluster_env,
        )
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        submit = _run(
            RAY,
            "submit",
            tmp / "cluster.yaml",
            REPO / "cluster" / "jobs" / "run_msa.py",
            "--job",
            "~/msa-fed/jobs/job.toml",
            "--output",
            tmp / "out" / "model",
            timeout=900,
            env=cluster_env,
        )
        text = submit.stdout + submit.stderr
        assert submit.returncode == 0, text[-6000:]
        assert "stored combined model version 1" in text
        connecting = [line for line in text.splitlines() if "Connecting to existing Ray cluster at address" in line]
        assert connecting and connecting[0].rstrip(". ").endswith(f":{gcs}"), text[-3000:]
        assert (tmp / "out" / "model" / "manifest.json").is_file()
        # the job file was read from the login's home, where file_mounts copied FOLDER/jobs
        assert (tmp / "home" / "msa-fed" / "jobs" / "job.toml").is_file()
