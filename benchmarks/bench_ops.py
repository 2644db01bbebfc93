"""Cost of the registry's audit log: combined-model transfers and small admin RPCs, with and without it.

    .venv/bin/python benchmarks/bench_ops.py            # 64 MiB model, 5 repeats, 300 small RPCs
    .venv/bin/python benchmarks/bench_ops.py --quick

One registry process per setting (``msa-fed registry serve`` on loopback, SQLite in a temporary
folder), the same client code against both, measured in the same run: the audit log adds a
JSON line per RPC and a sha256 over every chunk that moves.  Writes
``benchmarks/results/bench_ops.json``.
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


def serve(tmp: Path, audit: bool):
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    db = tmp / ("audit.db" if audit else "plain.db")
    with SqliteStore(db) as store:
        token = Registry(store).issue_token("admin", "admin")
    args = [
        sys.executable,
        "-m",
        "msa_fed.cli",
        "registry",
        "serve",
        "--db",
        str(db),
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--log-level",
        "WARNING",
    ]
    if audit:
        args += ["--audit-log", str(tmp / "audit.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRPC_VERBOSITY": "ERROR"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = proc.stdout.readline()
    return proc, line.split("registry listening on ", 1)[1].split()[0], token


def measure(address: str, token: str, size: int, repeats: int, calls: int) -> dict:
    from msa_fed.control.ops.client import OpsClient
    from msa_fed.control.registry.client import RegistryClient

    data = os.urandom(size)
    up, down, small = [], [], []
    with RegistryClient(address, token, insecure=True) as client:
        ops = OpsClient(client)
        ops.list_jobs()
        for i in range(repeats):
            blob = data[:-8] + i.to_bytes(8, "little")
            t0 = time.perf_counter()
            rec = client.upload_combined_model(blob, {"i": i})
            up.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.download_combined_model(rec.version)
            down.append(time.perf_counter() - t0)
        for _ in range(calls):
            t0 = time.perf_counter()
            ops.list_jobs()
            small.append(time.perf_counter() - t0)
    mb = size / 2**20
    return {
        "upload_mb_s": mb / statistics.median(up),
        "download_mb_s": mb / statistics.median(down),
        "small_rpc_ms_median": 1000 * statistics.median(small),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.repeats, args.calls = 8, 2, 50
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for audit in (False, True):
            proc, address, token = serve(Path(tmp), audit)
            try:
                results["audit" if audit else "no_audit"] = measure(
                    address, token, int(args.mb * 2**20), args.repeats, args.calls
                )
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        lines = len((Path(tmp) / "audit.jsonl").read_text().splitlines())
    base, audited = results["no_audit"], results["audit"]
    results["ratio_audit_over_plain"] = {k: audited[k] / base[k] for k in base}
    results["audit_lines"] = lines
    results["settings"] = vars(args)
    print(f"{'':22}{'no audit':>12}{'audit':>12}{'ratio':>8}")
    for key in base:
        print(f"{key:22}{base[key]:12.2f}{audited[key]:12.2f}{audited[key] / base[key]:8.2f}")
    out = REPO / "benchmarks" / "results" / "bench_ops.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"{lines} audit lines; results in {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
