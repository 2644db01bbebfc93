"""``msa-fed registry | admin | site`` commands (see docs/CONTROL_PLANE.md).

    msa-fed registry serve --db PATH --listen HOST:PORT [--tls-cert F --tls-key F [--tls-ca F]] [--insecure]
    msa-fed admin issue-token --db PATH (--site NAME | --admin)
    msa-fed admin revoke-token --db PATH (--site NAME | --admin)
    msa-fed admin list-sites --db PATH [--json]
    msa-fed site register --registry HOST:PORT --token T --name NAME [--insecure | --tls-ca F]
    msa-fed site publish  --registry HOST:PORT --token T [--predictor MODEL.onnx] [--unlabeled SAMPLE.npy]
    msa-fed site status   --registry HOST:PORT --token T [--json]
    msa-fed site heartbeat --registry HOST:PORT --token T [--interval SECONDS]

Handlers return an exit status; library errors propagate to ``msa_fed.cli.main``,
which prints ``error: <message>`` and exits 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from msa_fed.clitools import command_group
from msa_fed.errors import ConfigError

ADMIN_NAME = "admin"


def _iso(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


# --------------------------------------------------------------------------- registry


def _serve(args) -> int:
    from msa_fed.control.ops_audit import AuditLog
    from msa_fed.control.registry import Limits, Registry
    from msa_fed.control.server import RegistryServer, TlsConfig, check_transport
    from msa_fed.control.sqlite_store import SqliteStore

    if args.tls_ca and not args.tls_cert:
        raise ConfigError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key too")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key must be given together")
    tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    check_transport(args.listen, tls, args.insecure)  # before the database file is created
    limits = Limits(
        max_predictor_bytes=int(args.max_predictor_mb * 2**20), max_sample_bytes=int(args.max_sample_mb * 2**20)
    )
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    audit_log = AuditLog(args.audit_log) if args.audit_log else None
    store = SqliteStore(args.db)
    try:
        server = RegistryServer(
            Registry(store, limits), args.listen, tls=tls, insecure=args.insecure, max_workers=args.workers,
            audit_log=audit_log,
        )
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with server:
                print(f"registry listening on {server.address} ({server.mode}); database {args.db}", flush=True)
                stop.wait()
                print("registry stopping", flush=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        store.close()
    return 0


# --------------------------------------------------------------------------- admin


def _principal(args) -> tuple[str, str]:
    return ("admin", ADMIN_NAME) if args.admin else ("site", args.site)


def _issue_token(args) -> int:
    from msa_fed.control.registry import Registry
    from msa_fed.control.sqlite_store import SqliteStore

    role, name = _principal(args)
    with SqliteStore(args.db) as store:
        token = Registry(store).issue_token(role, name)
    print(token)
    print(f"token for {role} {name!r} issued; it is shown only once and replaces any previous one", file=sys.stderr)
    return 0


def _revoke_token(args) -> int:
    from msa_fed.control.registry import Registry
    from msa_fed.control.sqlite_store import SqliteStore

    role, name = _principal(args)
    with SqliteStore(args.db, create=False) as store:
        revoked = Registry(store).revoke_token(role, name)
    if not revoked:
        raise ConfigError(f"{role} {name!r} has no active token")
    print(f"revoked the token of {role} {name!r}")
    return 0


def _artifact_summary(rec) -> str:
    if rec is None:
        return "-"
    if rec.kind == "predictor":
        return f"{rec.sha256[:12]} {rec.meta['output_kind']} d={rec.meta['n_features']}"
    return f"{rec.sha256[:12]} {rec.meta['rows']}x{rec.meta['cols']}"


def _list_sites(args) -> int:
    from msa_fed.control.ops import Operations
    from msa_fed.control.ops_cli import print_site_statuses
    from msa_fed.control.registry import Registry
    from msa_fed.control.sqlite_store import SqliteStore

    with SqliteStore(args.db, create=False) as store:
        statuses = Operations(Registry(store)).site_statuses()
        records = {s.name: s for s in store.list_sites()}
    print_site_statuses(statuses, args.json, records)
    return 0


# --------------------------------------------------------------------------- site


def _client(args):
    from msa_fed.control.client import RegistryClient

    token = args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    if not token:
        raise ConfigError("a token is required: --token T or --token-file F")
    return RegistryClient(
        args.registry, token, insecure=args.insecure, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
        tls_key=args.tls_key, server_name=args.server_name, timeout=args.timeout,
    )


def _register(args) -> int:
    labels = {}
    for item in args.label or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label must be KEY=VALUE; got {item!r}")
        labels[key] = value
    with _client(args) as client:
        site = client.register(args.name, labels)
    print(f"site {site.name!r} registered at {_iso(site.registered_at)}")
    return 0


def _load_sample(path: str):
    import numpy as np

    try:
        X = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise ConfigError(f"--unlabeled {path!r} is not a numeric .npy array ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"--unlabeled {path!r} cannot be read as .npy ({exc})") from None
    if not hasattr(X, "ndim") or X.ndim != 2 or X.dtype.kind not in "fiub":
        raise ConfigError(f"--unlabeled {path!r} must hold a 2-D numeric array (m, d); got {getattr(X, 'shape', '?')}")
    return X


def _publish(args) -> int:
    if not args.predictor and not args.unlabeled:
        raise ConfigError("give --predictor MODEL.onnx and/or --unlabeled SAMPLE.npy")
    data = Path(args.predictor).read_bytes() if args.predictor else None
    X = _load_sample(args.unlabeled) if args.unlabeled else None
    with _client(args) as client:
        if data is not None:
            rec = client.upload_predictor(data)
            classes = rec.meta.get("classes")
            extra = f", classes={classes}" if classes is not None else ""
            print(f"published predictor sha256={rec.sha256} ({rec.meta['output_kind']}, n_features={rec.meta['n_features']}{extra})")
        if X is not None:
            rec = client.upload_sample(X)
            print(f"published unlabelled sample sha256={rec.sha256} shape=({rec.meta['rows']}, {rec.meta['cols']})")
    return 0


def _status(args) -> int:
    with _client(args) as client:
        site = client.get_site("")
    if args.json:
        print(json.dumps(asdict(site), indent=2))
        return 0
    print(f"site            {site.name}")
    print(f"registered at   {_iso(site.registered_at)}")
    print(f"last heartbeat  {_iso(site.last_heartbeat)}")
    for label, rec in (("predictor", site.predictor), ("sample", site.sample)):
        print(f"{label:<15} {_artifact_summary(rec) if rec is None else rec.sha256}")
        if rec is not None:
            print(f"{'':<15} {json.dumps(rec.meta)}")
    return 0


def _heartbeat(args) -> int:
    with _client(args) as client:
        while True:
            beat = client.heartbeat()
            print(f"heartbeat at {_iso(beat.server_time)}; latest combined model version {beat.latest_combined_version}", flush=True)
            if not args.interval:
                return 0
            time.sleep(args.interval)


# --------------------------------------------------------------------------- parser


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", required=True, metavar="HOST:PORT", help="registry address")
    p.add_argument("--token", help="this site's token (from 'msa-fed admin issue-token')")
    p.add_argument("--token-file", metavar="F", help="read the token from a file instead of --token")
    p.add_argument("--insecure", action="store_true", help="plaintext (loopback registries only)")
    p.add_argument("--tls-ca", metavar="F", help="CA certificate (PEM) that signed the registry's certificate")
    p.add_argument("--tls-cert", metavar="F", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", metavar="F", help="client key (PEM) for mutual TLS")
    p.add_argument("--server-name", metavar="NAME", help="expected name in the registry's certificate")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds per call (default 30)")


def _principal_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, metavar="PATH", help="registry SQLite database")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", metavar="NAME", help="the site")
    who.add_argument("--admin", action="store_true", help="the admin principal (coordinator job)")


def register(subparsers) -> None:
    """Add the ``registry``, ``admin`` and ``site`` command groups."""
    reg_sub = command_group(subparsers, "registry", "run the control-plane registry")
    serve = reg_sub.add_parser("serve", help="serve the registry over gRPC")
    serve.add_argument("--db", required=True, metavar="PATH", help="SQLite database (created if missing)")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind (port 0: any free port)")
    serve.add_argument("--tls-cert", metavar="F", help="server certificate chain (PEM)")
    serve.add_argument("--tls-key", metavar="F", help="server private key (PEM)")
    serve.add_argument("--tls-ca", metavar="F", help="CA (PEM) for client certificates: enables mutual TLS")
    serve.add_argument("--insecure", action="store_true", help="plaintext; refused unless HOST is loopback")
    serve.add_argument("--workers", type=int, default=32, help="RPC worker threads (default 32)")
    serve.add_argument("--max-predictor-mb", type=float, default=64.0, help="predictor size limit (default 64 MiB)")
    serve.add_argument("--max-sample-mb", type=float, default=256.0, help="sample size limit (default 256 MiB)")
    serve.add_argument("--audit-log", metavar="FILE", help="append one JSON line per RPC to FILE (docs/OPERATIONS.md)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.set_defaults(func=_serve)

    admin_sub = command_group(subparsers, "admin", "manage tokens, sites and the registry")
    issue = admin_sub.add_parser("issue-token", help="create a token (printed once) for a site or the admin")
    _principal_options(issue)
    issue.set_defaults(func=_issue_token)
    revoke = admin_sub.add_parser("revoke-token", help="revoke a site's (or the admin's) token")
    _principal_options(revoke)
    revoke.set_defaults(func=_revoke_token)
    ls = admin_sub.add_parser("list-sites", help="sites with their token state, registration and artifacts")
    ls.add_argument("--db", required=True, metavar="PATH", help="registry SQLite database")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_list_sites)

    site_sub = command_group(subparsers, "site", "act as a site: register, publish, serve, audit")
    p = site_sub.add_parser("register", help="register this site")
    _connection_options(p)
    p.add_argument("--name", required=True, help="site name (must match the token)")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="descriptive label (repeatable)")
    p.set_defaults(func=_register)
    p = site_sub.add_parser("publish", help="upload the frozen predictor and/or the unlabelled sample")
    _connection_options(p)
    p.add_argument("--predictor", metavar="MODEL.onnx", help="ONNX predictor (msa_fed.artifacts export)")
    p.add_argument("--unlabeled", metavar="SAMPLE.npy", help="unlabelled inputs, a 2-D numeric .npy array")
    p.set_defaults(func=_publish)
    p = site_sub.add_parser("status", help="this site's record in the registry")
    _connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_status)
    p = site_sub.add_parser("heartbeat", help="tell the registry this site is alive")
    _connection_options(p)
    p.add_argument("--interval", type=float, default=0.0, metavar="S", help="repeat every S seconds (default: once)")
    p.set_defaults(func=_heartbeat)
