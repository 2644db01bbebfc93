"""``msa-fed demo``: the whole federated flow on one machine, on built-in data.

1. a registry on loopback (plaintext, loopback only) with a temporary SQLite database;
2. an admin token and one token per site, issued as an operator would;
3. three sites register over gRPC and publish an ONNX predictor and an unlabelled sample;
4. each site's private data is written to "its node's disk" (a temporary folder) and a local
   Ray starts with the custom resources ``site:<name>`` (one node standing in for three);
5. the federated job runs (data-parallel classifier training, DC solve at the sites) and
   stores the combined model in the registry;
6. the model is downloaded again and evaluated against every baseline on target mixtures.
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


def run_demo(random_state: int = 0, log=_print) -> dict:
    from msa_fed import SiteData, fit_gmsa
    from msa_fed.control.client import RegistryClient
    from msa_fed.control.registry import Registry
    from msa_fed.control.server import RegistryServer
    from msa_fed.control.sqlite_store import SqliteStore
    from msa_fed.experiments.demo_data import SITES, make_federation
    from msa_fed.jobs.config import JobConfig
    from msa_fed.jobs.run import model_from_bytes, report, run_job
    from msa_fed.runtime.config import FitConfig
    from msa_fed.runtime.ray_sites import ensure_ray

    t0 = time.perf_counter()
    fed = make_federation(random_state=random_state)
    with tempfile.TemporaryDirectory(prefix="msa-fed-demo-") as tmp:
        tmp = Path(tmp)
        store = SqliteStore(tmp / "registry.db")
        registry = Registry(store)
        admin_token = registry.issue_token("admin", "operator")
        with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
            log(f"registry: listening on {server.address} (loopback, plaintext by --insecure), "
                f"SQLite at {tmp / 'registry.db'}")
            predictors = {}
            for name in SITES:
                d = fed[name]
                h = LogisticRegression().fit(d["X_train"], d["y_train"])
                predictors[name] = h
                token = registry.issue_token("site", name)
                with RegistryClient(server.address, token, insecure=True) as site:
                    site.register(name)
                    art = site.upload_predictor(export_sklearn(h, n_features=2))
                    site.upload_sample(d["X_unlabeled"])
                    site.heartbeat()
                np.savez(tmp / f"{name}.npz", X_labeled=d["X_labeled"], y_labeled=d["y_labeled"],
                         X_unlabeled=d["X_unlabeled"])
                log(f"site {name}: registered over gRPC, published predictor {art.sha256[:12]}... and "
                    f"{len(d['X_unlabeled'])} unlabelled points; {len(d['y_labeled'])} labelled points stay "
                    f"on the site")
            ensure_ray(num_cpus=2, resources={f"site:{n}": 1 for n in SITES})
            log("ray: local instance with resources " + ", ".join(f"site:{n}" for n in SITES))
            job = JobConfig(name="demo", registry=server.address, insecure=True,
                            site_data=str(tmp / "{site}.npz"), output_version="demo-v1",
                            fit=FitConfig(runtime="ray", topology="cluster")).validate()
            record, model = run_job(job, admin_token, log=log, verbose=True, output_dir=tmp / "job-output")
            report(model, log)
            with RegistryClient(server.address, admin_token, insecure=True) as admin:
                data, rec = admin.download_combined_model(record.version)
                stored = model_from_bytes(data)
                log(f"downloaded combined model version {rec.version} from the registry and loaded it "
                    f"(predictors checked by sha256)")
        store.close()

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
