"""``msa-fed registry | admin | site`` commands (see docs/CONTROL_PLANE.md).

    msa-fed registry serve --db PATH --listen HOST:PORT [--tls-cert F --tls-key F [--tls-ca F]] [--insecure]
    msa-fed registry serve --config registry.toml        # the same keys in a file (msa-fed consortium init)
    msa-fed admin issue-token --db PATH (--site NAME | --admin)
    msa-fed admin revoke-token --db PATH (--site NAME | --admin)
    msa-fed admin list-sites --db PATH [--json]
    msa-fed site register --registry HOST:PORT --token T --name NAME [--insecure | --tls-ca F]
    msa-fed site register --config site.toml             # name, connection and sealing key from site.toml
    msa-fed site publish  (--config site.toml | --registry HOST:PORT --token T) [--predictor MODEL.onnx]
                          [--unlabeled SAMPLE.npy (--config | --labeled DATA.npz | --no-labeled-check)
                           [--drop-shared]]
    msa-fed site status   --registry HOST:PORT --token T [--json]
    msa-fed site heartbeat --registry HOST:PORT --token T [--interval SECONDS]

Handlers return an exit status; library errors propagate to ``msa_fed.cli.main``,
which prints ``error: <message>`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import stat
import sys
import time
from dataclasses import asdict

from msa_fed.clitools import command_group
from msa_fed.errors import ConfigError

ADMIN_NAME = "admin"
MAX_TOKEN_FILE_BYTES = 4096


def _positive(value, flag: str, *, integer: bool = False, zero: bool = False):
    """``value`` if it is a finite positive number (or 0 when ``zero``), else ConfigError naming ``flag``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if zero else value > 0) and (not integer or float(value).is_integer())
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ConfigError(f"{flag} must be {kind} {'>= 0' if zero else '> 0'}; got {value!r}")
    return value


def _mib(value, flag: str) -> int:
    """``value`` MiB as bytes: finite, positive and at most 1 TiB."""
    _positive(value, flag)
    if value > 2**20:
        raise ConfigError(f"{flag} must be at most {2**20} (1 TiB); got {value!r}")
    size = int(value * 2**20)
    if size < 1:
        raise ConfigError(f"{flag} is below one byte; got {value!r}")
    return size


def _regular_file(path, flag: str, max_bytes: int) -> int:
    """Size of the regular file ``path``, checked with stat (never read) against ``max_bytes``."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{flag} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(f"{flag} {str(path)!r} is {what}; expected a file")
    if info.st_size > max_bytes:
        raise ConfigError(f"{flag} {str(path)!r} is {info.st_size} bytes; the limit is {max_bytes}")
    return info.st_size


def _read_file(path, flag: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` after :func:`_regular_file`; reads at most ``max_bytes + 1``."""
    _regular_file(path, flag, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r} cannot be read ({exc.strerror})") from None
    if len(data) > max_bytes:  # it grew since the stat
        raise ConfigError(f"{flag} {str(path)!r} is larger than the limit of {max_bytes} bytes")
    return data


def _iso(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


# --------------------------------------------------------------------------- registry


#: registry.toml keys (``registry serve --config``), each the flag of the same name; relative
#: paths are relative to the file
REGISTRY_KEYS = {
    "listen": str,
    "db": str,
    "tls_cert": str,
    "tls_key": str,
    "tls_ca": str,
    "insecure": bool,
    "audit_log": str,
    "workers": int,
    "log_level": str,
}
_REGISTRY_PATHS = ("db", "tls_cert", "tls_key", "tls_ca", "audit_log")
_SERVE_DEFAULTS = {"workers": 32, "log_level": "INFO", "insecure": False}


def with_registry_config(args):
    """``registry serve --config registry.toml``: the file's keys fill every option not given on the
    command line (a flag wins); then the defaults.  Returns ``args``."""
    from pathlib import Path

    import tomllib

    if args.config:
        path = Path(args.config).expanduser()
        text = _read_file(path, "--config", 1 << 20)
        try:
            doc = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {str(path)!r} is not valid TOML: {exc}") from None
        unknown = sorted(set(doc) - set(REGISTRY_KEYS))
        if unknown:
            raise ConfigError(
                f"--config {str(path)!r}: unknown key(s) {unknown}; expected some of {sorted(REGISTRY_KEYS)}"
            )
        base = path.resolve().parent
        for key, value in doc.items():
            want = REGISTRY_KEYS[key]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ConfigError(f"--config {str(path)!r}: {key} must be a {want.__name__}; got {value!r}")
            if key in _REGISTRY_PATHS:
                value = str(base / Path(value).expanduser())
            current = getattr(args, key)
            if current is None or (key == "insecure" and not current):
                setattr(args, key, value)
    for key, value in _SERVE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR; got {args.log_level!r}")
    missing = [f"--{k}" for k in ("db", "listen") if not getattr(args, k)]
    if missing:
        raise ConfigError(f"give {' and '.join(missing)} (or --config registry.toml naming them)")
    return args


def _serve(args) -> int:
    from msa_fed.control.audit import AuditLog
    from msa_fed.control.registry.service import Limits, Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore
    from msa_fed.control.server import RegistryServer, TlsConfig, check_transport

    args = with_registry_config(args)
    if args.tls_ca and not args.tls_cert:
        raise ConfigError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key too")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key must be given together")
    tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    check_transport(args.listen, tls, args.insecure)  # before the database file is created
    if tls is not None:
        from msa_fed.control.transport.cert_check import certificate_warnings

        for line in certificate_warnings(tls.cert_chain):
            print(line, file=sys.stderr, flush=True)
    _positive(args.workers, "--workers", integer=True)
    limits = Limits(
        max_predictor_bytes=_mib(args.max_predictor_mb, "--max-predictor-mb"),
        max_sample_bytes=_mib(args.max_sample_mb, "--max-sample-mb"),
        max_n_features=_positive(args.max_features, "--max-features", integer=True),
        max_streams_per_principal=_positive(args.max_streams_per_token, "--max-streams-per-token", integer=True),
        transfer_idle_s=_positive(args.transfer_idle_s, "--transfer-idle-s"),
    )
    if args.workers < 2:
        raise ConfigError(f"--workers must be at least 2; got {args.workers}")
    if os.path.isdir(args.db):
        raise ConfigError(f"--db {args.db!r} is a directory; expected a database file")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    audit_log = AuditLog(args.audit_log) if args.audit_log else None
    store = SqliteStore(args.db)
    try:
        server = RegistryServer(
            Registry(store, limits),
            args.listen,
            tls=tls,
            insecure=args.insecure,
            max_workers=args.workers,
            audit_log=audit_log,
        )
        # the handler only sets a flag: a lock taken in a signal handler (threading.Event.set)
        # deadlocks when the signal lands while the main thread holds that lock (Event.wait)
        stop: list[int] = []
        previous = {
            sig: signal.signal(sig, lambda signum, _f: stop.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            with server:
                print(f"registry listening on {server.address} ({server.mode}); database {args.db}", flush=True)
                while not stop:
                    time.sleep(0.2)
                print("registry stopping", flush=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        store.close()
    return 0


# --------------------------------------------------------------------------- admin


def _db_path(path) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"--db {str(path)!r} is a directory; expected a database file")


def _principal(args) -> tuple[str, str]:
    return ("admin", ADMIN_NAME) if args.admin else ("site", args.site)


def _issue_token(args) -> int:
    from msa_fed.control.registry.records import check_name
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    role, name = _principal(args)
    try:
        check_name(name, "--site")
    except Exception as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1]) from None
    _db_path(args.db)
    with SqliteStore(args.db) as store:
        token = Registry(store).issue_token(role, name)
    print(token)
    print(f"token for {role} {name!r} issued; it is shown only once and replaces any previous one", file=sys.stderr)
    return 0


def _revoke_token(args) -> int:
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    role, name = _principal(args)
    _db_path(args.db)
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
    from msa_fed.control.ops.cli import print_site_statuses
    from msa_fed.control.ops.service import Operations
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore

    _db_path(args.db)
    with SqliteStore(args.db, create=False) as store:
        statuses = Operations(Registry(store)).site_statuses()
        records = {s.name: s for s in store.list_sites()}
    print_site_statuses(statuses, args.json, records)
    return 0


# --------------------------------------------------------------------------- site


def _client(args):
    from msa_fed.control.ops.cli import connect_factory

    token = args.token
    if args.token and args.token_file:
        raise ConfigError("give --token or --token-file, not both")
    if args.token_file:
        raw = _read_file(args.token_file, "--token-file", MAX_TOKEN_FILE_BYTES)
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"--token-file {args.token_file!r} does not hold a token (not ASCII text)") from None
    if not token:
        raise ConfigError("a token is required: --token T or --token-file F")
    return connect_factory(args, token)()


def _register(args) -> int:
    from msa_fed.control.registry.records import check_name

    if getattr(args, "config", None):  # msa_fed.federation.cli reads site.toml and clears it
        raise ConfigError("--config site.toml: not available in this command set; give --registry and --name")
    if not args.registry or not args.name:
        raise ConfigError("give --registry HOST:PORT, --name NAME and a token, or --config site.toml")

    try:
        check_name(args.name, "--name")
    except Exception as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1]) from None
    labels = {}
    for item in args.label or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label must be KEY=VALUE; got {item!r}")
        labels[key] = value
    if args.seal_key:
        from pathlib import Path

        from msa_fed.crypto.sealing import SEAL_KEY_LABEL, SitePublicKey

        path = Path(args.seal_key)
        if not path.is_file():
            raise ConfigError(f"--seal-key {args.seal_key!r} not found (msa-fed site keygen writes FILE.pub)")
        public = SitePublicKey.parse(path.read_text(), f"--seal-key {args.seal_key!r}")
        labels[SEAL_KEY_LABEL] = public.text()
        print(f"sealing key fingerprint {public.fingerprint} (what every job file pins for this site)")
    with _client(args) as client:
        site = client.register(args.name, labels)
    print(f"site {site.name!r} registered at {_iso(site.registered_at)}")
    return 0


def _load_sample(path: str, max_bytes: int):
    """The 2-D numeric array of the .npy file ``path``; its header is checked before anything is allocated.

    The declared shape and dtype must describe exactly the bytes the file holds,
    and the sample as float32 (what is sent) must fit in ``max_bytes``.
    """
    import numpy as np
    from numpy.lib import format as npy

    flag = "--unlabeled"
    size = _regular_file(path, flag, 2**62)
    try:
        with open(path, "rb") as f:
            version = npy.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npy.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = npy.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            offset = f.tell()
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r} cannot be read ({exc.strerror})") from None
    except (ValueError, TypeError, SyntaxError) as exc:
        raise ConfigError(f"{flag} {path!r} is not a .npy array file ({' '.join(str(exc).split())[:200]})") from None
    if dtype.hasobject or dtype.kind not in "fiub" or dtype.fields is not None:
        raise ConfigError(f"{flag} {path!r} must hold a numeric array; its dtype is {dtype}")
    if len(shape) != 2:
        raise ConfigError(f"{flag} {path!r} must hold a 2-D array (m, d); its shape is {shape}")
    rows, cols = (int(n) for n in shape)
    if rows < 1 or cols < 1:
        raise ConfigError(f"{flag} {path!r} is empty (shape {shape})")
    if rows * cols * dtype.itemsize != size - offset:
        raise ConfigError(
            f"{flag} {path!r} declares shape {shape} of {dtype} ({rows * cols * dtype.itemsize} bytes) but holds "
            f"{size - offset} bytes of data"
        )
    if rows * cols * 4 > max_bytes:
        raise ConfigError(
            f"{flag} {path!r} of shape {shape} is {rows * cols * 4} bytes as float32; the limit is {max_bytes} "
            "(--max-sample-mb)"
        )
    try:
        X = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{flag} {path!r} cannot be read as .npy ({' '.join(str(exc).split())[:200]})") from None
    return X


def _load_predictor_file(path: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` (size checked with stat first), verified here with the loader the registry uses.

    The registry answers a refused predictor with a fixed reason and an incident
    id; checking locally first tells the site the loader's own reason.
    """
    from msa_fed.artifacts.predictors import load_predictor
    from msa_fed.errors import ArtifactError

    data = _read_file(path, "--predictor", max_bytes)
    try:
        load_predictor(data, max_bytes=max_bytes)
    except ArtifactError as exc:
        raise ConfigError(f"--predictor {path!r}: {' '.join(str(exc).split())}") from None
    return data


def _check_not_labelled(X, labeled: str | None, unchecked: bool = False, drop: bool = False):
    """``X`` checked to share no row with the site's labelled inputs (``--labeled``: the site's
    data file, an .npz with X_labeled, or a 2-D .npy of the labelled inputs; with ``--config
    site.toml`` the site's ``data`` file); without either, refused unless ``unchecked``
    (``--no-labeled-check``: the operator has no labelled data at hand).  Shared rows (duplicate
    records, say) are refused, naming how many, or left out with ``drop`` (``--drop-shared``).
    Returns the sample to publish.  The count is told to the operator at the site only: a site
    process refusing a sample never names it (privacy/consortium.py)."""
    import numpy as np

    from msa_fed.privacy.consortium import drop_shared

    if unchecked:
        if labeled:
            raise ConfigError("--no-labeled-check: the labelled inputs are given (--labeled or --config); drop one")
        if drop:
            raise ConfigError("--drop-shared needs the labelled inputs (--config or --labeled), not --no-labeled-check")
        print(
            "note: --no-labeled-check: the sample is published without checking that it holds no labelled "
            "input; a labelled row in it lets the coordinator decode that point's label from the site's answers",
            file=sys.stderr,
        )
        return X
    if not labeled:
        raise ConfigError(
            "--unlabeled: give the site's labelled inputs to check that the sample shares no row with them: "
            "--config site.toml (its data file) or --labeled DATA.npz (or --no-labeled-check when this machine "
            "holds no labelled data)"
        )
    _regular_file(labeled, "--labeled", 2**62)
    try:
        data = np.load(labeled, allow_pickle=False)
        if isinstance(data, np.ndarray):
            XL = data
        else:
            with data:
                XL = data["X_labeled"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--labeled {labeled!r}: not the site's data file (.npz with X_labeled) or a .npy array: "
            f"{' '.join(str(exc).split())[:200]}"
        ) from None
    XL = np.asarray(XL)
    if XL.ndim != 2 or XL.shape[1] != X.shape[1] or XL.dtype.kind not in "fiub":
        raise ConfigError(f"--labeled {labeled!r}: expected a numeric (n, {X.shape[1]}) array; got {XL.shape}")
    kept, shared = drop_shared(XL, X)
    if not shared:
        return X
    rows = f"{shared} of the {X.shape[0]} rows of the sample {'is a' if shared == 1 else 'are'} labelled input"
    rows += "" if shared == 1 else "s"
    if not drop:
        raise ConfigError(
            f"--unlabeled: {rows} of this site (equal rows, e.g. duplicate records); a site never publishes its "
            "labelled inputs: give --drop-shared to publish the sample without them"
        )
    if kept.shape[0] == 0:
        raise ConfigError(f"--drop-shared: {rows} of this site; nothing is left to publish")
    print(f"--drop-shared: {rows} of this site, left out; publishing the other {kept.shape[0]} rows")
    return kept


def _publish(args) -> int:
    if not args.predictor and not args.unlabeled:
        raise ConfigError("give --predictor MODEL.onnx and/or --unlabeled SAMPLE.npy")
    if args.drop_shared and not args.unlabeled:
        raise ConfigError("--drop-shared applies to --unlabeled SAMPLE.npy; none is given")
    if getattr(args, "config", None):  # msa_fed.federation.cli reads site.toml and clears it
        raise ConfigError("--config site.toml: not available in this command set; give --labeled DATA.npz")
    if not args.registry:
        raise ConfigError("give --registry HOST:PORT and a token, or --config site.toml")
    data = (
        _load_predictor_file(args.predictor, _mib(args.max_predictor_mb, "--max-predictor-mb"))
        if args.predictor
        else None
    )
    X = _load_sample(args.unlabeled, _mib(args.max_sample_mb, "--max-sample-mb")) if args.unlabeled else None
    if X is not None:
        X = _check_not_labelled(X, args.labeled, args.no_labeled_check, args.drop_shared)
    with _client(args) as client:
        if data is not None:
            rec = client.upload_predictor(data)
            classes = rec.meta.get("classes")
            extra = f", classes={classes}" if classes is not None else ""
            print(
                f"published predictor sha256={rec.sha256} ({rec.meta['output_kind']}, n_features={rec.meta['n_features']}{extra})"
            )
        if X is not None:
            rec = client.upload_sample(X)
            print(f"published unlabelled sample sha256={rec.sha256} shape=({rec.meta['rows']}, {rec.meta['cols']})")
    return 0


def _status(args) -> int:
    # with --config, msa_fed.federation.cli answers (the site process's view)
    if not args.registry:
        raise ConfigError("give --config site.toml (the site's whole status) or --registry HOST:PORT and a token")
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
    _positive(args.interval, "--interval", zero=True)
    with _client(args) as client:
        while True:
            beat = client.heartbeat()
            print(
                f"heartbeat at {_iso(beat.server_time)}; latest combined model version {beat.latest_combined_version}",
                flush=True,
            )
            if not args.interval:
                return 0
            time.sleep(args.interval)


# --------------------------------------------------------------------------- parser


def _principal_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, metavar="PATH", help="registry SQLite database")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", metavar="NAME", help="the site")
    who.add_argument("--admin", action="store_true", help="the admin principal (coordinator job)")


def register(subparsers) -> None:
    """Add the ``registry``, ``admin`` and ``site`` command groups."""
    from msa_fed.control.ops.cli import connection_options

    reg_sub = command_group(subparsers, "registry")
    serve = reg_sub.add_parser("serve", help="serve the registry over gRPC")
    serve.add_argument(
        "--config",
        metavar="registry.toml",
        help="the registry's settings (msa-fed consortium init writes one): listen, db, tls_cert, tls_key, "
        "tls_ca, insecure, audit_log, workers, log_level; a flag given here wins",
    )
    serve.add_argument("--db", metavar="PATH", help="SQLite database (created if missing)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="address to bind (port 0: any free port)")
    serve.add_argument("--tls-cert", metavar="F", help="server certificate chain (PEM)")
    serve.add_argument("--tls-key", metavar="F", help="server private key (PEM)")
    serve.add_argument("--tls-ca", metavar="F", help="CA (PEM) for client certificates: enables mutual TLS")
    serve.add_argument(
        "--insecure", action="store_true", default=None, help="plaintext; refused unless HOST is loopback"
    )
    serve.add_argument("--workers", type=int, help="RPC worker threads (default 32)")
    serve.add_argument("--max-predictor-mb", type=float, default=64.0, help="predictor size limit (default 64 MiB)")
    serve.add_argument("--max-sample-mb", type=float, default=256.0, help="sample size limit (default 256 MiB)")
    serve.add_argument(
        "--max-features", type=int, default=1_000_000, help="largest declared predictor input width (default 1000000)"
    )
    serve.add_argument(
        "--max-streams-per-token", type=int, default=2, help="concurrent uploads/downloads per token (default 2)"
    )
    serve.add_argument(
        "--transfer-idle-s", type=float, default=30.0, help="cut off an upload/download idle this long (default 30 s)"
    )
    serve.add_argument("--audit-log", metavar="FILE", help="append one JSON line per RPC to FILE (docs/OPERATIONS.md)")
    serve.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    serve.set_defaults(func=_serve)

    admin_sub = command_group(subparsers, "admin")
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

    site_sub = command_group(subparsers, "site")
    p = site_sub.add_parser("register", help="register this site")
    connection_options(p, "registry address (default: site.toml's)", token="site")
    p.add_argument(
        "--config",
        metavar="site.toml",
        help="the site's configuration: its name, registry, token, TLS files and sealing key (seal_key's "
        ".pub) are used unless given here",
    )
    p.add_argument("--name", help="site name (must match the token)")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="descriptive label (repeatable)")
    p.add_argument("--seal-key", metavar="FILE.pub", help="the site's public sealing key (msa-fed site keygen)")
    p.set_defaults(func=_register)
    p = site_sub.add_parser("publish", help="upload the frozen predictor and/or the unlabelled sample")
    connection_options(p, "registry address (default: site.toml's)", token="site")
    p.add_argument(
        "--config",
        metavar="site.toml",
        help="the site's configuration: its data file is checked against the sample, and its registry, "
        "token and TLS files are used unless --registry is given",
    )
    p.add_argument("--predictor", metavar="MODEL.onnx", help="ONNX predictor (msa_fed.artifacts export)")
    p.add_argument("--unlabeled", metavar="SAMPLE.npy", help="unlabelled inputs, a 2-D numeric .npy array")
    p.add_argument(
        "--labeled",
        metavar="DATA.npz",
        help="the site's data file (X_labeled) or a .npy of its labelled inputs: a sample sharing a row "
        "with them is refused",
    )
    p.add_argument(
        "--no-labeled-check",
        action="store_true",
        help="publish --unlabeled without --labeled or --config (this machine holds no labelled data): "
        "nothing checks here that the sample holds no labelled input",
    )
    p.add_argument(
        "--drop-shared",
        action="store_true",
        help="leave out the rows of --unlabeled that equal a labelled input (duplicate records) instead of "
        "refusing the sample; says how many",
    )
    p.add_argument("--max-predictor-mb", type=float, default=64.0, help="refuse a larger predictor file (default 64)")
    p.add_argument(
        "--max-sample-mb", type=float, default=256.0, help="refuse a larger sample, counted as float32 (default 256)"
    )
    p.set_defaults(func=_publish)
    p = site_sub.add_parser(
        "status",
        help="with --config site.toml: the site's process, registry connection, budgets left and their refill, "
        "epsilon, last jobs; with --registry and a token: its record in the registry",
    )
    connection_options(p, "registry address (default: site.toml's)", token="site")
    p.add_argument("--config", metavar="site.toml", help="the site's configuration (its whole status)")
    p.add_argument("--offline", action="store_true", help="with --config: the site's own files only")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_status)
    p = site_sub.add_parser("heartbeat", help="tell the registry this site is alive")
    connection_options(p, token="site")
    p.add_argument("--interval", type=float, default=0.0, metavar="S", help="repeat every S seconds (default: once)")
    p.set_defaults(func=_heartbeat)
