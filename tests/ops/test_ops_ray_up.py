"""``ray up`` + ``ray submit`` for real on one machine: the cluster launcher's local provider
reaches "the head" over SSH to a private sshd on loopback, as a dedicated unprivileged user.

What it takes (so the test needs root, OpenSSH's sshd and rsync; it is skipped without them):
- a login for the cluster (``ray up`` and ``ray submit`` log in as ``auth.ssh_user`` and run a
  login shell whose ``~/.bashrc`` puts the environment with msa_fed and Ray on PATH).  Here the
  Python environment lives under /root (mode 0700), which no other user can read, so the login
  is an alias of root (uid 0) with its own home in the test's folder: the launcher's ``~``
  paths land there, and root's own home and shell files stay untouched;
- an sshd on 127.0.0.1 on a free port with a host key and an authorised key made here; the
  launcher has no SSH port setting, so ``auth.ssh_proxy_command`` relays to that port;
- Ray started by ``head_start_ray_commands`` on non-default ports with its own temp dir (never
  ``ray stop``, which would stop every Ray of that user on the machine), stopped by PID at the end.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ops_helpers import REPO, RegistryProcess, env, issue_tokens, publish_sites

USER = "msafedtest"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
RAY = str(Path(sys.executable).parent / "ray")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates a user and runs sshd)"),
    pytest.mark.skipif(
        not (Path(SSHD).is_file() and shutil.which("rsync") and shutil.which("ssh-keygen")),
        reason="needs OpenSSH sshd, ssh-keygen and rsync (apt-get install openssh-server rsync)",
    ),
]

PROXY = """import socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        b = sys.stdin.buffer.raw.read(65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    sys.stdout.buffer.write(b)
    sys.stdout.buffer.flush()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _kill_processes_mentioning(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (a path unique to this test)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def ssh_head():
    """(tmp dir, ssh port, private key): a user and a private sshd on loopback; removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="mfru.", dir="/tmp"))
    tmp.chmod(0o755)
    home = tmp / "home"
    home.mkdir()
    try:
        pwd.getpwnam(USER)
        pytest.skip(f"a user {USER!r} exists already (a previous run's?); remove it with userdel -f {USER}")
    except KeyError:
        pass
    made = _run("useradd", "-o", "-u", "0", "-g", "0", "-M", "-d", home, "-s", "/bin/bash", USER)
    assert made.returncode == 0, made.stderr
    user = pwd.getpwnam(USER)
    sshd = None
    try:
        assert _run("usermod", "-p", "*", USER).returncode == 0  # no password, but not a locked account
        assert _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp / "id_ed25519").returncode == 0
        assert _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp / "host_key").returncode == 0
        (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
        (home / ".ssh" / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
        (home / ".bashrc").write_text(
            f"export PATH={Path(sys.executable).parent}:$PATH\nexport PYTHONPATH={REPO}\nexport GRPC_VERBOSITY=ERROR\n"
        )
        port = _free_port()
        (tmp / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host_key'}\nPidFile {tmp / 'sshd.pid'}\n"
            "AuthorizedKeysFile .ssh/authorized_keys\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"UsePAM no\nAllowUsers {USER}\nPermitRootLogin prohibit-password\nStrictModes no\n"
        )
        (tmp / "proxy.py").write_text(PROXY)
        Path("/run/sshd").mkdir(exist_ok=True)
        sshd = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "sshd.log", "w"),
        )  # noqa: SIM115
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield tmp, port, user
    finally:
        _kill_processes_mentioning(str(tmp))
        if sshd is not None:
            sshd.terminate()
            sshd.wait(timeout=30)
        _run("userdel", "-f", USER)  # the alias only (-f: its uid is root's, always "in use")
        for state in Path("/tmp").glob("cluster-msafed-test-*"):
            state.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_up_and_ray_submit_run_the_job(ssh_head):
    tmp, ssh_port, user = ssh_head
    # the federation: a registry (this process's user) and three sites' data, readable by the cluster's user
    db = tmp / "registry.db"
    tokens = issue_tokens(db, ("north", "east", "west"))
    for sub in ("jobs", "site-data", "out", "ray"):
        (tmp / sub).mkdir()
    token_file = tmp / "jobs" / "admin_token"
    token_file.write_text(tokens["admin"])
    token_file.chmod(0o600)
    with RegistryProcess(db) as reg:
        publish_sites(reg.address, tokens, tmp / "site-data")
        gcs = _free_port()
        ports = [_free_port() for _ in range(6)]
        (tmp / "jobs" / "job.toml").write_text(
            f'name = "ray-up"\n[registry]\naddress = "{reg.address}"\ninsecure = true\n'
            f'admin_token_file = "{token_file}"\n[run]\nsite_data = "{tmp}/site-data/{{site}}.npz"\n'
            f'topology = "cluster"\nray_address = "127.0.0.1:{gcs}"\ndata_channel = "tls"\n'
        )
        name = f"msafed-test-{secrets.token_hex(3)}"
        config = {
            "cluster_name": name,
            "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
            "auth": {
                "ssh_user": USER,
                "ssh_private_key": str(tmp / "id_ed25519"),
                "ssh_proxy_command": f"{sys.executable} {tmp / 'proxy.py'} 127.0.0.1 {ssh_port}",
            },
            "min_workers": 0,
            "max_workers": 0,
            "file_mounts": {"~/msa-fed/jobs": str(tmp / "jobs")},
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [
                (
                    f"ray start --head --node-ip-address=127.0.0.1 --port={gcs} --ray-client-server-port={ports[0]} "
                    f"--include-dashboard=false --dashboard-agent-listen-port={ports[1]} "
                    f"--dashboard-agent-grpc-port={ports[2]} --runtime-env-agent-port={ports[3]} "
                    f"--metrics-export-port={ports[4]} --num-cpus=2 --temp-dir={tmp / 'ray'} --disable-usage-stats "
                    '--resources=\'{"site:north": 1, "site:east": 1, "site:west": 1}\''
                )
            ],
            "worker_start_ray_commands": [],
        }
        (tmp / "cluster.json").write_text(json.dumps(config))  # YAML is a superset of JSON
        cluster_env = {**env(), "HOME": str(tmp / "launcher-home")}
        (tmp / "launcher-home").mkdir()
        up = _run(
            RAY,
            "up",
            "-y",
            "--no-config-cache",
            "--log-style=record",
            tmp / "cluster.json",
            timeout=240,
            env=cluster_env,
        )
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        submit = _run(
            RAY,
            "submit",
            tmp / "cluster.json",
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
        # the job file was read from the login's home, where file_mounts copied cluster/jobs
        assert (Path(user.pw_dir) / "msa-fed" / "jobs" / "job.toml").is_file()
