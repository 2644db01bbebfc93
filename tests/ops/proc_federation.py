"""A federation of real processes, driven with the commands an operator types: a registry
process (restartable on its port), `msa-fed site register/publish` per site, one `msa-fed site
serve` process per site, and the job as `msa-fed run --job job.toml`.  Sealed end to end, as by
default: the consortium's job key (`msa-fed job keygen`) and one sealing key per site (`msa-fed
site keygen`, registered with `site register --seal-key`) whose fingerprints each job file pins;
``sealed=False`` opts every site and job out (``allow_unsealed = true``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from ops_helpers import Lines, RegistryProcess, cli, env, issue_tokens

from msa_fed.federation.local import site_toml


def write_site_files(folder: Path, files: dict) -> None:
    """What a hospital puts next to its site.toml: data.npz, unlabeled.npy and predictor.onnx
    (from one entry of :func:`demo_sites`)."""
    np.savez(
        folder / "data.npz",
        X_labeled=files["X_labeled"],
        y_labeled=files["y_labeled"],
        X_unlabeled=files["X_unlabeled"],
    )
    np.save(folder / "unlabeled.npy", files["X_unlabeled"])
    (folder / "predictor.onnx").write_bytes(files["predictor"])


def demo_sites(names=("north", "east", "west"), seed: int = 0) -> dict:
    """Each site's labelled data, unlabelled sample and ONNX predictor (the demo's distribution)."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.artifacts.predictors import export_sklearn
    from msa_fed.experiments.demo_data import make_federation

    fed = make_federation(n_labeled=200, n_unlabeled=300, n_test=10, random_state=seed)
    out = {}
    for name in names:
        d = fed[name]
        h = LogisticRegression().fit(d["X_train"], d["y_train"])
        # float32-exact sample: the registry keeps samples as float32
        Xu = d["X_unlabeled"].astype(np.float32).astype(np.float64)
        out[name] = dict(
            X_labeled=d["X_labeled"], y_labeled=d["y_labeled"], X_unlabeled=Xu, predictor=export_sklearn(h, 2)
        )
    return out


class ProcFederation:
    def __init__(self, root: Path, sites: dict, accept_jobs: dict | None = None, sealed: bool = True):
        self.root = Path(root)
        self.sealed = sealed
        self.fingerprints: dict[str, str] = {}  # "job" and each site: the key fingerprint keygen printed
        self.sites = sites
        self.accept_jobs = accept_jobs or {}
        self.registry = RegistryProcess(self.root / "registry.db", audit_log=self.root / "audit.jsonl")
        self.procs: dict[str, subprocess.Popen] = {}
        self.out: dict[str, Lines] = {}

    # ------------------------------------------------------------------ set-up, as an operator
    def start(self) -> ProcFederation:
        self.root.mkdir(parents=True, exist_ok=True)
        self.registry.start()
        tokens = issue_tokens(self.root / "registry.db", list(self.sites))
        (self.root / "admin_token").write_text(tokens["admin"] + "\n")
        os.chmod(self.root / "admin_token", 0o600)
        if self.sealed:
            self.fingerprints["job"] = self._keygen("job", self.root / "job.key")
        for name, files in self.sites.items():
            folder = self.root / name
            folder.mkdir()
            (folder / "token.txt").write_text(tokens[name] + "\n")
            os.chmod(folder / "token.txt", 0o600)
            write_site_files(folder, files)
            sealing: dict = dict(allow_unsealed=True)
            register = ["site", "register", "--registry", self.address, "--insecure"]
            register += ["--token-file", folder / "token.txt", "--name", name]
            if self.sealed:
                self.fingerprints[name] = self._keygen("site", folder / "site.key")
                sealing = dict(seal_key="site.key", job_keys=(self.fingerprints["job"],))
                register += ["--seal-key", folder / "site.key.pub"]
            (folder / "site.toml").write_text(
                site_toml(name, self.address, accept_jobs=self.accept_jobs.get(name, "admin"), **sealing)
            )
            site = ["--registry", self.address, "--insecure", "--token-file", folder / "token.txt"]
            for args in (
                register,
                [
                    "site",
                    "publish",
                    *site,
                    "--predictor",
                    folder / "predictor.onnx",
                    "--unlabeled",
                    folder / "unlabeled.npy",
                    "--config",
                    folder / "site.toml",
                ],
            ):
                rc, out, err = cli(*args)
                assert rc == 0, (args, out, err)
        return self

    @staticmethod
    def _keygen(kind: str, path: Path) -> str:
        """``msa-fed site|job keygen --out PATH``; the fingerprint it prints (what the others pin)."""
        rc, out, err = cli(kind, "keygen", "--out", path)
        assert rc == 0, (out, err)
        return next(line.split()[1] for line in out.splitlines() if line.startswith("fingerprint "))

    @property
    def address(self) -> str:
        return self.registry.address

    def admin(self, *args, timeout: float = 300) -> tuple[int, str, str]:
        return cli(
            *args,
            "--registry",
            self.address,
            "--insecure",
            "--admin-token-file",
            self.root / "admin_token",
            timeout=timeout,
        )

    def config(self, name: str) -> Path:
        return self.root / name / "site.toml"

    # ------------------------------------------------------------------ site processes
    def serve(self, name: str) -> Lines:
        proc = subprocess.Popen(
            [sys.executable, "-m", "msa_fed.cli", "site", "serve", "--config", str(self.config(name))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(),
            cwd=self.root / name,
        )
        self.procs[name] = proc
        self.out[name] = Lines(proc.stdout)
        return self.out[name]

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)

    def write_job(self, name: str, extra: str = "") -> Path:
        path = self.root / f"{name}.toml"
        path.write_text(
            f'name = "{name}"\n\n[registry]\naddress = "{self.address}"\ninsecure = true\n'
            f'admin_token_file = "{self.root / "admin_token"}"\n\n[run]\ntopology = "federated"\n'
            f'data_channel = "plain"\nsite_timeout_s = 180\ncheckpoint_dir = "{self.root / ("ckpt-" + name)}"\n'
            + extra
            + self.sealing_table()
        )
        return path

    def sealing_table(self) -> str:
        """The job file's [sealing] table: the job key and each site's pinned fingerprint."""
        if not self.sealed:
            return "\n[sealing]\nallow_unsealed = true\n"
        pins = ", ".join(f'"{n}={self.fingerprints[n]}"' for n in self.sites)
        return f'\n[sealing]\njob_key = "{self.root / "job.key"}"\nsites = [{pins}]\n'

    def start_job(self, job: Path, *args) -> tuple[subprocess.Popen, Lines]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "msa_fed.cli", "run", "--job", str(job), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env(), "MSA_FED_PROGRESS": "lines"},
            cwd=self.root,
        )
        return proc, Lines(proc.stdout)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.registry.stop()

    def __enter__(self) -> ProcFederation:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
