"""The sealing of job traffic (msa_fed.crypto.sealing), without any network: the job's and the
site's ends exchange frames, and a hostile relay between them alters, replays, reorders, moves
and forges frames; each is refused by the receiver with "tampered" naming the site."""

from __future__ import annotations

import os
import stat

import pytest

from msa_fed.crypto.sealing import (
    JobCertificate,
    JobKey,
    JobSealer,
    SiteKey,
    SiteOpener,
    SitePublicKey,
    TamperedError,
    job_content,
    job_content_digest,
    parse_frame,
    verify_transcript,
)
from msa_fed.errors import ConfigError

SITES = ("north", "east")


@pytest.fixture(scope="module")
def keys():
    return {n: SiteKey.generate() for n in SITES}, JobKey.generate()


def _content(keys, job_id="job-1", **kw):
    site_keys, _ = keys
    sites = [
        dict(
            name=n, key_fingerprint=site_keys[n].public.fingerprint, sample_sha256="ab" * 32, predictor_sha256="cd" * 32
        )
        for n in SITES
    ]
    kw = {"task": "classification", "loss": "cross_entropy", "mu": 1e-3, "objective": "minmax", **kw}
    return job_content(job_id, sites, planned_queries=50, **kw)


def _ends(keys, job_id="job-1"):
    site_keys, job_key = keys
    sealer = JobSealer(job_key, _content(keys, job_id), {n: k.public for n, k in site_keys.items()})
    openers = {n: SiteOpener(n, site_keys[n], {job_key.fingerprint}) for n in SITES}
    return sealer, openers


def _round_trip(sealer, opener, site, request=b"request bytes", answer=b"answer bytes"):
    frame, seq = sealer.seal(site, request)
    ctx, got = opener.open(sealer.job_id, frame)
    assert got == request
    back = opener.seal(ctx, answer)
    return sealer.open(site, seq, back, request, "dc_evaluate"), frame, back, seq


def test_round_trip_and_nothing_in_the_clear(keys):
    sealer, openers = _ends(keys)
    secret = b"z=0.3141592653589793 aggregate 2.718281828459045" * 4
    answer, frame, back, _ = _round_trip(sealer, openers["north"], "north", request=secret, answer=secret[::-1])
    assert answer == secret[::-1]
    assert secret not in frame and secret[::-1] not in back and secret[:16] not in frame + back
    # the same plaintext sealed twice gives two different frames (sequence numbers and nonces)
    f1, _ = sealer.seal("east", b"same")
    f2, _ = sealer.seal("east", b"same")
    assert f1 != f2 and parse_frame(f1).nonce != parse_frame(f2).nonce


def test_no_nonce_is_used_twice_under_a_key_even_for_the_same_request_answered_again(keys):
    """The nonce is drawn at random for every frame and carried in it: the same request opened by
    two site processes with no memory of each other (a restart that lost everything) and answered
    twice gives two answers under one key with different nonces, and XOR of the two ciphertexts
    with the known second answer does not give the first."""
    sealer, _ = _ends(keys)
    frame, seq = sealer.seal("north", b"the request")
    first = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint})
    again = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint})  # no floor: a lost disk
    secret = b"Qhat partial 0.123456789 0.987654321 exact L values"
    known = b"SiteStateLost: no state for the job (restarted?) ..."[: len(secret)]
    ctx1, _ = first.open(sealer.job_id, frame)
    ctx2, _ = again.open(sealer.job_id, frame)
    a1, a2 = parse_frame(first.seal(ctx1, secret)), parse_frame(again.seal(ctx2, known))
    assert a1.nonce != a2.nonce and len(a1.nonce) == 12
    recovered = bytes(x ^ y ^ z for x, y, z in zip(a1.ciphertext[64:], a2.ciphertext[64:], known))
    assert recovered != secret and secret[:8] not in recovered
    # positive control: the same XOR under one nonce (the old sealing) recovers every byte
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    aead, nonce = ChaCha20Poly1305(os.urandom(32)), os.urandom(12)
    c1, c2 = aead.encrypt(nonce, secret, b""), aead.encrypt(nonce, known, b"")
    assert bytes(x ^ y ^ z for x, y, z in zip(c1, c2, known)) == secret
    # many frames, many nonces, none twice
    nonces = {parse_frame(sealer.seal("east", b"x")[0]).nonce for _ in range(2000)}
    assert len(nonces) == 2000
    # an altered nonce fails authentication; a frame of the old format is named as such
    bad = bytearray(frame)
    bad[15] ^= 0x01
    with pytest.raises(TamperedError, match="failed authentication"):
        SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}).open(sealer.job_id, bytes(bad))
    old = b"MSAS\x01" + frame[5:]
    with pytest.raises(TamperedError, match="sealing version 1"):
        SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}).open(sealer.job_id, old)


def test_keys_on_disk_are_private_and_pinned_by_fingerprint(tmp_path, keys):
    key = SiteKey.generate()
    path = key.save(tmp_path / "site.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    public = SitePublicKey.parse((tmp_path / "site.key.pub").read_text())
    assert public == key.public and len(public.fingerprint) == 64
    assert SiteKey.load(path).public == key.public
    with pytest.raises(ConfigError, match="never overwritten"):
        key.save(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        SiteKey.load(path)
    job = JobKey.generate()
    jpath = job.save(tmp_path / "job.key")
    assert stat.S_IMODE(os.stat(jpath).st_mode) == 0o600 and JobKey.load(jpath).fingerprint == job.fingerprint
    # the job refuses a registry's key that is not the pinned one
    site_keys, job_key = keys
    listed = {n: k.public for n, k in site_keys.items()} | {"east": SiteKey.generate().public}
    with pytest.raises(ConfigError, match="not the pinned"):
        JobSealer(job_key, _content(keys), listed)


def test_content_digest_changes_with_every_field(keys):
    base = _content(keys)
    digest = job_content_digest(base)
    assert digest == job_content_digest(_content(keys))
    for change in (dict(mu=1e-2), dict(objective="gamma"), dict(features="rff"), dict(task="regression")):
        assert job_content_digest(_content(keys, **change)) != digest
    other = _content(keys)
    other["sites"][1]["sample_sha256"] = "ee" * 32
    assert job_content_digest(other) != digest
    assert job_content_digest(_content(keys, job_id="job-2")) != digest


def test_an_altered_byte_anywhere_is_detected(keys):
    sealer, openers = _ends(keys)
    frame, _ = sealer.seal("north", b"q" * 100)
    for at in (0, 6, 12, len(frame) // 2, len(frame) - 1):
        bad = bytearray(frame)
        bad[at] ^= 0x01
        fresh = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint})
        with pytest.raises(TamperedError, match="site 'north': tampered"):
            fresh.open(sealer.job_id, bytes(bad))
    # an answer altered on its way back
    frame, seq = sealer.seal("north", b"q")
    ctx, _ = openers["north"].open(sealer.job_id, frame)
    back = bytearray(openers["north"].seal(ctx, b"a" * 50))
    back[-5] ^= 0x80
    with pytest.raises(TamperedError, match="site 'north': tampered"):
        sealer.open("north", seq, bytes(back), b"q")


def test_replay_reorder_and_turned_around_frames_are_refused(keys):
    sealer, openers = _ends(keys)
    site = openers["north"]
    first, seq1 = sealer.seal("north", b"one")
    second, seq2 = sealer.seal("north", b"two")
    ctx2, _ = site.open(sealer.job_id, second)  # delivered out of order ...
    with pytest.raises(TamperedError, match="replayed or reordered"):
        site.open(sealer.job_id, first)  # ... so the earlier one is refused
    with pytest.raises(TamperedError, match="replayed or reordered"):
        site.open(sealer.job_id, second)  # replayed
    answer2 = site.seal(ctx2, b"answer two")
    with pytest.raises(TamperedError, match="replayed or reordered"):
        sealer.open("north", seq1, answer2, b"one")  # an answer to another request
    assert sealer.open("north", seq2, answer2, b"two") == b"answer two"
    with pytest.raises(TamperedError):
        site.open(sealer.job_id, answer2)  # an answer sent back as a request
    # an old answer replayed for a later request
    third, seq3 = sealer.seal("north", b"three")
    site.open(sealer.job_id, third)
    with pytest.raises(TamperedError, match="replayed or reordered"):
        sealer.open("north", seq3, answer2, b"three")


def test_frames_cannot_move_to_another_job_or_site(keys):
    sealer_a, openers = _ends(keys, "job-a")
    sealer_b, _ = _ends(keys, "job-b")
    frame, _ = sealer_a.seal("north", b"x")
    with pytest.raises(TamperedError, match="relayed as job 'job-b'"):
        openers["north"].open("job-b", frame)
    # a frame for north delivered to east
    with pytest.raises(TamperedError, match="site 'east': tampered"):
        openers["east"].open("job-a", frame)
    # job b's answer key cannot open job a's answers
    frame_b, seq_b = sealer_b.seal("north", b"y")
    ctx, _ = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}).open("job-b", frame_b)
    answer_b = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}).seal(ctx, b"ans")
    _, seq_a = sealer_a.seal("north", b"z")
    with pytest.raises(TamperedError):
        sealer_a.open("north", seq_b, answer_b, b"z")


def test_a_relay_cannot_make_a_job_of_its_own(keys):
    """The registry's forgeries: its own job key (not pinned), or a genuine certificate with its
    own ciphertext, or a genuine certificate whose content it edits."""
    site_keys, job_key = keys
    opener = SiteOpener("north", site_keys["north"], {job_key.fingerprint})
    rogue = JobSealer(JobKey.generate(), _content(keys), {n: k.public for n, k in site_keys.items()})
    frame, _ = rogue.seal("north", b"inject")
    with pytest.raises(TamperedError, match="does not pin"):
        opener.open("job-1", frame)
    sealer, _ = _ends(keys)
    real, _ = sealer.seal("north", b"real")
    _, _, _, cert, ciphertext = parse_frame(real)
    forged = real[: len(real) - len(ciphertext)] + os.urandom(len(ciphertext))
    with pytest.raises(TamperedError, match="failed authentication"):
        opener.open("job-1", forged)
    edited = cert.replace(b'"minmax"', b'"gamma!"')
    assert edited != cert
    with pytest.raises(TamperedError, match="signature does not verify"):
        SiteOpener("north", site_keys["north"], {job_key.fingerprint}).open("job-1", real.replace(cert, edited))
    with pytest.raises(ValueError):
        JobCertificate.decode(b"\x00" * 10, {job_key.fingerprint})


def test_the_signed_transcript_verifies_and_attributes(keys):
    sealer, openers = _ends(keys)
    for site in SITES:
        for k in range(3):
            _round_trip(sealer, openers[site], site, request=f"req {k}".encode(), answer=f"{site} says {k}".encode())
    record = sealer.record()
    assert verify_transcript(record) == {"north": 3, "east": 3}
    assert verify_transcript(record, {keys[1].fingerprint}) == {"north": 3, "east": 3}
    with pytest.raises(ValueError, match="does not pin"):
        verify_transcript(record, {"00" * 32})
    # a changed answer digest no longer carries the site's signature
    bad = dict(record, answers=[dict(a) for a in record["answers"]])
    bad["answers"][4]["answer_sha256"] = "00" * 32
    with pytest.raises(ValueError, match="answer 5 .*east.*does not verify"):
        verify_transcript(bad)
    # a site key swapped into the transcript is not the pinned one
    swapped = dict(record, site_keys={**record["site_keys"], "east": SiteKey.generate().public.text()})
    with pytest.raises(ValueError, match="not the one the job's content pins"):
        verify_transcript(swapped)


def test_a_site_answer_not_signed_by_its_key_is_named_before_the_transcript_is_kept(keys):
    """A site that seals with its agreement key but signs with another key: the seal opens (the
    relay did nothing), the signature does not verify, and the job names the site before it keeps
    a transcript that would not attribute the answer."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    sealer, _ = _ends(keys)
    real = keys[0]["east"]
    liar = SiteOpener("east", SiteKey(Ed25519PrivateKey.generate(), real.agreement), {keys[1].fingerprint})
    liar.key.public = real.public  # it claims the pinned key
    answer, _, _, _ = _round_trip(sealer, liar, "east", answer=b"a lie")
    assert answer == b"a lie"
    with pytest.raises(TamperedError, match="site 'east': tampered: its answer 1 .* signature"):
        sealer.record()


def test_a_floor_from_disk_refuses_what_an_earlier_process_saw(keys):
    sealer, _ = _ends(keys)
    frames = [sealer.seal("north", f"r{k}".encode()) for k in range(3)]
    floors = {}
    restarted = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}, floor=lambda d: floors.get(d, 0))
    floors[sealer.certificate.digest.hex()] = 2  # an earlier process served request 2
    for frame, _ in frames[:2]:
        with pytest.raises(TamperedError, match="replayed or reordered"):
            restarted.open(sealer.job_id, frame)
    ctx, plain = restarted.open(sealer.job_id, frames[2][0])
    assert plain == b"r2" and ctx.seq == 3


def test_every_request_taken_is_on_disk_before_open_returns_and_a_restart_refuses_it(tmp_path, keys):
    """The site keeps each job's last request in its job book (SQLite) as it opens it, before any
    answer is made: a new process on the same book (a restart, or a crash right after the
    request was opened) refuses every frame the earlier one took, saying "replayed"."""
    from msa_fed.site.job_book import JobBook

    sealer, _ = _ends(keys)
    frames = [sealer.seal("north", f"r{k}".encode())[0] for k in range(5)]
    book = JobBook(tmp_path / "jobs.sqlite")
    seen = []

    def remember(digest, seq):
        book.set_seal_floor(digest, seq)
        seen.append(JobBook(tmp_path / "jobs.sqlite").seal_floor(digest))  # another reader sees it now

    site = SiteOpener("north", keys[0]["north"], {keys[1].fingerprint}, floor=book.seal_floor, remember=remember)
    for frame in frames[:4]:
        site.open(sealer.job_id, frame)
    assert seen == [1, 2, 3, 4]
    book.close()  # the process dies
    book = JobBook(tmp_path / "jobs.sqlite")
    restarted = SiteOpener(
        "north", keys[0]["north"], {keys[1].fingerprint}, floor=book.seal_floor, remember=book.set_seal_floor
    )
    for frame in frames[:4]:
        with pytest.raises(TamperedError, match="replayed"):
            restarted.open(sealer.job_id, frame)
    ctx, plain = restarted.open(sealer.job_id, frames[4])
    assert plain == b"r4" and book.seal_floor(sealer.certificate.digest.hex()) == 5


def _ledger_site(tmp_path, keys, book=None):
    """The site's opener as a site process wires it (:func:`sealing_opener` with its ledger file),
    its ledger and its audit log; the ledger's SQL statements counted in ``statements``."""
    from types import SimpleNamespace

    from msa_fed.federation.site_sealing import sealing_opener
    from msa_fed.privacy.audit import AuditLog
    from msa_fed.privacy.ledger import Ledger

    site_keys, job_key = keys
    path = tmp_path / "north.key"
    if not path.exists():
        site_keys["north"].save(path)
    config = SimpleNamespace(name="north", seal_key=str(path), job_keys={job_key.fingerprint}, allow_unsealed=False)
    ledger = Ledger(str(tmp_path / "ledger.sqlite"))
    statements: list[str] = []
    ledger._db.set_trace_callback(statements.append)
    audit = AuditLog(str(tmp_path / "audit.jsonl"), ledger=ledger)
    return sealing_opener(config, book, ledger), ledger, audit, statements


def _floor_on_disk(tmp_path, sealer) -> int:
    from msa_fed.privacy.ledger import Ledger

    other = Ledger(str(tmp_path / "ledger.sqlite"))  # another reader: what a restarted site finds
    try:
        return other.seal_floor("north:" + sealer.certificate.digest.hex())
    finally:
        other.close()


def test_a_sealed_request_s_floor_is_committed_with_its_audit_record_in_one_commit(tmp_path, keys):
    """A site with a ledger file keeps each request's sequence number in the transaction that
    commits the request's audit record: one commit per request, and on disk before the answer
    is sealed; a request answered without a record of its own (a rare path) commits it as it is
    sealed.  A restarted site refuses every request whose answer left."""
    sealer, _ = _ends(keys)
    opener, ledger, audit, statements = _ledger_site(tmp_path, keys)
    frames = []
    for k in range(3):
        frame, seq = sealer.seal("north", f"r{k}".encode())
        frames.append(frame)
        statements.clear()
        ctx, plain = opener.open(sealer.job_id, frame)
        assert plain == f"r{k}".encode() and _floor_on_disk(tmp_path, sealer) == k  # taken, not committed yet
        audit.append({"site": "north", "job": sealer.job_id, "request": "dc_evaluate"}, [("dc_evaluation", 1)])
        assert _floor_on_disk(tmp_path, sealer) == k + 1  # committed with the record
        back = opener.seal(ctx, b"answer")
        assert sealer.open("north", seq, back, plain, "dc_evaluate") == b"answer"
        assert [s for s in statements if s == "COMMIT"] == ["COMMIT"], statements  # one commit for the request
    # the rare path: an answer with no record of its own since the request was taken
    frame, seq = sealer.seal("north", b"r3")
    frames.append(frame)
    ctx, plain = opener.open(sealer.job_id, frame)
    assert _floor_on_disk(tmp_path, sealer) == 3
    back = opener.seal(ctx, b"answer")
    assert _floor_on_disk(tmp_path, sealer) == 4  # before the answer's frame existed
    assert sealer.open("north", seq, back, plain, "dc_evaluate") == b"answer"
    ledger.close()
    audit.close()
    restarted, ledger, audit, _ = _ledger_site(tmp_path, keys)
    for frame in frames:
        with pytest.raises(TamperedError, match="replayed"):
            restarted.open(sealer.job_id, frame)
    ledger.close()
    audit.close()


def test_a_floor_the_job_book_kept_before_is_still_a_floor(tmp_path, keys):
    """A site whose seal floors were kept in its job book (before its ledger kept them) still
    refuses what it took then; what it takes now goes to the ledger."""
    from msa_fed.site.job_book import JobBook

    sealer, _ = _ends(keys)
    frames = [sealer.seal("north", f"r{k}".encode())[0] for k in range(4)]
    book = JobBook(tmp_path / "jobs.sqlite")
    book.set_seal_floor(sealer.certificate.digest.hex(), 2)
    opener, ledger, audit, _ = _ledger_site(tmp_path, keys, book)
    for frame in frames[:2]:
        with pytest.raises(TamperedError, match="replayed"):
            opener.open(sealer.job_id, frame)
    ctx, plain = opener.open(sealer.job_id, frames[2])
    opener.seal(ctx, b"answer")
    assert plain == b"r2" and _floor_on_disk(tmp_path, sealer) == 3
    assert book.seal_floor(sealer.certificate.digest.hex()) == 2
    ledger.close()
    audit.close()
    book.close()
