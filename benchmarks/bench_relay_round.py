"""Where a DC round through the relay spends its time: latency and CPU per process, sealed and not.

    .venv/bin/python benchmarks/bench_relay_round.py                         # this tree
    .venv/bin/python benchmarks/bench_relay_round.py --baseline ../main      # against another tree
    .venv/bin/python benchmarks/bench_relay_round.py --kind sealed --turns 1 --stages   # where the CPU goes

One federation on this machine (:class:`msa_fed.federation.local.LocalFederation`: a registry with
its relay in this process, one ``msa-fed site serve`` process per site), p = ``--sites`` sites with
2000 labelled points each, the job joined and set up (domain model, Qhat) as a real job does.  A
round is one relay ``Call`` carrying a ``dc_evaluate`` request (L, dL) to every site; ``--kind``
sealed (the default of a job: each request sealed for its site, each answer sealed and signed) or
unsealed, or a ``ping`` round (the transport and the seals alone).  Per round: the median and
p90 latency, and the CPU time of this process (the job's client and the registry) and of all the
site processes together (from ``/proc``), which on a machine with fewer cores than processes is
what the latency is made of.

``--baseline TREE`` runs the same measurement with ``TREE``'s code (``PYTHONPATH``), in turns
with this tree's (``--turns`` each, alternating, one fresh process per turn), and prints the
medians of the turns side by side.  ``--stages``: also the thread CPU per round of each stage
of a round, in this process (the job's ``RelayClient.call`` with its seals and opens, the relay's
``Call``) and in each site process (run under :mod:`site_stages`: opening the seal, the chain,
the policy's ledger and audit record, the sums, the codec, the sealed answer); a process's CPU
less its stages is gRPC's threads and the hand-offs between them.  JSON to
``benchmarks/results/relay_round.json`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(tree: Path, kind: str, method: str, p: int, rounds: int, stages: bool = False) -> dict:
    """One measurement with the code of ``tree`` (run in its own process; its benchmarks'
    helpers put ``tree`` first on the path of this process and of the site processes).
    ``stages``: also the thread CPU of the stages of a round in this process (the job's client,
    the relay's Call) and in each site process (:mod:`site_stages`), per round."""
    import signal

    import numpy as np

    sys.path.insert(0, str(tree / "benchmarks"))
    import bench_federation as bf

    if Path(bf.__file__).resolve().parents[1] != tree.resolve():
        raise RuntimeError(f"measuring {tree} but its helpers came from {bf.__file__}")

    from msa_fed.artifacts.predictors import sha256_hex
    from msa_fed.boundary import messages as m
    from msa_fed.federation.local import LocalFederation

    files = bf.make_sites(p, 2000, 1000)
    names = sorted(files)
    kw, _, classes = bf._kwargs(files, names)
    spec, qhat, _ = bf._honest_model(files, names, kw)
    rng = np.random.default_rng(2)
    zs = [rng.dirichlet(np.ones(p)) for _ in range(rounds + 10)]
    sealed = kind == "sealed"
    here: dict = {}  # this process's stages
    if stages:
        from site_stages import timed  # the sites' timer (benchmarks/, next to bench_federation)

        from msa_fed.control.relay import RelayServicer
        from msa_fed.crypto.sealing import JobSealer
        from msa_fed.federation.relay_client import RelayClient

        # before the federation starts: the server binds the servicer's methods when it is built
        lock = threading.Lock()
        timed(RelayServicer, "Call", "relay.Call", here, lock)
        timed(RelayClient, "call", "job.call", here, lock)
        timed(JobSealer, "seal", "job.call.seal", here, lock)
        timed(JobSealer, "open", "job.call.open", here, lock)
    staged = Path(tempfile.mkdtemp(prefix="bench-stages-")) if stages else Path()
    wrapper = str(Path(__file__).resolve().with_name("site_stages.py"))
    launcher = {n: [sys.executable, wrapper, str(staged / f"{n}.json"), "--"] for n in files} if stages else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp,
        LocalFederation(Path(tmp) / "fed", files, sealed=sealed, silence_timeout_s=120, launcher=launcher) as fed,
    ):
        fed.wait_connected(timeout=600)
        sealer = None
        if sealed:
            from msa_fed.crypto.sealing import JobKey, JobSealer, job_content
            from msa_fed.federation.agent import sample_sha256

            content = job_content(
                "bench",
                [
                    dict(
                        name=n,
                        key_fingerprint=fed.seal_keys[n].public.fingerprint,
                        sample_sha256=sample_sha256(files[n].X_unlabeled),
                        predictor_sha256=sha256_hex(files[n].predictor),
                    )
                    for n in names
                ],
                task="classification",
                loss="cross_entropy",
                min_points=20,
                planned_queries=rounds + 100,
            )
            sealer = JobSealer(JobKey.load(fed.job_key_path), content, {n: fed.seal_keys[n].public for n in names})
        relay = bf._round_setup(fed, names, files, classes, spec, qhat, sealer)

        def calls(z):
            if method == "ping":
                return [(n, "ping", None) for n in names]
            return [(n, "dc_evaluate", m.DCRequest(z=z, eta=0.01, what=("L", "dL"))) for n in names]

        for z in zs[:10]:  # warm-up
            bf._answered(relay, calls(z))
        pids = [fed.procs[n].pid for n in names]
        if stages:
            for q in pids:
                os.kill(q, signal.SIGUSR1)  # the sites count their stages from here
            time.sleep(0.5)
            here.clear()
        sites0, own0, wall0 = sum(_cpu_s(q) for q in pids), time.process_time(), time.perf_counter()
        times = []
        for z in zs[10:]:
            t0 = time.perf_counter()
            out = relay.call("bench", calls(z), 60)
            times.append(time.perf_counter() - t0)
            bad = [r for r in out if not isinstance(r, (m.DCPartial, m.Ack))]
            if bad:
                raise RuntimeError(f"a site did not answer: {bad[0]}")
        wall = time.perf_counter() - wall0
        own, sites = time.process_time() - own0, sum(_cpu_s(q) for q in pids) - sites0
        if sealer is not None:
            sealer.verify_signatures()
        relay.close_job("bench")
        relay.close()
    out_stages = {}
    if stages:
        out_stages["job and registry"] = {k: 1e3 * v[1] / rounds for k, v in here.items()}
        per_site: dict[str, list[float]] = {}
        for n in names:
            doc = json.loads((staged / f"{n}.json").read_text())["stages"]
            for k, v in doc.items():
                per_site.setdefault(k, []).append(1e3 * v[1] / rounds)
        out_stages["each site (mean)"] = {k: statistics.fmean(v) for k, v in per_site.items()}
        for f in staged.iterdir():
            f.unlink()
        staged.rmdir()
    return {
        "kind": kind,
        "method": method,
        "p": p,
        "rounds": rounds,
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * float(np.percentile(times, 90)),
        "mean_ms": 1e3 * wall / rounds,
        "job_and_registry_cpu_ms": 1e3 * own / rounds,
        "sites_cpu_ms": 1e3 * sites / rounds,
        "load": os.getloadavg()[0],
        **({"stages_cpu_ms_per_round": out_stages} if stages else {}),
    }


def _turn(tree: Path, args, kind: str, method: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), GRPC_VERBOSITY="ERROR")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(tree), kind, method]
    cmd += ["--sites", str(args.sites), "--rounds", str(args.rounds)] + (["--stages"] if args.stages else [])
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement with {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--kind", choices=["sealed", "unsealed"], action="append")
    ap.add_argument("--method", choices=["dc", "ping"], action="append")
    ap.add_argument("--baseline", type=Path, help="another tree (e.g. ../main) measured in turns with this one")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--stages",
        action="store_true",
        help="also the thread CPU per round of each stage: the job's client and the relay here, the chain in the sites",
    )
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        r = measure(Path(args.one[0]), args.one[1], args.one[2], args.sites, args.rounds, stages=args.stages)
        import msa_fed

        r["code"] = str(Path(msa_fed.__file__).resolve().parents[1])
        print(json.dumps(r))
        return 0
    if args.quick:
        args.sites, args.rounds, args.turns = 3, 30, 1
    kinds, methods = args.kind or ["sealed", "unsealed"], args.method or ["dc"]
    trees = {"this tree": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs: dict = {}
    for turn in range(args.turns):
        for kind in kinds:
            for method in methods:
                for label, tree in trees.items():
                    r = _turn(tree, args, kind, method)
                    runs.setdefault(f"{kind} {method}", {}).setdefault(label, []).append(r)
                    print(
                        f"turn {turn + 1} {kind} {method} round, {label}: median {r['median_ms']:.2f} ms "
                        f"(p90 {r['p90_ms']:.2f}); CPU per round: job+registry {r['job_and_registry_cpu_ms']:.2f} ms, "
                        f"sites {r['sites_cpu_ms']:.2f} ms; load {r['load']:.1f}",
                        flush=True,
                    )
                    for where, by_stage in r.get("stages_cpu_ms_per_round", {}).items():
                        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_stage.items()))
                        print(f"  thread CPU per round (ms), {where}: {shown}", flush=True)
    summary = {}
    for key, by_tree in runs.items():
        summary[key] = {}
        for label, rs in by_tree.items():
            summary[key][label] = {
                f: statistics.median(r[f] for r in rs)
                for f in ("median_ms", "p90_ms", "job_and_registry_cpu_ms", "sites_cpu_ms", "load")
            }
        line = ", ".join(
            f"{label} {v['median_ms']:.2f} ms (CPU job+registry {v['job_and_registry_cpu_ms']:.2f}, sites "
            f"{v['sites_cpu_ms']:.2f})"
            for label, v in summary[key].items()
        )
        if "baseline" in summary[key]:
            ratio = summary[key]["this tree"]["median_ms"] / summary[key]["baseline"]["median_ms"]
            summary[key]["ratio_median"] = ratio
            line += f"; this tree / baseline {ratio:.2f}"
        print(f"{key} round, p={args.sites}, medians of {args.turns} turns: {line}", flush=True)
    if not args.quick:
        out = REPO / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        doc = {"command": " ".join(["python benchmarks/bench_relay_round.py", *sys.argv[1:]]), "summary": summary}
        (out / "relay_round.json").write_text(json.dumps({**doc, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
