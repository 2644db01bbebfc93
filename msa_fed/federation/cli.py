"""``msa-fed site serve | jobs | approve``: the site's process in the federated topology.

msa-fed site serve   --config site.toml     # dial out to the registry and answer the job's requests
msa-fed site jobs    --config site.toml [--json]
msa-fed site approve JOB_ID --config site.toml [--digest SHA256]
msa-fed site keygen --out site.key          # the site's sealing key (+ site.key.pub to register)
msa-fed job keygen --out job.key            # the consortium's job key (+ job.key.pub)
msa-fed site peers   --config site.toml     # peers excluded after their predictor broke a limit here
msa-fed site clear-peer PEER --config site.toml
msa-fed site status  --config site.toml [--json] [--offline]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from msa_fed.clitools import command_group
from msa_fed.errors import ConfigError


def _config(args):
    from msa_fed.federation.config import SiteConfig

    return SiteConfig.from_toml(args.config)


def _serve(args) -> int:
    from msa_fed.federation.agent import SiteAgent, load_site_policy
    from msa_fed.privacy.policy import ANY_PEER

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from msa_fed.federation.serve_ops import SiteLock, state_files

    config = _config(args)
    policy = load_site_policy(config)
    lock = SiteLock(config.name, state_files(config, policy)).acquire()  # one process per site
    try:
        agent = SiteAgent(config, echo=lambda text: print(text, flush=True))
    except BaseException:
        lock.release()
        raise
    if policy.peers == ANY_PEER:  # the default: the operator is told, once, at start
        print(
            f'site {config.name}: peers = "any": it joins jobs with whatever sites the registry lists; '
            "name its peers in its policy ([limits] peers = [...])",
            flush=True,
        )
    agent.lines.config_path = os.path.abspath(args.config)
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
        lock.release()
    return 0


def _jobs(args) -> int:
    from msa_fed.site.job_book import JobBook

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
    from msa_fed.crypto.sealing import describe_content

    print(f"{'job':<32} {'state':<9} {'admin':<16} {'first seen (UTC)':<20} sites")
    for j in jobs:
        seen = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(j["first_seen"]))
        print(f"{j['job_id']:<32} {j['state']:<9} {j['admin'] or '-':<16} {seen:<20} {','.join(j['sites'])}")
        if j.get("content"):
            for line in describe_content(j["content"]):
                print("    " + line)
        if j.get("digest"):
            print(f"    content digest {j['digest']} (what 'msa-fed site approve' approves)")
    return 0


def _approve(args) -> int:
    from msa_fed.errors import ConfigError
    from msa_fed.site.job_book import JobBook

    config = _config(args)
    book = JobBook(config.jobs_path)
    try:
        known = {j["job_id"]: j for j in book.jobs()}.get(args.job_id)
        digest = args.digest or (known or {}).get("digest") or None
        if known is None and not args.digest:  # its content is unknown: approve what, exactly?
            raise ConfigError(
                f"job {args.job_id!r} has not asked site {config.name!r} yet; approve it once 'msa-fed site jobs' "
                "lists it, or in advance with --digest (the content digest the job's coordinator gives out)"
            )
        if known is not None and args.digest and known.get("digest") and known["digest"] != args.digest:
            raise ConfigError(
                f"job {args.job_id} asked with content digest {known['digest']}, not {args.digest}; "
                "read it with 'msa-fed site jobs' before approving"
            )
        book.set_state(args.job_id, "approved", create=True, digest=digest)
    finally:
        book.close()
    if known is None:
        note = f" in advance, for content {digest}"
    else:
        note = f" for content {digest}" if digest else ""
    print(f"site {config.name}: job {args.job_id} approved{note}")
    return 0


def _write_key(kind: str, out: str, what: str):
    """A new key of ``msa_fed.crypto.sealing.<kind>`` saved to ``out`` (private, never overwritten)
    and its public half beside it, said in one line; returns (key, path)."""
    from msa_fed.crypto import sealing

    key = getattr(sealing, kind).generate()
    path = key.save(out)
    print(f"{what} written to {path} (mode 0600) and its public half to {path}.pub")
    return key, path


def _site_keygen(args) -> int:
    key, path = _write_key("SiteKey", args.out, "sealing key")
    print(f"fingerprint {key.public.fingerprint}")
    print(f"register it: msa-fed site register ... --seal-key {path}.pub; the consortium pins the fingerprint")
    print(f'site.toml: seal_key = "{path}", and job_keys lists the fingerprint of the consortium\'s job key')
    return 0


def _job_keygen(args) -> int:
    key, _ = _write_key("JobKey", args.out, "job key")
    print(f"fingerprint {key.fingerprint} (each site lists it in job_keys of its site.toml)")
    return 0


def _exclusions(args):
    from msa_fed.federation.agent import excluded_peers_path
    from msa_fed.runtime.exclusions import ExclusionBook

    config = _config(args)
    return config, ExclusionBook(excluded_peers_path(config), f"site {config.name!r}")


def _peers(args) -> int:
    config, book = _exclusions(args)
    entries = book.entries()
    if args.json:
        print(json.dumps(entries, indent=2, sort_keys=True))
    elif not entries:
        print(f"site {config.name}: no peer excluded")
    for peer, e in sorted(entries.items()) if not args.json else ():
        print(f"{peer}: excluded since {e.get('since')} ({e.get('count')} fault(s)): {e.get('reason')}")
    return 0


def _clear_peer(args) -> int:
    config, book = _exclusions(args)
    if not book.clear(args.peer):
        print(f"site {config.name}: peer {args.peer!r} was not excluded")
        return 1
    print(f"site {config.name}: peer {args.peer!r} admitted again")
    return 0


def status_command(args) -> int:
    """``msa-fed site status --config site.toml`` (the parser is the control CLI's ``site status``)."""
    from msa_fed.federation.site_status import site_status, status_lines

    status = site_status(_config(args), ask_registry=not args.offline)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print("\n".join(status_lines(status)))
    return 0


def with_site_config(args):
    """``site publish --config site.toml``: the site's data file is the labelled inputs the sample
    is checked against, and without --registry its connection (registry, token, TLS files) is
    site.toml's.  Returns ``args`` ready for the control CLI's handler (``config`` cleared)."""
    if not getattr(args, "config", None):
        return args
    if args.labeled:
        raise ConfigError("give --config site.toml or --labeled DATA.npz, not both (site.toml names the data file)")
    config = _config(args)
    args.labeled, args.config = config.data, None
    if not args.predictor and not args.unlabeled:  # what site.toml names
        args.predictor = config.predictor
        if config.unlabeled is None:
            raise ConfigError(
                "site publish --config: give --unlabeled SAMPLE.npy, or name the sample in site.toml "
                '(unlabeled = "unlabeled.npy")'
            )
        args.unlabeled = config.unlabeled
    _connection_from(config, args)
    return args


def _connection_from(config, args) -> None:
    """Without --registry, the registry, token and TLS files of site.toml."""
    if not args.registry:
        args.registry = config.registry
        if not (args.token or args.token_file):
            args.token_file = config.token_file
        args.insecure = args.insecure or config.insecure
        for key in ("tls_ca", "tls_cert", "tls_key", "server_name"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(config, key))


def with_site_register(args):
    """``site register --config site.toml``: the site's name, its connection (as for publish) and
    the public half of its sealing key (``seal_key`` + ``.pub``).  Returns ``args`` for the
    control CLI's handler (``config`` cleared)."""
    if not getattr(args, "config", None):
        return args
    config = _config(args)
    args.config = None
    if args.name and args.name != config.name:
        raise ConfigError(f"--name {args.name!r} differs from site.toml's name {config.name!r}; drop one")
    args.name = config.name
    if args.seal_key is None and config.seal_key:
        args.seal_key = config.seal_key + ".pub"
    _connection_from(config, args)
    return args


def with_site_logs(args):
    """``site audit --config site.toml``: the audit log and the ledger the site process writes
    (:func:`msa_fed.federation.agent.load_site_policy`).  Returns ``args`` for the privacy CLI's
    handler (``config`` cleared)."""
    if not getattr(args, "config", None):
        return args
    from msa_fed.federation.agent import load_site_policy

    if args.log or args.ledger:
        raise ConfigError("give --config site.toml or --log F [--ledger F], not both")
    policy = load_site_policy(_config(args))
    args.log, args.ledger, args.config = policy.audit_log, policy.ledger, None
    return args


def register(sub: argparse._SubParsersAction) -> None:
    site = command_group(sub, "site")
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
    approve.add_argument(
        "--digest", help="the content digest shown by 'msa-fed site jobs' (binds an approval given in advance)"
    )
    approve.set_defaults(func=_approve)

    keygen = site.add_parser("keygen", help="create the site's sealing key (sealed end-to-end job traffic)")
    keygen.add_argument("--out", required=True, metavar="FILE", help="private key file (never overwritten)")
    keygen.set_defaults(func=_site_keygen)

    job = command_group(sub, "job")
    jkeygen = job.add_parser("keygen", help="create the consortium's job key (signs every sealed job)")
    jkeygen.add_argument("--out", required=True, metavar="FILE", help="private key file (never overwritten)")
    jkeygen.set_defaults(func=_job_keygen)

    peers = site.add_parser("peers", help="peers excluded after their predictor broke a limit at this site")
    peers.add_argument("--config", required=True, help="site.toml")
    peers.add_argument("--json", action="store_true")
    peers.set_defaults(func=_peers)

    clear = site.add_parser("clear-peer", help="admit an excluded peer to jobs again")
    clear.add_argument("peer", help="the peer site's name, as listed by 'msa-fed site peers'")
    clear.add_argument("--config", required=True, help="site.toml")
    clear.set_defaults(func=_clear_peer)


def extend(sub: argparse._SubParsersAction) -> None:
    """Once every module has registered its commands (msa_fed/cli.py): ``--config site.toml`` on
    the site commands of the layers below, which cannot read site.toml themselves."""
    site = sub.choices["site"]._msa_fed_commands
    # `site status` belongs to the control CLI (a site's record at the registry); with --config it
    # is the site process's whole view, answered here (the control layer does not import this one)
    status = site.choices["status"]
    registry_view = status.get_default("func")
    status.set_defaults(func=lambda args: status_command(args) if args.config else registry_view(args))
    # `site audit|register|publish --config site.toml`: site.toml read here, then their own handler
    for name, read in (("audit", with_site_logs), ("register", with_site_register), ("publish", with_site_config)):
        command = site.choices[name]
        command.set_defaults(func=_after(read, command.get_default("func")))


def _after(read, handler):
    """``handler(read(args))``: a lower layer's command, given what site.toml says."""
    return lambda args: handler(read(args))
