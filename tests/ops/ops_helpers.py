"""Helpers of the operations tests: a registry subprocess, the CLI in this process or as a subprocess, a
federation's sites."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from cli_runner import registry_serve_argv, run_cli

REPO = Path(__file__).resolve().parents[2]


def env(grpc_verbosity: str | None = "ERROR") -> dict:
    """This environment with the checkout first on PYTHONPATH, no RAY_ADDRESS, and gRPC's own log
    level ``grpc_verbosity`` (None: the command's own default)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("GRPC_VERBOSITY", None)
    if grpc_verbosity is not None:
        e["GRPC_VERBOSITY"] = grpc_verbosity
    e.pop("RAY_ADDRESS", None)
    return e


def cli(*args, cwd=None, timeout: float | None = None) -> tuple[int, str, str]:
    """Run ``msa-fed ARGS`` in this process (tests/cli_runner.py); (exit status, stdout, stderr).
    With ``timeout``, in a new process bounded by it (a command that talks to a server which may
    be away: a hung call must not hang the test)."""
    if timeout is not None:
        return cli_process(*args, timeout=timeout, cwd=cwd)
    return run_cli(*args, cwd=cwd)


def cli_process(*args, timeout: float = 300, cwd=None, environ: dict | None = None) -> tuple[int, str, str]:
    """Run ``msa-fed ARGS`` in a new process (in ``environ``, by default :func:`env`); (exit status,
    stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "msa_fed.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env() if environ is None else environ,
        cwd=cwd,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


class Lines:
    """Collects a process's output lines in a thread; ``wait_for(text)`` blocks until one contains it."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.ended = False  # the stream closed: the process will print nothing more
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.ended:
                    why = "the process ended" if self.ended else f"within {timeout} s"
                    raise AssertionError(f"no line with {text!r} ({why}); got:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 1.0))

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


class RegistryProcess:
    """``msa-fed registry serve`` on loopback (plaintext) in a subprocess; restartable on the same port."""

    def __init__(self, db, audit_log=None, port: int = 0):
        self.db, self.audit_log, self.port = Path(db), audit_log, port
        self.proc = None
        self.address = None

    def start(self) -> RegistryProcess:
        args = registry_serve_argv(self.db, f"127.0.0.1:{self.port}", "WARNING", "--workers", "16")
        if self.audit_log:
            args += ["--audit-log", str(self.audit_log)]
        deadline = time.monotonic() + 120
        while True:  # the port of a just-stopped server may take a moment to be free again
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
            self.out = Lines(self.proc.stdout)
            try:
                line = self.out.wait_for("registry listening on", timeout=60)
                break
            except AssertionError:
                self.proc.kill()
                self.proc.wait()
                if time.monotonic() > deadline or "cannot bind" not in self.out.text():
                    raise
                time.sleep(0.5)
        self.address = line.split("registry listening on ", 1)[1].split()[0]
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def issue_tokens(db, sites) -> dict:
    """Tokens of the admin and of each site, issued on the database as an operator would."""
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    with SqliteStore(db) as store:
        registry = Registry(store)
        tokens = {"admin": registry.issue_token("admin", "admin")}
        tokens.update({s: registry.issue_token("site", s) for s in sites})
    return tokens


def publish_sites(address: str, tokens: dict, data_dir: Path, random_state: int = 0, n_test: int = 200) -> dict:
    """Each demo site registers, publishes an ONNX predictor and its unlabelled sample, and keeps its
    labelled data in ``data_dir/<site>.npz`` (its node's disk).  Returns the federation's data."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.artifacts.predictors import export_sklearn
    from msa_fed.control.registry.client import RegistryClient
    from msa_fed.experiments.demo_data import SITES, make_federation

    fed = make_federation(n_labeled=200, n_unlabeled=300, n_test=n_test, random_state=random_state)
    for name in SITES:
        d = fed[name]
        h = LogisticRegression().fit(d["X_train"], d["y_train"])
        with RegistryClient(address, tokens[name], insecure=True) as site:
            site.register(name)
            site.upload_predictor(export_sklearn(h, n_features=2))
            site.upload_sample(d["X_unlabeled"])
            site.heartbeat()
        np.savez(
            data_dir / f"{name}.npz", X_labeled=d["X_labeled"], y_labeled=d["y_labeled"], X_unlabeled=d["X_unlabeled"]
        )
    return fed


def write_job(path: Path, address: str, token_file: Path, data_dir: Path, sites=(), name: str = "ops-test") -> Path:
    site_list = ", ".join(f'"{s}"' for s in sites)
    path.write_text(f'''name = "{name}"

[registry]
address = "{address}"
insecure = true
admin_token_file = "{token_file}"

[run]
sites = [{site_list}]
site_data = "{data_dir}/{{site}}.npz"
topology = "cluster"
data_channel = "plain"
''')
    return path


# The job driver as a process: a local Ray whose one node carries every site's resource (one
# machine standing in for three), then the real `msa-fed run`.
DRIVER = """
import sys
from msa_fed.runtime.ray_sites import ensure_ray
ensure_ray(num_cpus=2, resources={"site:north": 1, "site:east": 1, "site:west": 1})
from msa_fed.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_job(*args, cwd=None) -> tuple[subprocess.Popen, Lines]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "run", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env(), "MSA_FED_PROGRESS": "lines"},
        cwd=cwd,
    )
    return proc, Lines(proc.stdout)


def free_recipe_ports(start: int) -> int:
    """A base port whose recipe ports (base .. base+8, base+100 .. base+199: the registry's and
    Ray's in the deploy recipes) are all free now, searched from ``start`` in steps of 200."""
    import socket

    for base in range(start, 60000, 200):
        socks = []
        try:
            for port in [*range(base, base + 9), *range(base + 100, base + 200)]:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no free port range")
