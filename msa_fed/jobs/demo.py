"""``msa-fed demo``: the whole federated flow on one machine, on built-in data.

1. a registry on loopback (plaintext, loopback only) with a temporary SQLite database and the
   relay between jobs and site processes;
2. an admin token and one token per site, issued as an operator would;
3. three sites register over gRPC and publish an ONNX predictor and an unlabelled sample; each
   site's private data goes to its own folder with its ``site.toml``;
4. three ``msa-fed site serve`` processes start, one per site: each checks its files against
   what it published and dials out to the registry (no listening socket);
5. the federated job runs: the coordinator trains the domain classifier itself on samples this
   small (on larger ones a local Ray's actors would stand in for the sites with their published
   samples, started by the job); every labelled-data query goes through the relay to the site's
   process, sealed end to end (each site has a sealing key whose fingerprint the
   job pins, and serves only jobs signed by the consortium's job key); the combined model is
   stored in the registry;
6. each site's policy and audit log are summarised (what it answered and refused, and the
   policy's measured decisions; the log's hash chain and its length in the site's ledger are
   checked), and the model is downloaded again and evaluated against every baseline on target
   mixtures.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def process_start() -> float:
    """When this process started (``time.time()`` scale): the demo's time includes its imports."""
    try:  # Linux: the process's age is the system's uptime minus its start in clock ticks
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # elsewhere: from the first line of the demo
        return time.time()


def _print(text: str = ""):
    print(text, flush=True)


def accuracy_table(fed: dict, names, columns: dict, log=_print):
    """Accuracy of each method on each site and on the uniform mixture of all sites."""
    targets = list(names) + ["uniform"]
    header = f"{'method':<12}" + "".join(f"{t:>10}" for t in targets)
    log(header)
    log("-" * len(header))
    rows = {}
    for method, predict in columns.items():
        accs = [float(np.mean(predict(fed[n]["X_test"]) == fed[n]["y_test"])) for n in names]
        accs.append(float(np.mean(accs)))  # equal-size test sets: the uniform mixture
        rows[method] = dict(zip(targets, accs))
        log(f"{method:<12}" + "".join(f"{a:>10.3f}" for a in accs))
    return rows


#: each demo site's privacy policy file (``policy`` in its site.toml): the defaults, written out,
#: with a per-job budget of DC evaluations and the consortium named (as a deployed site names
#: its peers: a job with any other site is refused)
DEMO_POLICY = """[limits]
min_points = 20
max_point_share = 0.25
eta_min = 1e-3
peers = ["north", "east", "west"]

[budget]
domain_models_per_job = 3
dc_evaluations_per_job = 2000

[dp]
enabled = false
"""


def site_summary(folder) -> list[str]:
    """What a site's process decided, from its own files: its policy, and its audit log (the
    policy's hash-chained log, checked against the length its ledger recorded)."""
    import json

    from msa_fed.federation.agent import load_site_policy
    from msa_fed.federation.config import SiteConfig
    from msa_fed.privacy.audit import verify_log
    from msa_fed.privacy.ledger import Ledger

    config = SiteConfig.from_toml(Path(folder) / "site.toml")
    policy = load_site_policy(config)
    ledger = Ledger(policy.ledger)
    try:
        anchor = ledger.anchor(policy.audit_log)
    finally:
        ledger.close()
    summary = verify_log(policy.audit_log, anchor)
    records = [json.loads(x) for x in Path(policy.audit_log).read_text().splitlines()]
    answered: dict[str, int] = {}
    for r in records:
        if r.get("outcome") == "answered":
            answered[r["request"]] = answered.get(r["request"], 0) + 1
    refused = ", ".join(f"{r} x{c}" for r, c in sorted(summary["refused"].items())) or "nothing"
    lines = [
        f"policy {Path(config.policy).name if config.policy else '(defaults)'}: min_points "
        f"{policy.min_points}, max_point_share {policy.max_point_share:g}, eta_min {policy.eta_min:g}, "
        f"{policy.dc_evaluations_per_job} DC evaluations per job, DP {'on' if policy.dp_enabled else 'off'}",
        "answered "
        + (", ".join(f"{k} x{v}" for k, v in sorted(answered.items())) or "nothing")
        + f"; refused {refused}; {summary['lines']} audit records, hash chain intact"
        + (", length matches the ledger" if anchor is not None else ""),
    ]
    last: dict[str, dict] = {}
    for r in records:
        if r.get("decisions"):
            last[r["request"]] = r["decisions"]
    for kind in ("set_domain_model", "set_qhat", "dc_evaluate"):
        if kind in last:
            shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in last[kind].items())
            lines.append(f"decisions on {kind}{' (last)' if kind == 'dc_evaluate' else ''}: {shown}")
    return lines


def _workdir(keep):
    """The demo's folder: a temporary one, or ``keep`` (new or empty), which is left in place."""
    from contextlib import nullcontext

    if keep is None:
        return tempfile.TemporaryDirectory(prefix="msa-fed-demo-")
    path = check_keep(keep)
    path.mkdir(parents=True, exist_ok=True)
    return nullcontext(str(path))


def check_keep(keep) -> Path:
    """``--keep DIR`` as an absolute path, refused when it holds anything (ConfigError)."""
    from msa_fed.errors import ConfigError

    path = Path(keep).expanduser().resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--keep {str(keep)!r} exists and is not an empty folder; give a new one")
    return path


def run_demo(random_state: int = 0, log=_print, keep=None) -> dict:
    """The demo (see the module docstring); ``keep``: a folder that keeps the registry's database,
    each site's folder and the combined model after the demo, else everything is removed."""
    from sklearn.linear_model import LogisticRegression  # here: a refused --keep answers before it loads

    from msa_fed import SiteData, fit_gmsa
    from msa_fed.artifacts.predictors import export_sklearn
    from msa_fed.control.registry.client import RegistryClient
    from msa_fed.experiments.demo_data import SITES, make_federation
    from msa_fed.federation.local import LocalFederation, SiteFiles
    from msa_fed.jobs.config import JobConfig
    from msa_fed.jobs.run import model_from_bytes, report, run_job
    from msa_fed.runtime.config import FitConfig

    t0 = process_start()
    fed = make_federation(random_state=random_state)
    predictors, files = {}, {}
    for name in SITES:
        d = fed[name]
        h = LogisticRegression().fit(d["X_train"], d["y_train"])
        predictors[name] = h
        files[name] = SiteFiles(d["X_labeled"], d["y_labeled"], d["X_unlabeled"], export_sklearn(h, n_features=2))
    with _workdir(keep) as tmp:
        with LocalFederation(Path(tmp), files, policies={n: DEMO_POLICY for n in SITES}) as lf:
            log(
                f"registry: listening on {lf.address} (loopback, plaintext by --insecure), relay on, "
                "SQLite database in the demo's temporary folder"
            )
            for name in SITES:
                log(
                    f"site {name}: registered over gRPC, published predictor and {len(fed[name]['X_unlabeled'])} "
                    f"unlabelled points; {len(fed[name]['y_labeled'])} labelled points stay in its folder; "
                    f"sealing key {lf.seal_keys[name].public.fingerprint[:16]}... (pinned by the job)"
                )
            lf.wait_connected(timeout=120)
            log(
                "sites: "
                + ", ".join(f"{n} (pid {lf.procs[n].pid})" for n in SITES)
                + " run 'msa-fed site serve' and are connected to the registry (outgoing connections)"
            )
            job = JobConfig(
                name="demo",
                registry=lf.address,
                insecure=True,
                output_version="demo-v1",
                fit=FitConfig(runtime="ray", topology="federated"),
                **lf.sealing(),  # sealed end to end: the consortium's job key and each site's pinned key
            ).validate()
            record, model = run_job(
                job, lf.admin_token, log=log, verbose=True, output_dir=Path(tmp) / "job-output", pointers=False
            )
            report(model, log)
            with RegistryClient(lf.address, lf.admin_token, insecure=True) as admin:
                data, rec = admin.download_combined_model(record.version)
                stored = model_from_bytes(data)
                log(
                    f"downloaded combined model version {rec.version} from the registry and loaded it "
                    f"(predictors checked by sha256)"
                )
            log("")
            log("what each site's process decided (its policy and its audit log):")
            for name in SITES:
                for line in site_summary(lf.workdir / name):
                    log(f"  {name}: {line}")

    # Baselines for the table are computed here with the sites' data, which only the demo has.
    sites = [SiteData(n, fed[n]["X_labeled"], fed[n]["y_labeled"], fed[n]["X_unlabeled"], predictors[n]) for n in SITES]
    gmsa = fit_gmsa(sites, "classification", random_state=random_state)

    def unif(X):
        P = np.mean([predictors[n].predict_proba(X) for n in SITES], axis=0)
        return predictors[SITES[0]].classes_[P.argmax(1)]

    columns = {"DMSA": stored.predict, "GMSA": gmsa.predict, "unif": unif}
    columns.update({f"h_{n}": predictors[n].predict for n in SITES})
    log("")
    log("accuracy on the target domains (4000 test points each) and their uniform mixture:")
    rows = accuracy_table(fed, SITES, columns, log)
    # a deployment's questions, answered by the stored model alone: a target of 60% north, 30%
    # east, 10% west test points and 20 points far from every site (docs/DESIGN.md section 11)
    rng = np.random.default_rng([random_state, 11])
    parts = [
        fed[n]["X_test"][rng.choice(len(fed[n]["X_test"]), k, replace=False)] for n, k in zip(SITES, (600, 300, 100))
    ]
    target = np.vstack([*parts, rng.normal((9.0, -9.0), 0.5, (20, 2))])
    log("")
    log("the stored model on an unlabelled target (600 north, 300 east, 100 west, 20 far away; rows 1000-1019):")
    for line in stored.check_target(target, top=5).lines():
        log(f"  {line}")
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a Ray the job started: its stop is part of the demo's time
        ray.shutdown()
    if keep is None:
        log(f"\ndemo finished in {time.time() - t0:.1f} s (its registry, sites and folders are removed)")
    else:
        log(
            f"\ndemo finished in {time.time() - t0:.1f} s; kept in {tmp}: the combined model "
            f"(msa_fed.load_model('{Path(tmp) / 'job-output'}')), the registry's database and each site's "
            "folder with its audit log"
        )
    return rows


def main_demo(args) -> int:
    keep = getattr(args, "keep", None)
    if keep is not None:
        check_keep(keep)  # before any work
    rows = run_demo(random_state=args.seed, keep=keep)
    if rows["DMSA"]["uniform"] < rows["unif"]["uniform"]:
        print("error: DMSA was less accurate than the uniform combination on the uniform mixture", file=sys.stderr)
        return 1
    return 0
