"""Wall time of the operator commands that load a predictor: `site publish`, `model download`,
`model report`, each a fresh ``msa-fed`` process against one registry on loopback.

    .venv/bin/python benchmarks/bench_cli_exit.py                       # this tree
    .venv/bin/python benchmarks/bench_cli_exit.py --baseline /other/checkout   # and another, same run

Every command that opens an ONNX predictor starts the sandbox's helper process; this measures
whether anything is left to wait for when the command ends.  With ``--baseline`` the same
commands run with ``PYTHONPATH`` pointing at the other checkout, interleaved, against the same
registry.  Writes ``benchmarks/results/bench_cli_exit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _serve(tmp: Path):
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    db = tmp / "registry.db"
    with SqliteStore(db) as store:
        reg = Registry(store)
        admin = reg.issue_token("admin", "admin")
        site = reg.issue_token("site", "north")
    (tmp / "admin").write_text(admin)
    (tmp / "site").write_text(site)
    args = [sys.executable, "-m", "msa_fed.cli", "registry", "serve", "--db", str(db)]
    args += ["--listen", "127.0.0.1:0", "--insecure", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRPC_VERBOSITY": "ERROR"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = proc.stdout.readline()
    return proc, line.split("registry listening on ", 1)[1].split()[0]


def _model(tmp: Path) -> Path:
    from sklearn.linear_model import LogisticRegression

    import msa_fed
    from msa_fed.artifacts.predictors import export_sklearn
    from msa_fed.experiments.demo_data import SITES, make_federation

    fed = make_federation(n_labeled=150, n_unlabeled=200, n_test=10, random_state=1)
    sites = []
    for n in SITES:
        h = LogisticRegression().fit(fed[n]["X_train"], fed[n]["y_train"])
        sites.append(msa_fed.SiteData(n, fed[n]["X_labeled"], fed[n]["y_labeled"], fed[n]["X_unlabeled"], h))
    (tmp / "predictor.onnx").write_bytes(export_sklearn(sites[0].predictor, n_features=2))
    import numpy as np

    np.save(tmp / "unlabeled.npy", fed["north"]["X_unlabeled"])
    return msa_fed.fit_dmsa(sites, task="classification").save(tmp / "model")


def _time(code: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(code), "GRPC_VERBOSITY": "ERROR"}
    started = time.monotonic()
    # cwd: not a checkout (`python -m` puts the working directory first on sys.path)
    proc = subprocess.run(
        [sys.executable, "-m", "msa_fed.cli", *args], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
    )
    took = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{args[:2]} failed with {code}: {proc.stderr.strip()}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another checkout to measure in the same run")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    codes = {"this": REPO} | ({"baseline": a.baseline.resolve()} if a.baseline else {})
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = _model(tmp)
        proc, address = _serve(tmp)
        try:
            common = ["--registry", address, "--insecure"]
            admin = [*common, "--admin-token-file", str(tmp / "admin")]
            site = [*common, "--token-file", str(tmp / "site")]
            _time(REPO, ["site", "register", *site, "--name", "north"])
            _time(REPO, ["model", "upload", str(model), *admin])
            times: dict[str, dict[str, list[float]]] = {k: {} for k in codes}
            for r in range(a.repeats):
                for label, code in codes.items():
                    cmds = {
                        "site publish": ["site", "publish", *site, "--predictor", str(tmp / "predictor.onnx")],
                        "model download": ["model", "download", "latest", "--out", str(tmp / f"d{label}{r}"), *admin],
                        "model report": ["model", "report", "latest", "--out", str(tmp / f"r{label}{r}.html"), *admin],
                    }
                    for name, args in cmds.items():
                        times[label].setdefault(name, []).append(_time(code, args))
        finally:
            proc.terminate()
            proc.wait()
    result = {label: {k: round(statistics.median(v), 2) for k, v in t.items()} for label, t in times.items()}
    result["load"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    out = REPO / "benchmarks" / "results" / "bench_cli_exit.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
