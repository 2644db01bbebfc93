"""Building blocks shared by the subsystems' command-line modules.

Each subsystem module exposes ``register(subparsers)``; several may add commands to the same
group (``site``, ``admin``, ``model``, ...), so a group is created once and then reused.
"""

from __future__ import annotations

import argparse


def command_group(
    subparsers: argparse._SubParsersAction, name: str, help: str | None = None
) -> argparse._SubParsersAction:
    """The sub-command table of group ``name`` (``msa-fed NAME COMMAND``).  :mod:`msa_fed.cli`
    declares every group (``GROUPS``, with its help) and creates it before any module adds
    commands; a group it does not declare is created here, the command tree refuses it unless
    ``COMMANDS`` names it for the module, and ``tests/test_cli_tree.py`` fails until it is declared."""
    existing = subparsers.choices.get(name)
    if existing is not None:
        return existing._msa_fed_commands
    parser = subparsers.add_parser(name, help=help)
    commands = parser.add_subparsers(dest=f"{name.replace('-', '_')}_command", metavar="COMMAND", required=True)
    parser._msa_fed_commands = commands
    return commands
