"""A whole federation on one machine, with real processes: for the demo, tests and benchmarks.

    with LocalFederation(workdir, sites) as fed:        # sites: {name: SiteFiles}
        fed.wait_connected()
        job = JobConfig(registry=fed.address, insecure=True, **fed.sealing(), ...)
        run_job(job, fed.admin_token)

It starts a registry (gRPC on 127.0.0.1, plaintext by explicit choice, or TLS on ``listen``; SQLite
in ``workdir``)
with its relay, issues an admin token and one token per site, registers each site and publishes
its predictor and unlabelled sample over gRPC as the site's operator would, writes each site's
``site.toml``, data file, token file and sealing key into ``workdir/<site>/`` (the consortium's
job key is ``workdir/job.key``: its jobs are sealed end to end, as by default), and starts one
``msa-fed site serve --config site.toml`` subprocess per site.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msa_fed.privacy.consortium import check_disjoint


@dataclass
class SiteFiles:
    """What a site holds: labelled data, its unlabelled sample and its ONNX predictor (bytes)."""

    X_labeled: np.ndarray
    y_labeled: np.ndarray
    X_unlabeled: np.ndarray
    predictor: bytes


def site_toml(
    name: str,
    registry: str,
    *,
    accept_jobs: str = "admin",
    policy: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    seal_key: str | None = None,
    job_keys=(),
    allow_unsealed: bool = False,
) -> str:
    lines = [
        f'name = "{name}"',
        f'registry = "{registry}"',
        'token_file = "token.txt"',
        'data = "data.npz"',
        'predictor = "predictor.onnx"',
        'audit_log = "audit.jsonl"',
        f'accept_jobs = "{accept_jobs}"',
    ]
    if tls_ca is None:
        lines.append("insecure = true")
    else:
        lines.append(f'tls_ca = "{tls_ca}"')
    if tls_cert is not None:
        lines += [f'tls_cert = "{tls_cert}"', f'tls_key = "{tls_key}"']
    if policy:
        lines.append(f'policy = "{policy}"')
    if seal_key:
        lines.append(f'seal_key = "{seal_key}"')
        lines.append("job_keys = [" + ", ".join(f'"{k}"' for k in job_keys) + "]")
    elif allow_unsealed:
        lines.append("allow_unsealed = true")
    return "\n".join(lines) + "\n"


class LocalFederation:
    def __init__(
        self,
        workdir,
        sites: dict[str, SiteFiles],
        *,
        accept_jobs: str = "admin",
        start_sites: bool = True,
        max_workers: int = 64,
        heartbeat_interval_s: float = 1.0,
        silence_timeout_s: float = 10.0,
        env: dict | None = None,
        tls=None,
        tls_ca: str | None = None,
        listen: str = "127.0.0.1:0",
        site_host=None,
        client_certs: dict | None = None,
        launcher: dict | None = None,
        policies: dict[str, str] | None = None,
        sealed: bool = True,
        python: str | None = None,
    ):
        """tls : a :class:`msa_fed.control.server.TlsConfig` (None: plaintext on loopback); tls_ca :
        the CA file the sites and this process trust; site_host(name) : the registry host a site
        dials (default 127.0.0.1); client_certs : {site: (cert path, key path)} for mutual TLS;
        launcher : {site: command prefix} (e.g. ``ip netns exec NS``); policies : {site: the text of
        its privacy policy file} (written to ``<site>/policy.toml``; a site without one runs with the
        policy's defaults); sealed : every site gets a sealing key (``<site>/site.key``, registered
        with the registry) and pins the consortium's job key ``workdir/job.key``: the sites serve
        sealed jobs only (:meth:`sealing` gives a job's [sealing] fields); False: every site opts
        out (``allow_unsealed = true``), for the tests of the unsealed path; python : the interpreter
        of the ``site serve`` processes (default: this one; e.g. a site-only venv's)."""
        self.python = python or sys.executable
        self.sealed = sealed
        self.seal_keys: dict[str, Any] = {}
        self.tls, self.tls_ca, self.listen = tls, tls_ca, listen
        self.site_host = site_host or (lambda name: "127.0.0.1")
        self.client_certs = client_certs or {}
        self.launcher = launcher or {}
        self.policies = dict(policies or {})
        self.workdir = Path(workdir)
        self.sites = dict(sites)
        self.accept_jobs = accept_jobs
        self.start_sites = start_sites
        self.max_workers = max_workers
        self.relay_settings = dict(heartbeat_interval_s=heartbeat_interval_s, silence_timeout_s=silence_timeout_s)
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.tokens: dict[str, str] = {}
        self.server: Any = None
        self.store: Any = None

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        from msa_fed.control.registry.client import RegistryClient
        from msa_fed.control.registry.service import Registry
        from msa_fed.control.registry.sqlite_store import SqliteStore
        from msa_fed.control.server import RegistryServer

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.store = SqliteStore(self.workdir / "registry.db")
        self.registry = Registry(self.store)
        self.admin_token = self.registry.issue_token("admin", "operator")
        self.server = RegistryServer(
            self.registry, self.listen, insecure=self.tls is None, tls=self.tls, max_workers=self.max_workers
        ).start()
        for key, value in self.relay_settings.items():
            setattr(self.server.relay, key, value)
        self.address = f"127.0.0.1:{self.server.port}"
        secure = dict(insecure=True) if self.tls is None else dict(tls_ca=self.tls_ca)
        job_keys: tuple = ()
        if self.sealed:
            from msa_fed.crypto.sealing import JobKey

            self.job_key_path = self.workdir / "job.key"
            job_key = JobKey.generate()
            job_key.save(self.job_key_path)
            job_keys = (job_key.fingerprint,)
        for name, files in self.sites.items():
            token = self.tokens[name] = self.registry.issue_token("site", name)
            folder = self.workdir / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "token.txt").write_text(token + "\n")
            os.chmod(folder / "token.txt", 0o600)
            np.savez(
                folder / "data.npz", X_labeled=files.X_labeled, y_labeled=files.y_labeled, X_unlabeled=files.X_unlabeled
            )
            (folder / "predictor.onnx").write_bytes(files.predictor)
            cert, key = self.client_certs.get(name, (None, None))
            labels, seal_key = {}, None
            if self.sealed:
                from msa_fed.crypto.sealing import SEAL_KEY_LABEL, SiteKey

                site_key = self.seal_keys[name] = SiteKey.generate()
                seal_key = str(site_key.save(folder / "site.key"))
                labels[SEAL_KEY_LABEL] = site_key.public.text()
            policy = None
            if name in self.policies:
                policy = "policy.toml"
                (folder / policy).write_text(self.policies[name])
            (folder / "site.toml").write_text(
                site_toml(
                    name,
                    f"{self.site_host(name)}:{self.server.port}",
                    accept_jobs=self.accept_jobs,
                    tls_ca=self.tls_ca,
                    tls_cert=cert,
                    tls_key=key,
                    policy=policy,
                    seal_key=seal_key,
                    job_keys=job_keys,
                    allow_unsealed=not self.sealed,
                )
            )
            with RegistryClient(self.address, token, tls_cert=cert, tls_key=key, **secure) as client:
                client.register(name, labels)
                client.upload_predictor(files.predictor)
                check_disjoint(name, files.X_labeled, files.X_unlabeled)  # as `site publish` does
                client.upload_sample(files.X_unlabeled)
        if self.start_sites:
            for name in self.sites:
                self.spawn(name)
        return self

    def sealing(self, names=None) -> dict:
        """The JobConfig fields of a job sealed for this federation's sites: job_key, seal_sites
        (for a federation built with ``sealed=False``: allow_unsealed)."""
        if not self.sealed:
            return dict(allow_unsealed=True)
        names = sorted(self.sites if names is None else names)
        return dict(
            job_key=str(self.job_key_path),
            seal_sites=tuple(f"{n}={self.seal_keys[n].public.fingerprint}" for n in names),
        )

    def config_path(self, name: str) -> Path:
        return self.workdir / name / "site.toml"

    def spawn(self, name: str, config: Path | None = None) -> subprocess.Popen:
        """Start ``msa-fed site serve`` for ``name`` (its output goes to ``<site>/serve.log``)."""
        config = config or self.config_path(name)
        out = open(self.workdir / name / "serve.log", "ab")
        env = dict(os.environ if self.env is None else self.env)
        cmd = list(self.launcher.get(name, ())) + [
            self.python,
            "-m",
            "msa_fed.cli",
            "site",
            "serve",
            "--config",
            str(config),
        ]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir / name))
        out.close()
        self.procs[name] = proc
        return proc

    def log_text(self, name: str) -> str:
        p = self.workdir / name / "serve.log"
        return p.read_text(errors="replace") if p.is_file() else ""

    def connected(self) -> list[str]:
        return sorted(self.server.relay.connected())

    def wait_connected(self, names=None, timeout: float = 120.0) -> None:
        names = sorted(self.sites if names is None else names)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n in self.server.relay.connected() for n in names):
                return
            for n in names:
                proc = self.procs.get(n)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"site {n}'s process exited ({proc.returncode}):\n{self.log_text(n)[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(
            f"sites {[n for n in names if n not in self.server.relay.connected()]} did not connect within {timeout} s"
        )

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)

    def stop(self):
        for _name, proc in list(self.procs.items()):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in list(self.procs.items()):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.server is not None:
            self.server.stop(0.5)
            self.server = None
        if self.store is not None:
            self.store.close()
            self.store = None
