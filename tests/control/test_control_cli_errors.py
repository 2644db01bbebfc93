"""Bad input to every control-plane command gives one ``error:`` line, before anything large is read."""

from __future__ import annotations

import numpy as np
import pytest
from control_helpers import linear_onnx
from numpy.lib import format as npy

from msa_fed.control.registry.service import Registry
from msa_fed.control.registry.sqlite_store import SqliteStore
from msa_fed.control.server import RegistryServer


def one_error_line(rc, err, *fragments):
    assert rc == 1, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def served(tmp_path, run):
    """A registry with site 'a' registered; yields (address, token, store)."""
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    token = registry.issue_token("site", "a")
    with RegistryServer(registry, "127.0.0.1:0", insecure=True) as server:
        assert (
            run("site", "register", "--registry", server.address, "--token", token, "--name", "a", "--insecure")[0] == 0
        )
        yield server.address, token, store
    store.close()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "-inf", "1e300"])
@pytest.mark.parametrize("flag", ["--max-predictor-mb", "--max-sample-mb"])
def test_serve_refuses_non_finite_or_non_positive_limits(run, tmp_path, flag, value):
    db = tmp_path / "new.db"
    rc, _, err = run("registry", "serve", "--db", db, "--listen", "127.0.0.1:0", "--insecure", f"{flag}={value}")
    one_error_line(rc, err, flag)
    assert not db.exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--workers", "0"], "--workers"),
        (["--workers", "1"], "--workers"),
        (["--max-features", "0"], "--max-features"),
        (["--max-streams-per-token=-2"], "--max-streams-per-token"),
        (["--transfer-idle-s", "nan"], "--transfer-idle-s"),
        (["--transfer-idle-s", "0"], "--transfer-idle-s"),
    ],
)
def test_serve_refuses_bad_resource_options(run, tmp_path, args, fragment):
    rc, _, err = run("registry", "serve", "--db", tmp_path / "new.db", "--listen", "127.0.0.1:0", "--insecure", *args)
    one_error_line(rc, err, fragment)


def test_db_naming_a_directory_or_a_non_database(run, tmp_path):
    (tmp_path / "text.db").write_text("not sqlite")
    for db in (tmp_path, tmp_path / "text.db"):
        rc, _, err = run("registry", "serve", "--db", db, "--listen", "127.0.0.1:0", "--insecure")
        one_error_line(rc, err, "--db")
        for command in (["issue-token", "--site", "a"], ["revoke-token", "--site", "a"], ["list-sites"]):
            rc, _, err = run("admin", command[0], "--db", db, *command[1:])
            one_error_line(rc, err, "--db")


def test_token_file_that_is_a_directory_missing_huge_or_binary(run, served, tmp_path):
    address, _, _ = served
    huge = tmp_path / "huge.token"
    with open(huge, "wb") as f:
        f.truncate(50 * 2**30)  # sparse: stat says 50 GiB; it must not be read
    binary = tmp_path / "binary.token"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    for path, fragment in (
        (tmp_path, "is a directory"),
        (tmp_path / "missing", "does not exist"),
        (huge, "is 53687091200 bytes; the limit is 4096"),
        (binary, "not ASCII"),
    ):
        rc, _, err = run("site", "heartbeat", "--registry", address, "--insecure", "--token-file", path)
        one_error_line(rc, err, "--token-file", fragment)
    rc, _, err = run("site", "heartbeat", "--registry", address, "--insecure", "--token", "t", "--token-file", binary)
    one_error_line(rc, err, "not both")


def test_publish_predictor_that_is_a_directory_or_a_huge_sparse_file(run, served, tmp_path):
    address, token, store = served
    huge = tmp_path / "huge.onnx"
    with open(huge, "wb") as f:
        f.truncate(100 * 2**30)  # 100 GiB of holes: reading it first ran out of memory
    base = ("site", "publish", "--registry", address, "--token", token, "--insecure")
    rc, _, err = run(*base, "--predictor", tmp_path)
    one_error_line(rc, err, "--predictor", "is a directory")
    rc, _, err = run(*base, "--predictor", huge)
    one_error_line(rc, err, "--predictor", "is 107374182400 bytes; the limit is 67108864")
    rc, _, err = run(*base, "--predictor", "/dev/zero")
    one_error_line(rc, err, "--predictor", "not a regular file")
    model = tmp_path / "m.onnx"
    model.write_bytes(linear_onnx([1.0, 2.0], padding=300_000))  # ~1.2 MB
    rc, _, err = run(*base, "--predictor", model, "--max-predictor-mb", "1")
    one_error_line(rc, err, "the limit is 1048576")
    assert store.get_site("a").predictor is None
    rc, out, err = run(*base, "--predictor", model)
    assert rc == 0 and "published predictor" in out, err


def write_npy_header(path, shape, descr="<f8", data=b""):
    with open(path, "wb") as f:
        npy.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
        f.write(data)


def test_publish_unlabeled_with_a_crafted_npy_header(run, served, tmp_path):
    address, token, store = served
    base = ("site", "publish", "--registry", address, "--token", token, "--insecure", "--unlabeled")
    crafted = tmp_path / "crafted.npy"
    write_npy_header(crafted, (10**7, 2 * 10**4), data=b"\x00" * 64)  # declares 1.46 TiB, holds 64 bytes
    rc, _, err = run(*base, crafted)
    one_error_line(rc, err, "--unlabeled", "declares shape (10000000, 20000)", "holds 64 bytes")
    short = tmp_path / "short.npy"
    write_npy_header(short, (3, 2), data=b"\x00" * 47)
    rc, _, err = run(*base, short)
    one_error_line(rc, err, "holds 47 bytes")
    # consistent with its size, but above the limit (counted as float32, what is sent)
    big = tmp_path / "big.npy"
    np.save(big, np.zeros((300_000, 1), dtype=np.float32))  # 1.2 MB
    rc, _, err = run(*base, big, "--max-sample-mb", "1")
    one_error_line(rc, err, "the limit is 1048576")
    for name, shape, descr in (
        ("objects", (2, 2), "|O"),
        ("3d", (2, 2, 2), "<f4"),
        ("1d", (4,), "<f4"),
        ("structured", (2, 2), [("a", "<f4")]),
        ("empty", (0, 3), "<f4"),
    ):
        path = tmp_path / f"{name}.npy"
        n = int(np.prod(shape))
        write_npy_header(path, shape, descr, b"\x00" * (n * 4))
        rc, _, err = run(*base, path)
        one_error_line(rc, err, "--unlabeled")
    (tmp_path / "text.npy").write_text("hello")
    rc, _, err = run(*base, tmp_path / "text.npy")
    one_error_line(rc, err, "is not a .npy array file")
    rc, _, err = run(*base, tmp_path)
    one_error_line(rc, err, "is a directory")
    assert store.get_site("a").sample is None
    good = tmp_path / "good.npy"
    np.save(good, np.arange(6, dtype=np.float64).reshape(3, 2), allow_pickle=False)
    np.save(tmp_path / "labelled.npy", -np.arange(6, dtype=np.float64).reshape(3, 2) - 1)
    rc, out, err = run(*base, good, "--labeled", tmp_path / "labelled.npy")
    assert rc == 0 and "shape=(3, 2)" in out, err


def test_other_bad_values_of_site_commands(run, served, tmp_path):
    address, token, _ = served
    conn = ("--registry", address, "--token", token, "--insecure")
    (tmp_path / "not.pem").write_text("hello")
    cases = [
        (("site", "heartbeat", *conn, "--interval=-1"), "--interval"),
        (("site", "heartbeat", *conn, "--interval", "nan"), "--interval"),
        (("site", "heartbeat", *conn, "--timeout", "0"), "--timeout"),
        (("site", "heartbeat", *conn, "--timeout", "inf"), "--timeout"),
        (("site", "register", *conn, "--name", "a\n"), "--name must be"),
        (("site", "register", *conn, "--name", "a", "--label", "=x"), "--label"),
        (("site", "status", "--registry", "no-port", "--token", token, "--insecure"), "--registry"),
        (("site", "status", "--registry", address, "--token", token, "--tls-ca", tmp_path / "not.pem"), "not PEM"),
        (("site", "status", "--registry", address, "--token", token, "--tls-ca", tmp_path), "--tls-ca"),
        (("site", "publish", *conn), "give --predictor"),
    ]
    for argv, fragment in cases:
        rc, _, err = run(*argv)
        one_error_line(rc, err, fragment)
