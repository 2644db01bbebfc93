"""Each TLS mistake, as an operator makes it, ends `site serve` and a CLI call at once with one line
that names the cause and the file to fix: an unknown CA, a missing or foreign client certificate,
a name mismatch, plaintext against TLS and TLS against plaintext.  Never the TLS library's or
gRPC's text, never the start-up's five minutes of "did not answer" (the bound is the subprocess
timeout below, loosely: a loaded machine starts Python slowly)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from ops_helpers import REPO, cli_process, env

from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer, TlsConfig

sys.path.insert(0, str(REPO / "tests" / "federation"))
from fedhelpers import make_pki, site_files  # noqa: E402

#: generous: the site's process must end long before the start-up's 5 minutes of retries
BOUND_S = 60
#: what no line may hold: the TLS library's or gRPC's own words
RAW = ("SSL", "TSI_", "Socket closed", "UNAVAILABLE", "handshake", "Traceback", "failed to connect")


def _run(*args, cwd=None) -> tuple[int, str]:
    """``msa-fed ARGS`` in a new process with gRPC's own default log level: (exit status, output)."""
    rc, out, err = cli_process(*args, timeout=BOUND_S, cwd=cwd, environ=env(grpc_verbosity=None))
    return rc, out + err


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An mTLS registry with site east registered, a plaintext one, the right PKI and a foreign one."""
    tmp = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp / "pki", clients=["east"])
    foreign = make_pki(tmp / "foreign", clients=["east"])
    store = SqliteStore(tmp / "registry.db")
    registry = Registry(store)
    token = registry.issue_token("site", "east")
    admin = registry.issue_token("admin", "admin")
    (tmp / "token.txt").write_text(token + "\n")
    (tmp / "admin_token").write_text(admin + "\n")
    os.chmod(tmp / "admin_token", 0o600)
    tls = TlsConfig.from_files(pki["server_cert"], pki["server_key"], pki["ca"])
    files = site_files(("east",))["east"]
    np.savez(tmp / "data.npz", X_labeled=files.X_labeled, y_labeled=files.y_labeled, X_unlabeled=files.X_unlabeled)
    (tmp / "predictor.onnx").write_bytes(files.predictor)
    with (
        RegistryServer(registry, "127.0.0.1:0", tls=tls, max_workers=16) as secure,
        RegistryServer(Registry(SqliteStore(tmp / "plain.db")), "127.0.0.1:0", insecure=True, max_workers=16) as plain,
    ):
        yield dict(tmp=tmp, pki=pki, foreign=foreign, secure=secure.address, plain=plain.address)
    store.close()


def _cases(w) -> dict:
    """mistake -> (site.toml's connection keys, words the error line must hold)."""
    pki, foreign = w["pki"], w["foreign"]
    good = dict(tls_ca=pki["ca"], tls_cert=pki["east_cert"], tls_key=pki["east_key"])
    return {
        "unknown CA": (
            dict(good, tls_ca=foreign["ca"]),
            ["is not signed by the CA in", foreign["ca"], "unknown CA"],
        ),
        "no client certificate": (
            dict(tls_ca=pki["ca"]),
            ["requires a client certificate (mutual TLS) and none was given", "tls_cert", "tls_key"],
        ),
        "foreign client certificate": (
            dict(good, tls_cert=foreign["east_cert"], tls_key=foreign["east_key"]),
            ["refused the client certificate", foreign["east_cert"], "not signed by the CA the registry trusts"],
        ),
        "name mismatch": (
            dict(good, server_name="registry.example.org"),
            ["certificate names localhost, 127.0.0.1, not 'registry.example.org'"],
        ),
        "plaintext against TLS": (
            dict(insecure=True),
            ["speaks TLS", "insecure", "is plaintext"],
        ),
        "TLS against plaintext": (
            dict(good, address=w["plain"]),
            ["speaks plaintext (it runs with --insecure), not TLS"],
        ),
    }


MISTAKES = [
    "unknown CA",
    "no client certificate",
    "foreign client certificate",
    "name mismatch",
    "plaintext against TLS",
    "TLS against plaintext",
]


def _check(rc: int, text: str, words) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1, text
    for word in words:
        assert word in errors[0], (word, text)
    for line in lines:
        assert not any(raw in line for raw in RAW), line
        assert "did not answer" not in line, text  # not taken for an outage, not retried
    return errors[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", MISTAKES)
def test_site_serve_names_the_tls_mistake(world, mistake, tmp_path):
    keys, words = _cases(world)[mistake]
    address = keys.pop("address", world["secure"])
    lines = [
        'name = "east"',
        f'registry = "{address}"',
        f'token_file = "{world["tmp"] / "token.txt"}"',
        f'data = "{world["tmp"] / "data.npz"}"',
        f'predictor = "{world["tmp"] / "predictor.onnx"}"',
        'audit_log = "audit.jsonl"',
        "allow_unsealed = true",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    config = tmp_path / "site.toml"
    config.write_text("\n".join(lines) + "\n")
    rc, text = _run("site", "serve", "--config", config, cwd=tmp_path)
    line = _check(rc, text, words)
    if "tls_ca" in keys and mistake == "unknown CA":
        assert "tls_ca " in line  # site.toml's key, not a flag


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", MISTAKES)
def test_an_admin_command_names_the_tls_mistake(world, mistake):
    keys, words = _cases(world)[mistake]
    address = keys.pop("address", world["secure"])
    flags = ["--registry", address, "--admin-token-file", world["tmp"] / "admin_token"]
    for key, value in keys.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, value]
    if mistake == "name mismatch" and "--server-name" not in flags:
        pytest.fail("the case sets server_name")
    rc, text = _run("model", "list", *flags)
    _check(rc, text, [w.replace("tls_cert", "--tls-cert").replace("tls_key", "--tls-key") for w in words])


def test_a_healthy_connection_is_not_taken_for_a_mistake(world):
    from msa_fed.control.transport.connection import Connection, diagnose_tls

    pki = world["pki"]
    conn = Connection(world["secure"], "x", tls_ca=pki["ca"], tls_cert=pki["east_cert"], tls_key=pki["east_key"])
    assert diagnose_tls(conn) is None
    assert diagnose_tls(Connection(world["plain"], "x", insecure=True)) is None
    # nothing listens: an outage, not a TLS mistake (the callers retry it)
    assert diagnose_tls(Connection("127.0.0.1:1", "x", tls_ca=pki["ca"])) is None
