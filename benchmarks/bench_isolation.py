"""Cost of running peers' predictors in limited worker processes (msa_fed.artifacts.isolated)
against in-process onnxruntime, in the same run, at the batch sizes a job uses.

Where a job runs predictors:

- each site, once per job: every predictor on its labelled and unlabelled rows together
  (``SiteWorker._outputs``: its own in process, its peers' through ``answered_together``, one
  request to a worker for all of them); the predictors' sessions are new to the job (a site's Ray
  actor is new per job; a site agent's worker keeps a model loaded across jobs, the "warm" rows);
- the coordinator: the combined model's ``predict_proba`` (peers' predictors in its workers,
  one request per call; in process, its fused ONNX graph).

Cases (sizes of the experiments this repository runs): the synthetic demo (3 sites, logistic
regressions, d = 2, 400 labelled + 1000 unlabelled rows), Adult (2 sites, logistic regression,
d = 14 stand-in for the one-hot pipeline, 400 + 400 rows), digits (3 sites, the digit CNN on
16x16 images, untrained weights, 1000 + 1000 rows).  Each timing is the median of repeats,
the in-process and isolated variants interleaved.  "one by one" is one request per peer
predictor (the path before requests were batched), in the same run.  "Loaded at admission" is
what a site does now: when a job's predictors arrive (``SiteWorker.__init__``, ``prestart``) its
peers' models go to the worker and their sessions open there, in the background while the job
sets up; the site's evaluation is then one request of rows (its own predictor's session opening
in process meanwhile).  It is timed two ways: the load and the evaluation back to back (the whole
work, an upper bound of the job's wait) and the evaluation alone (the load overlapping the job's
set-up, as in a job).  At the coordinator the
in-process baseline is the fused ONNX graph (every predictor trusted) and, for reference, the
part-by-part numpy path the isolated model takes.

    python benchmarks/bench_isolation.py [--quick] [--repeats N] [--site-only]
        ->  benchmarks/results/bench_isolation.json
    python benchmarks/bench_isolation.py --quick --repeats 41 --baseline OTHER_CHECKOUT   # this tree's
        # isolation code against another checkout's, in one process (the evaluation alone)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sklearn.linear_model import LogisticRegression  # noqa: E402

from msa_fed.artifacts.export import export_torch  # noqa: E402
from msa_fed.artifacts.isolated import (  # noqa: E402
    IsolationLimits,
    PredictorPool,
    answered_together,
    isolate,
    prestart,
)
from msa_fed.artifacts.loader import OnnxClassifier  # noqa: E402
from msa_fed.artifacts.predictors import export_sklearn, load_predictor  # noqa: E402
from msa_fed.site.worker import predictor_outputs  # noqa: E402

#: the set-up a job does between its join and a site's first evaluation (seconds; a federated
#: job's domain classifier and Qhat take longer): the peers' models load meanwhile
SETUP_S = 0.05


def _logistic(d: int, rng, k: int) -> bytes:
    X = rng.normal(size=(500, d))
    y = (X @ rng.normal(size=d) + 0.3 * k > 0).astype(int)
    return export_sklearn(LogisticRegression(max_iter=500).fit(X, y), n_features=d)


def _cnn(seed: int) -> bytes:
    import torch

    from msa_fed.experiments.cnn import DigitCNN

    class Flat(torch.nn.Module):  # rows of 256 pixels in, class probabilities out
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.cnn = DigitCNN()

        def forward(self, x):
            return torch.softmax(self.cnn(x.reshape(-1, 1, 16, 16)), dim=1)

    return export_torch(Flat().eval(), 256, "probabilities", classes=list(range(10)))


def _fresh(h: OnnxClassifier) -> OnnxClassifier:
    """The same predictor with no session yet (as a job's new site worker has it)."""
    return OnnxClassifier(h.data, h.kind, h.n_features_in_, 1, h.sha256, classes=list(h.classes_))


def _median(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cpu_ns(pids) -> dict:
    """{pid: CPU time (ns) so far} of the processes ``pids``, all their threads, from the
    scheduler's own accounting (``/proc/PID/task/TID/schedstat``: nanoseconds on a CPU, not 10 ms
    ticks; ``/proc/PID/schedstat`` alone is the main thread's); a process gone is left out."""
    out = {}
    for pid in pids:
        try:
            total = 0
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                        total += int(fh.read().split()[0])
                except FileNotFoundError:  # a thread that ended since the listing
                    pass
            out[pid] = total
        except (OSError, ValueError, IndexError):
            pass
    return out


def _workers(pool) -> set:
    """The pids of the pool's worker processes (between requests every worker is idle)."""
    return set() if pool is None else {w.pid for w in pool._idle if w.pid}


def _interleaved(fs: dict, repeats: int, pool=None) -> tuple[dict, dict]:
    """Median ms of each variant, the variants interleaved (each first in turn); a variant that
    returns a number returns its own time (seconds: the part of it that is timed).  Also the
    median CPU ms of each run: this process's (all its threads) plus the pool's worker
    processes' (a worker that ends during a run is not counted: none does in these runs)."""
    times: dict = {k: [] for k in fs}
    cpu: dict = {k: [] for k in fs}
    names = list(fs)
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = _cpu_ns(_workers(pool)), time.process_time_ns()
            t = time.perf_counter()
            own = fs[k]()
            times[k].append(own if isinstance(own, float) else time.perf_counter() - t)
            c1, w1 = time.process_time_ns(), _cpu_ns(_workers(pool))
            cpu[k].append(c1 - c0 + sum(v - w0.get(pid, 0) for pid, v in w1.items()))
    return (
        {k: 1e3 * statistics.median(v) for k, v in times.items()},
        {k: 1e-6 * statistics.median(v) for k, v in cpu.items()},
    )


def site_case(name: str, onnxs: list[bytes], d: int, rows: int, pool: PredictorPool, repeats: int, rng) -> dict:
    """A site's evaluation of all p predictors on its ``rows`` rows, in process against isolated."""
    loaded = [load_predictor(o, kind="probabilities") for o in onnxs]
    classes = np.unique(np.concatenate([h.classes_ for h in loaded]))
    X = rng.normal(size=(rows, d))
    peers = [isolate(h, f"site{k}", pool) for k, h in enumerate(loaded) if k > 0]

    def evaluate(hs):
        for h in answered_together(hs, X):
            predictor_outputs(h, X, "classification", classes, who="")

    def forget():  # the worker has not seen these models yet (a new job's predictors)
        for w in pool._idle:
            w.loaded.difference_update(h.sha256 for h in peers)

    def inproc_fresh():
        evaluate([_fresh(h) for h in loaded])

    def isolated_fresh():
        forget()
        evaluate([_fresh(loaded[0]), *peers])

    def admit():  # what the site does when a job's predictors arrive: their models into the worker
        for thread in prestart([loaded[0], *peers]):
            thread.join()

    def isolated_admitted():  # the models loaded at admission, then the evaluation, back to back
        forget()
        admit()
        evaluate([_fresh(loaded[0]), *peers])

    def isolated_admitted_eval() -> float:  # the evaluation alone (the load overlaps the job's set-up)
        forget()
        admit()
        hs = [_fresh(loaded[0]), *peers]
        t = time.perf_counter()
        evaluate(hs)
        return time.perf_counter() - t

    def isolated_job() -> float:  # as a job sees it: admitted, its set-up, then the evaluation
        forget()
        threads = prestart([loaded[0], *peers])  # at admission, in the background
        time.sleep(SETUP_S)  # the job's set-up (the domain model, Qhat) between join and evaluation
        hs = [_fresh(loaded[0]), *peers]
        t = time.perf_counter()
        evaluate(hs)  # waits for the load where it has not ended
        took = time.perf_counter() - t
        for thread in threads:
            thread.join()
        return took

    def one_by_one_fresh():
        forget()
        for h in [_fresh(loaded[0]), *peers]:
            predictor_outputs(h, X, "classification", classes, who="")

    warm_in = [_fresh(h) for h in loaded]

    def inproc_warm():
        evaluate(warm_in)

    def isolated_warm():
        evaluate([warm_in[0], *peers])

    isolated_fresh(), inproc_warm(), isolated_warm()  # sessions and the worker up
    t, cpu = _interleaved(
        {
            "inproc_fresh": inproc_fresh,
            "isolated_fresh": isolated_fresh,
            "isolated_admitted": isolated_admitted,
            "isolated_admitted_eval": isolated_admitted_eval,
            "isolated_job": isolated_job,
            "one_by_one_fresh": one_by_one_fresh,
            "inproc_warm": inproc_warm,
            "isolated_warm": isolated_warm,
        },
        repeats,
        pool,
    )
    out = {"case": name, "p": len(onnxs), "d": d, "rows": rows, **{f"{k}_ms": v for k, v in t.items()}}
    out.update({f"{k}_cpu_ms": v for k, v in cpu.items()})
    out["job_ratio"] = t["isolated_job"] / t["inproc_fresh"]
    out["admitted_cpu_ratio"] = cpu["isolated_admitted"] / cpu["inproc_fresh"]
    out["warm_cpu_ratio"] = cpu["isolated_warm"] / cpu["inproc_warm"]
    out["fresh_cpu_ratio"] = cpu["isolated_fresh"] / cpu["inproc_fresh"]
    out["fresh_ratio"] = t["isolated_fresh"] / t["inproc_fresh"]
    out["admitted_ratio"] = t["isolated_admitted"] / t["inproc_fresh"]
    out["admitted_eval_ratio"] = t["isolated_admitted_eval"] / t["inproc_fresh"]
    out["one_by_one_ratio"] = t["one_by_one_fresh"] / t["inproc_fresh"]
    out["warm_ratio"] = t["isolated_warm"] / t["inproc_warm"]
    return out


def baseline_case(name: str, onnxs: list[bytes], d: int, rows: int, baseline: str, repeats: int, rng) -> dict:
    """A site's evaluation with its peers' models loaded in their worker (as at admission) and its
    own predictor's session new, in process (every session new) and through two trees' isolation
    code in this process, interleaved: ``baseline``'s ``msa_fed/artifacts/isolated.py`` (another
    checkout) against this tree's, each with its own pool and worker.  Wall and CPU (this process
    and the pool's worker) medians."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_isolated", Path(baseline) / "msa_fed/artifacts/isolated.py")
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules["baseline_isolated"] = other  # dataclasses look their module up
    spec.loader.exec_module(other)
    import msa_fed.artifacts.isolated as here

    loaded = [load_predictor(o, kind="probabilities") for o in onnxs]
    classes = np.unique(np.concatenate([h.classes_ for h in loaded]))
    X = rng.normal(size=(rows, d))
    arms = {}
    for tag, mod in (("baseline", other), ("this tree", here)):
        pool = mod.PredictorPool(mod.IsolationLimits(workers=1))
        arms[tag] = (mod, pool, [mod.isolate(h, f"site{k}", pool) for k, h in enumerate(loaded) if k > 0])

    def isolated(tag):
        def run():
            mod, _, peers = arms[tag]
            for h in mod.answered_together([_fresh(loaded[0]), *peers], X):
                predictor_outputs(h, X, "classification", classes, who="")

        return run

    def inproc():
        for h in [_fresh(h) for h in loaded]:
            predictor_outputs(h, X, "classification", classes, who="")

    fs = {"in process": inproc, **{tag: isolated(tag) for tag in arms}}
    for tag in arms:  # workers up, the peers' models loaded (as at admission)
        fs[tag]()
    times: dict = {k: [] for k in fs}
    cpu: dict = {k: [] for k in fs}
    names = list(fs)
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            pool = arms[k][1] if k in arms else None
            w0, c0 = _cpu_ns(_workers(pool)), time.process_time_ns()
            t = time.perf_counter()
            fs[k]()
            times[k].append(time.perf_counter() - t)
            c1, w1 = time.process_time_ns(), _cpu_ns(_workers(pool))
            cpu[k].append(c1 - c0 + sum(v - w0.get(pid, 0) for pid, v in w1.items()))
    for _, pool, _ in arms.values():
        pool.close()
    out: dict = {"case": name, "p": len(onnxs), "d": d, "rows": rows, "repeats": repeats}
    for k in fs:
        out[k] = {"ms": 1e3 * statistics.median(times[k]), "cpu_ms": 1e-6 * statistics.median(cpu[k])}
    for k in arms:
        out[k]["ratio"] = out[k]["ms"] / out["in process"]["ms"]
        out[k]["cpu_ratio"] = out[k]["cpu_ms"] / out["in process"]["cpu_ms"]
    print(
        f"site   {name:<13} evaluation, the peers' models loaded, the own session new (wall / CPU ms): "
        + ", ".join(f"{k} {v['ms']:.2f} / {v['cpu_ms']:.2f}" for k, v in out.items() if isinstance(v, dict))
        + f";  to in process: baseline x{out['baseline']['ratio']:.2f}, this tree x{out['this tree']['ratio']:.2f}",
        flush=True,
    )
    return out


def coordinator_case(name: str, onnxs: list[bytes], d: int, rows: int, pool, repeats: int, rng) -> dict:
    """The combined model's predict_proba: every predictor in process (the fused graph) against
    peers' predictors in their workers (one request per call)."""
    from msa_fed.artifacts.model import CombinedModel
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import train_domain_classifier
    from msa_fed.core.features import make_feature_map

    p = len(onnxs)
    loaded = [load_predictor(o, kind="probabilities") for o in onnxs]
    samples = [rng.normal(size=(200, d)) + k for k in range(p)]
    dm = train_domain_classifier(samples, make_feature_map("standard"), ClassifierConfig())
    classes = np.unique(np.concatenate([h.classes_ for h in loaded]))

    def model(predictors):
        return CombinedModel(
            method="dmsa",
            task="classification",
            site_names=[f"site{k}" for k in range(p)],
            domain_model=dm,
            qhat=np.full(p, 1 / p),
            z=np.full(p, 1 / p),
            eta=1e-2,
            predictors=predictors,
            n_features=d,
            classes=classes,
        )

    inproc = model(loaded)
    iso = model([isolate(h, f"site{k}", pool) for k, h in enumerate(loaded)])  # the coordinator: all are peers'
    X = rng.normal(size=(rows, d))
    np.testing.assert_allclose(iso.predict_proba(X), inproc.predict_proba(X), atol=1e-6)
    t, _ = _interleaved(
        {
            "inproc": lambda: inproc.predict_proba(X),
            "inproc_numpy": lambda: inproc._predict_proba_numpy(X),
            "isolated": lambda: iso.predict_proba(X),
        },
        repeats,
    )
    return {
        "case": name,
        "p": p,
        "d": d,
        "rows": rows,
        "inproc_ms": t["inproc"],
        "inproc_numpy_ms": t["inproc_numpy"],
        "isolated_ms": t["isolated"],
        "ratio": t["isolated"] / t["inproc"],
        "ratio_to_numpy": t["isolated"] / t["inproc_numpy"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="5 repeats, no CNN, no 10x rows at the coordinator")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of each variant (default 21; 5 with --quick)")
    ap.add_argument("--site-only", action="store_true", help="the sites' per-job evaluation only")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "bench_isolation.json"))
    ap.add_argument(
        "--baseline",
        metavar="OTHER_CHECKOUT",
        help="only the sites' evaluation (the peers' models loaded): this tree's isolation code against that one's",
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    repeats = args.repeats or (21 if not args.quick else 5)
    pool = PredictorPool(IsolationLimits(workers=1))
    load_before = os.getloadavg()
    t = time.perf_counter()
    first = isolate(
        load_predictor(export_sklearn(LogisticRegression().fit([[0.0], [1.0]], [0, 1]), n_features=1)), "s", pool
    )
    first.predict_proba(np.zeros((1, 1)))
    worker_start = time.perf_counter() - t
    cases = [
        ("demo", [_logistic(2, rng, k) for k in range(3)], 2, 1400),
        ("adult", [_logistic(14, rng, k) for k in range(2)], 14, 800),
    ]
    if not args.quick:
        cases.append(("digits (CNN)", [_cnn(k) for k in range(3)], 256, 2000))
    sites, coordinator = [], []
    if args.baseline:
        out = {"load_before": load_before, "cpus": os.cpu_count(), "baseline": args.baseline}
        out["site_against_baseline"] = [
            baseline_case(name, onnxs, d, rows, args.baseline, repeats, rng) for name, onnxs, d, rows in cases
        ]
        out["load_after"] = os.getloadavg()
        pool.close()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"load {load_before} -> {out['load_after']}")
        return 0
    for name, onnxs, d, rows in cases:
        r = site_case(name, onnxs, d, rows, pool, repeats, rng)
        sites.append(r)
        print(
            f"site   {name:<13} p={r['p']} d={d:<3} n={rows:<5} per job {r['inproc_fresh_ms']:7.2f} -> "
            f"{r['isolated_fresh_ms']:7.2f} ms (x{r['fresh_ratio']:.2f}; one by one x{r['one_by_one_ratio']:.2f}; "
            f"loaded at admission: {r['isolated_admitted_ms']:.2f} ms x{r['admitted_ratio']:.2f}, "
            f"its evaluation {r['isolated_admitted_eval_ms']:.2f} ms x{r['admitted_eval_ratio']:.2f})"
            f"   warm {r['inproc_warm_ms']:7.2f} -> {r['isolated_warm_ms']:7.2f} ms (x{r['warm_ratio']:.2f})",
            flush=True,
        )
        print(
            f"       {name:<13} as a job sees it (admitted, {SETUP_S * 1e3:.0f} ms of set-up, evaluation) "
            f"{r['isolated_job_ms']:.2f} ms x{r['job_ratio']:.2f};  CPU (this process + the worker): "
            f"in process {r['inproc_fresh_cpu_ms']:.2f} ms, load + evaluation {r['isolated_admitted_cpu_ms']:.2f} ms "
            f"x{r['admitted_cpu_ratio']:.2f}, one request (site process) {r['isolated_fresh_cpu_ms']:.2f} ms "
            f"x{r['fresh_cpu_ratio']:.2f}, warm {r['inproc_warm_cpu_ms']:.2f} -> {r['isolated_warm_cpu_ms']:.2f} ms "
            f"x{r['warm_cpu_ratio']:.2f}",
            flush=True,
        )
        for n in () if args.site_only else (rows, 10 * rows) if not args.quick else (rows,):
            c = coordinator_case(name, onnxs, d, n, pool, repeats, rng)
            coordinator.append(c)
            print(
                f"coord  {name:<13} p={c['p']} d={d:<3} n={n:<5} predict_proba {c['inproc_ms']:7.2f} "
                f"(numpy path {c['inproc_numpy_ms']:7.2f}) -> {c['isolated_ms']:7.2f} ms (x{c['ratio']:.2f}; "
                f"x{c['ratio_to_numpy']:.2f} of the numpy path)",
                flush=True,
            )
    pool.close()
    out = {
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "worker_start_s": worker_start,
        "site": sites,
        "coordinator": coordinator,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(
        f"worker start (fork + limits + onnxruntime import + first load): {worker_start:.2f} s; "
        f"load {load_before} -> {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
