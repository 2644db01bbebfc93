"""``msa-fed site serve | jobs | approve``: the site's process in the federated topology.

msa-fed site serve   --config site.toml     # dial out to the registry and answer the job's requests
msa-fed site jobs    --config site.toml [--json]
msa-fed site approve JOB_ID --config site.toml
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from msa_fed.clitools import command_group


def _config(args):
    from msa_fed.federation.config import SiteConfig

    return SiteConfig.from_toml(args.config)


def _serve(args) -> int:
    from msa_fed.federation.agent import SiteAgent

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    config = _config(args)
    agent = SiteAgent(config, echo=lambda text: print(text, flush=True))
    previous = {sig: signal.signal(sig, lambda *_: agent.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        agent.check_published()
        print(
            f"site {config.name}: predictor and unlabelled sample match what the site published; "
            f"accepting jobs: {config.accept_jobs}",
            flush=True,
        )
        # serve in a thread so that a signal handler can run while gRPC blocks the main thread
        errors = []

        def run():
            try:
                agent.serve(check=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised below in the main thread
                errors.append(exc)

        worker = threading.Thread(target=run, name="site-agent", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
        if errors:
            raise errors[0]
        print(f"site {config.name}: stopped", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        agent.close()
    return 0


def _jobs(args) -> int:
    from msa_fed.federation.state import JobBook

    config = _config(args)
    book = JobBook(config.jobs_path)
    try:
        jobs = book.jobs()
    finally:
        book.close()
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print(f"site {config.name}: no jobs yet (accepting: {config.accept_jobs})")
        return 0
    print(f"{'job':<32} {'state':<9} {'admin':<16} {'first seen (UTC)':<20} sites")
    for j in jobs:
        seen = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(j["first_seen"]))
        print(f"{j['job_id']:<32} {j['state']:<9} {j['admin'] or '-':<16} {seen:<20} {','.join(j['sites'])}")
    return 0


def _approve(args) -> int:
    from msa_fed.errors import ConfigError
    from msa_fed.federation.state import JobBook

    config = _config(args)
    book = JobBook(config.jobs_path)
    try:
        jobs = book.jobs()
        if "@" in args.job_id:  # name@content: exactly this job, seen or not
            keys = [args.job_id]
        else:  # a name: the contents that asked under it so far (never one not seen yet)
            keys = [j["job_id"] for j in jobs if j["job_id"].split("@", 1)[0] == args.job_id]
            if not keys:
                raise ConfigError(
                    f"job {args.job_id!r} has not asked site {config.name!r} yet; approve it once it is listed "
                    "by 'msa-fed site jobs', or in advance by its full id NAME@CONTENT"
                )
        known = {j["job_id"] for j in jobs}
        for key in keys:
            book.set_state(key, "approved", create=True)
    finally:
        book.close()
    for key in keys:
        note = "" if key in known else " (not seen yet: approved in advance)"
        print(f"site {config.name}: job {key} approved{note}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    site = command_group(sub, "site", "site commands (register, publish, serve, ...)")
    serve = site.add_parser(
        "serve",
        help="run the site's process: dial out to the registry and answer the "
        "job's requests (federated topology; no listening socket)",
    )
    serve.add_argument("--config", required=True, help="site.toml (see cluster/README.md)")
    serve.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.set_defaults(func=_serve)

    jobs = site.add_parser("jobs", help="the jobs this site was asked to serve (pending, approved, served)")
    jobs.add_argument("--config", required=True, help="site.toml")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=_jobs)

    approve = site.add_parser("approve", help='admit a job (for accept_jobs = "approve")')
    approve.add_argument(
        "job_id",
        help="the job's id NAME@CONTENT as listed by 'msa-fed site jobs' (a bare NAME approves the "
        "contents that asked under it so far)",
    )
    approve.add_argument("--config", required=True, help="site.toml")
    approve.set_defaults(func=_approve)
