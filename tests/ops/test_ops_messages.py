"""Errors an operator meets at start-up say what to do: a registry database on a read-only
filesystem is not called a damaged database."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from ops_helpers import env


def test_a_read_only_filesystem_is_named_as_such(tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], check=False).returncode != 0:
        pytest.skip("needs a private mount namespace (unshare -m, root) to mount a read-only filesystem")
    folder = tmp_path / "ro"
    folder.mkdir()
    script = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {folder} && exec {sys.executable} -m msa_fed.cli registry serve "
        f"--db {folder}/registry.db --listen 127.0.0.1:0 --insecure"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: --db '{folder}/registry.db' cannot be written: '{folder}' is read-only")
    assert "not a usable SQLite database" not in proc.stderr and proc.stderr.count("\n") == 1


def _self_signed(folder, not_before, not_after):
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "registry")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + not_before)
        .not_valid_after(now + not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder / "cert.pem", folder / "key.pem"


def test_an_expired_server_certificate_is_warned_about_at_start(tmp_path):
    import datetime as dt

    from ops_helpers import Lines

    cert, key = _self_signed(tmp_path, dt.timedelta(days=-30), dt.timedelta(days=-1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "msa_fed.cli", "registry", "serve", "--db", str(tmp_path / "r.db")]
        + ["--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
    )
    out = Lines(proc.stdout)
    try:
        out.wait_for("registry listening on", timeout=120)
    finally:
        proc.terminate()
        proc.wait(60)
    first = out.lines[0]
    assert first.startswith("warning: --tls-cert: the registry's certificate expired at 20"), out.text()
    assert "renew it and restart the registry" in first


def test_certificate_warnings_ahead_of_expiry_and_before_validity(tmp_path):
    import datetime as dt

    from msa_fed.control.transport.cert_check import certificate_warnings

    soon, _ = _self_signed(tmp_path, dt.timedelta(days=-1), dt.timedelta(days=3))
    assert "expires at" in certificate_warnings(soon.read_bytes())[0]
    later, _ = _self_signed(tmp_path, dt.timedelta(days=2), dt.timedelta(days=300))
    assert "is not valid before" in certificate_warnings(later.read_bytes())[0]
    fine, _ = _self_signed(tmp_path, dt.timedelta(days=-1), dt.timedelta(days=300))
    assert certificate_warnings(fine.read_bytes()) == []
