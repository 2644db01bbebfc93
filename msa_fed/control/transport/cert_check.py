"""Warnings about the registry's own certificate, given when it starts.

A registry serves an expired (or not yet valid) certificate without complaint; every client
then fails its TLS handshake with an UNAVAILABLE that does not say why.  The start-up line says
it instead, with the dates, and warns ahead of expiry.
"""

from __future__ import annotations

import datetime as dt

#: warn this long before the certificate expires
EXPIRY_WARNING = dt.timedelta(days=14)


def certificate_warnings(cert_chain: bytes, flag: str = "--tls-cert", now: dt.datetime | None = None) -> list[str]:
    """Lines about the leaf certificate (the first of the PEM chain) that an operator must act on."""
    from cryptography import x509

    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        cert = x509.load_pem_x509_certificate(cert_chain)
    except ValueError:
        return [f"warning: {flag}: the first PEM block is not an X.509 certificate that can be read"]
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    when = end.strftime("%Y-%m-%dT%H:%M:%SZ")
    if now > end:
        return [
            f"warning: {flag}: the registry's certificate expired at {when}; every client will refuse "
            "the connection: renew it and restart the registry"
        ]
    if now < start:
        return [
            f"warning: {flag}: the registry's certificate is not valid before "
            f"{start.strftime('%Y-%m-%dT%H:%M:%SZ')} (a clock or a date is wrong); clients will refuse it until then"
        ]
    if end - now < EXPIRY_WARNING:
        return [f"warning: {flag}: the registry's certificate expires at {when}; renew it before then"]
    return []
