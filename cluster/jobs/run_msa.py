#!/usr/bin/env python
"""Job entry point for Ray clusters: attach to the running cluster and run the federated job.

    ray submit cluster/onprem.yaml cluster/jobs/run_msa.py -- --job JOB.toml --admin-token-file F
    ray job submit --working-dir . -- python cluster/jobs/run_msa.py --job JOB.toml --admin-token-file F

Same flags as ``msa-fed run``; the only difference is that this script attaches to the cluster
it runs in (``ray.init(address="auto")``) instead of starting one.
"""
from __future__ import annotations

import os
import sys


def preload_msa_fed():
    """Import every module of msa_fed now.  With ``ray job submit --working-dir``, Ray may delete
    the unpacked working directory on the head while the driver still runs (its reference count
    drops to zero between the job supervisor and the job's first actors; ray-project/ray#49254),
    and a module imported lazily afterwards is then missing."""
    import importlib
    import pkgutil

    import msa_fed

    for info in pkgutil.walk_packages(msa_fed.__path__, "msa_fed."):
        importlib.import_module(info.name)


def main(argv=None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # torch (through msa_fed.jobs.run) must be loaded before Ray starts its threads: loaded after
    # ray.init, its MKL fails with "Cannot load libtorch_cpu.so" (static TLS exhausted).
    import msa_fed.jobs.run  # noqa: F401

    preload_msa_fed()
    import ray

    from msa_fed.cli import main as cli_main

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
