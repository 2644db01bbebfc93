"""Benchmark of the Ray runtime: DC round latency, DC solve, data-parallel SGD.

    .venv/bin/python benchmarks/bench_runtime.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_runtime.py --quick    # small sizes, to check it runs

Prints a table and writes benchmarks/results/bench_runtime.json.

1. Round latency: one distributed DC evaluation (z to every site actor, L and dL sums back,
   added at the coordinator) for p site actors, each with 50 labelled points, so that the
   round is all overhead, with each way the calls can travel (``data_channel``): "tls" (the
   default: direct mutual-TLS connections), "plain" (the same over loopback without TLS) and
   "off" (Ray actor calls, the baseline); next to them a no-op ``ping`` round over the TLS
   channel and through Ray (the floor of Ray's actor calls on this machine).  Actor start-up
   time and memory are reported.  The domain model here is GMSA's KDE (the round does not
   depend on it), so the actors do not load torch and 64 of them fit in memory.
   With --compiled, for p <= 4, the same round through a Ray Compiled Graph (beta), an
   alternative measured and not adopted (BENCHMARKS.md).
2. DC solve, p = 8 sites, n = 1e5 labelled points in all: the whole solve with the sums from
   the site actors (TLS channel, and through Ray), against the same solve in one process (one
   pooled point set, and the p point sets summed in a loop as ``runtime="local"`` does), for
   the default objective (minmax) and the paper's Gamma (Newton, then DCA).  The same z is
   checked.
3. Domain classifier, SGD for the same epochs and schedule: data-parallel over the site actors
   (one worker per site, and two; TLS channel, and through Ray for one worker per site) against
   single-process training on the pooled sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from msa_fed.core.dc_solver import LocalOracle, solve_dc  # noqa: E402
from msa_fed.core.dc_terms import PointSet  # noqa: E402
from msa_fed.core.density import KDEDomainModel  # noqa: E402
from msa_fed.core.domain_classifier import ClassifierConfig, DomainClassifier, train_domain_classifier  # noqa: E402
from msa_fed.core.features import StandardFeatures  # noqa: E402
from msa_fed.runtime.config import FitConfig  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402
from msa_fed.runtime.progress import Progress  # noqa: E402
from msa_fed.runtime.ray_sites import RaySites, ensure_ray  # noqa: E402

ETA = 1e-2


def make_federation(p: int, n_labeled: int, n_unlabeled: int, d: int, seed: int = 0) -> list[dict]:
    """SiteWorker kwargs of p synthetic sites (shifted Gaussians, logistic predictors)."""
    rng = np.random.default_rng(seed)
    means = rng.normal(scale=1.0, size=(p, d))
    rules = rng.normal(size=(p, d))
    predictors, data = [], []
    for k in range(p):

        def draw(n, k=k):
            X = rng.normal(size=(n, d)) + means[k]
            return X, (X @ rules[k] + 0.5 * rng.normal(size=n) > means[k] @ rules[k]).astype(int)

        Xt, yt = draw(200)
        predictors.append(LogisticRegression().fit(Xt, yt))
        Xl, yl = draw(n_labeled)
        data.append((Xl, yl, rng.normal(size=(n_unlabeled, d)) + means[k]))
    classes = np.array([0, 1])
    return [
        dict(
            name=f"site{k:02d}",
            index=k,
            X_labeled=Xl,
            y_labeled=yl,
            X_unlabeled=Xu,
            predictors=predictors,
            task="classification",
            loss="cross_entropy",
            classes=classes,
            min_points=20,
        )
        for k, (Xl, yl, Xu) in enumerate(data)
    ]


def domain_model(kwargs: list[dict], seed: int = 1) -> DomainClassifier:
    """The Maxent domain model of the sites' published samples (standardised inputs, polished to
    the optimum, as the coordinator trains it: the sites verify it), the same everywhere."""
    from dataclasses import replace

    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle

    U = [kw["X_unlabeled"] for kw in kwargs]
    cfg = ClassifierConfig(mu=1e-3)
    model = train_domain_classifier(U, StandardFeatures(), cfg, random_state=seed)
    oracle = sum_oracle(balanced_shards([model.feature_map.transform(X) for X in U], replace(cfg, dtype="float64")))
    model.theta_, _ = polish_maxent(oracle, model.theta_, model.n_features_, len(U), cfg.mu, cfg.max_iter)
    return model


def coordinator_for(backend, kwargs, **config) -> Coordinator:
    c = Coordinator(backend, kwargs[0]["predictors"], FitConfig(**config)).start()
    backend.share_samples([kw["X_unlabeled"] for kw in kwargs])  # the sites verify the domain model
    return c


def actor_memory_mb(backend) -> float:
    """Mean proportional set size (PSS) of the site actors' processes, in MB (Linux)."""
    from ray._private import state as ray_state

    sizes = []
    for h in backend.actors:
        pid = ray_state.actors(actor_id=h._actor_id.hex()).get("Pid")
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    sizes.append(int(line.split()[1]) / 1024)
        except OSError:
            pass
    return float(np.mean(sizes)) if sizes else float("nan")


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def timed(fn, repeats: int):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return np.array(ts) * 1e3  # ms


# ----------------------------------------------------------------------------- 1. latency
def compiled_rounds(backend, p: int, rounds: int):
    """The same DC round through a Ray Compiled Graph (beta): round times (ms), compile time (s)
    and the CPU share each idle actor burns while the graph is compiled (its readers poll)."""
    from ray._private import state as ray_state
    from ray.dag import InputNode, MultiOutputNode

    from msa_fed.boundary import messages as m

    msg = m.DCRequest(z=np.full(p, 1.0 / p), eta=ETA, what=("L", "dL"))
    t = time.perf_counter()
    with InputNode() as inp:
        dag = MultiOutputNode([h.dc_evaluate.bind(inp) for h in backend.actors])
    graph = dag.experimental_compile()
    compile_s = time.perf_counter() - t
    import ray

    try:
        for _ in range(20):
            ray.get(graph.execute(msg))
        times = timed(lambda: ray.get(graph.execute(msg)), rounds)
    except Exception as exc:  # noqa: BLE001 - seen here: a 10 s channel time-out at p = 8
        print(f"  compiled graph failed: {type(exc).__name__}: {str(exc).splitlines()[-1][:160]}", flush=True)
        graph.teardown()
        return np.array([np.nan]), compile_s, np.nan
    try:
        pids = [ray_state.actors(actor_id=h._actor_id.hex())["Pid"] for h in backend.actors]

        def cpu_s(pid):
            f = Path(f"/proc/{pid}/stat").read_text().split()
            return (int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")

        before = [cpu_s(x) for x in pids]
        time.sleep(2.0)
        idle = float(np.mean([(cpu_s(x) - b) / 2.0 for x, b in zip(pids, before)]))
    finally:
        graph.teardown()
    return times, compile_s, idle


def bench_latency(ps, rounds: int, compiled_upto: int = 0) -> list[dict]:
    rows, per_actor_mb = [], None
    for p in ps:
        if per_actor_mb is not None and p * per_actor_mb > 0.6 * mem_available_mb():
            rows.append(
                {
                    "p": p,
                    "skipped": f"{p} actors need ~{p * per_actor_mb / 1024:.1f} GB, more than 60% of the "
                    f"{mem_available_mb() / 1024:.1f} GB available",
                }
            )
            print(f"  p={p}: skipped ({rows[-1]['skipped']})", flush=True)
            continue
        kwargs = make_federation(p, n_labeled=50, n_unlabeled=50, d=4, seed=p)
        compiled_too = p <= compiled_upto
        backend = RaySites(kwargs)
        t0 = time.perf_counter()
        c = coordinator_for(backend, kwargs)
        startup = time.perf_counter() - t0
        try:
            # GMSA's KDE domain model: the round is the same, and the actors need no torch
            kde = KDEDomainModel(bandwidth=1.0).fit([kw["X_unlabeled"] for kw in kwargs])
            _, oracle = c.prepare_dc(kde)
            z = np.full(p, 1.0 / p)
            res = {}
            for mode in ("tls", "plain", "off"):  # "off": every call through Ray, the baseline
                backend.set_data_channel(mode)
                for _ in range(20):  # warm-up (opens the channels)
                    oracle.evaluate(z, ETA, ("L", "dL"))
                res[mode] = timed(lambda: oracle.evaluate(z, ETA, ("L", "dL")), rounds)
                if mode in ("tls", "off"):
                    res["ping_" + mode] = timed(lambda: c.call_all("ping", None), rounds)
            per_actor_mb = actor_memory_mb(backend)
            compiled, compile_s, idle_cpu = (
                compiled_rounds(backend, p, rounds) if compiled_too else ([np.nan], np.nan, np.nan)
            )
        finally:
            backend.shutdown()
        row = {"p": p, "startup_s": startup, "actor_pss_mb": per_actor_mb}
        for key, ts in res.items():
            row[f"{key}_ms_median"] = float(np.median(ts))
            row[f"{key}_ms_p10"] = float(np.percentile(ts, 10))
            row[f"{key}_ms_p90"] = float(np.percentile(ts, 90))
        row.update(
            speedup_tls_vs_ray=row["off_ms_median"] / row["tls_ms_median"],
            compiled_ms_median=float(np.median(compiled)),
            compile_s=compile_s,
            compiled_idle_cpu_per_actor=idle_cpu,
        )
        rows.append(row)
        print(
            f"  p={p}: DC round tls {row['tls_ms_median']:.2f} ms, plain {row['plain_ms_median']:.2f} ms, "
            f"Ray {row['off_ms_median']:.2f} ms ({row['speedup_tls_vs_ray']:.1f}x); ping tls "
            f"{row['ping_tls_ms_median']:.2f} ms, Ray {row['ping_off_ms_median']:.2f} ms; start-up {startup:.1f} s, "
            f"{per_actor_mb:.0f} MB per actor"
            + (
                f"; compiled graph {row['compiled_ms_median']:.2f} ms (compiling {compile_s:.1f} s, idle actors "
                f"busy {idle_cpu:.0%} of a CPU each)"
                if compiled_too
                else ""
            ),
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------- 2. DC solve
def bench_solve(p: int, n_total: int, objectives, repeats: int = 3) -> list[dict]:
    kwargs = make_federation(p, n_labeled=n_total // p, n_unlabeled=50, d=4, seed=7)
    dm = domain_model(kwargs)
    local = LocalSites(kwargs)
    lc = coordinator_for(local, kwargs)
    qhat, local_oracle = lc.prepare_dc(dm)
    sets = [w._points for w in local.workers]
    pooled = LocalOracle(
        [
            PointSet(
                w=np.vstack([s.w for s in sets]),
                pi=np.concatenate([s.pi for s in sets]),
                H=np.vstack([s.H for s in sets]),
                loss="cross_entropy",
            )
        ]
    )
    per_site = LocalOracle(sets)
    backend = RaySites(kwargs)
    rows = []
    try:
        rc = coordinator_for(backend, kwargs)
        rqhat, ray_oracle = rc.prepare_dc(dm)
        assert np.allclose(rqhat, qhat, rtol=1e-12)
        for objective in objectives:
            opts = dict(objective=objective, random_state=0, warn=False)
            out, times = {}, {}
            for _ in range(repeats):  # interleaved, median: the machine's load drifts
                for label, oracle in (
                    ("in_process_pooled", pooled),
                    ("in_process_per_site", per_site),
                    ("distributed", ray_oracle),
                    ("distributed_ray_calls", ray_oracle),
                ):
                    backend.set_data_channel("off" if label == "distributed_ray_calls" else "tls")
                    oracle.evaluate(np.full(p, 1.0 / p), ETA, ("L",))  # opens the channels outside the timing
                    t = time.perf_counter()
                    res = solve_dc(oracle, ETA, **opts)
                    times.setdefault(label, []).append(time.perf_counter() - t)
                    out[label] = (float(np.median(times[label])), res)
            z_ref = out["in_process_pooled"][1].z
            row = {
                "objective": objective,
                "p": p,
                "n_total": p * (n_total // p),
                "n_evaluations": out["distributed"][1].n_evaluations,
                "max_abs_dz": float(np.abs(out["distributed"][1].z - z_ref).max()),
            }
            for label, (secs, _) in out.items():
                row[f"{label}_s"] = secs
            row["ratio_vs_pooled"] = row["distributed_s"] / row["in_process_pooled_s"]
            row["ratio_vs_per_site"] = row["distributed_s"] / row["in_process_per_site_s"]
            row["ratio_ray_calls_vs_pooled"] = row["distributed_ray_calls_s"] / row["in_process_pooled_s"]
            row["distributed_ms_per_evaluation"] = 1e3 * row["distributed_s"] / row["n_evaluations"]
            row["pooled_ms_per_evaluation"] = (
                1e3 * row["in_process_pooled_s"] / out["in_process_pooled"][1].n_evaluations
            )
            rows.append(row)
            print(
                f"  {objective}: distributed {row['distributed_s']:.2f} s (through Ray: {row['distributed_ray_calls_s']:.2f} s) "
                f"vs in-process {row['in_process_pooled_s']:.2f} s (pooled; {row['in_process_per_site_s']:.2f} s per-site "
                f"loop): ratio {row['ratio_vs_pooled']:.2f} (through Ray {row['ratio_ray_calls_vs_pooled']:.2f}), "
                f"{row['n_evaluations']} evaluations, max |dz| {row['max_abs_dz']:.1e}",
                flush=True,
            )
    finally:
        backend.shutdown()
    return rows


# ----------------------------------------------------------------------------- 3. SGD
def bench_sgd(p: int, m_total: int, d: int, epochs: int, batch_size: int, workers=(1, 2)) -> list[dict]:
    kwargs = make_federation(p, n_labeled=50, n_unlabeled=m_total // p, d=d, seed=11)
    ccfg = ClassifierConfig(mu=1e-3, optimizer="sgd", epochs=epochs, batch_size=batch_size, lr=0.05)
    samples = [kw["X_unlabeled"] for kw in kwargs]
    t = time.perf_counter()
    ref = train_domain_classifier(samples, StandardFeatures(), ccfg, random_state=0)
    single = time.perf_counter() - t
    probe = np.vstack(samples)[:: max(1, m_total // 2000)]
    rows = [{"mode": "single process", "workers_per_site": 0, "seconds": single, "max_abs_dproba": 0.0}]
    print(f"  single process: {single:.2f} s", flush=True)
    steps = epochs * int(np.ceil((m_total // p) / batch_size))
    for w, mode in [(w, "tls") for w in workers] + [(1, "off")]:
        backend = RaySites(kwargs, workers_per_site=w, data_channel=mode)
        try:
            c = coordinator_for(backend, kwargs, classifier=ccfg)
            t = time.perf_counter()
            c.train_domain_model(Progress(False))  # cold: each actor loads torch on its first shard
            cold = time.perf_counter() - t
            t = time.perf_counter()
            dm = c.train_domain_model(Progress(False))
            secs = time.perf_counter() - t
        finally:
            backend.shutdown()
        diff = float(np.abs(dm.predict_proba(probe) - ref.predict_proba(probe)).max())
        rows.append(
            {
                "mode": "data-parallel" + (" (Ray calls)" if mode == "off" else ""),
                "data_channel": mode,
                "workers_per_site": w,
                "seconds": secs,
                "cold_seconds": cold,
                "max_abs_dproba": diff,
                "ratio_vs_single": secs / single,
                "ms_per_step": 1e3 * secs / steps,
            }
        )
        print(
            f"  data-parallel ({mode}), {w} worker(s) per site: {secs:.2f} s ({secs / single:.1f}x single; first run "
            f"{cold:.1f} s), max |dQ| {diff:.1e}",
            flush=True,
        )
    for r in rows:
        r.update(p=p, m_total=p * (m_total // p), d=d, epochs=epochs, batch_size=batch_size, steps=steps)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (checks that the benchmark runs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_runtime.json"))
    ap.add_argument("--sections", default="latency,solve,sgd", help="comma-separated subset to run")
    ap.add_argument("--compiled", action="store_true", help="also time Ray Compiled Graph rounds for p <= 4")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if args.quick:
        ps, rounds, n_total, m_total, epochs = (2, 4), 30, 4_000, 4_000, 1
    else:
        ps, rounds, n_total, m_total, epochs = (2, 4, 8, 16, 32, 64), 200, 100_000, 100_000, 2
    t0 = time.perf_counter()
    ensure_ray(num_cpus=os.cpu_count())
    load = os.getloadavg()
    print(f"Ray {__import__('ray').__version__}, {os.cpu_count()} CPUs, load average {load[0]:.1f}", flush=True)
    latency, solve, sgd = [], [], []
    if "latency" in sections:
        print("1. distributed DC evaluation round (50 labelled points per site)", flush=True)
        latency = bench_latency(ps, rounds, compiled_upto=4 if args.compiled else 0)
    if "solve" in sections:
        print(f"2. DC solve, p = 8, n = {n_total} labelled points (median of 3)", flush=True)
        solve = bench_solve(8, n_total, ("minmax", "gamma"))
    if "sgd" in sections:
        print(f"3. domain classifier, SGD, p = 8, m = {m_total} unlabelled points, {epochs} epochs", flush=True)
        sgd = bench_sgd(8, m_total, d=10, epochs=epochs, batch_size=256)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_start": load,
            "load_average_end": os.getloadavg(),
        },
        "quick": args.quick,
        "latency": latency,
        "dc_solve": solve,
        "sgd": sgd,
        "seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(
        "\n| p | DC round, TLS channel (ms) | p90 | plain channel (ms) | Ray calls (ms) | Ray/TLS | ping TLS (ms) "
        "| ping Ray (ms) | actor start-up (s) | PSS/actor (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in latency:
        if "skipped" in r:
            print(f"| {r['p']} | skipped: {r['skipped']} | | | | | | | | |")
        else:
            print(
                f"| {r['p']} | {r['tls_ms_median']:.2f} | {r['tls_ms_p90']:.2f} | {r['plain_ms_median']:.2f} | "
                f"{r['off_ms_median']:.2f} | {r['speedup_tls_vs_ray']:.1f}x | {r['ping_tls_ms_median']:.2f} | "
                f"{r['ping_off_ms_median']:.2f} | {r['startup_s']:.1f} | {r['actor_pss_mb']:.0f} |"
            )
    print(
        "\n| objective | evaluations | distributed, TLS channel (s) | in-process pooled (s) | in-process per-site (s) "
        "| ratio | distributed, Ray calls (s) | ratio | max abs dz |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in solve:
        print(
            f"| {r['objective']} | {r['n_evaluations']} | {r['distributed_s']:.2f} | {r['in_process_pooled_s']:.2f} | "
            f"{r['in_process_per_site_s']:.2f} | {r['ratio_vs_pooled']:.2f} | {r['distributed_ray_calls_s']:.2f} | "
            f"{r['ratio_ray_calls_vs_pooled']:.2f} | {r['max_abs_dz']:.1e} |"
        )
    print("\n| SGD | workers/site | seconds | vs single | ms/step | first run (s) | max abs dQ |")
    print("|---|---|---|---|---|---|---|")
    for r in sgd:
        print(
            f"| {r['mode']} | {r['workers_per_site'] or '-'} | {r['seconds']:.2f} | "
            f"{r.get('ratio_vs_single', 1.0):.1f}x | {r.get('ms_per_step', float('nan')):.1f} | "
            f"{r.get('cold_seconds', float('nan')):.1f} | {r['max_abs_dproba']:.1e} |"
        )
    print(f"\nwritten {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
