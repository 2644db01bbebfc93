"""``msa-fed`` command line.

Each subsystem contributes its sub-commands through a ``register(subparsers)``
function; this module only assembles them and turns library errors into one
clear line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from msa_fed import __version__
from msa_fed.errors import MsaFedError

# (module, attribute) pairs; each module exposes register(subparsers).
_SUBSYSTEMS = (
    "msa_fed.experiments.cli",
    "msa_fed.control.cli",
    "msa_fed.jobs.cli",
    "msa_fed.privacy.cli",  # site audit (the site's privacy policy and audit log)
    "msa_fed.federation.cli",  # site serve / jobs / approve (federated topology)
    "msa_fed.control.ops_cli",  # model, job and site administration against a registry
    "msa_fed.control.ops_export",  # msa-fed model export (after ops_cli, which makes `model`)
    "msa_fed.jobs.consortium",  # msa-fed consortium init / add-site: a start-up kit per party
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msa-fed",
        description="Federated discriminative multiple-source adaptation (DMSA).",
    )
    parser.add_argument("--version", action="version", version=f"msa-fed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBSYSTEMS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # subsystem not built in this checkout
            if not (exc.name and (name == exc.name or name.startswith(exc.name + "."))):
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # gRPC logs an INFO line each time Ray forks a worker while gRPC threads run (the demo, the
    # job), and its TLS library's text on every failed handshake: noise in a terminal, where every
    # failure is one line of ours (a TLS mistake in words: msa_fed.control.connection.diagnose_tls).
    # GRPC_VERBOSITY=ERROR shows gRPC's own error lines again. Must precede `import grpc`.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except MsaFedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a command turns it into one (msa-fed run)
        print(f"error: {exc}" if str(exc) else "error: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
