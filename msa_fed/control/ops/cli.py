"""``msa-fed model | job | admin deregister`` commands against a running registry (admin token).

    msa-fed model list     --registry HOST:PORT --admin-token-file F [--json]
    msa-fed model show     VERSION|latest ...   [--json]
    msa-fed model download VERSION|latest --out DIR ...
    msa-fed model promote  VERSION [--reason TEXT] ...
    msa-fed model upload   DIR [--retry-for S] ...
    msa-fed job list       [--limit N] [--json] ...
    msa-fed job show       JOB_ID [--json] ...
    msa-fed job finish     JOB_ID --status succeeded|failed [--model-version N] [--error TEXT] ...
    msa-fed admin deregister --site NAME [--reason TEXT] ...

Every command also takes --tls-ca F (or --insecure towards a loopback registry), --tls-cert /
--tls-key for mutual TLS, --server-name and --timeout.  See docs/OPERATIONS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from msa_fed.artifacts.privacy_view import ESTIMATE_NOTE, MEASURED_NOTE, epsilon_line, reported_losses, site_check_of
from msa_fed.clitools import command_group
from msa_fed.errors import ConfigError

TOKEN_FILE_ENV = "MSA_FED_ADMIN_TOKEN_FILE"


def iso(t) -> str:
    from msa_fed.control.ops.service import iso as _iso

    return _iso(t)


def read_admin_token(path: str | None) -> str:
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if not path:
        raise ConfigError(f"--admin-token-file is required (or set {TOKEN_FILE_ENV})")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--admin-token-file {path!r} not found")
    token = p.read_text().strip()
    if not token:
        raise ConfigError(f"--admin-token-file {path!r} is empty")
    return token


def connect_factory(args, token: str | None = None):
    """A function that opens a new :class:`RegistryClient` with the command's connection flags
    (:func:`connection_options`) and ``token`` (default: the admin token of ``--admin-token-file``)."""
    from msa_fed.control.registry.client import RegistryClient

    token = token or read_admin_token(args.admin_token_file)
    timeout = 30.0 if args.timeout is None else args.timeout
    if not 0 < timeout < float("inf"):
        raise ConfigError(f"--timeout must be a finite number > 0; got {timeout!r}")

    def connect(**kwargs):
        return RegistryClient(
            args.registry,
            token,
            insecure=bool(args.insecure),
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            server_name=args.server_name,
            timeout=timeout,
            **kwargs,
        )

    return connect


def download_version(args, text: str):
    """(archive, record) of the stored model version ``text`` ("latest" or a number), with the
    command's connection flags (a command that reads either a local model or, with --registry, a
    stored one)."""
    try:
        version = _version(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"with --registry, {exc}") from None
    with connect_factory(args)() as client:
        return client.download_combined_model(version or None)


@contextmanager
def _ops(args):
    """The operations client of the command's connection (closed after the block)."""
    from msa_fed.control.ops.client import OpsClient

    with connect_factory(args)() as client:
        yield OpsClient(client)


def _version(text: str) -> int:
    if text in ("latest", "current"):
        return 0
    try:
        version = int(text)
    except ValueError:
        version = -1
    if version < 1:
        raise argparse.ArgumentTypeError(f"VERSION must be a positive integer or 'latest'; got {text!r}")
    return version


def _table(header, rows) -> None:
    table = [tuple(header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _manifest(record) -> dict:
    from msa_fed.control.ops.service import manifest_of

    return manifest_of(record)


# --------------------------------------------------------------------------- model


def _model_dict(m: dict) -> dict:
    """A stored model's status for --json: its record, its manifest read, current, its promotions."""
    record = {**asdict(m["record"]), "manifest_json": None, "manifest": _manifest(m["record"])}
    return {**record, "current": m["current"], "promotions": [asdict(p) for p in m["promotions"]]}


def _model_list(args) -> int:
    with _ops(args) as ops:
        models, current = ops.list_models()
    if args.json:
        print(json.dumps({"current_version": current, "models": [_model_dict(m) for m in models]}, indent=2))
        return 0
    if not models:
        print("no combined model stored")
        return 0
    rows = []
    for m in models:
        r, man = m["record"], _manifest(m["record"])
        rows.append(
            (
                r.version,
                "*" if m["current"] else "",
                iso(r.created_at),
                r.created_by,
                r.sha256[:12],
                r.size,
                man.get("job", "-"),
                man.get("job_id", "-"),
                ",".join(man.get("sites") or []) or "-",
            )
        )
    _table(("VERSION", "CURRENT", "CREATED", "BY", "SHA256", "BYTES", "JOB", "JOB ID", "SITES"), rows)
    return 0


def print_model_facts(man: dict) -> None:
    """z, the losses (marked as estimates under DP) and the epsilon each site spent."""
    sites = man.get("sites") or []
    eps = man.get("epsilon_by_site") or {}
    if man.get("z"):
        print(f"{'z':<15} " + "  ".join(f"{n}={v:.4f}" for n, v in zip(sites, man["z"])))
    _, texts, measured = reported_losses(man.get("info"), man.get("domain_losses") or None, eps)
    if texts:
        print(f"{'L_k(z)':<15} " + "  ".join(f"{n}={v}" for n, v in zip(sites, texts)))
        if measured:
            print(f"{'':<15} ({MEASURED_NOTE})")
    shown = epsilon_line(sites, eps)
    if shown is not None:
        print(f"{'epsilon':<15} {shown}  ({ESTIMATE_NOTE})")


def _model_show(args) -> int:
    with _ops(args) as ops:
        m = ops.get_model(args.version)
    r, man = m["record"], _manifest(m["record"])
    if args.json:
        print(json.dumps(_model_dict(m), indent=2))
        return 0
    sites = man.get("sites") or []
    print(f"version         {r.version}{'  (current: what latest resolves to)' if m['current'] else ''}")
    print(f"created         {iso(r.created_at)} by {r.created_by}")
    print(f"sha256          {r.sha256}  ({r.size} bytes)")
    print(
        f"job             {man.get('job', '-')}  id {man.get('job_id', '-')}  "
        f"output_version {man.get('output_version') or '-'}"
    )
    print(f"method          {man.get('method', '-')} / {man.get('task', '-')}, eta={man.get('eta', '-')}")
    print_model_facts(man)
    for k, sha in enumerate(man.get("predictor_sha256") or []):
        print(f"predictor       {sites[k] if k < len(sites) else k}: sha256 {sha}")
    influence = (man.get("info") or {}).get("influence")
    if isinstance(influence, dict) and influence.get("sites"):
        from msa_fed.core.influence import influence_lines

        for line in influence_lines(influence):
            print(line)
    check = site_check_of(man.get("info"))
    if check is not None:
        from msa_fed.core.harm import harm_lines

        for line in harm_lines(check):
            print(line)
    for p in m["promotions"]:
        print(f"promoted        {iso(p.promoted_at)} by {p.promoted_by}" + (f": {p.reason}" if p.reason else ""))
    return 0


def _model_download(args) -> int:
    from msa_fed.artifacts.model import load_model
    from msa_fed.control.ops.models import unpack_model

    with connect_factory(args)() as client:
        data, record = client.download_combined_model(args.version or None)
    out = unpack_model(data, args.out)
    try:
        model = load_model(out)  # every predictor checked against its sha256
    except Exception:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        raise
    print(
        f"combined model version {record.version} (sha256 {record.sha256}) written to {out}: "
        f"{model.method} over sites {', '.join(model.site_names)}; open it with msa_fed.load_model({str(out)!r})"
    )
    return 0


def _model_promote(args) -> int:
    with _ops(args) as ops:
        m = ops.promote(args.version, args.reason or "")
    print(f"combined model version {m['record'].version} is now current (what jobs and clients get as latest)")
    return 0


def upload_model_dir(args, path, *, log=print):
    """Upload the model directory ``path`` (load-checked first) and complete its job record, if any."""
    from msa_fed.artifacts.model import load_model
    from msa_fed.control.ops.client import OpsClient
    from msa_fed.control.ops.models import (
        pack_model,
        read_manifest,
        registry_manifest,
        upload_with_retry,
    )
    from msa_fed.errors import RegistryError

    load_model(path)  # refuse to store what cannot be opened
    manifest = registry_manifest(read_manifest(path))
    connect = connect_factory(args)
    record = upload_with_retry(
        lambda: connect(retries=0),
        pack_model(path),
        manifest,
        retry_for=args.retry_for,
        upload_id=manifest.get("job_id") and f"job-{manifest['job_id']}",
        log=log,
    )
    job_id = manifest.get("job_id")
    if job_id:
        try:
            with connect() as client:
                OpsClient(client).finish_job(job_id, "succeeded", record.version)
        except RegistryError as exc:
            if exc.code != "NOT_FOUND":
                raise
    return record


def _model_upload(args) -> int:
    record = upload_model_dir(args, args.dir, log=lambda s: print(s, file=sys.stderr))
    print(f"stored combined model version {record.version} (sha256 {record.sha256})")
    return 0


# --------------------------------------------------------------------------- job


def _job_list(args) -> int:
    with _ops(args) as ops:
        jobs = ops.list_jobs(args.limit)
    if args.json:
        print(json.dumps([asdict(j) for j in jobs], indent=2))
        return 0
    if not jobs:
        print("no job recorded")
        return 0
    _table(
        ("JOB ID", "NAME", "STATUS", "STARTED", "ENDED", "MODEL", "TOPOLOGY", "SITES", "ERROR"),
        [
            (
                j.job_id,
                j.name,
                j.status,
                iso(j.started_at),
                iso(j.ended_at),
                j.model_version or "-",
                j.topology,
                ",".join(j.sites),
                (j.error[:60] + "...") if len(j.error) > 60 else (j.error or "-"),
            )
            for j in jobs
        ],
    )
    return 0


def _job_show(args) -> int:
    from msa_fed.crypto.sealing import check_model_transcript

    with _ops(args) as ops:
        j = ops.get_job(args.job_id)
        manifest = json.loads(ops.get_model(j.model_version)["record"].manifest_json) if j.model_version else {}
    ok, sealed = check_model_transcript(manifest, args.job_key)
    if args.json:
        print(json.dumps({**asdict(j), "sealed": sealed}, indent=2))
        return 0 if ok else 1
    print(f"job id          {j.job_id}")
    print(f"name            {j.name}")
    print(f"status          {j.status}")
    print(f"sites           {', '.join(j.sites) or '-'}")
    print(f"topology        {j.topology}")
    print(f"started         {iso(j.started_at)} by {j.started_by}")
    print(f"ended           {iso(j.ended_at)}")
    print(f"model version   {j.model_version or '-'}")
    print(f"error           {j.error or '-'}")
    print(f"sealed          {sealed}")
    return 0 if ok else 1


def _job_finish(args) -> int:
    with _ops(args) as ops:
        j = ops.finish_job(args.job_id, args.status, args.model_version or 0, args.error or "")
    print(f"job {j.job_id} recorded as {j.status} at {iso(j.ended_at)}")
    return 0


def _job_log(args) -> int:
    _positive_interval = args.interval if args.interval > 0 else 2.0

    def show(lines) -> int:
        """Print the lines; the last one's number (0: none)."""
        for _, when, text in lines:
            print(f"{iso(when)} {text}" if args.timestamps else text, flush=True)
        return lines[-1][0] if lines else 0

    after = 0
    with _ops(args) as ops:
        while True:
            lines, total, dropped = ops.job_log(args.job_id, after)
            after = show(lines) or after
            if len(lines) == 1000:  # more to read at once
                continue
            if not args.follow:
                break
            job = ops.get_job(args.job_id)
            if job.status != "running":
                more, _, dropped = ops.job_log(args.job_id, after)
                show(more)
                print(f"job {job.job_id} {job.status}" + (f": {job.error}" if job.error else ""), flush=True)
                break
            time.sleep(_positive_interval)
    if dropped:
        print(f"({dropped} later line(s) of this job were over the registry's limit and not kept)")
    return 0


def _job_cancel(args) -> int:
    with _ops(args) as ops:
        j = ops.finish_job(args.job_id, "cancelled", 0, args.reason or "")
    print(f"job {j.job_id} ({j.name}) {j.error}; its sites were told to stop, its driver ends at its next call")
    return 0


# --------------------------------------------------------------------------- admin


def _deregister(args) -> int:
    with _ops(args) as ops:
        status = ops.deregister(args.site, args.reason or "")
    print(
        f"site {status.name!r} deregistered at {iso(status.deregistration.deregistered_at)}: token revoked, "
        f"registration and artifacts removed; every later job refuses it"
    )
    return 0


#: the columns of ``admin list-sites`` ("_": a space)
SITE_COLUMNS = "NAME TOKEN REGISTERED REVOKED DEREGISTERED LAST_HEARTBEAT CONNECTED ARTIFACTS USABLE"


def site_status_rows(statuses):
    """Rows of ``admin list-sites``: NAME TOKEN REGISTERED REVOKED DEREGISTERED LAST-HEARTBEAT CONNECTED ARTIFACTS."""
    from msa_fed.control.ops.service import exclusion_reason

    rows = []
    for s in statuses:
        d = s.deregistration
        rows.append(
            (
                s.name,
                s.token,
                iso(s.registered_at) if s.registered else "no",
                iso(s.token_revoked_at),
                f"{iso(d.deregistered_at)}" + (f" ({d.reason})" if d.reason else "") if d else "-",
                iso(s.last_heartbeat),
                "-" if s.connected is None else ("yes" if s.connected else "no"),
                " ".join(
                    f"{k}:{v[:12]}" for k, v in (("predictor", s.predictor_sha256), ("sample", s.sample_sha256)) if v
                )
                or "-",
                "yes" if exclusion_reason(s) is None and s.predictor_sha256 else "no",
            )
        )
    return tuple(c.replace("_", " ") for c in SITE_COLUMNS.split()), rows


def print_site_statuses(statuses, as_json: bool, records: dict | None = None) -> None:
    """Print ``admin list-sites``; ``records`` ({name: SiteRecord}) adds each site's full record to --json."""
    if as_json:
        rows = []
        for s in statuses:
            row = {**asdict(s), "registered": s.registered}
            if records is not None:
                site = records.get(s.name)
                row["site"] = asdict(site) if site is not None else None
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return
    header, rows = site_status_rows(statuses)
    _table(header, rows)


def _site_status(args) -> int:
    with _ops(args) as ops:
        statuses = ops.site_statuses()
    print_site_statuses(statuses, args.json)
    return 0


# --------------------------------------------------------------------------- parser


def connection_options(p: argparse.ArgumentParser, registry_help: str | None = None, token: str = "admin") -> None:
    """The registry connection flags, the same on every command that dials the registry:
    ``--registry`` (optional where ``registry_help`` says what else gives it), the token (``token``
    "admin": ``--admin-token-file``; "site": ``--token`` / ``--token-file``), the TLS files,
    ``--server-name`` and ``--timeout`` (read by :func:`connect_factory`)."""
    p.add_argument(
        "--registry", required=registry_help is None, metavar="HOST:PORT", help=registry_help or "registry address"
    )
    if token == "site":
        p.add_argument("--token", help="this site's token (from 'msa-fed admin issue-token')")
        p.add_argument("--token-file", metavar="F", help="read the token from a file instead of --token")
    else:
        p.add_argument(
            "--admin-token-file", metavar="F", help=f"file holding the admin token (default ${TOKEN_FILE_ENV})"
        )
    p.add_argument("--insecure", action="store_true", default=None, help="plaintext (loopback registries only)")
    p.add_argument("--tls-ca", metavar="F", help="CA certificate (PEM) that signed the registry's certificate")
    p.add_argument("--tls-cert", metavar="F", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", metavar="F", help="client key (PEM) for mutual TLS")
    p.add_argument("--server-name", metavar="NAME", help="expected name in the registry's certificate")
    p.add_argument("--timeout", type=float, metavar="S", help="seconds per call (default 30)")


def register(subparsers) -> None:
    """Add ``model``, ``job`` and ``admin deregister`` / ``admin site-status``."""
    model = command_group(subparsers, "model")
    p = model.add_parser("list", help="every stored version; * marks the current one (what latest resolves to)")
    connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_model_list)
    p = model.add_parser("show", help="one version's record and manifest summary")
    p.add_argument("version", type=_version, metavar="VERSION", help="version number or 'latest'")
    connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_model_show)
    p = model.add_parser("download", help="write a version as a model directory msa_fed.load_model opens")
    p.add_argument("version", type=_version, metavar="VERSION", help="version number or 'latest'")
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) directory to write")
    connection_options(p)
    p.set_defaults(func=_model_download)
    p = model.add_parser("promote", help="make an older version current (rollback)")
    p.add_argument("version", type=_version, metavar="VERSION", help="version number")
    p.add_argument("--reason", help="why (recorded)")
    connection_options(p)
    p.set_defaults(func=_model_promote)
    p = model.add_parser("upload", help="store a saved model directory (e.g. one a job could not upload)")
    p.add_argument("dir", metavar="DIR", help="model directory (manifest.json, arrays.npz, predictors/)")
    p.add_argument(
        "--retry-for",
        type=float,
        default=60.0,
        metavar="S",
        help="keep retrying an unreachable registry for S seconds (default 60)",
    )
    connection_options(p)
    p.set_defaults(func=_model_upload)

    job = command_group(subparsers, "job")
    p = job.add_parser("list", help="recent jobs, newest first")
    p.add_argument("--limit", type=int, default=50, help="at most N jobs (default 50)")
    connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_job_list)
    p = job.add_parser("show", help="one job's record (and its sites' signed answers, verified)")
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument(
        "--job-key",
        action="append",
        metavar="SHA256",
        help="fingerprint of the consortium's job key the sealed transcript must be signed by (repeatable)",
    )
    connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_job_show)
    p = job.add_parser(
        "finish", help="record the end of a job whose driver could not (the line it printed gives this command)"
    )
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument("--status", required=True, choices=["succeeded", "failed"])
    p.add_argument("--model-version", type=int, metavar="N", help="the version it stored (succeeded)")
    p.add_argument("--error", metavar="TEXT", help="its error line (failed)")
    connection_options(p)
    p.set_defaults(func=_job_finish)

    p = job.add_parser("log", help="a job's progress lines, as its driver printed them (kept by the registry)")
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--timestamps", action="store_true", help="prefix each line with when the registry got it")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="--follow: ask every S seconds")
    connection_options(p)
    p.set_defaults(func=_job_log)
    p = job.add_parser("cancel", help="stop a running job: its sites stop answering it, its driver ends")
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument("--reason", metavar="TEXT", help="why (recorded, and shown by the driver and 'job show')")
    connection_options(p)
    p.set_defaults(func=_job_cancel)

    admin = command_group(subparsers, "admin")
    p = admin.add_parser("deregister", help="revoke a site's token and remove it; later jobs refuse it")
    p.add_argument("--site", required=True, metavar="NAME")
    p.add_argument("--reason", help="why (recorded and shown in the error of any job that names the site)")
    connection_options(p)
    p.set_defaults(func=_deregister)
    p = admin.add_parser("site-status", help="like list-sites, through the registry with the admin token")
    connection_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_site_status)
