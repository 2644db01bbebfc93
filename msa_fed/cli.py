"""``msa-fed`` command line: the command tree, declared here.

:data:`GROUPS` names every command group (``msa-fed GROUP COMMAND``) with what it is for, and
:data:`COMMANDS` every module that adds commands with what it adds: the groups it fills and its
top-level commands (``run``, ``demo``, ...).  Each module is imported here by its name and adds
its commands through its ``register(subparsers)`` (a group's with
:func:`msa_fed.clitools.command_group`); one that fails to import is an error naming it, never a
group silently missing, and one that adds other than what it is declared to add is an error too.
Every group is made before any module registers, so the tree does not depend on the modules'
order.  This module also turns library errors into one clear line on stderr and a non-zero exit
status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from msa_fed import __version__
from msa_fed.clitools import command_group
from msa_fed.errors import MsaFedError, missing_extra

#: the command groups, in the order ``msa-fed --help`` lists them: name -> what it is for
GROUPS = {
    "registry": "run the control-plane registry",
    "admin": "manage tokens, sites and the registry",
    "site": "a site's own commands: register, publish, serve, approve jobs, audit",
    "job": "jobs: their records, and the consortium's job key",
    "model": "combined models stored in the registry",
    "consortium": "start-up kits for a consortium's parties (registry, sites, coordinator)",
}

#: the modules that add commands -> what each adds: the groups it fills, its top-level commands
COMMANDS: dict[str, frozenset[str]] = {
    "msa_fed.control.cli": frozenset({"registry", "admin", "site"}),  # registry serve, tokens, site register
    "msa_fed.control.ops.cli": frozenset({"admin", "job", "model"}),  # administration against a registry
    "msa_fed.control.ops.export": frozenset({"model"}),  # model export
    "msa_fed.federation.cli": frozenset({"site", "job"}),  # site serve / jobs / approve, job keygen
    "msa_fed.privacy.cli": frozenset({"site"}),  # site audit (the site's policy and audit log)
    "msa_fed.jobs.cli": frozenset({"run", "excluded", "demo", "model"}),  # the job; model report
    "msa_fed.jobs.target": frozenset({"model"}),  # model check-target
    "msa_fed.jobs.consortium": frozenset({"consortium"}),  # a start-up kit per party
    "msa_fed.experiments.cli": frozenset({"experiment"}),  # the paper's experiments
}


class BrokenCommands(MsaFedError):
    """A module of the command tree failed to import, or adds other than it is declared to add:
    the installation is incomplete or broken."""


def _tree(sub: argparse._SubParsersAction) -> dict[str, frozenset[str]]:
    """{top-level name: its commands (a group's) or nothing (a command)} of a parser being built."""
    return {
        name: frozenset(getattr(p, "_msa_fed_commands", argparse.Namespace(choices={})).choices)
        for name, p in sub.choices.items()
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msa-fed",
        description="Federated discriminative multiple-source adaptation (DMSA).",
    )
    parser.add_argument("--version", action="version", version=f"msa-fed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help in GROUPS.items():
        command_group(sub, name, help)
    for name, declared in COMMANDS.items():
        before = _tree(sub)
        try:
            importlib.import_module(name).register(sub)  # register may import what its commands share
        except ImportError as exc:
            raise BrokenCommands(
                f"the commands of {name} cannot be loaded ({type(exc).__name__}: {exc}); reinstall msa-fed"
            ) from exc
        added = {top for top, commands in _tree(sub).items() if commands != before.get(top)}
        if added != declared:
            raise BrokenCommands(
                f"the commands of {name} add to {sorted(added)}; msa_fed.cli.COMMANDS declares {sorted(declared)}"
            )
    for name in COMMANDS:  # then what a module adds to the commands of others, whatever the order above
        extend = getattr(importlib.import_module(name), "extend", None)
        if extend is not None:
            extend(sub)
    return parser


def groups_of(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """{group: its commands} of a built parser: the groups made by ``command_group``."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: list(p._msa_fed_commands.choices) for name, p in sub.choices.items() if hasattr(p, "_msa_fed_commands")
    }


def main(argv: list[str] | None = None) -> int:
    # gRPC logs an INFO line each time Ray forks a worker while gRPC threads run (the demo, the
    # job), and its TLS library's text on every failed handshake: noise in a terminal, where every
    # failure is one line of ours (a TLS mistake in words: msa_fed.control.transport.connection.diagnose_tls).
    # GRPC_VERBOSITY=ERROR shows gRPC's own error lines again. Must precede `import grpc`; a
    # default set here is taken back when main returns (a caller in the same process keeps its
    # environment; gRPC has read it by then and the processes started meanwhile inherited it).
    ours = "GRPC_VERBOSITY" not in os.environ
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        return _main(argv)
    finally:
        if ours:
            os.environ.pop("GRPC_VERBOSITY", None)


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
    except BrokenCommands as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
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
    except ModuleNotFoundError as exc:  # a command of the coordinator's side, run from a site install
        needs = missing_extra(exc, f"msa-fed {args.command}")
        if needs is None:
            raise
        print(f"error: {needs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a command turns it into one (msa-fed run)
        print(f"error: {exc}" if str(exc) else "error: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
