"""``msa-fed site audit``: verify a site's audit log (hash chain and, with the ledger, its length).

``--log F [--ledger F]`` names the files; ``--config site.toml`` (answered through
:mod:`msa_fed.federation.cli`) takes the ones the site process writes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from msa_fed.clitools import command_group
from msa_fed.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    site = command_group(sub, "site")
    audit = site.add_parser("audit", help="verify the site's hash-chained audit log and print a summary")
    audit.add_argument("--log", help="the audit log (JSON lines)")
    audit.add_argument("--ledger", help="the site's ledger (SQLite): also detects lines cut off the end")
    audit.add_argument(
        "--config", metavar="site.toml", help="the site's configuration: its audit log and ledger (instead of --log)"
    )
    audit.add_argument("--json", action="store_true", help="print the summary as JSON")
    audit.set_defaults(func=_audit)


def _audit(args) -> int:
    from msa_fed.privacy.audit import verify_log
    from msa_fed.privacy.ledger import Ledger

    if getattr(args, "config", None):  # msa_fed.federation.cli reads site.toml and clears it
        raise ConfigError("--config site.toml: not available in this command set; give --log F [--ledger F]")
    if not args.log:
        raise ConfigError("give --config site.toml or --log F [--ledger F]")
    log = Path(args.log)
    if not log.is_file():
        raise ConfigError(f"audit log {str(log)!r} not found")
    anchor = None
    if args.ledger:
        if not Path(args.ledger).is_file():
            raise ConfigError(f"ledger {args.ledger!r} not found")
        ledger = Ledger(args.ledger)
        try:
            anchor = ledger.anchor(os.path.abspath(str(log)))
        finally:
            ledger.close()
        if anchor is None:
            raise ConfigError(f"ledger {args.ledger!r} holds no anchor for audit log {str(log)!r}")
    summary = verify_log(log, anchor)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    print(
        f"audit log {log!s}: chain intact, {summary['lines']} records"
        + (" (length matches the ledger)" if anchor is not None else " (no ledger given: length not checked)")
    )
    print(f"  from {summary['first']} to {summary['last']}, jobs: {len(summary['jobs'])}")
    for kind, count in sorted(summary["requests"].items()):
        print(f"  {kind}: {count}")
    refused = summary["refused"]
    print("  refused: " + (", ".join(f"{r} {c}" for r, c in sorted(refused.items())) if refused else "none"))
    for job, eps in sorted(summary["epsilon_by_job"].items()):
        print(f"  epsilon spent by job {job}: {eps:.4g}")
    return 0
