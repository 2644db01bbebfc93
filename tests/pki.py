"""Throwaway test certificates (EC P-256, valid for a day): a CA and leaves it signs, the one
builder of the control-plane and the federation tests."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _valid_for_a_day(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def new_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate named ``common_name`` (it may sign certificates and CRLs), and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
    cert = (
        _valid_for_a_day(builder.public_key(key.public_key()))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def leaf(ca_cert, ca_key, cn: str, usage: str, san) -> tuple[bytes, bytes]:
    """PEM (certificate, key) for ``cn`` (usage "server" or "client") with subjectAltNames ``san``
    (a list of x509 general names, or None), signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if usage == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _valid_for_a_day(x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject))
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key(key)


def pem_key(key) -> bytes:
    """A private key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
