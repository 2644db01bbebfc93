#!/usr/bin/env python
"""Job entry point for Ray clusters: attach to the running cluster and run the federated job.

    ray submit cluster/onprem.yaml cluster/jobs/run_msa.py -- --job JOB.toml --admin-token-file F
    ray job submit --working-dir . -- python cluster/jobs/run_msa.py --job JOB.toml --admin-token-file F

Same flags as ``msa-fed run``; the only difference is that this script attaches to a running
cluster instead of starting one: ``RAY_ADDRESS`` if set, else the job file's ``[run]
ray_address``, else ``"auto"`` (the cluster started last on this machine: give an explicit
address where two clusters may run).

Everything the job reads from the working directory is read BEFORE ``ray.init``: the job file,
the admin token file and the registry's CA certificate (given as flags or named in the job
file) are copied into a private temporary folder and the job reads those copies, and every
msa_fed module is imported.  With ``ray job submit --working-dir``, Ray may release the
unpacked working directory on the head while the driver still runs (its reference count drops
to zero between the job supervisor and the job's first actors; ray-project/ray#49254), and a
file or module read lazily afterwards is then missing ("job file not found").
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

import tomllib

#: flags whose value is a file the job reads, and the job-file key that can name the same file
SNAPSHOT_FLAGS = {
    "--job": None,
    "--admin-token-file": "admin_token_file",
    "--tls-ca": "tls_ca",
    "--tls-cert": "tls_cert",  # the client certificate, for a registry that requires one
    "--tls-key": "tls_key",
    "--job-key": "job_key",  # [sealing] job_key: the consortium's job key (sealed jobs)
}
#: the job-file table of each key above (default [registry])
KEY_TABLES = {"job_key": "sealing"}


def _copy(path: str, folder: str, name: str) -> str | None:
    """A private copy of ``path`` in ``folder``, or None when it cannot be read (the CLI then says why)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    target = os.path.join(folder, name)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return target


def snapshot_inputs(argv: list[str], folder: str) -> list[str]:
    """``argv`` with every input file replaced by a copy in ``folder`` (read now, once)."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag in SNAPSHOT_FLAGS:
        parser.add_argument(flag)
    parser.add_argument("--admin-token")
    known, _ = parser.parse_known_args(argv)
    out = list(argv)

    def replace(flag: str, copy: str) -> None:
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = copy
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={copy}"

    copies = {}
    for flag in SNAPSHOT_FLAGS:
        value = getattr(known, flag[2:].replace("-", "_"))
        if value:
            copy = _copy(value, folder, flag[2:])
            if copy is not None:
                replace(flag, copy)
                copies[flag] = copy
    # files the job file names itself ([registry] admin_token_file, tls_ca, tls_cert, tls_key,
    # [sealing] job_key), unless a flag overrides them
    if "--job" in copies:
        try:
            with open(copies["--job"], "rb") as fh:
                doc = tomllib.load(fh)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            doc = {}
        for flag, key in SNAPSHOT_FLAGS.items():
            given = getattr(known, flag[2:].replace("-", "_")) or (flag == "--admin-token-file" and known.admin_token)
            table = doc.get(KEY_TABLES.get(key or "", "registry"), {})
            if key and not given and isinstance(table, dict) and isinstance(table.get(key), str):
                copy = _copy(table[key], folder, flag[2:])
                if copy is not None:
                    out += [flag, copy]
    return out


def job_ray_address(argv: list[str]) -> str | None:
    """The ``[run] ray_address`` of the (copied) job file in ``argv``, if any."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--job")
    known, _ = parser.parse_known_args(argv)
    try:
        with open(known.job, "rb") as fh:
            address = tomllib.load(fh).get("run", {}).get("ray_address")
    except (OSError, TypeError, tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return address if isinstance(address, str) and address else None


def preload_msa_fed():
    """Import every module of msa_fed now (see the module docstring)."""
    import importlib
    import pkgutil

    import msa_fed

    for info in pkgutil.walk_packages(msa_fed.__path__, "msa_fed."):
        importlib.import_module(info.name)


def main(argv=None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = tempfile.mkdtemp(prefix="msa-fed-job-inputs-")  # mode 0700
    atexit.register(shutil.rmtree, folder, True)
    argv = snapshot_inputs(argv, folder)
    # the working directory of `ray job submit` is Ray's to release: keep results under the home
    os.environ.setdefault("MSA_FED_OUTPUT_ROOT", os.path.join(os.path.expanduser("~"), "msa-fed-jobs"))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # torch (through msa_fed.jobs.run) must be loaded before Ray starts its threads: loaded after
    # ray.init, its MKL fails with "Cannot load libtorch_cpu.so" (static TLS exhausted).
    import msa_fed.jobs.run  # noqa: F401

    preload_msa_fed()
    import ray

    from msa_fed.cli import main as cli_main

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or job_ray_address(argv) or "auto"
        ray.init(address=address, log_to_driver=False)
    return cli_main(["run", *argv])


if __name__ == "__main__":
    sys.exit(main())
