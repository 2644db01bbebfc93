"""Data and checks shared by the federation tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn, load_predictor
from msa_fed.federation.local import SiteFiles

NAMES = ("north", "east", "west")
CENTERS = {"north": (0.0, 2.0), "east": (2.0, 0.0), "west": (-2.0, 0.0)}
#: labelled sizes distinct from every other dimension that crosses the boundary
N_LABELED = {"north": 121, "east": 133, "west": 147}
N_UNLABELED = {"north": 160, "east": 170, "west": 180}


def site_files(names=NAMES, seed: int = 0) -> dict[str, SiteFiles]:
    """Per site: labelled data, an unlabelled sample exactly representable in float32 (the
    registry stores samples as float32, so the federated job sees the same numbers as the site's
    file), and the ONNX export of a logistic regression trained on the site's own data."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        c = np.asarray(CENTERS.get(name, (rng.normal(), rng.normal())))

        def draw(n, c=c):
            X = rng.normal(loc=c, size=(n, 2))
            return X, (X[:, 0] * X[:, 1] > 0).astype(np.int64)

        Xtr, ytr = draw(400)
        Xl, yl = draw(N_LABELED.get(name, 120))
        Xu, _ = draw(N_UNLABELED.get(name, 150))
        h = LogisticRegression().fit(Xtr, ytr)
        out[name] = SiteFiles(Xl, yl, Xu.astype(np.float32).astype(np.float64), export_sklearn(h, n_features=2))
    return out


def local_kwargs(files: dict[str, SiteFiles], names, min_points: int = 20):
    """SiteWorker keyword arguments for runtime="local" with the same ONNX predictors."""
    preds = [load_predictor(files[n].predictor, kind="probabilities") for n in names]
    classes = np.unique(np.concatenate([p.classes_ for p in preds]))
    kw = [
        dict(
            name=n,
            index=k,
            X_labeled=files[n].X_labeled,
            y_labeled=files[n].y_labeled,
            X_unlabeled=files[n].X_unlabeled,
            predictors=preds,
            task="classification",
            loss="cross_entropy",
            classes=classes,
            min_points=min_points,
        )
        for k, n in enumerate(names)
    ]
    return kw, preds, classes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:[") : -1])
    return out


def tcp_sockets(pid: int) -> list[tuple[str, str, str]]:
    """(state, local address, remote address) of every TCP socket (IPv4 and IPv6) the process
    holds, read from /proc: state "0A" is LISTEN, "01" ESTABLISHED."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                found.append((cols[3], cols[1], cols[2]))
    return found


def port_of(hex_address: str) -> int:
    return int(hex_address.rsplit(":", 1)[1], 16)


def make_pki(folder: Path, server_ips=("127.0.0.1",), clients=()) -> dict[str, str]:
    """A throwaway CA (EC P-256), a server certificate for ``server_ips`` and one client
    certificate per name in ``clients`` (common name = the name); {name: path} of the PEM files:
    "ca", "server_cert", "server_key", and "<client>_cert", "<client>_key"."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from pki import leaf, new_ca

    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = new_ca("federation test CA")
    pems = {"ca": ca.public_bytes(serialization.Encoding.PEM)}
    server_san = [x509.DNSName("localhost")] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    pems["server_cert"], pems["server_key"] = leaf(ca, ca_key, "registry", "server", server_san)
    for client in clients:
        pems[f"{client}_cert"], pems[f"{client}_key"] = leaf(ca, ca_key, client, "client", [x509.DNSName(client)])
    out = {}
    for label, data in pems.items():
        path = folder / f"{label}.pem"
        path.write_bytes(data)
        out[label] = str(path)
    return out


def fit_config(solver=None, **kw):
    """A FitConfig for the coordinator in tests (``solver`` may be a dict of SolverConfig fields)."""
    from msa_fed.core.config import SolverConfig
    from msa_fed.runtime.config import FitConfig

    if isinstance(solver, dict):
        solver = SolverConfig(**solver)
    return FitConfig(solver=solver, **kw)


def job_config(
    name: str,
    registry: str,
    *,
    topology: str = "federated",
    data_channel: str = "plain",
    site_timeout_s: float | None = None,
    checkpoint_dir=None,
    **job,
):
    """A validated JobConfig of a test job (the fit's topology and the Ray options set here)."""
    from msa_fed.jobs.config import JobConfig
    from msa_fed.runtime.config import FitConfig, RayConfig

    fit = dict(runtime="ray", topology=topology, ray=RayConfig(data_channel=data_channel))
    if site_timeout_s is not None:
        fit["site_timeout_s"] = site_timeout_s
    if checkpoint_dir is not None:
        fit["checkpoint_dir"] = str(checkpoint_dir)
    return JobConfig(name=name, registry=registry, fit=FitConfig(**fit), **job).validate()


def output_dir(root) -> Path:
    """A fresh output directory for one run_job under ``root`` (a job never overwrites a result)."""
    import uuid

    return Path(root) / f"job-output-{uuid.uuid4().hex[:8]}"


#: the keys of a minimal site.toml for site "east" (files relative to the config's folder)
SITE_TOML = {
    "name": "east",
    "registry": "127.0.0.1:50051",
    "token_file": "token.txt",
    "insecure": True,
    "data": "data.npz",
    "predictor": "predictor.onnx",
    "audit_log": "audit.jsonl",
}


def write_site_toml(folder, **changes) -> Path:
    """folder/site.toml: SITE_TOML with ``changes`` (a value of None drops the key)."""
    import json

    values = {k: v for k, v in {**SITE_TOML, **changes}.items() if v is not None}
    path = Path(folder) / "site.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


def write_site_files(folder) -> None:
    """The files SITE_TOML names: a token, 30 labelled and 30 unlabelled points, a predictor's bytes."""
    folder = Path(folder)
    (folder / "token.txt").write_text("mft1.site.east.secret\n")
    rng = np.random.default_rng(0)
    np.savez(
        folder / "data.npz",
        X_labeled=rng.normal(size=(30, 2)),
        y_labeled=np.zeros(30),
        X_unlabeled=rng.normal(size=(30, 2)),
    )
    (folder / "predictor.onnx").write_bytes(b"x")


def cli_run(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``msa-fed ARGS`` in a new interpreter, its output captured as text (where the process is
    what the test is about: a job driver that attaches to Ray, its exit on an error)."""
    return subprocess.run(
        [sys.executable, "-m", "msa_fed.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def cli_here(*args) -> subprocess.CompletedProcess:
    """An operator's ``msa-fed ARGS`` (site jobs, site approve, site audit, job show) run in this
    process (tests/cli_runner.py): the same command, exit status and output, without the seconds
    a new interpreter spends importing numpy, gRPC and the rest."""
    from cli_runner import run_cli

    rc, out, err = run_cli(*args)
    return subprocess.CompletedProcess([sys.executable, "-m", "msa_fed.cli", *map(str, args)], rc, out, err)
