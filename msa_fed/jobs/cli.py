"""``msa-fed run`` (the federated job) and ``msa-fed demo``."""

from __future__ import annotations

import argparse
import os


def _run(args) -> int:
    from msa_fed.control.ops.cli import TOKEN_FILE_ENV
    from msa_fed.jobs.config import JobConfig, check_admin_token, read_token_file
    from msa_fed.jobs.operations import check_output_dir

    if args.admin_token and args.admin_token_file:
        raise ValueError("give --admin-token or --admin-token-file, not both")
    # the whole job file is checked before any network work (and before the heavy imports)
    config = JobConfig.from_toml(
        args.job,
        registry=args.registry,
        tls_ca=args.tls_ca,
        insecure=args.insecure,
        admin_token_file=args.admin_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server_name=args.server_name,
        timeout=args.timeout,
        job_key=args.job_key,
    )
    if args.admin_token:
        check_admin_token(args.admin_token, "--admin-token")
    token = args.admin_token or read_token_file(config.admin_token_file or os.environ.get(TOKEN_FILE_ENV))
    check_output_dir(args.output)
    config.check_sealed()
    from msa_fed.jobs.run import report, run_job  # torch, Ray: only once the whole input is checked

    _, model = run_job(
        config, token, verbose=not args.quiet, output_dir=args.output, upload_retry_for=args.upload_retry_for
    )
    report(model)
    return 0


def _excluded(args) -> int:
    from msa_fed.jobs.run import exclusion_book

    book = exclusion_book()
    if args.clear:
        if not book.clear(args.clear):
            print(f"site {args.clear!r} was not excluded ({book.path})")
            return 1
        print(f"site {args.clear!r} admitted to jobs again")
        return 0
    entries = book.entries()
    if not entries:
        print(f"no site excluded ({book.path})")
    for site, e in sorted(entries.items()):
        print(f"{site}: excluded since {e.get('since')} ({e.get('count')} fault(s)): {e.get('reason')}")
    return 0


def _demo(args) -> int:
    from msa_fed.jobs.demo import main_demo

    return main_demo(args)


def register(sub: argparse._SubParsersAction) -> None:
    from msa_fed.control.ops.cli import connection_options

    run = sub.add_parser("run", help="run the federated job over the registered sites")
    run.add_argument("--job", required=True, help="job file (TOML; see cluster/README.md)")
    connection_options(run, "HOST:PORT of the registry; each connection flag overrides the job file's [registry]")
    run.add_argument("--admin-token", help="admin token (prefer --admin-token-file: a flag is visible in ps)")
    run.add_argument(
        "--job-key", help="the consortium's job key: seal the job's traffic end to end ([sealing] job_key)"
    )
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument(
        "--output",
        metavar="DIR",
        help="save the combined model here before uploading it "
        "(default: <root>/<job id>/model, root $MSA_FED_OUTPUT_ROOT or msa-fed-jobs in the working dir)",
    )
    run.add_argument(
        "--upload-retry-for",
        type=float,
        default=300.0,
        metavar="S",
        help="retry storing the model in an unreachable registry for S seconds (default 300; recording "
        "the job's end: at most 60 s)",
    )
    run.set_defaults(func=_run)

    excluded = sub.add_parser(
        "excluded",
        help="sites excluded from the jobs run here after an implausible answer ($MSA_FED_OUTPUT_ROOT)",
    )
    excluded.add_argument("--clear", metavar="SITE", help="admit SITE to jobs again")
    excluded.set_defaults(func=_excluded)

    demo = sub.add_parser("demo", help="the federated flow end to end on built-in data (local Ray, loopback gRPC)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--keep",
        metavar="DIR",
        help="a new (or empty) folder that keeps the combined model, the registry's database and the sites' "
        "folders after the demo (default: everything is removed)",
    )
    demo.set_defaults(func=_demo)

    from msa_fed.jobs.report import register_cli as register_report

    register_report(sub)  # msa-fed model report
