"""Federated topology benchmark: the relay's round latency, a full job, and a registry holding many sites.

    .venv/bin/python benchmarks/bench_federation.py            # full run (several minutes)
    .venv/bin/python benchmarks/bench_federation.py --quick    # smoke run

Everything runs on this machine over loopback, with real processes: a registry (gRPC, SQLite)
with its relay, and one ``msa-fed site serve`` process per site (:class:`LocalFederation`).

1. **DC round through the relay** (p = ``--sites``): every site has joined a job and holds its
   domain model and Qhat; one round is one relay ``Call`` carrying a ``dc_evaluate`` request to
   each site and gathering the p answers (L, dL; cross-entropy).  Median and p90 over
   ``--rounds`` rounds, against the same round with the sites as in-process objects
   (``runtime="local"``: the sums alone, no transport).
2. **Full job**: p = ``--sites`` sites, n = ``--n`` labelled points in all (n / p per site),
   ``--m`` unlabelled points per site, DMSA with the default settings: the federated topology
   (site processes + relay + Ray stand-ins training the classifier) against ``runtime="local"``
   on the same data and predictors; wall time of ``Coordinator.fit`` (sites already started).
   The federated job runs sealed end to end (the default: a job key signs its content, each
   request sealed for its site, each answer sealed and signed) and unsealed, ``--job-repeats``
   times each, in turns with the local fit (medians).  The federated fits run with a job's
   default ``influence = "when-harmed"`` (on these honest sites: no report, the verdict request
   only).  ``--influence`` (default ``both``): the local and the sealed fit also with the
   influence report always on (``influence = true``), in the same turns (``on``: only those;
   ``off``: only the fits without it).
3. **Sealed DC round** (``--only sealed``): the same round for a job whose traffic is sealed end
   to end (:mod:`msa_fed.crypto.sealing`: each request and answer an AEAD frame, each answer
   signed by its site) next to the unsealed round, on two federations of p sites running side by
   side, rounds interleaved (unsealed, sealed, unsealed, ...) so that both see the same load.
4. **A registry holding ``--many`` connected sites**: thin site clients (one stream each,
   heartbeats every second) connect; time until all are connected, the registry process's CPU
   share while they only heartbeat (``--hold`` s), and a fan-out ``ping`` to all of them in one
   Call (median over rounds).

Prints a table and writes JSON to ``benchmarks/results/federation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

from sklearn.linear_model import LogisticRegression  # noqa: E402

from msa_fed.artifacts.predictors import export_sklearn, load_predictor, sha256_hex  # noqa: E402
from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.core.config import WHEN_HARMED, ClassifierConfig, SolverConfig  # noqa: E402
from msa_fed.core.features import StandardFeatures  # noqa: E402
from msa_fed.federation.local import LocalFederation, SiteFiles  # noqa: E402
from msa_fed.federation.relay_client import RelayClient  # noqa: E402
from msa_fed.runtime.config import FitConfig  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.federated import FederatedSites  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402
from msa_fed.site.worker import SiteWorker  # noqa: E402


def make_sites(p: int, n_per_site: int, m_per_site: int, d: int = 4, seed: int = 0) -> dict[str, SiteFiles]:
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(p):
        mean = np.zeros(d)
        mean[k % d] = 1.5 * (1 + k // d)
        rule = rng.normal(size=d)

        def draw(n, mean=mean, rule=rule):
            X = rng.normal(size=(n, d)) + mean
            return X, (X @ rule + 0.5 * rng.normal(size=n) > mean @ rule).astype(np.int64)

        Xtr, ytr = draw(500)
        Xl, yl = draw(n_per_site)
        Xu, _ = draw(m_per_site)
        h = LogisticRegression().fit(Xtr, ytr)
        out[f"s{k:02d}"] = SiteFiles(Xl, yl, Xu.astype(np.float32).astype(np.float64), export_sklearn(h, n_features=d))
    return out


def _kwargs(files, names):
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
            min_points=20,
        )
        for k, n in enumerate(names)
    ]
    return kw, preds, classes


def _pct(xs, q):
    return float(np.percentile(xs, q))


def _honest_model(files, names, kw):
    """The domain model a coordinator would send: the optimum over the published samples (float32
    on the wire), polished, which the sites verify; (spec, qhat, in-process site workers)."""
    from dataclasses import replace

    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle, train_domain_classifier

    p = len(names)
    U = [files[n].X_unlabeled.astype(np.float32).astype(np.float64) for n in names]
    ccfg = ClassifierConfig(mu=1e-3)
    dm = train_domain_classifier(U, StandardFeatures(), ccfg)
    oracle = sum_oracle(balanced_shards([dm.feature_map.transform(X) for X in U], replace(ccfg, dtype="float64")))
    dm.theta_, _ = polish_maxent(oracle, dm.theta_, dm.n_features_, p, ccfg.mu, ccfg.max_iter)
    spec = m.domain_model_spec(dm, p)
    local = [SiteWorker(**{**k, "X_unlabeled": X}) for k, X in zip(kw, U)]  # the published values
    for w in local:
        w.set_published(m.PublishedSamples(tuple(U)))
    parts = [w.set_domain_model(spec) for w in local]
    qhat = np.sum([r.sums for r in parts], axis=0)
    return spec, qhat, local


def bench_round(args, workdir: Path) -> dict:
    p = args.sites
    files = make_sites(p, 2000, 1000)
    names = sorted(files)
    kw, preds, classes = _kwargs(files, names)
    spec, qhat, local = _honest_model(files, names, kw)
    for w in local:
        w.set_qhat(m.QhatBroadcast(qhat=qhat, eta=0.01))
    rng = np.random.default_rng(2)
    zs = [rng.dirichlet(np.ones(p)) for _ in range(args.rounds)]
    t_local = []
    for z in zs:
        req = m.DCRequest(z=z, eta=0.01, what=("L", "dL"))
        t0 = time.perf_counter()
        [w.dc_evaluate(req) for w in local]
        t_local.append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    with LocalFederation(workdir / "round", files, sealed=False) as fed:  # the unsealed relay
        fed.wait_connected(timeout=600)
        connect_s = time.perf_counter() - t_start
        with _round_setup(fed, names, files, classes, spec, qhat) as relay:
            for z in zs[:5]:  # warm-up
                relay.call(
                    "bench", [(n, "dc_evaluate", m.DCRequest(z=z, eta=0.01, what=("L", "dL"))) for n in names], 60
                )
            t_relay = []
            for z in zs:
                req = m.DCRequest(z=z, eta=0.01, what=("L", "dL"))
                t0 = time.perf_counter()
                out = relay.call("bench", [(n, "dc_evaluate", req) for n in names], 60)
                t_relay.append(time.perf_counter() - t0)
            expect = [w.dc_evaluate(m.DCRequest(z=zs[-1], eta=0.01, what=("L", "dL"))) for w in local]
            assert all(np.array_equal(a.sums.L, b.sums.L) for a, b in zip(out, expect))
            relay.close_job("bench")
    return {
        "p": p,
        "n_per_site": 2000,
        "rounds": args.rounds,
        "sites_connected_s": connect_s,
        "relay_median_ms": 1e3 * statistics.median(t_relay),
        "relay_p90_ms": 1e3 * _pct(t_relay, 90),
        "local_median_ms": 1e3 * statistics.median(t_local),
        "local_p90_ms": 1e3 * _pct(t_local, 90),
    }


def _answered(relay, calls, timeout_s: float = 600.0) -> list:
    """relay.call until every site answered (a loaded machine may let a stream lapse meanwhile)."""
    from msa_fed.runtime.federated import SiteUnreachable

    deadline = time.monotonic() + timeout_s
    out = relay.call("bench", calls, 300)
    while any(isinstance(r, SiteUnreachable) for r in out) and time.monotonic() < deadline:
        time.sleep(1.0)
        out = relay.call("bench", calls, 300)
    bad = [r for r in out if isinstance(r, (SiteUnreachable, Exception))]
    if bad:
        raise RuntimeError(f"a site did not answer: {bad[0]}")
    return out


def _round_setup(fed, names, files, classes, spec, qhat, sealer=None):
    """A relay client of a job joined by every site of ``fed``, set up to the DC rounds."""
    relay = RelayClient(fed.address, fed.admin_token, insecure=True, sealer=sealer)
    relay.open_job("bench", names)
    shas = [sha256_hex(files[n].predictor) for n in names]
    joins = [
        m.JobSetup(
            job_id="bench",
            sites=tuple(names),
            index=i,
            predictor_sha256=tuple(shas),
            task="classification",
            loss="cross_entropy",
            classes=classes,
            min_points=20,
        )
        for i in range(len(names))
    ]
    _answered(relay, [(n, "join_job", joins[i]) for i, n in enumerate(names)])
    got = _answered(relay, [(n, "set_domain_model", spec) for n in names])
    assert np.allclose(np.sum([r.sums for r in got], axis=0), qhat)
    _answered(relay, [(n, "set_qhat", m.QhatBroadcast(qhat=qhat, eta=0.01)) for n in names])
    return relay


def bench_sealed_round(args, workdir: Path) -> dict:
    from msa_fed.crypto.sealing import JobKey, JobSealer, job_content
    from msa_fed.federation.agent import sample_sha256

    p = args.sites
    files = make_sites(p, 2000, 1000)
    names = sorted(files)
    kw, preds, classes = _kwargs(files, names)
    spec, qhat, _ = _honest_model(files, names, kw)
    rng = np.random.default_rng(2)
    zs = [rng.dirichlet(np.ones(p)) for _ in range(args.rounds)]
    times: dict[str, list] = {"unsealed": [], "sealed": []}
    with (
        LocalFederation(workdir / "plain", files, sealed=False, silence_timeout_s=120) as plain,
        LocalFederation(workdir / "sealed", files, sealed=True, silence_timeout_s=120) as sealed,
    ):
        plain.wait_connected(timeout=600)
        sealed.wait_connected(timeout=600)
        content = job_content(
            "bench",
            [
                dict(
                    name=n,
                    key_fingerprint=sealed.seal_keys[n].public.fingerprint,
                    sample_sha256=sample_sha256(files[n].X_unlabeled),
                    predictor_sha256=sha256_hex(files[n].predictor),
                )
                for n in names
            ],
            task="classification",
            loss="cross_entropy",
            min_points=20,
            planned_queries=10 * args.rounds,
        )
        sealer = JobSealer(JobKey.load(sealed.job_key_path), content, {n: sealed.seal_keys[n].public for n in names})
        relays = {
            "unsealed": _round_setup(plain, names, files, classes, spec, qhat),
            "sealed": _round_setup(sealed, names, files, classes, spec, qhat, sealer),
        }
        for z in zs[:5]:  # warm-up
            for relay in relays.values():
                _answered(relay, [(n, "dc_evaluate", m.DCRequest(z=z, eta=0.01, what=("L", "dL"))) for n in names])
        outs = {}
        for z in zs:
            req = m.DCRequest(z=z, eta=0.01, what=("L", "dL"))
            for kind, relay in relays.items():
                t0 = time.perf_counter()
                outs[kind] = _answered(relay, [(n, "dc_evaluate", req) for n in names])
                times[kind].append(time.perf_counter() - t0)
        assert all(np.array_equal(a.sums.L, b.sums.L) for a, b in zip(outs["sealed"], outs["unsealed"]))
        for relay in relays.values():
            relay.close_job("bench")
            relay.close()
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {
        "p": p,
        "n_per_site": 2000,
        "rounds": args.rounds,
        "unsealed_median_ms": med["unsealed"],
        "unsealed_p90_ms": 1e3 * _pct(times["unsealed"], 90),
        "sealed_median_ms": med["sealed"],
        "sealed_p90_ms": 1e3 * _pct(times["sealed"], 90),
        "ratio_median": med["sealed"] / med["unsealed"],
        "signed_answers": len(sealer.transcript),
        "load": os.getloadavg(),
    }


def _job_sealer(fed, files, names, job_id: str):
    """The sealer a default (sealed) job builds (:func:`msa_fed.federation.job.job_sealer`): its
    content signed by the consortium's job key, each site's key pinned."""
    from msa_fed.crypto.sealing import JobKey, JobSealer, job_content
    from msa_fed.federation.agent import sample_sha256

    content = job_content(
        job_id,
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
        mu=1e-3,
        objective="minmax",
        planned_queries=10000,
        min_points=20,
    )
    return JobSealer(JobKey.load(fed.job_key_path), content, {n: fed.seal_keys[n].public for n in names})


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_fit(coord) -> tuple:
    """(model, {phase: seconds}) of ``coord.fit()``: the domain classifier's training, the DC set-up
    (domain model and Qhat at the sites) and the rest (the z solve's rounds and the model)."""
    phases: dict[str, float] = {}

    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t

        return run

    coord.train_domain_model = timed("classifier", coord.train_domain_model)
    coord.prepare_dc = timed("dc_setup", coord.prepare_dc)
    t0 = time.perf_counter()
    model = coord.fit()
    total = time.perf_counter() - t0
    phases["solve"] = total - phases.get("classifier", 0.0) - phases.get("dc_setup", 0.0)
    return model, total, phases


def bench_job(args, workdir: Path) -> dict:
    """The full job, local and federated (sealed, the default, and unsealed), ``--job-repeats``
    times in turns (local, sealed, unsealed, local, ...) so that all three see the same load.
    The federated fits run with a job's default (the report once a site is harmed: none here).
    With ``--influence on`` (or ``both``) the local and the sealed fit also run with the influence
    report always on (``local_influence``, ``sealed_influence``), in the same turns."""
    from dataclasses import replace

    from msa_fed.runtime.ray_sites import ensure_ray

    p = args.sites
    files = make_sites(p, args.n // p, args.m, seed=3)
    names = sorted(files)
    kw, preds, classes = _kwargs(files, names)
    config = FitConfig(
        task="classification", classifier=ClassifierConfig(mu=1e-3), solver=SolverConfig(objective="minmax")
    )
    with_report = replace(config, influence=True)
    job_default = replace(config, influence=WHEN_HARMED)  # a job's: the report once a site is harmed
    off = args.influence in ("off", "both")
    on = args.influence in ("on", "both")
    ensure_ray(num_cpus=os.cpu_count())
    times: dict[str, list] = {}
    phases: dict[str, list] = {}
    cpu: dict[str, list] = {}  # CPU seconds of each fit: this process, the site processes
    z_diff, evaluations, signed, report_rounds = 0.0, None, 0, None
    with (
        LocalFederation(workdir / "job-sealed", files, sealed=True, silence_timeout_s=120) as sealed,
        LocalFederation(workdir / "job-plain", files, sealed=False, silence_timeout_s=120) as plain,
    ):
        sealed.wait_connected(timeout=600)
        plain.wait_connected(timeout=600)
        for rep in range(args.job_repeats):
            runs = []
            if off:
                runs += [("local", None, config), ("sealed", sealed, job_default), ("unsealed", plain, job_default)]
            if on:
                runs += [("local_influence", None, with_report), ("sealed_influence", sealed, with_report)]
            local = None
            for kind, fed, cfg in runs:
                if fed is None:
                    c = Coordinator(LocalSites(kw), preds, cfg).start()
                    own0 = time.process_time()
                    local, took, split = _timed_fit(c)
                    cpu.setdefault(kind + "_this_process", []).append(time.process_time() - own0)
                    times.setdefault(kind, []).append(took)
                    for phase, v in split.items():
                        phases.setdefault(f"{kind}_{phase}", []).append(v)
                    continue
                job_id = f"benchjob-{kind}-{rep}"
                is_sealed = fed is sealed
                sealer = _job_sealer(fed, files, names, job_id) if is_sealed else None
                relay = RelayClient(fed.address, fed.admin_token, insecure=True, sealer=sealer)
                backend = FederatedSites(
                    names,
                    relay,
                    [files[n].X_unlabeled for n in names],
                    job_id=job_id,
                    predictor_sha256=[sha256_hex(files[n].predictor) for n in names],
                    classes=classes,
                    site_timeout_s=600,
                    data_channel="plain",
                    owns_relay=True,
                )
                t0 = time.perf_counter()
                site_pids = [fed.procs[n].pid for n in names]
                with Coordinator(backend, preds, cfg) as coord:
                    own0, sites0 = time.process_time(), sum(_proc_cpu_s(q) for q in site_pids)
                    model, took, split = _timed_fit(coord)
                    # the fit's CPU: this process (the coordinator and the registry) and the sites
                    cpu.setdefault(kind + "_this_process", []).append(time.process_time() - own0)
                    cpu.setdefault(kind + "_sites", []).append(sum(_proc_cpu_s(q) for q in site_pids) - sites0)
                    times.setdefault(kind, []).append(took)
                    for phase, v in split.items():
                        phases.setdefault(f"{kind}_{phase}", []).append(v)
                    if sealer is not None:  # what the job keeps with its model: every signature checked
                        t1 = time.perf_counter()
                        backend.transcript()
                        times.setdefault(kind + "_transcript", []).append(time.perf_counter() - t1)
                times.setdefault(kind + "_start", []).append(time.perf_counter() - t0)
                assert local is not None
                z_diff = max(z_diff, float(np.max(np.abs(model.z - local.z))))
                evaluations = model.info["solver"]["n_evaluations"]
                table = model.info.get("influence") or {}
                if table:
                    report_rounds = table.get("rounds")
                if sealer is not None:
                    signed = len(sealer.transcript)
    import ray

    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "p": p,
        "n": args.n,
        "m_per_site": args.m,
        "repeats": args.job_repeats,
        "influence": args.influence,
        "runs_s": times,
        "medians_s": med,
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
        "max_abs_z_difference": z_diff,
        "n_evaluations": evaluations,
        "influence_report_rounds": report_rounds,
        "signed_answers_last_sealed_job": signed,
        "load": os.getloadavg(),
    }
    if off:
        out.update(
            local_fit_s=med["local"],
            federated_fit_s=med["sealed"],
            federated_unsealed_fit_s=med["unsealed"],
            federated_start_and_fit_s=med["sealed_start"],
            sealed_transcript_check_s=med["sealed_transcript"],
            ratio_fit=med["sealed"] / med["local"],
            ratio_fit_unsealed=med["unsealed"] / med["local"],
            ratio_start_and_fit=med["sealed_start"] / med["local"],
        )
    if on:
        out.update(
            local_influence_fit_s=med["local_influence"],
            federated_influence_fit_s=med["sealed_influence"],
            ratio_fit_influence=med["sealed_influence"] / med["local_influence"],
        )
        if off:  # the real job (report on) against the local fit without it
            out["ratio_fit_influence_vs_local_off"] = med["sealed_influence"] / med["local"]
    return out


#: the arms of the full job, each against the local fit of the same run (the baseline)
JOB_ARMS = (
    ("local", "local fit (the baseline)", "local"),
    ("sealed", "federated, sealed (a job's defaults)", "local"),
    ("unsealed", "federated, unsealed", "local"),
    ("local_influence", "local fit with the influence report", "local_influence"),
    ("sealed_influence", "federated, sealed, with the influence report always on", "local_influence"),
)


def job_lines(r: dict) -> list[str]:
    """One line per arm of :func:`bench_job`'s result: its median and range over the repeats and
    its ratio to the local fit of the same run (the report's arms: to the local fit with the
    report, and to the one without it where it ran)."""
    runs, med = r["runs_s"], r["medians_s"]
    lines = [
        f"full job p={r['p']} n={r['n']}, medians of {r['repeats']} in turns (load {r['load'][0]:.1f}); "
        f"{r['n_evaluations']} evaluations; max |z - z_local| = {r['max_abs_z_difference']:.1e}"
    ]
    for kind, label, base in JOB_ARMS:
        if kind not in med:
            continue
        ts = runs[kind]
        line = f"  {label:<58} {med[kind]:7.3f} s ({min(ts):.3f}-{max(ts):.3f}): ratio {med[kind] / med[base]:.2f}"
        if base != "local" and "local" in med:
            line += f" ({med[kind] / med['local']:.2f} against the local fit without the report)"
        if kind == "sealed_influence" and r.get("influence_report_rounds") is not None:
            line += f"; the report {r['influence_report_rounds']} rounds"
        lines.append(line)
    cpu = r.get("cpu_median_s") or {}
    for kind, _, _ in JOB_ARMS:
        if kind + "_this_process" in cpu:
            line = f"  CPU of the fit, {kind}: this process {cpu[kind + '_this_process']:.3f} s"
            if kind + "_sites" in cpu:
                line += f", the site processes {cpu[kind + '_sites']:.3f} s"
            lines.append(line)
    return lines


def bench_many(args, workdir: Path) -> dict:
    import grpc

    from msa_fed.boundary import wire
    from msa_fed.boundary.proto import relay_pb2 as pb
    from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore
    from msa_fed.control.server import RegistryServer

    n = args.many
    store = SqliteStore(workdir / "many.db")
    registry = Registry(store)
    admin = registry.issue_token("admin", "operator")
    names = [f"site{k:03d}" for k in range(n)]
    tokens = {}
    for name in names:
        tokens[name] = registry.issue_token("site", name)
        store.register_site(name, {}, time.time())
    server = RegistryServer(registry, "127.0.0.1:0", insecure=True, max_workers=2 * n + 32).start()
    stop = threading.Event()
    ack = wire.to_proto("ping", m.Ack("bench"), wire.RESPONSES)

    def thin_site(name):
        channel = grpc.insecure_channel(server.address)
        out: queue.Queue = queue.Queue()
        out.put(pb.SiteToRelay(hello=pb.Hello(site=name)))

        def gen():
            while True:
                item = out.get()
                if item is None:
                    return
                yield item

        def beat():
            while not stop.wait(1.0):
                out.put(pb.SiteToRelay(heartbeat=pb.Heartbeat(sent_at=time.time())))
            out.put(None)

        threading.Thread(target=beat, daemon=True).start()
        call = pb_grpc.RelayStub(channel).Connect(gen(), metadata=(("authorization", f"Bearer {tokens[name]}"),))
        try:
            for msg in call:
                if msg.WhichOneof("part") == "forward":
                    resp = type(ack)()
                    resp.CopyFrom(ack)
                    resp.method = msg.forward.request.method
                    out.put(pb.SiteToRelay(answer=pb.Answer(call_id=msg.forward.call_id, response=resp)))
        except grpc.RpcError:
            pass
        channel.close()

    t0 = time.perf_counter()
    for name in names:
        threading.Thread(target=thin_site, args=(name,), daemon=True).start()
    while len(server.relay.connected()) < n:
        time.sleep(0.05)
        if time.perf_counter() - t0 > 300:
            raise RuntimeError(f"only {len(server.relay.connected())} of {n} sites connected")
    connect_s = time.perf_counter() - t0
    cpu0, w0 = time.process_time(), time.perf_counter()
    time.sleep(args.hold)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - w0)  # this process: registry + thin clients
    beats = [s.last_heartbeat for s in store.list_sites()]
    fresh = sum(1 for b in beats if b and time.time() - b < 5)
    with RelayClient(server.address, admin, insecure=True) as relay:
        relay.open_job("many", names)
        times = []
        for _ in range(args.many_rounds):
            t = time.perf_counter()
            res = relay.call("many", [(nm, "ping", None) for nm in names], 30)
            times.append(time.perf_counter() - t)
            assert all(isinstance(r, m.Ack) for r in res), res[:3]
    stop.set()
    server.stop(0.5)
    store.close()
    return {
        "sites": n,
        "connect_all_s": connect_s,
        "hold_s": args.hold,
        "process_cpu_share": cpu_share,
        "sites_with_fresh_heartbeat": fresh,
        "fanout_ping_median_ms": 1e3 * statistics.median(times),
        "fanout_ping_p90_ms": 1e3 * _pct(times, 90),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sites", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--m", type=int, default=2000)
    ap.add_argument("--job-repeats", type=int, default=3, help="full jobs of each kind, in turns (medians)")
    ap.add_argument(
        "--influence",
        choices=["off", "on", "both"],
        default="both",
        help="full job: a job's default (the report once a site is harmed), the report always on, or both in turns",
    )
    ap.add_argument("--many", type=int, default=64)
    ap.add_argument("--many-rounds", type=int, default=50)
    ap.add_argument("--hold", type=float, default=20.0)
    ap.add_argument("--only", choices=["round", "sealed", "job", "many"], action="append")
    args = ap.parse_args(argv)
    if args.quick:
        args.sites, args.rounds, args.n, args.m, args.many, args.hold, args.many_rounds = 3, 30, 3000, 300, 16, 3, 10
        args.job_repeats = 1
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "command": "python benchmarks/bench_federation.py" + (" --quick" if args.quick else ""),
    }
    todo = args.only or ["round", "sealed", "job", "many"]
    with tempfile.TemporaryDirectory(prefix="bench-fed-") as tmp:
        if "round" in todo:
            r = out["dc_round"] = bench_round(args, Path(tmp))
            print(
                f"DC round through the relay, p={r['p']}: median {r['relay_median_ms']:.2f} ms "
                f"(p90 {r['relay_p90_ms']:.2f}); in-process sums alone {r['local_median_ms']:.2f} ms",
                flush=True,
            )
        if "sealed" in todo:
            r = out["dc_round_sealed"] = bench_sealed_round(args, Path(tmp))
            print(
                f"DC round p={r['p']}, sealed end to end: median {r['sealed_median_ms']:.2f} ms "
                f"(p90 {r['sealed_p90_ms']:.2f}); unsealed, interleaved: {r['unsealed_median_ms']:.2f} ms "
                f"(p90 {r['unsealed_p90_ms']:.2f}); ratio {r['ratio_median']:.2f}",
                flush=True,
            )
        if "job" in todo:
            r = out["full_job"] = bench_job(args, Path(tmp))
            for line in job_lines(r):
                print(line, flush=True)
            ph = r["phases_median_s"]
            for kind in ("local", "sealed", "unsealed", "local_influence", "sealed_influence"):
                if kind + "_classifier" in ph:
                    print(
                        f"  {kind}: classifier {ph[kind + '_classifier']:.2f} s, DC set-up (domain model, Qhat) "
                        f"{ph[kind + '_dc_setup']:.2f} s, solve {ph[kind + '_solve']:.2f} s",
                        flush=True,
                    )
        if "many" in todo:
            r = out["many_sites"] = bench_many(args, Path(tmp))
            print(
                f"{r['sites']} connected sites: all connected in {r['connect_all_s']:.1f} s; "
                f"{r['sites_with_fresh_heartbeat']} with a heartbeat in the last 5 s; CPU share of the "
                f"registry process (with the thin clients) {r['process_cpu_share']:.2f}; fan-out ping to all "
                f"{r['fanout_ping_median_ms']:.1f} ms median (p90 {r['fanout_ping_p90_ms']:.1f})",
                flush=True,
            )
    results = REPO / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    if not args.quick:  # sections of an --only run replace theirs and keep the others
        path = results / "federation.json"
        kept = json.loads(path.read_text()) if path.is_file() else {}
        if args.only:  # the machine and command of the full run stay; each section notes its own
            for key in todo:
                section = {"round": "dc_round", "sealed": "dc_round_sealed", "job": "full_job", "many": "many_sites"}
                out[section[key]].update(command=" ".join(["python benchmarks/bench_federation.py", *sys.argv[1:]]))
                out[section[key]].setdefault("load", out["machine"]["load"])
            out = {k: v for k, v in out.items() if k not in ("machine", "command")}
        path.write_text(json.dumps({**kept, **out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
