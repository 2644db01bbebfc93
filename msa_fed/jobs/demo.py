"""``msa-fed demo``: the whole federated flow on one machine, on built-in data.

1. a registry on loopback (plaintext, loopback only) with a temporary SQLite database and the
   relay between jobs and site processes;
2. an admin token and one token per site, issued as an operator would;
3. three sites register over gRPC and publish an ONNX predictor and an unlabelled sample; each
   site's private data goes to its own folder with its ``site.toml``;
4. three ``msa-fed site serve`` processes start, one per site: each checks its files against
   what it published and dials out to the registry (no listening socket);
5. the federated job runs on a local Ray: one actor per site stands for it with its published
   sample (data-parallel classifier training); every labelled-data query goes through the relay
   to the site's process; the combined model is stored in the registry;
6. each site's request log is summarised (what it answered and refused), and the model is
   downloaded again and evaluated against every baseline on target mixtures.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn


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


def site_summary(path) -> str:
    """One line on what a site answered and refused, from its request log (hash chain checked)."""
    from msa_fed.federation.state import read_log, summarise, verify_log

    n = verify_log(path)
    s = summarise(read_log(path))
    answered = ", ".join(f"{k} x{v}" for k, v in sorted(s["answered"].items())) or "nothing"
    refused = ", ".join(f"{k} x{v}" for k, v in sorted(s["refused"].items())) or "nothing"
    return f"answered {answered}; refused {refused}; {n} log entries, hash chain intact"


def run_demo(random_state: int = 0, log=_print) -> dict:
    from msa_fed import SiteData, fit_gmsa
    from msa_fed.control.client import RegistryClient
    from msa_fed.experiments.demo_data import SITES, make_federation
    from msa_fed.federation.local import LocalFederation, SiteFiles
    from msa_fed.jobs.config import JobConfig
    from msa_fed.jobs.run import model_from_bytes, report, run_job
    from msa_fed.runtime.config import FitConfig
    from msa_fed.runtime.ray_sites import ensure_ray

    t0 = time.perf_counter()
    fed = make_federation(random_state=random_state)
    predictors, files = {}, {}
    for name in SITES:
        d = fed[name]
        h = LogisticRegression().fit(d["X_train"], d["y_train"])
        predictors[name] = h
        files[name] = SiteFiles(d["X_labeled"], d["y_labeled"], d["X_unlabeled"], export_sklearn(h, n_features=2))
    with tempfile.TemporaryDirectory(prefix="msa-fed-demo-") as tmp:
        with LocalFederation(Path(tmp), files) as lf:
            log(f"registry: listening on {lf.address} (loopback, plaintext by --insecure), relay on, "
                f"SQLite at {Path(tmp) / 'registry.db'}")
            for name in SITES:
                log(f"site {name}: registered over gRPC, published predictor and {len(fed[name]['X_unlabeled'])} "
                    f"unlabelled points; {len(fed[name]['y_labeled'])} labelled points stay in its folder")
            ensure_ray(num_cpus=2)
            log("ray: local instance (the coordinator's cluster; it holds no labelled data)")
            lf.wait_connected(timeout=120)
            log("sites: " + ", ".join(f"{n} (pid {lf.procs[n].pid})" for n in SITES)
                + " run 'msa-fed site serve' and are connected to the registry (outgoing connections)")
            job = JobConfig(name="demo", registry=lf.address, insecure=True, output_version="demo-v1",
                            fit=FitConfig(runtime="ray", topology="federated")).validate()
            record, model = run_job(job, lf.admin_token, log=log, verbose=True, output_dir=Path(tmp) / "job-output")
            report(model, log)
            with RegistryClient(lf.address, lf.admin_token, insecure=True) as admin:
                data, rec = admin.download_combined_model(record.version)
                stored = model_from_bytes(data)
                log(f"downloaded combined model version {rec.version} from the registry and loaded it "
                    f"(predictors checked by sha256)")
            log("")
            log("what each site's process answered (its own request log):")
            for name in SITES:
                log(f"  {name}: " + site_summary(lf.workdir / name / "audit.jsonl"))

    # Baselines for the table are computed here with the sites' data, which only the demo has.
    sites = [SiteData(n, fed[n]["X_labeled"], fed[n]["y_labeled"], fed[n]["X_unlabeled"], predictors[n])
             for n in SITES]
    gmsa = fit_gmsa(sites, "classification", random_state=random_state)

    def unif(X):
        P = np.mean([predictors[n].predict_proba(X) for n in SITES], axis=0)
        return predictors[SITES[0]].classes_[P.argmax(1)]

    columns = {"DMSA": stored.predict, "GMSA": gmsa.predict, "unif": unif}
    columns.update({f"h_{n}": predictors[n].predict for n in SITES})
    log("")
    log("accuracy on the target domains (4000 test points each) and their uniform mixture:")
    rows = accuracy_table(fed, SITES, columns, log)
    log(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return rows


def main_demo(args) -> int:
    rows = run_demo(random_state=args.seed)
    if rows["DMSA"]["uniform"] < rows["unif"]["uniform"]:
        print("error: DMSA was less accurate than the uniform combination on the uniform mixture",
              file=sys.stderr)
        return 1
    return 0
