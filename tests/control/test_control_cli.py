"""The ``msa-fed registry | admin | site`` contract, run through ``msa_fed.cli.main`` in-process."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import threading
import time

import numpy as np
import pytest
from control_helpers import linear_onnx, make_pki

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer


@pytest.fixture
def db(tmp_path):
    return tmp_path / "registry.db"


@pytest.fixture
def served(db):
    store = SqliteStore(db)
    with RegistryServer(Registry(store), "127.0.0.1:0", insecure=True) as server:
        yield server
    store.close()


def issue(run, db, *who):
    rc, out, err = run("admin", "issue-token", "--db", db, *who)
    assert rc == 0 and "shown only once" in err
    (token,) = out.split()
    return token


def assert_one_line_error(rc, err, expected=None):
    assert rc == 1
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    if expected is not None:
        assert err == f"error: {expected}\n"


def test_site_flow_through_the_cli(run, db, served, tmp_path):
    token = issue(run, db, "--site", "a")
    admin_token = issue(run, db, "--admin")
    addr = served.address
    rc, out, _ = run(
        "site", "register", "--registry", addr, "--token", token, "--name", "a", "--insecure", "--label", "city=Lyon"
    )
    assert rc == 0 and "site 'a' registered" in out

    model, sample = tmp_path / "model.onnx", tmp_path / "sample.npy"
    model.write_bytes(linear_onnx([1.0, 2.0]))
    X = np.arange(10, dtype=np.float64).reshape(5, 2)
    np.save(sample, X)
    np.save(tmp_path / "labelled.npy", X + 0.5)  # the site's labelled inputs: no row in the sample
    rc, out, err = run(
        "site",
        "publish",
        "--registry",
        addr,
        "--token",
        token,
        "--insecure",
        "--predictor",
        model,
        "--unlabeled",
        sample,
        "--labeled",
        tmp_path / "labelled.npy",
    )
    assert rc == 0, err
    assert "published predictor sha256=" in out and "shape=(5, 2)" in out

    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    rc, out, _ = run("site", "status", "--registry", addr, "--token-file", token_file, "--insecure", "--json")
    status = json.loads(out)
    assert rc == 0 and status["name"] == "a" and status["labels"] == {"city": "Lyon"}
    assert status["sample"]["meta"] == {"rows": 5, "cols": 2, "dtype": "float32"}
    rc, out, _ = run("site", "heartbeat", "--registry", addr, "--token", token, "--insecure")
    assert rc == 0 and "heartbeat at" in out

    with RegistryClient(addr, admin_token, insecure=True) as admin:  # what the job sees
        got, _ = admin.download_sample("a")
    np.testing.assert_array_equal(got, X.astype(np.float32))

    rc, out, _ = run("admin", "list-sites", "--db", db)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["NAME", "TOKEN"]
    assert lines[1].startswith("a ") and "active" in lines[1] and status["predictor"]["sha256"][:12] in lines[1]
    rc, out, _ = run("admin", "list-sites", "--db", db, "--json")
    listing = json.loads(out)
    assert [r["name"] for r in listing] == ["a"] and listing[0]["site"]["predictor"]["sha256"] == status["predictor"][
        "sha256"
    ]


def test_auth_errors_are_one_clear_line(run, db, served):
    token = issue(run, db, "--site", "a")
    issue(run, db, "--site", "b")
    addr = served.address
    head, secret = token.rsplit(".", 1)
    wrong = f"{head}.{'x' if secret[0] != 'x' else 'y'}{secret[1:]}"
    rc, _, err = run("site", "register", "--registry", addr, "--token", wrong, "--name", "a", "--insecure")
    assert_one_line_error(rc, err, "UNAUTHENTICATED: invalid token for site 'a'")
    rc, _, err = run("site", "register", "--registry", addr, "--token", token, "--name", "b", "--insecure")
    assert_one_line_error(rc, err, "PERMISSION_DENIED: site 'a' may not act on site 'b'")
    rc, out, _ = run("admin", "revoke-token", "--db", db, "--site", "a")
    assert rc == 0 and "revoked" in out
    rc, _, err = run("site", "register", "--registry", addr, "--token", token, "--name", "a", "--insecure")
    assert_one_line_error(rc, err, "UNAUTHENTICATED: the token of site 'a' was revoked (or replaced by a newer one)")
    rc, _, err = run("admin", "revoke-token", "--db", db, "--site", "a")
    assert_one_line_error(rc, err, "site 'a' has no active token")
    # a new token replaces the revoked one
    fresh = issue(run, db, "--site", "a")
    rc, _, _ = run("site", "register", "--registry", addr, "--token", fresh, "--name", "a", "--insecure")
    assert rc == 0


def test_input_errors_are_one_clear_line(run, db, served, tmp_path):
    token = issue(run, db, "--site", "a")
    addr = served.address
    run("site", "register", "--registry", addr, "--token", token, "--name", "a", "--insecure")
    disguised = tmp_path / "model.onnx"
    disguised.write_bytes(pickle.dumps({"not": "a model"}))
    rc, _, err = run("site", "publish", "--registry", addr, "--token", token, "--insecure", "--predictor", disguised)
    assert_one_line_error(rc, err)
    assert err.startswith("error: --predictor")
    assert "artifact is a Python pickle" in err  # checked locally, where the site may see the loader's reason
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    rc, _, err = run("site", "publish", "--registry", addr, "--token", token, "--insecure", "--unlabeled", objects)
    assert_one_line_error(rc, err)
    assert "--unlabeled" in err
    rc, _, err = run(
        "site", "publish", "--registry", addr, "--token", token, "--insecure", "--predictor", tmp_path / "missing.onnx"
    )
    assert_one_line_error(rc, err)
    rc, _, err = run("site", "status", "--registry", "10.0.0.1:7443", "--token", token, "--insecure")
    assert_one_line_error(rc, err)
    assert "only allowed towards loopback" in err
    rc, _, err = run("admin", "list-sites", "--db", tmp_path / "nope.db")
    assert_one_line_error(rc, err)
    rc, _, err = run("registry", "serve", "--db", tmp_path / "new.db", "--listen", "0.0.0.0:0", "--insecure")
    assert_one_line_error(rc, err)
    assert "--insecure refuses" in err and not (tmp_path / "new.db").exists()
    rc, _, err = run("registry", "serve", "--db", tmp_path / "new.db", "--listen", "127.0.0.1:0")
    assert_one_line_error(rc, err)
    assert "TLS is required" in err
    rc, _, err = run("registry", "serve", "--db", db, "--listen", "127.0.0.1:notaport", "--insecure")
    assert_one_line_error(rc, err)
    # the server is unreachable: UNAVAILABLE, still one line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    rc, _, err = run("site", "heartbeat", "--registry", dead, "--token", token, "--insecure", "--timeout", "3")
    assert_one_line_error(rc, err)
    assert err.startswith("error: UNAVAILABLE: ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_registry_serve_with_mutual_tls_until_sigterm(run, db, tmp_path):
    paths = make_pki().write(tmp_path)  # the client certificate names site-a
    token = issue(run, db, "--site", "site-a")
    address = f"127.0.0.1:{free_port()}"
    outcome = {}

    def site_then_stop():
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with RegistryClient(
                        address,
                        token,
                        tls_ca=paths["ca"],
                        tls_cert=paths["client_cert"],
                        tls_key=paths["client_key"],
                        retries=0,
                        timeout=5,
                    ) as client:
                        outcome["site"] = client.register("site-a").name
                        break
                except Exception as exc:
                    if time.monotonic() > deadline:
                        outcome["error"] = repr(exc)
                        break
                    time.sleep(0.1)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    helper = threading.Thread(target=site_then_stop)
    helper.start()
    rc, out, err = run(
        "registry",
        "serve",
        "--db",
        db,
        "--listen",
        address,
        "--tls-cert",
        paths["server_cert"],
        "--tls-key",
        paths["server_key"],
        "--tls-ca",
        paths["ca"],
        "--log-level",
        "ERROR",
    )
    helper.join(30)
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    assert outcome == {"site": "site-a"}, outcome
    assert rc == 0 and f"registry listening on {address} (mutual TLS)" in out and "registry stopping" in out
    # and the same site through the CLI, over TLS, against a server from the API
    with SqliteStore(db) as store:
        from msa_fed.control.server import TlsConfig

        tls = TlsConfig.from_files(paths["server_cert"], paths["server_key"])
        with RegistryServer(Registry(store), "127.0.0.1:0", tls=tls) as server:
            register = (
                "site",
                "register",
                "--registry",
                f"localhost:{server.port}",
                "--token",
                token,
                "--name",
                "site-a",
            )
            rc, out, err = run(*register, "--tls-ca", paths["ca"])
            assert rc == 0, err
            rc, _, err = run(*register, "--insecure", "--timeout", "5")
            assert_one_line_error(rc, err)  # a TLS registry dialled in plaintext: said in words
            assert err.startswith(
                f"error: the registry localhost:{server.port} speaks TLS, and --insecure is plaintext"
            )
