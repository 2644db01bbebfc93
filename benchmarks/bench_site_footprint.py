"""The site's footprint: its install's size and the memory of `msa-fed site serve` over a sealed job.

    .venv/bin/python benchmarks/bench_site_footprint.py --site-python /tmp/slim/bin/python
    .venv/bin/python benchmarks/bench_site_footprint.py --site-python .venv/bin/python --site-code /tmp/base \
        --site-python /tmp/slim/bin/python --site-code ""

For each ``--site-python`` (default: this interpreter), with the msa_fed of the ``--site-code`` at
the same position (a checkout put on PYTHONPATH, e.g. an older commit's for a baseline; "" or
none: the interpreter's own install, or this checkout for this interpreter), it starts a federation on loopback (a
registry in this process, three ``msa-fed site serve`` processes started with that interpreter,
sealed end to end, as by default) and runs one sealed federated job to its end (local Ray, the
coordinator in this venv: tests/federation/fedhelpers.py's three sites).  Every 0.1 s it reads
the RSS of each site process and, apart, the summed RSS of its descendants (the sandboxed
workers that run the peers' predictors).  Per site it reports the site process's peak RSS (its
kernel high-water mark, VmHWM, read at the job's end), the peak of its children's summed RSS (as
sampled), and the coordinator packages mapped into the site process (/proc/PID/maps: shared
libraries of torch, Ray, scikit-learn or scipy); per interpreter, the size of its venv
(``du``-style: allocated blocks, pip and setuptools included).  JSON to
``benchmarks/results/site_footprint.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "federation"))

PACKAGES = ("torch", "ray", "sklearn", "scipy", "onnxruntime")


def dir_size(path: Path) -> int:
    """Bytes allocated under ``path`` (as ``du`` counts them; hard links once)."""
    seen, total = set(), 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def mapped_packages(pid: int) -> list[str]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [p for p in PACKAGES if f"/{p}/" in maps or f"/{p}.libs/" in maps or f"/{p}_" in maps]


def run_one(site_python: str, site_code: str, workdir: Path) -> dict:
    import ray
    from fedhelpers import NAMES, job_config, output_dir, site_files

    from msa_fed.federation.local import LocalFederation
    from msa_fed.jobs.run import run_job
    from msa_fed.runtime.ray_actors import ensure_ray

    prefix = subprocess.run(
        [site_python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    ensure_ray(num_cpus=2, resources={f"site:{n}": 1 for n in NAMES})
    peaks_children = {n: 0 for n in NAMES}
    result: dict = {
        "site_python": site_python,
        "site_code": site_code,
        "venv": prefix,
        "venv_bytes": dir_size(Path(prefix)),
    }
    stop = threading.Event()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # a separate install: its own msa_fed
    if not site_code and Path(prefix).resolve() == Path(sys.prefix).resolve():
        site_code = str(ROOT)  # this venv: this checkout's msa_fed
    if site_code:
        env["PYTHONPATH"] = result["site_code"] = site_code
    with LocalFederation(workdir, site_files(), python=site_python, env=env) as fed:
        fed.wait_connected(timeout=180)
        pids = {n: fed.procs[n].pid for n in NAMES}

        def sample():
            while not stop.is_set():
                for n, pid in pids.items():
                    peaks_children[n] = max(peaks_children[n], sum(status_kb(c, "VmRSS") for c in descendants(pid)))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        job = job_config("footprint", fed.address, insecure=True, **fed.sealing())
        _, model = run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(workdir))
        result["job_s"] = round(time.monotonic() - started, 1)
        stop.set()
        sampler.join()
        result["z"] = [round(float(v), 6) for v in model.z]
        result["sites"] = {
            n: {
                "peak_rss_mb": round(status_kb(pid, "VmHWM") / 1024, 1),
                "children_peak_rss_mb": round(peaks_children[n] / 1024, 1),
                "coordinator_libraries_mapped": mapped_packages(pid),
            }
            for n, pid in pids.items()
        }
    ray.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site-python", action="append", help="interpreter of the site processes (repeatable)")
    parser.add_argument("--site-code", action="append", default=[], help="msa_fed checkout for the same position")
    args = parser.parse_args()
    results = []
    pythons = args.site_python or [sys.executable]
    codes = args.site_code + [""] * (len(pythons) - len(args.site_code))
    for python, code in zip(pythons, codes):
        with tempfile.TemporaryDirectory(prefix="msa_fed_footprint_") as tmp:
            r = run_one(python, code, Path(tmp))
        results.append(r)
        size = r["venv_bytes"] / 2**20
        code = r["site_code"] or "its install"
        print(f"site interpreter {python} (code: {code}): venv {size:.0f} MiB, job {r['job_s']} s")
        for name, s in r["sites"].items():
            print(
                f"  {name:6s} site serve peak RSS {s['peak_rss_mb']:6.1f} MiB   sandbox children peak "
                f"{s['children_peak_rss_mb']:6.1f} MiB   coordinator libraries mapped: "
                f"{', '.join(s['coordinator_libraries_mapped']) or 'none'}"
            )
    out = ROOT / "benchmarks" / "results" / "site_footprint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
