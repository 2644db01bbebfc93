"""End-to-end sealing of job traffic: the registry relays frames it can neither read nor forge.

Keys (standard constructions of ``cryptography``; nothing here is a new scheme):

- a **site key** (``msa-fed site keygen``): an Ed25519 signing key and an X25519 agreement key,
  kept by the site (one PEM file, mode 0600).  Its public half (:class:`SitePublicKey`, one line
  of text) is registered with the registry as the site's ``seal_key`` label; what the consortium
  agrees on is its **fingerprint**, the sha256 of the public bytes, pinned in every job file.
- the consortium's **job key** (``msa-fed job keygen``): an Ed25519 key held by whoever may run
  jobs (the coordinator's operator, not the registry).  Sites pin its fingerprint
  (``job_keys`` in site.toml).
- per run, the job draws an ephemeral X25519 key and has the job key sign a
  :class:`JobCertificate`: the job id, the job's content (:func:`job_content`: its sites with
  their key fingerprints and published-sample digests, task, feature map, mu, objective, the
  number of queries planned) and the ephemeral public key.

Frames.  For each (job, site) both sides derive two keys with HKDF-SHA256 from the X25519 secret
of the job's ephemeral key and the site's agreement key (salt: the certificate's sha256; info:
the site's name and key and the direction).  Each request and answer is sealed with
ChaCha20-Poly1305 under a fresh random 96-bit nonce that the frame carries (``os.urandom``; never
derived from a counter or any state a restart, a crash or an upgrade could lose, so no (key,
nonce) pair is used twice: the chance that two of 2^32 frames under one key draw the same nonce
is below 2^-32); the associated data are the direction, sequence number, job id, site name and
certificate digest.  So a frame cannot be read without a party's private key, changed, moved to
another job or site, or turned around; the site accepts each sequence number once and in
increasing order (no replay, no reordering) and, through ``remember``, keeps the last one it took
on disk before it answers, so a restarted site refuses what an earlier process took ("replayed");
the job accepts only the answer to the sequence number it sent.  Every answer is also signed with the
site's Ed25519 key over (certificate digest, site, sequence number, request digest, answer
digest): the job keeps these signatures (:class:`JobSealer.transcript`) with the combined
model, so a site that lied is attributable (:func:`verify_transcript`).

This module is pure (no gRPC): the relay carries its frames as opaque bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from msa_fed.errors import ConfigError, SiteError

VERSION = b"msa-fed-seal-v1"
SITE_KEY_PREFIX = "msa-fed-site-key-v1:"
JOB_KEY_PREFIX = "msa-fed-job-key-v1:"
#: the site label under which the registry stores a site's public sealing key
SEAL_KEY_LABEL = "seal_key"
MAGIC = b"MSAS\x02"  # v2: the frame carries its random nonce
TO_SITE, TO_JOB = 1, 2
NONCE_BYTES = 12
_HEADER = len(MAGIC) + 1 + 8 + NONCE_BYTES + 4
MAX_CERT_BYTES = 1 << 16


class TamperedError(SiteError):
    """A frame between the job and ``site`` failed its checks: altered, replayed, reordered, moved
    to another job, or not sealed at all.  One line naming the site and "tampered"."""

    def __init__(self, site: str, message: str):
        super().__init__(site, message if message.startswith("tampered") else f"tampered: {message}")


def fingerprint(public: bytes) -> str:
    """The sha256 (hex) of a public key's raw bytes: what a consortium pins."""
    return hashlib.sha256(public).hexdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ConfigError(f"{what} is not base64") from None


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


# ---------------------------------------------------------------------- key files
def _write_private(path, pem: bytes) -> Path:
    """Write a private key file readable by its owner only (0600 from creation; never replaced)."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{str(path)!r} exists; a key file is never overwritten (move it away first)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return path


def _read_private(path, what: str) -> list:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} not found")
    if path.stat().st_mode & 0o077:
        raise ConfigError(f"{what} {str(path)!r} is readable by others; chmod 600 it")
    text = path.read_bytes()
    blocks = [b"-----BEGIN" + part for part in text.split(b"-----BEGIN")[1:]]
    keys = []
    for block in blocks:
        try:
            keys.append(serialization.load_pem_private_key(block, password=None))
        except (ValueError, TypeError):
            raise ConfigError(f"{what} {str(path)!r} holds an unreadable key") from None
    return keys


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class SitePublicKey:
    """A site's public sealing key: Ed25519 (signatures) and X25519 (key agreement), 32 bytes each."""

    signing: bytes
    agreement: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.signing + self.agreement)

    def text(self) -> str:
        return SITE_KEY_PREFIX + _b64(self.signing + self.agreement)

    @classmethod
    def parse(cls, text: str, what: str = "site key") -> SitePublicKey:
        text = text.strip()
        if not text.startswith(SITE_KEY_PREFIX):
            raise ConfigError(f"{what} must start with {SITE_KEY_PREFIX!r}")
        raw = _unb64(text[len(SITE_KEY_PREFIX) :], what)
        if len(raw) != 64:
            raise ConfigError(f"{what} must hold 64 bytes; got {len(raw)}")
        return cls(raw[:32], raw[32:])

    def verifier(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.signing)


class SiteKey:
    """A site's private sealing key (see the module docstring)."""

    def __init__(self, signing: Ed25519PrivateKey, agreement: X25519PrivateKey):
        self.signing, self.agreement = signing, agreement
        self.public = SitePublicKey(signing.public_key().public_bytes_raw(), agreement.public_key().public_bytes_raw())

    @classmethod
    def generate(cls) -> SiteKey:
        return cls(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())

    def save(self, path) -> Path:
        """The private key to ``path`` (0600) and the public line to ``path.pub``."""
        path = _write_private(path, _pem(self.signing) + _pem(self.agreement))
        Path(str(path) + ".pub").write_text(self.public.text() + "\n")
        return path

    @classmethod
    def load(cls, path) -> SiteKey:
        keys = _read_private(path, "site key")
        if len(keys) != 2 or not isinstance(keys[0], Ed25519PrivateKey) or not isinstance(keys[1], X25519PrivateKey):
            raise ConfigError(f"site key {str(path)!r} must hold an Ed25519 and an X25519 key (msa-fed site keygen)")
        return cls(keys[0], keys[1])


class JobKey:
    """The consortium's job key: an Ed25519 key that signs every job's certificate."""

    def __init__(self, key: Ed25519PrivateKey):
        self.key = key
        self.public = key.public_key().public_bytes_raw()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def public_text(self) -> str:
        return JOB_KEY_PREFIX + _b64(self.public)

    @classmethod
    def generate(cls) -> JobKey:
        return cls(Ed25519PrivateKey.generate())

    def save(self, path) -> Path:
        path = _write_private(path, _pem(self.key))
        Path(str(path) + ".pub").write_text(self.public_text() + "\n")
        return path

    @classmethod
    def load(cls, path) -> JobKey:
        keys = _read_private(path, "job key")
        if len(keys) != 1 or not isinstance(keys[0], Ed25519PrivateKey):
            raise ConfigError(f"job key {str(path)!r} must hold one Ed25519 key (msa-fed job keygen)")
        return cls(keys[0])


# ---------------------------------------------------------------------- the job's content
def job_content(
    job_id: str,
    sites,
    *,
    task: str,
    loss: str,
    features: Any = None,
    mu: float | None = None,
    objective: str | None = None,
    planned_queries: int | None = None,
    min_points: int | None = None,
) -> dict:
    """What a site approves, as a JSON-able dict.

    sites : one dict per site, in the job's order, with ``name``, ``key_fingerprint`` (sealing
        key; "" for an unsealed job), ``sample_sha256`` and ``predictor_sha256``.
    planned_queries : the most labelled-data queries (DC evaluations and bounds) the job will send
        each site; a site refuses the next one."""
    out = {
        "job_id": str(job_id),
        "sites": [
            {
                "name": str(s["name"]),
                "key_fingerprint": str(s.get("key_fingerprint", "")),
                "sample_sha256": str(s.get("sample_sha256", "")),
                "predictor_sha256": str(s.get("predictor_sha256", "")),
            }
            for s in sites
        ],
        "task": str(task),
        "loss": str(loss),
        "features": features,
        "mu": None if mu is None else float(mu),
        "objective": objective,
        "planned_queries": None if planned_queries is None else int(planned_queries),
        "min_points": None if min_points is None else int(min_points),
    }
    json.dumps(out)  # JSON-able or a TypeError here, not at a site
    return out


def job_content_digest(content: dict) -> str:
    """The sha256 (hex) of a job's content (:func:`job_content`), canonical JSON: a job whose
    content differs in anything has another digest (and needs a new approval)."""
    return hashlib.sha256(_canonical(content)).hexdigest()


def describe_content(content: dict) -> list[str]:
    """A job's content in words, one line per fact (``msa-fed site jobs``)."""
    lines = [f"job {content.get('job_id')!r}: task {content.get('task')}, loss {content.get('loss')}"]
    for s in content.get("sites", []):
        key = s.get("key_fingerprint") or "(unsealed)"
        lines.append(
            f"  site {s.get('name')}: key {key[:16]}..., published sample {str(s.get('sample_sha256'))[:16]}..., "
            f"predictor {str(s.get('predictor_sha256'))[:16]}..."
        )
    lines.append(
        f"  feature map {content.get('features')!r}, mu {content.get('mu')!r}, objective {content.get('objective')!r}"
    )
    q = content.get("planned_queries")
    lines.append(f"  at most {q} labelled-data queries per site" if q is not None else "  no query count declared")
    return lines


# ---------------------------------------------------------------------- the job's certificate
@dataclass(frozen=True)
class JobCertificate:
    """A job's id, content and ephemeral X25519 key, signed by the consortium's job key."""

    body: bytes
    signature: bytes
    job_id: str
    content: dict
    agreement: bytes
    authority: bytes

    @cached_property
    def digest(self) -> bytes:  # computed once: every answer the site seals binds it
        return hashlib.sha256(self.encode()).digest()

    @property
    def content_digest(self) -> str:
        return job_content_digest(self.content)

    def encode(self) -> bytes:
        return len(self.body).to_bytes(4, "big") + self.body + self.signature

    @classmethod
    def issue(cls, key: JobKey, job_id: str, content: dict, agreement: bytes) -> JobCertificate:
        body = _canonical(
            {"v": 1, "job_id": job_id, "content": content, "agreement": _b64(agreement), "authority": _b64(key.public)}
        )
        return cls(body, key.key.sign(VERSION + b"|job|" + body), job_id, content, agreement, key.public)

    @classmethod
    def decode(cls, data: bytes, trusted: frozenset[str] | set[str]) -> JobCertificate:
        """Parse and verify a certificate; ``trusted``: the job-key fingerprints this party pins."""
        if len(data) < 4 + 64 or len(data) > MAX_CERT_BYTES:
            raise ValueError("malformed job certificate")
        n = int.from_bytes(data[:4], "big")
        if 4 + n + 64 != len(data):
            raise ValueError("malformed job certificate")
        body, signature = data[4 : 4 + n], data[4 + n :]
        try:
            doc = json.loads(body)
            authority = base64.b64decode(doc["authority"], validate=True)
            agreement = base64.b64decode(doc["agreement"], validate=True)
            job_id, content = str(doc["job_id"]), doc["content"]
        except (ValueError, KeyError, TypeError):
            raise ValueError("malformed job certificate") from None
        if doc.get("v") != 1 or len(authority) != 32 or len(agreement) != 32 or not isinstance(content, dict):
            raise ValueError("malformed job certificate")
        if fingerprint(authority) not in trusted:
            raise ValueError(
                f"the job is signed by job key {fingerprint(authority)[:16]}..., which this site does not pin"
            )
        try:
            Ed25519PublicKey.from_public_bytes(authority).verify(signature, VERSION + b"|job|" + body)
        except InvalidSignature:
            raise ValueError("the job certificate's signature does not verify") from None
        if content.get("job_id") != job_id:
            raise ValueError("the job certificate's content names another job")
        return cls(body, signature, job_id, content, agreement, authority)


def _keys(secret: bytes, cert_digest: bytes, site: str, site_key: SitePublicKey) -> tuple[bytes, bytes]:
    def derive(direction: int) -> bytes:
        info = VERSION + b"|" + site.encode() + b"|" + site_key.signing + site_key.agreement + bytes([direction])
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=cert_digest, info=info).derive(secret)

    return derive(TO_SITE), derive(TO_JOB)


def _aad(direction: int, seq: int, job_id: str, site: str, cert_digest: bytes) -> bytes:
    return b"|".join([VERSION, bytes([direction]), seq.to_bytes(8, "big"), job_id.encode(), site.encode(), cert_digest])


def _nonce() -> bytes:
    """A fresh random 96-bit nonce (carried in the frame): no counter a restart could reset."""
    return os.urandom(NONCE_BYTES)


def _frame(direction: int, seq: int, nonce: bytes, cert: bytes, ciphertext: bytes) -> bytes:
    return (
        MAGIC + bytes([direction]) + seq.to_bytes(8, "big") + nonce + len(cert).to_bytes(4, "big") + cert + ciphertext
    )


class Frame(NamedTuple):
    """A parsed frame: direction, sequence number, nonce, certificate bytes (requests) and ciphertext."""

    direction: int
    seq: int
    nonce: bytes
    cert: bytes
    ciphertext: bytes


def parse_frame(frame: bytes) -> Frame:
    """The parts of a frame (:class:`Frame`); ValueError if malformed."""
    if len(frame) < _HEADER + 16 or frame[: len(MAGIC)] != MAGIC:
        if frame[: len(MAGIC) - 1] == MAGIC[:-1]:
            raise ValueError(f"a frame of sealing version {frame[len(MAGIC) - 1]}, not {MAGIC[-1]} (upgrade both ends)")
        raise ValueError("not a sealed frame")
    at = len(MAGIC)
    direction = frame[at]
    seq = int.from_bytes(frame[at + 1 : at + 9], "big")
    nonce = frame[at + 9 : at + 9 + NONCE_BYTES]
    n = int.from_bytes(frame[_HEADER - 4 : _HEADER], "big")
    if n > MAX_CERT_BYTES or _HEADER + n + 16 > len(frame):
        raise ValueError("malformed sealed frame")
    return Frame(direction, seq, nonce, frame[_HEADER : _HEADER + n], frame[_HEADER + n :])


def _answer_message(cert_digest: bytes, site: str, seq: int, request_sha: bytes, answer_sha: bytes) -> bytes:
    return b"|".join([VERSION, b"answer", cert_digest, site.encode(), seq.to_bytes(8, "big"), request_sha, answer_sha])


# ---------------------------------------------------------------------- the job's side
class JobSealer:
    """The job's end: seals requests to each site and opens (and checks) their answers.

    key : the consortium's job key.  content : :func:`job_content` (its sites' key fingerprints
    are the pins).  site_keys : {site: SitePublicKey}, e.g. as the registry lists them; each must
    have the fingerprint the content pins, or this refuses to start."""

    def __init__(self, key: JobKey, content: dict, site_keys: dict[str, SitePublicKey]):
        self.job_id = str(content["job_id"])
        self.content = content
        pins = {s["name"]: s["key_fingerprint"] for s in content["sites"]}
        self.site_keys: dict[str, SitePublicKey] = {}
        for name, pin in pins.items():
            got = site_keys.get(name)
            if got is None:
                raise ConfigError(f"site {name!r} has no registered sealing key (msa-fed site register --seal-key)")
            if got.fingerprint != pin:
                raise ConfigError(
                    f"site {name!r}: the registry lists sealing key {got.fingerprint[:16]}..., not the pinned "
                    f"{pin[:16]}... (a changed key needs a new pin in the job file)"
                )
            self.site_keys[name] = got
        self._ephemeral = X25519PrivateKey.generate()
        self.certificate = JobCertificate.issue(
            key, self.job_id, content, self._ephemeral.public_key().public_bytes_raw()
        )
        self._cert = self.certificate.encode()
        self._digest = self.certificate.digest
        self._aeads: dict[str, tuple[ChaCha20Poly1305, ChaCha20Poly1305]] = {}
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.transcript: list[dict] = []
        self._checked = 0  # transcript entries whose signature was verified
        self._verifiers = {n: k.verifier() for n, k in self.site_keys.items()}

    def _aead(self, site: str) -> tuple[ChaCha20Poly1305, ChaCha20Poly1305]:
        pair = self._aeads.get(site)
        if pair is None:
            pub = self.site_keys[site]
            secret = self._ephemeral.exchange(X25519PublicKey.from_public_bytes(pub.agreement))
            k_in, k_out = _keys(secret, self._digest, site, pub)
            pair = self._aeads[site] = (ChaCha20Poly1305(k_in), ChaCha20Poly1305(k_out))
        return pair

    def seal(self, site: str, plaintext: bytes) -> tuple[bytes, int]:
        """(frame, sequence number) of one request to ``site``."""
        if site not in self.site_keys:
            raise ConfigError(f"site {site!r} is not a site of job {self.job_id!r}")
        with self._lock:
            seq = self._seq[site] = self._seq.get(site, 0) + 1
        to_site, _ = self._aead(site)
        nonce = _nonce()
        sealed = to_site.encrypt(nonce, plaintext, _aad(TO_SITE, seq, self.job_id, site, self._digest))
        return _frame(TO_SITE, seq, nonce, self._cert, sealed), seq

    def open(self, site: str, seq: int, frame: bytes, request: bytes, method: str = "") -> bytes:
        """The plaintext answer of ``site`` to request ``seq`` (whose plaintext was ``request``);
        :class:`TamperedError` unless it is exactly the site's sealed answer to that request.

        The seal (the AEAD keyed by the site's and the job's keys) is what protects the job from
        the relay, and is checked here; the site's signature inside it is evidence for third
        parties (only the site could have sealed it, but the job could have too), and is checked
        for all answers at once by :meth:`verify_signatures` (``record`` calls it): an Ed25519
        verification costs more than the rest of a frame's checks together."""
        try:
            direction, got, nonce, cert, ciphertext = parse_frame(frame)
        except ValueError as exc:
            raise TamperedError(site, f"tampered: its answer to {method or 'a request'} is {exc}") from None
        if direction != TO_JOB or cert:
            raise TamperedError(site, f"tampered: its answer to {method or 'a request'} is not an answer frame")
        if got != seq:
            raise TamperedError(
                site,
                f"tampered: answer {got} came back for request {seq} of {method or 'a request'} "
                "(replayed or reordered)",
            )
        _, from_site = self._aead(site)
        try:
            inner = from_site.decrypt(nonce, ciphertext, _aad(TO_JOB, seq, self.job_id, site, self._digest))
        except InvalidTag:
            raise TamperedError(
                site, f"tampered: its answer to {method or 'a request'} failed authentication"
            ) from None
        if len(inner) < 64:
            raise TamperedError(site, "tampered: an answer without its signature")
        signature, answer = inner[:64], inner[64:]
        request_sha, answer_sha = hashlib.sha256(request).digest(), hashlib.sha256(answer).digest()
        with self._lock:
            self.transcript.append(
                {
                    "site": site,
                    "seq": seq,
                    "method": method,
                    "request_sha256": request_sha.hex(),
                    "answer_sha256": answer_sha.hex(),
                    "signature": _b64(signature),
                }
            )
        return answer

    def verify_signatures(self) -> int:
        """Check the signature of every answer not checked yet; their number.  A site whose
        signature does not verify is named: :class:`TamperedError` (the job must not keep a
        transcript that does not attribute)."""
        with self._lock:
            todo, self._checked = self.transcript[self._checked :], len(self.transcript)
        for entry in todo:
            site = entry["site"]
            message = _answer_message(
                self._digest,
                site,
                entry["seq"],
                bytes.fromhex(entry["request_sha256"]),
                bytes.fromhex(entry["answer_sha256"]),
            )
            try:
                self._verifiers[site].verify(base64.b64decode(entry["signature"]), message)
            except InvalidSignature:
                raise TamperedError(
                    site,
                    f"tampered: its answer {entry['seq']} to {entry['method'] or 'a request'} carries a "
                    "signature its sealing key did not make",
                ) from None
        return len(todo)

    def record(self) -> dict:
        """The signed transcript, JSON-able: the certificate, the sites' public keys and one entry
        per answer (digests and signatures, never the answers: the registry stores this).  Every
        signature is checked first (:meth:`verify_signatures`)."""
        self.verify_signatures()
        with self._lock:
            answers = list(self.transcript)
        return {
            "certificate": _b64(self._cert),
            "job_key_fingerprint": fingerprint(self.certificate.authority),
            "content_digest": self.certificate.content_digest,
            "site_keys": {n: k.text() for n, k in self.site_keys.items()},
            "answers": answers,
        }


def verify_transcript(record: dict, trusted_job_keys=None) -> dict:
    """Check a job's signed transcript (:meth:`JobSealer.record`); {site: answers verified}.

    The certificate must verify (against ``trusted_job_keys`` fingerprints when given, else against
    the key it names, whose fingerprint the caller compares), each site key must have the
    fingerprint the signed content pins, and every answer's signature must verify.  ValueError
    naming the first entry that does not."""
    try:
        cert_bytes = _unb64(record["certificate"], "certificate")
        n = int.from_bytes(cert_bytes[:4], "big")
        authority = base64.b64decode(json.loads(cert_bytes[4 : 4 + n])["authority"])
    except (ConfigError, KeyError, ValueError, TypeError):
        raise ValueError("the transcript's certificate is malformed") from None
    trusted = set(trusted_job_keys) if trusted_job_keys else {fingerprint(authority)}
    cert = JobCertificate.decode(cert_bytes, frozenset(trusted))
    pins = {s["name"]: s["key_fingerprint"] for s in cert.content.get("sites", [])}
    keys = {}
    for name, text in record.get("site_keys", {}).items():
        key = SitePublicKey.parse(text, f"site key of {name!r}")
        if pins.get(name) != key.fingerprint:
            raise ValueError(f"site {name!r}: the transcript's key is not the one the job's content pins")
        keys[name] = key
    counts = {n: 0 for n in pins}
    for k, entry in enumerate(record.get("answers", []), 1):
        site = entry.get("site")
        if site not in keys:
            raise ValueError(f"answer {k}: site {site!r} is not a site of the job")
        message = _answer_message(
            cert.digest,
            site,
            int(entry["seq"]),
            bytes.fromhex(entry["request_sha256"]),
            bytes.fromhex(entry["answer_sha256"]),
        )
        try:
            keys[site].verifier().verify(base64.b64decode(entry["signature"]), message)
        except (InvalidSignature, ValueError):
            raise ValueError(
                f"answer {k} (site {site!r}, {entry.get('method')}): the signature does not verify"
            ) from None
        counts[site] += 1
    return counts


def check_model_transcript(manifest: dict, trusted_job_keys=None) -> tuple[bool, str]:
    """(verified, one line in words) for the signed transcript a combined model's manifest carries
    (``info.job.sealed_transcript``); (True, "no: ...") for a model of an unsealed job."""
    info = manifest.get("info") if isinstance(manifest, dict) else None
    job = info.get("job") if isinstance(info, dict) else None
    record = job.get("sealed_transcript") if isinstance(job, dict) else None
    if not manifest:
        return True, "-"
    if not isinstance(record, dict):
        return True, "no (the job's traffic was not sealed: no signed transcript)"
    try:
        counts = verify_transcript(record, trusted_job_keys)
    except (ValueError, ConfigError, KeyError, TypeError) as exc:
        return False, f"TRANSCRIPT DOES NOT VERIFY: {exc}"
    per_site = ", ".join(f"{n} {c}" for n, c in counts.items())
    return True, (
        f"yes: {sum(counts.values())} signed answers verified ({per_site}); job key "
        f"{record.get('job_key_fingerprint', '')[:16]}..., content digest {record.get('content_digest', '')}"
    )


# ---------------------------------------------------------------------- the site's side
@dataclass
class RequestSeal:
    """What the site keeps of one opened request to seal its answer."""

    job_id: str
    seq: int
    certificate: JobCertificate
    request: bytes
    aead: ChaCha20Poly1305 = field(repr=False)


class SiteOpener:
    """The site's end: opens requests (checking certificate, seal and sequence) and seals answers.

    name : the site's name.  key : its :class:`SiteKey`.  trusted_job_keys : the job-key
    fingerprints the site pins (whoever holds one of those keys may run jobs here).  floor :
    ``floor(certificate digest hex) -> int``, the last sequence number of a job that an earlier
    process of the site took (it and every earlier one are refused as "replayed").  remember :
    ``remember(certificate digest hex, seq)``, called with every request :meth:`open` accepts,
    before it returns: it must keep ``seq`` where ``floor`` finds it after a restart or a crash,
    or, with ``settle(digest hex, seq)`` (called by :meth:`seal` first, so before any answer
    leaves), only note it for ``settle`` to keep (:meth:`msa_fed.privacy.ledger.Ledger.keep_floor`)."""

    MAX_JOBS = 4096

    def __init__(self, name: str, key: SiteKey, trusted_job_keys, floor=None, remember=None, settle=None):
        self.name, self.key, self.floor, self.remember, self.settle = name, key, floor, remember, settle
        self.trusted = frozenset(trusted_job_keys)
        if not self.trusted:
            raise ConfigError("a sealed site pins at least one job key (job_keys in site.toml)")
        self._sessions: dict[bytes, tuple[JobCertificate, ChaCha20Poly1305, ChaCha20Poly1305]] = {}
        self._last: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def _session(self, cert_bytes: bytes, job_id: str):
        digest = hashlib.sha256(cert_bytes).digest()
        with self._lock:
            found = self._sessions.get(digest)
        if found is not None:
            return digest, found
        try:
            cert = JobCertificate.decode(cert_bytes, self.trusted)
        except ValueError as exc:
            raise TamperedError(self.name, f"tampered: job {job_id!r}: {exc}") from None
        if cert.job_id != job_id:
            raise TamperedError(
                self.name, f"tampered: a frame of job {cert.job_id[:64]!r} was relayed as job {job_id[:64]!r}"
            )
        mine = [s for s in cert.content.get("sites", []) if s.get("name") == self.name]
        if len(mine) != 1 or mine[0].get("key_fingerprint") != self.key.public.fingerprint:
            raise TamperedError(self.name, f"tampered: job {job_id!r} does not pin this site's sealing key")
        secret = self.key.agreement.exchange(X25519PublicKey.from_public_bytes(cert.agreement))
        k_in, k_out = _keys(secret, digest, self.name, self.key.public)
        found = (cert, ChaCha20Poly1305(k_in), ChaCha20Poly1305(k_out))
        with self._lock:
            if len(self._sessions) >= self.MAX_JOBS:
                self._sessions.clear()  # never grows without bound; a cleared job re-derives its keys
            self._sessions[digest] = found
        return digest, found

    def open(self, job_id: str, frame: bytes) -> tuple[RequestSeal, bytes]:
        """(what seals the answer, the request's plaintext); :class:`TamperedError` otherwise."""
        try:
            direction, seq, nonce, cert_bytes, ciphertext = parse_frame(frame)
        except ValueError as exc:
            raise TamperedError(self.name, f"tampered: a request of job {job_id[:64]!r} is {exc}") from None
        if direction != TO_SITE or not cert_bytes:
            raise TamperedError(self.name, f"tampered: a request of job {job_id[:64]!r} is not a request frame")
        digest, (cert, to_site, from_site) = self._session(cert_bytes, job_id)
        if cert.job_id != job_id:
            raise TamperedError(
                self.name, f"tampered: a frame of job {cert.job_id[:64]!r} was relayed as job {job_id[:64]!r}"
            )
        try:
            plaintext = to_site.decrypt(nonce, ciphertext, _aad(TO_SITE, seq, job_id, self.name, digest))
        except InvalidTag:
            raise TamperedError(self.name, f"tampered: a request of job {job_id!r} failed authentication") from None
        with self._lock:
            last = self._last.get(digest)
            if last is None:
                last = int(self.floor(digest.hex())) if self.floor is not None else 0
            if seq <= last:
                raise TamperedError(
                    self.name,
                    f"tampered: request {seq} of job {job_id!r} is replayed or reordered: this site "
                    f"took request {last} of the job already, and takes each request once, in order",
                )
            if self.remember is not None:  # on disk before the answer is made, let alone sent
                self.remember(digest.hex(), seq)
            self._last[digest] = seq
        return RequestSeal(job_id, seq, cert, plaintext, from_site), plaintext

    def seal(self, ctx: RequestSeal, answer: bytes) -> bytes:
        """The sealed, signed frame of the answer to the request ``ctx`` was opened from."""
        digest = ctx.certificate.digest
        if self.settle is not None:  # the request's sequence number on disk before its answer exists
            self.settle(digest.hex(), ctx.seq)
        signature = self.key.signing.sign(
            _answer_message(
                digest, self.name, ctx.seq, hashlib.sha256(ctx.request).digest(), hashlib.sha256(answer).digest()
            )
        )
        nonce = _nonce()
        sealed = ctx.aead.encrypt(nonce, signature + answer, _aad(TO_JOB, ctx.seq, ctx.job_id, self.name, digest))
        return _frame(TO_JOB, ctx.seq, nonce, b"", sealed)

    def forget(self, job_id: str) -> None:
        """Drop the keys of a finished job (its sequence numbers stay: an old frame stays refused)."""
        with self._lock:
            for digest, (cert, _, _) in list(self._sessions.items()):
                if cert.job_id == job_id:
                    del self._sessions[digest]
