"""The site policy's overhead on a DC round (p = 8 sites, in process).

One DC round = ``dc_evaluate`` (what = L, dL) at each of the 8 sites.  Baseline: the same sums
computed by each site's point set directly (what the site did before it enforced a policy:
the min_points test and ``PointSet.evaluate``).  Policy: ``SiteWorker.dc_evaluate`` with the
default policy (in-memory ledger and audit log), and with a ledger file and an audit log file
on disk.  Median of interleaved repeats, in one run; n labelled points per site is varied
(50: the round is nearly all overhead; 12 500: the bench_runtime solve size).

    python benchmarks/bench_privacy.py [--rounds 200] [--json benchmarks/results/bench_privacy.json]
    python benchmarks/bench_privacy.py --ray        # also: full DC rounds on Ray site actors (TLS channel)

``--verify``: the cost of verifying a domain model at a site (msa_fed/privacy/verify.py): p = 8
sites, 1000 published points each, d = 20, the polished optimum; the standard map and 1000
random Fourier features; median of repeats, against ``set_domain_model`` with verification off.

``--per-request``: the policy's CPU on one site request (n = 50, p = 8), in one process (warm,
then with the caches evicted before every request, as a site actor finds them): the
site's DC answer without the policy (the Ray baseline's ``dc_evaluate``) against
``SiteWorker.dc_evaluate`` with the in-memory ledger and log and with a ledger file and an audit
log file; this thread's CPU time per request, blocks of requests alternating between the arms,
medians over the blocks (CPU time: the other processes of a loaded machine do not count).
Also run with ``--ray``, before the Ray rounds.

``--ray``: p = 8 site actors on a local Ray (50 labelled points each, as in bench_runtime's
round latency), one DC round = ``DistributedOracle.evaluate`` (L and dL) over the TLS data
channel; the baseline actors are a SiteWorker subclass whose ``dc_evaluate`` is the site's
code before the policy (min_points test and the sums), the others enforce the default policy;
the two alternate which goes first in a round.  Besides the round's wall time, the CPU time
of the p site actors' processes per round (``/proc/PID/schedstat``), which a loaded machine's
other work does not inflate as much.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def make_sites(p: int, n: int, policy_kw: dict, seed: int = 0):
    from sklearn.linear_model import LogisticRegression

    from msa_fed.boundary import messages as m
    from msa_fed.core.features import StandardFeatures, feature_map_state
    from msa_fed.privacy.policy import SitePolicy
    from msa_fed.site.worker import SiteWorker

    rng = np.random.default_rng(seed)
    d = 4
    data = []
    for k in range(p):
        X = rng.normal(size=(n, d)) + np.eye(d)[k % d] * 1.5
        y = (X[:, 0] + rng.normal(size=n) > 0).astype(int)
        data.append((X, y))
    preds = []
    for k in range(p):
        X, y = data[k]
        preds.append(LogisticRegression().fit(X, y))
    fmap = StandardFeatures().fit(np.vstack([X for X, _ in data]))
    theta = rng.normal(scale=0.3, size=p * (d + 1))
    spec = m.DomainModelSpec(kind="maxent", n_sources=p, feature_map=feature_map_state(fmap), theta=theta)
    workers = []
    # a random theta: these sites time DC rounds, so they do not verify the model (timed in verify_cost)
    policy_kw = {"verify_domain_models": False, **policy_kw}
    for k, (X, y) in enumerate(data):
        pol = SitePolicy(**{kk: (v.format(k=k) if isinstance(v, str) else v) for kk, v in policy_kw.items()})
        workers.append(
            SiteWorker(
                f"s{k}",
                k,
                X,
                y,
                X,
                predictors=preds,
                task="classification",
                loss="cross_entropy",
                classes=np.array([0, 1]),
                policy=pol,
            )
        )
    parts = [w.set_domain_model(spec) for w in workers]
    qhat = np.sum([r.sums for r in parts], axis=0)
    for w in workers:
        w.set_qhat(m.QhatBroadcast(qhat=qhat, eta=0.01))
    return workers


def _unchecked_cls():
    from msa_fed.boundary import messages as m
    from msa_fed.site.published import SiteStateLost
    from msa_fed.site.worker import SiteWorker

    class UncheckedSite(SiteWorker):
        """The site's DC answer as it was before the policy (the baseline)."""

        def dc_evaluate(self, msg):
            if self._points is None:
                raise SiteStateLost(self.name)
            if self._points.n_points < 20:
                raise ValueError("too few points")
            return m.DCPartial(
                sums=self._points.evaluate(msg.z, msg.eta, what=tuple(msg.what), global_bound=msg.global_bound)
            )

    return UncheckedSite


def ray_rounds(rounds: int, n: int = 50, p: int = 8) -> dict:
    """Median DC round on Ray site actors over the TLS channel: unchecked vs default policy."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.core.density import KDEDomainModel
    from msa_fed.runtime.config import FitConfig
    from msa_fed.runtime.coordinator import Coordinator
    from msa_fed.runtime.ray_sites import RaySites, ensure_ray
    from msa_fed.site.worker import SiteWorker

    ensure_ray(None, num_cpus=2, include_dashboard=False, log_to_driver=False)
    rng = np.random.default_rng(0)
    d = 4
    data = [(rng.normal(size=(n, d)) + np.eye(d)[k % d] * 1.5) for k in range(p)]
    ys = [(X[:, 0] > 0).astype(int) for X in data]
    preds = [LogisticRegression().fit(X, y) for X, y in zip(data, ys)]
    classes = np.array([0, 1])
    kw = [
        dict(
            name=f"s{k}",
            index=k,
            X_labeled=X,
            y_labeled=y,
            X_unlabeled=X,
            predictors=preds,
            task="classification",
            loss="cross_entropy",
            classes=classes,
            privacy={"dc_evaluations_per_job": 10**9, "dc_evaluations_per_day": 10**9},
        )
        for k, (X, y) in enumerate(zip(data, ys))
    ]
    from msa_fed.runtime.ray_actors import actor_pid

    out: dict = {}
    times: dict = {}
    cpu: dict = {}
    cpu_main: dict = {}  # the actors' main threads only (what this bench measured before)
    cpu_here: dict = {}  # this process (the coordinator)
    by_thread: dict = {}  # the actors' CPU by thread name over the timed rounds (ns)
    before: dict = {}
    backends = {
        "baseline (no policy)": RaySites(kw, worker_cls=_unchecked_cls()),
        "default policy": RaySites(kw, worker_cls=SiteWorker),
    }
    oracles = {}
    try:
        for name, be in backends.items():
            c = Coordinator(be, preds, FitConfig(method="gmsa", features="standard", bandwidth=1.0)).start()
            be.share_samples(data)  # the sites verify the KDE's samples against the published ones
            dm = KDEDomainModel(bandwidth=1.0).fit([X for X in data])
            _, oracles[name] = c.prepare_dc(dm)
            times[name], cpu[name], cpu_main[name], cpu_here[name] = [], [], [], []
            by_thread[name], before[name] = {}, {}
        pids = {name: [actor_pid(a) for a in be.actors] for name, be in backends.items()}
        zs = rng.dirichlet(np.ones(p), size=rounds + 20)
        names = list(oracles)
        for r, z in enumerate(zs):
            # interleaved, each variant first in every other round (the round that follows
            # another one waits for that one's actors to give the cores back)
            for name in names if r % 2 == 0 else names[::-1]:
                oracle = oracles[name]
                c0, m0, h0 = _schedstat_ns(pids[name]), _schedstat_ns(pids[name], True), time.process_time()
                t = time.perf_counter()
                oracle.evaluate(z, 0.01, ("L", "dL"))
                if r >= 20:
                    times[name].append(time.perf_counter() - t)
                    h1 = time.process_time()
                    cpu[name].append(_schedstat_ns(pids[name]) - c0)
                    cpu_main[name].append(_schedstat_ns(pids[name], True) - m0)
                    cpu_here[name].append(h1 - h0)
                    if r % 10 == 0:  # by thread, every 10th round (reading the names costs)
                        _by_thread(pids[name], by_thread[name], before[name])
                else:
                    _by_thread(pids[name], {}, before[name])
    finally:
        for be in backends.values():
            be.shutdown()
    base = float(np.median(times["baseline (no policy)"]))
    base_cpu = float(np.median(cpu["baseline (no policy)"]))
    for name, ts in times.items():
        out[name] = {
            "median_ms": float(np.median(ts)) * 1e3,
            "p90_ms": float(np.percentile(ts, 90)) * 1e3,
            "ratio": float(np.median(ts)) / base,
            # the p site actors' CPU per round (their processes, all threads)
            "actors_cpu_ms": float(np.median(cpu[name])) * 1e-6,
            "actors_cpu_ratio": float(np.median(cpu[name])) / base_cpu,
            "actors_main_thread_cpu_ms": float(np.median(cpu_main[name])) * 1e-6,
            "coordinator_cpu_ms": float(np.median(cpu_here[name])) * 1e3,
        }
        print(
            f"Ray, p={p}, n={n} per site, TLS channel  {name:<22} {out[name]['median_ms']:7.3f} ms "
            f"(p90 {out[name]['p90_ms']:.3f})  x{out[name]['ratio']:.3f};  the sites' CPU per round "
            f"{out[name]['actors_cpu_ms']:.3f} ms x{out[name]['actors_cpu_ratio']:.3f} (their main threads "
            f"{out[name]['actors_main_thread_cpu_ms']:.3f} ms; "
            f"the coordinator {out[name]['coordinator_cpu_ms']:.3f} ms)"
        )
    for name in times:
        # per timed round (10 rounds between readings): each thread name's CPU, largest first
        per = {k: v * 1e-6 / 10 / (len(times[name]) / 10) for k, v in by_thread[name].items()}
        out[name]["actors_cpu_ms_by_thread"] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
        top = list(out[name]["actors_cpu_ms_by_thread"].items())[:6]
        print(f"  {name}: the actors' CPU per round by thread " + ", ".join(f"{k} {v:.3f} ms" for k, v in top))
    out["load"] = os.getloadavg()
    print(f"  load average {out['load'][0]:.1f}")
    return out


def _by_thread(pids, acc: dict, last: dict) -> None:
    """Add each actor thread's CPU since the previous reading to ``acc[thread name]`` (ns)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    ns = int(fh.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                    comm = fh.read().strip()
            except FileNotFoundError:
                continue
            key = (pid, tid)
            if key in last:
                acc[comm] = acc.get(comm, 0) + ns - last[key]
            last[key] = ns


def _schedstat_ns(pids, main_only: bool = False) -> int:
    """CPU time (ns) of the processes ``pids`` so far, all their threads, from the scheduler's
    accounting (``/proc/PID/task/TID/schedstat``, nanoseconds).  ``/proc/PID/schedstat`` alone
    is the main thread's: a site actor answers the data channel's calls in another thread
    (msa_fed/boundary/channel.py), whose CPU it would leave out (``main_only``: that figure)."""
    total = 0
    for pid in pids:
        tids = [str(pid)] if main_only else os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except FileNotFoundError:  # a thread that ended since the listing
                pass
    return total


def verify_cost(repeats: int = 7, p: int = 8, n: int = 1000, d: int = 20) -> dict:
    """Median seconds of one verification (check_maxent) and of set_domain_model without it."""
    from dataclasses import replace

    from sklearn.linear_model import LogisticRegression

    from msa_fed.boundary import messages as m
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle, train_domain_classifier
    from msa_fed.core.features import feature_map_state, make_feature_map
    from msa_fed.privacy.policy import SitePolicy
    from msa_fed.privacy.verify import PUBLISHED_MEMO, check_maxent
    from msa_fed.site.worker import SiteWorker

    rng = np.random.default_rng(0)
    U = [rng.normal(size=(n, d)) + 0.7 * np.eye(d)[k % d] for k in range(p)]
    Xl = rng.normal(size=(n, d)) + 0.7 * np.eye(d)[0]
    yl = (Xl[:, 0] > 0.3).astype(int)
    h = LogisticRegression().fit(Xl, yl)
    out = {}
    for label, feats in (("standard", "standard"), ("rff, 1000 components", ("rff", {"n_components": 1000}))):
        cfg = ClassifierConfig(mu=1e-3)
        model = train_domain_classifier(U, make_feature_map(feats, 0), cfg)
        Phis = [model.feature_map.transform(X) for X in U]
        oracle = sum_oracle(balanced_shards(Phis, replace(cfg, dtype="float64")))
        model.theta_, _ = polish_maxent(oracle, model.theta_, model.n_features_, p, cfg.mu, 1000)
        state = feature_map_state(model.feature_map)
        pol = SitePolicy(domain_models_per_job=10**6, domain_models_per_day=10**6)
        spec = m.domain_model_spec(model, p)
        worker = SiteWorker(
            "s0",
            0,
            Xl,
            yl,
            U[0],
            predictors=[h] * p,
            classes=np.array([0, 1]),
            policy=replace(pol, verify_domain_models=False),
        )
        ts_check, ts_set = [], []
        for _ in range(repeats):
            PUBLISHED_MEMO.clear()  # the whole check, as a site process runs it once per model
            t = time.perf_counter()
            res = check_maxent(model.theta_, cfg.mu, state, U, pol, "s0")
            ts_check.append(time.perf_counter() - t)
            t = time.perf_counter()
            worker._spec_key = None
            worker.set_domain_model(spec)
            ts_set.append(time.perf_counter() - t)
        out[label] = {
            "verify_ms": float(np.median(ts_check)) * 1e3,
            "set_domain_model_without_ms": float(np.median(ts_set)) * 1e3,
            "deviation": res["verify_deviation"],
        }
        print(
            f"verify, p={p}, {n} points per site, d={d}, {label:<22} {out[label]['verify_ms']:8.1f} ms "
            f"(set_domain_model without it {out[label]['set_domain_model_without_ms']:.1f} ms; "
            f"deviation of the honest model {res['verify_deviation']:.2g})"
        )
    return out


def per_request(
    requests: int = 500, blocks: int = 21, n: int = 50, p: int = 8, tmp: Path | None = None, cold: bool = False
) -> dict:
    """CPU per request (this thread's CPU time, ``time.thread_time``) of one site's DC answer
    without the policy (the Ray baseline's ``dc_evaluate``: the min_points test and the sums)
    and with it (``SiteWorker.dc_evaluate``: in-memory ledger and log, the Ray runtime's
    default; and with a ledger file and an audit log file, what a site process runs), in one
    process: ``blocks`` blocks of ``requests`` requests per arm, the arms alternating block by
    block (each first in every other block), medians over the blocks.  CPU time rather than
    wall time: a loaded machine's other processes do not count, only what this code costs
    (caches shared with them still do).  ``cold``: the caches evicted before every request (a
    32 MiB array written; not timed), as a site actor finds them when its request arrives after
    the other processes' work: each request timed alone (``time.thread_time_ns``)."""
    from msa_fed.boundary import messages as m

    tmp = Path(tempfile.mkdtemp()) if tmp is None else tmp
    budgets = {"dc_evaluations_per_job": 10**9, "dc_evaluations_per_day": 10**9}
    base = make_sites(p, n, budgets)[0]
    base.__class__ = _unchecked_cls()  # the same site, its DC answer as it was before the policy
    arms = {
        "without the policy": base,
        "policy (memory ledger + log)": make_sites(p, n, budgets)[0],
        "policy (ledger + audit log files)": make_sites(
            p, n, {**budgets, "ledger": str(tmp / "pr_l{k}.sqlite"), "audit_log": str(tmp / "pr_a{k}.jsonl")}
        )[0],
    }
    zs = np.random.default_rng(2).dirichlet(np.ones(p), size=requests)
    reqs = [m.DCRequest(z=z, eta=0.01, what=("L", "dL")) for z in zs]
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for w in arms.values():  # warm: caches, the ledger's tables, the log file open
        for r in reqs[:50]:
            w.dc_evaluate(r)
    junk = np.zeros(32 << 20 if cold else 0, dtype=np.uint8)
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            answer = arms[name].dc_evaluate
            if cold:
                ns = 0
                for r in reqs:
                    junk += 1  # every cache line of 32 MiB written: this request's code and data evicted
                    t0 = time.thread_time_ns()
                    answer(r)
                    ns += time.thread_time_ns() - t0
                cpu[name].append(ns * 1e-9 / len(reqs))
                continue
            t = time.thread_time()
            for r in reqs:
                answer(r)
            cpu[name].append((time.thread_time() - t) / len(reqs))
    ref = float(np.median(cpu["without the policy"]))
    out: dict = {"requests_per_block": requests, "blocks": blocks, "cold": cold, "load": os.getloadavg()}
    for name, ts in cpu.items():
        med = float(np.median(ts))
        out[name] = {
            "cpu_us": med * 1e6,
            "cpu_us_min_max": [min(ts) * 1e6, max(ts) * 1e6],
            "policy_us": (med - ref) * 1e6,
            "ratio": med / ref,
        }
        print(
            f"one DC request{' (cold caches)' if cold else ''}, n={n}, p={p}, CPU (median of {blocks} blocks of "
            f"{requests}): {name:<34} "
            f"{med * 1e6:6.1f} us  (+{(med - ref) * 1e6:5.1f} us)  x{med / ref:.3f}"
        )
    print(f"  load average {out['load'][0]:.1f}")
    return out


def main(argv=None):
    from msa_fed.boundary import messages as m

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--sizes", default="50,1000,12500")
    ap.add_argument("--json")
    ap.add_argument("--ray", action="store_true", help="also time full DC rounds on Ray site actors")
    ap.add_argument("--ray-only", action="store_true", help="only the Ray rounds")
    ap.add_argument("--verify", action="store_true", help="also time the verification of a domain model")
    ap.add_argument("--verify-only", action="store_true", help="only the verification")
    ap.add_argument("--per-request", action="store_true", help="only the policy's CPU on one site request")
    ap.add_argument("--blocks", type=int, default=21, help="--per-request / --ray: blocks of requests per arm")
    args = ap.parse_args(argv)
    p = 8
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(1)
    zs = rng.dirichlet(np.ones(p), size=args.rounds)
    out = {}
    if args.per_request:
        out["per_request_p8_n50"] = per_request(blocks=args.blocks)
        out["per_request_p8_n50_cold"] = per_request(requests=100, blocks=args.blocks, cold=True)
        args.sizes = ""
    if args.verify or args.verify_only:
        out["verify_p8_n1000_d20"] = verify_cost()
    if args.ray or args.ray_only:
        out["per_request_p8_n50"] = per_request(blocks=args.blocks)  # the same path's CPU, in process
        out["ray_round_p8"] = ray_rounds(args.rounds)
    for n in [] if (args.ray_only or args.verify_only) else (int(s) for s in args.sizes.split(",") if s):
        variants = {
            "default policy (memory ledger + log)": make_sites(
                p, n, {"dc_evaluations_per_job": 10**9, "dc_evaluations_per_day": 10**9}
            ),
            "ledger + audit log files": make_sites(
                p,
                n,
                {
                    "dc_evaluations_per_job": 10**9,
                    "dc_evaluations_per_day": 10**9,
                    "ledger": str(tmp / f"l{n}_{{k}}.sqlite"),
                    "audit_log": str(tmp / f"a{n}_{{k}}.jsonl"),
                },
            ),
        }
        base_workers = variants["default policy (memory ledger + log)"]

        def baseline(z, base_workers=base_workers):
            for w in base_workers:
                w._points.evaluate(z, 0.01, what=("L", "dL"))

        def policy(workers):
            def run(z):
                for w in workers:
                    w.dc_evaluate(m.DCRequest(z=z, eta=0.01, what=("L", "dL")))

            return run

        fns = {"baseline (sums only)": baseline, **{k: policy(v) for k, v in variants.items()}}
        times = {k: [] for k in fns}
        for r in range(args.rounds):
            for k, fn in fns.items():  # interleaved
                t = time.perf_counter()
                fn(zs[r])
                times[k].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        base = med["baseline (sums only)"]
        out[n] = {k: {"median_ms": v * 1e3, "ratio": v / base} for k, v in med.items()}
        for k, v in out[n].items():
            print(f"n={n:>6} per site  {k:<40} {v['median_ms']:8.3f} ms  x{v['ratio']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
