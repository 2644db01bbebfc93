"""The privacy audit of recorded boundary messages (DESIGN.md section 4)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import numpy as np

from msa_fed.core.dc_terms import DCSums
from msa_fed.boundary import messages as m

COUNTS = ("n_labeled", "n_unlabeled")  # counts, not data
SCALARS = (int, float, str, bool, np.integer, np.floating, type(None))


def _leaves(value, path):
    """(path, leaf) for every leaf of a message: arrays, scalars, and anything else."""
    if isinstance(value, np.ndarray) or isinstance(value, SCALARS):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(value, (m.Message, DCSums)) and is_dataclass(value):
        for f in fields(value):
            if not f.name.startswith("_"):
                yield from _leaves(getattr(value, f.name), f"{path}.{f.name}")
    else:
        yield path, value


CERT_FIELDS = ("cert", "peer_cert")  # the data channel's ephemeral certificates (public)


def _is_certificate(text) -> bool:
    """ "" or exactly one PEM X.509 certificate (nothing else hidden in the text)."""
    if text == "":
        return True
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        return False
    from cryptography.hazmat.primitives.serialization import Encoding

    return len(certs) == 1 and certs[0].public_bytes(Encoding.PEM).decode("ascii") == text


def audit(records, n_labeled: dict[str, int]) -> list[str]:
    """Every violation of the privacy contract in ``records`` (Recorder.records); [] if none.

    - every message is one of the boundary types;
    - no array anywhere has a dimension equal to a site's number of labelled points;
    - no field of any message type names labels or targets;
    - nothing but arrays and plain scalars (no opaque objects that could hide data);
    - what a site answers carries no integer arrays except the public class list of its predictor;
    - certificate fields hold exactly one PEM certificate each.
    """
    bad = []
    sizes = set(n_labeled.values())
    for direction, site, method, msg in records:
        where = f"{direction} {site}.{method}"
        if msg is None and direction == "to_site":  # a request without payload (info, ping)
            continue
        if not isinstance(msg, m.REQUEST_TYPES + m.RESPONSE_TYPES):
            bad.append(f"{where}: {type(msg).__name__} is not a boundary message type")
            continue
        for f in fields(msg):
            if f.name.lower().startswith("y") or ("label" in f.name.lower() and f.name not in COUNTS):
                bad.append(f"{where}: field {f.name!r} names labels")
        for f in fields(msg):
            if f.name in CERT_FIELDS and not _is_certificate(getattr(msg, f.name)):
                bad.append(f"{where}: field {f.name!r} is not exactly one PEM certificate")
        for path, leaf in _leaves(msg, type(msg).__name__):
            if isinstance(leaf, np.ndarray):
                if sizes & set(leaf.shape):
                    bad.append(f"{where}: {path} has shape {leaf.shape}, a site's number of labelled points")
                if direction == "from_site" and leaf.dtype.kind in "iub" and not path.endswith(".classes"):
                    bad.append(f"{where}: {path} is an integer array ({leaf.dtype})")
                if leaf.dtype == object:
                    bad.append(f"{where}: {path} is an object array")
            elif not isinstance(leaf, SCALARS):
                bad.append(f"{where}: {path} is an opaque {type(leaf).__name__}")
    return bad
