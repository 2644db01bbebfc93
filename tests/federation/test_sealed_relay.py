"""Sealed job traffic through a real registry and real `msa-fed site serve` processes.

- every byte the registry relays for a sealed job is recorded at the relay: no array the job or a
  site exchanged (z, Qhat, the domain model, DC sums) and no eta appears in it, a key held by the
  registry opens none of it, and the job's z equals the in-process fit's to 1e-9;
- a hostile relay (the registry's own relay, patched in this process) that alters one byte of a
  request or an answer, replays one, moves one into another job or injects its own: the receiver
  detects it and the job fails with one line naming the site and "tampered";
- an approve-only site refuses a job whose content differs from the one it approved;
- a registry that requires client certificates runs a job whose certificate is given on the
  command line (`msa-fed run --tls-cert`) or in the job file, and says which option is missing
  when none is.
"""

from __future__ import annotations

import json
import struct
import sys
import threading

import numpy as np
import pytest
from fedhelpers import NAMES, cli_here, fit_config, job_config, local_kwargs, make_pki, output_dir, site_files  # noqa: E402

from msa_fed.artifacts.predictors import sha256_hex
from msa_fed.boundary.proto import boundary_pb2 as bpb
from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.control import relay as relay_mod
from msa_fed.crypto.sealing import (
    JobKey,
    JobSealer,
    SiteKey,
    TamperedError,
    job_content,
    parse_frame,
    verify_transcript,
)
from msa_fed.errors import PrivacyError
from msa_fed.federation.local import LocalFederation
from msa_fed.federation.relay_client import RelayClient
from msa_fed.runtime.federated import FederatedSites

ORDER = sorted(NAMES)


@pytest.fixture(scope="module")
def files():
    return site_files()


@pytest.fixture(scope="module")
def fed(tmp_path_factory, files):
    with LocalFederation(tmp_path_factory.mktemp("sealed"), files) as fed:  # sealed: the default
        fed.wait_connected(timeout=180)
        yield fed


class _Tap:
    """Patches the registry's relay (in this process): every forwarded request and every answer
    passes through ``on_forward(conn, call_id, message)`` / ``on_answer(conn, call_id, answer)``,
    which record them and may return a changed message."""

    def __init__(self, monkeypatch):
        self.forwards: list[tuple[str, pb.RelayToSite]] = []  # (site, what the relay forwarded)
        self.answers: list[tuple[str, pb.Answer]] = []
        self.on_forward = lambda conn, message: message
        self.on_answer = lambda conn, answer: answer
        self.lock = threading.Lock()
        forward, answer = relay_mod._Connection.forward, relay_mod._Connection.answer
        tap = self

        def tapped_forward(conn, call_id, message, pending):
            with tap.lock:
                tap.forwards.append((conn.name, pb.RelayToSite.FromString(message.SerializeToString())))
            return forward(conn, call_id, tap.on_forward(conn, message), pending)

        def tapped_answer(conn, call_id, response):
            with tap.lock:
                tap.answers.append((conn.name, pb.Answer.FromString(response.SerializeToString())))
            return answer(conn, call_id, tap.on_answer(conn, response))

        monkeypatch.setattr(relay_mod._Connection, "forward", tapped_forward)
        monkeypatch.setattr(relay_mod._Connection, "answer", tapped_answer)

    def relayed(self) -> list[bytes]:
        """What the relay carried, cut where a search for a secret may not run across: each message
        without its sealed frame, and each frame's public header fields and its ciphertext apart.
        (One search over whole frames finds 4.0 = 00 00 00 00 00 00 10 40 in about one job of a
        hundred: a sequence number 16 written big-endian, followed by a random nonce that starts 0x40.)"""
        parts: list[bytes] = []
        for message in [f.forward for _, f in self.forwards] + [a for _, a in self.answers]:
            envelope = type(message).FromString(message.SerializeToString())
            envelope.ClearField("sealed")
            parts.append(envelope.SerializeToString())
            if message.sealed:
                _, seq, nonce, cert, ciphertext = parse_frame(message.sealed)
                parts += [seq.to_bytes(8, "big"), nonce, cert, ciphertext]
        return parts


def _backend(fed, files, job_id, relay, names=ORDER):
    return FederatedSites(
        list(names),
        relay,
        [files[n].X_unlabeled for n in names],
        job_id=job_id,
        predictor_sha256=[sha256_hex(files[n].predictor) for n in names],
        classes=np.array([0, 1]),
        site_timeout_s=30,
        data_channel="plain",
    )


def _sealer(fed, files, job_id, names=ORDER, job_key=None, **content):
    keys = {n: fed.seal_keys[n].public for n in names}
    sites = [
        dict(
            name=n,
            key_fingerprint=keys[n].fingerprint,
            sample_sha256=_sample_sha(files[n].X_unlabeled),
            predictor_sha256=sha256_hex(files[n].predictor),
        )
        for n in names
    ]
    options = dict(task="classification", loss="cross_entropy", mu=1e-3, objective="minmax", min_points=20)
    options.update(content)
    key = job_key or JobKey.load(fed.job_key_path)
    return JobSealer(key, job_content(job_id, sites, planned_queries=100, **options), keys)


def _sample_sha(X) -> str:
    from msa_fed.federation.agent import sample_sha256

    return sample_sha256(X)


def _join(fed, files, job_id, sealer, names=ORDER):
    relay = RelayClient(fed.address, fed.admin_token, insecure=True, sealer=sealer)
    backend = _backend(fed, files, job_id, relay, names)
    relay.open_job(job_id, list(names))
    backend._relay([(i, "join_job", backend.join[i]) for i in range(len(names))])
    return backend, relay


# ---------------------------------------------------------------------- a hostile relay
def _flip(data: bytes, at: int = -20) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


def _audit(fed, name) -> list[dict]:
    return [json.loads(x) for x in (fed.workdir / name / "audit.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "attack", ["alter request", "alter answer", "replay request", "replay answer", "move to another job", "inject"]
)
def test_a_hostile_relay_is_detected_and_the_job_fails_naming_the_site(fed, files, monkeypatch, attack):
    job_id = "hostile-" + attack.replace(" ", "-")
    tap = _Tap(monkeypatch)
    backend, relay = _join(fed, files, job_id, _sealer(fed, files, job_id))  # honest so far
    victim = "north"
    old_forward = next(f for site, f in tap.forwards if site == victim and f.forward.job_id == job_id)
    old_answer = next(a for site, a in tap.answers if site == victim)
    if attack == "move to another job":  # a frame of this job, relayed into another open job
        other = job_id + "-b"
        backend, relay = _backend(fed, files, other, relay), relay
        relay.sealer = _sealer(fed, files, other)
        relay.open_job(other, ORDER)

    def on_forward(conn, message):
        if conn.name != victim:
            return message
        fwd = pb.RelayToSite.FromString(message.SerializeToString())
        if attack == "alter request":
            fwd.forward.sealed = _flip(fwd.forward.sealed)
        elif attack == "replay request":
            fwd.forward.sealed = old_forward.forward.sealed
        elif attack == "move to another job":
            fwd.forward.sealed = old_forward.forward.sealed  # job_id stays the other job's
        elif attack == "inject":  # the registry's own request, under its own key
            rogue = _sealer(fed, files, fwd.forward.job_id, job_key=JobKey.generate())
            ping = bpb.SiteRequest(method="ping", empty=bpb.Empty())
            fwd.forward.sealed = rogue.seal(victim, ping.SerializeToString())[0]
        return fwd

    def on_answer(conn, answer):
        if conn.name != victim:
            return answer
        if attack == "alter answer":
            answer = pb.Answer.FromString(answer.SerializeToString())
            answer.sealed = _flip(answer.sealed)
        elif attack == "replay answer":
            answer = pb.Answer(call_id=answer.call_id, sealed=old_answer.sealed)
        return answer

    tap.on_forward, tap.on_answer = on_forward, on_answer
    method = "join_job" if attack == "move to another job" else "info"
    msgs = backend.join if method == "join_job" else [None] * len(ORDER)
    with pytest.raises(TamperedError) as info:
        backend._relay([(i, method, msgs[i]) for i in range(len(ORDER))])
    text = str(info.value)
    assert info.value.site == victim and text.startswith(f"site '{victim}': tampered") and "\n" not in text, text
    if attack in ("alter request", "replay request", "move to another job", "inject"):  # the site saw it
        assert any(r.get("outcome") == "refused" and r.get("rule") == "tampered" for r in _audit(fed, victim)[-5:]), (
            _audit(fed, victim)[-3:]
        )
    relay.close()


def test_a_relay_that_hands_one_site_the_frame_of_another_in_the_same_call_is_named(fed, files, monkeypatch):
    """All the sites' requests of a round travel in one Call: a relay that gives site west the
    frame sealed for north in that Call (each a valid frame of this job) is refused by west, which
    cannot open it; north and east answer as usual and the job fails naming west."""
    job_id = "hostile-swap"
    tap = _Tap(monkeypatch)
    backend, relay = _join(fed, files, job_id, _sealer(fed, files, job_id))
    seen: dict[str, bytes] = {}

    def on_forward(conn, message):
        if message.forward.job_id != job_id:
            return message
        seen[conn.name] = message.forward.sealed
        if conn.name != "west":
            return message
        fwd = pb.RelayToSite.FromString(message.SerializeToString())
        fwd.forward.sealed = seen["north"]  # forwarded just before, in this Call (site order)
        return fwd

    tap.on_forward = on_forward
    before, answers = len(_audit(fed, "west")), len(tap.answers)
    with pytest.raises(TamperedError) as info:
        backend._relay([(i, "info", None) for i in range(len(ORDER))])
    assert info.value.site == "west" and str(info.value).startswith("site 'west': tampered"), str(info.value)
    refused = [r for r in _audit(fed, "west")[before:] if r.get("outcome") == "refused"]
    assert [r.get("rule") for r in refused] == ["tampered"], refused
    sealed = {site: bool(a.sealed) for site, a in tap.answers[answers:]}
    assert sealed == {"east": True, "north": True, "west": False}, sealed  # west refused in the clear
    assert not any(r.get("outcome") == "refused" for n in ("east", "north") for r in _audit(fed, n)[-2:])
    relay.close()


def test_a_restarted_site_process_refuses_a_replayed_join(fed, files, monkeypatch):
    """A site process keeps each sealed job's last join on disk: after a restart (its sequence
    numbers in memory gone) the relay cannot make it join the job again with an old frame, while
    the job's own rejoin (a new frame) is served."""
    import time

    job_id = "restart-replay"
    tap = _Tap(monkeypatch)
    backend, relay = _join(fed, files, job_id, _sealer(fed, files, job_id))
    old_join = next(f for site, f in tap.forwards if site == "west" and f.forward.job_id == job_id)
    fed.kill("west")
    deadline = time.monotonic() + 60
    while "west" in fed.connected() and time.monotonic() < deadline:
        time.sleep(0.1)
    fed.spawn("west")
    fed.wait_connected(["west"], timeout=180)
    before = len(_audit(fed, "west"))

    def replay_join(conn, message):
        if conn.name != "west":
            return message
        fwd = pb.RelayToSite.FromString(message.SerializeToString())
        fwd.forward.sealed = old_join.forward.sealed
        return fwd

    tap.on_forward = replay_join
    with pytest.raises(TamperedError, match="site 'west': tampered"):
        backend._relay([(i, "info", None) for i in range(len(ORDER))])
    records = _audit(fed, "west")[before:]
    assert any(r.get("outcome") == "refused" and r.get("rule") == "tampered" for r in records), records
    assert not any(r.get("request") == "join_job" and r.get("outcome") == "answered" for r in records), records
    # the job's own rejoin is served: west lost the job's state, the backend replays its join
    tap.on_forward = lambda conn, message: message
    infos = backend._relay([(i, "info", None) for i in range(len(ORDER))])
    assert [i.name for i in infos] == ORDER
    relay.close()


def test_a_relay_that_replays_every_frame_after_a_site_restart_learns_nothing(fed, files, monkeypatch):
    """The attack on sealing across a restart: the relay keeps every frame of a job; site north's
    process is killed (a crash) and started again; the relay delivers north's old request frames
    again, one by one, in order.  North answers none of them (each is refused in the clear, its
    audit log saying "replayed"), no answer of north's is ever sealed under a nonce used before,
    and the XOR of an old and a new sealed answer with the new plaintext (what a relay does when a
    nonce repeats) gives nothing of the old answer; the job's own resume still works."""
    import time

    from msa_fed.crypto import sealing

    job_id = "restart-xor"
    victim = "north"
    at = ORDER.index(victim)
    tap = _Tap(monkeypatch)
    plain: dict[bytes, bytes] = {}  # north's sealed answer frame -> its plaintext (the job opened it)
    open_ = JobSealer.open

    def open_and_keep(self, site, seq, frame, request, method=""):
        answer = open_(self, site, seq, frame, request, method)
        if site == victim:
            plain[frame] = answer
        return answer

    monkeypatch.setattr(JobSealer, "open", open_and_keep)
    backend, relay = _join(fed, files, job_id, _sealer(fed, files, job_id))
    for method in ("info", "ping", "info", "ping", "info"):
        backend._relay([(i, method, None) for i in range(len(ORDER))])
    old_requests = [f.forward.sealed for site, f in tap.forwards if site == victim and f.forward.job_id == job_id]
    old_answers = [a.sealed for site, a in tap.answers if site == victim and a.sealed]
    assert len(old_requests) == len(old_answers) == 6 and all(a in plain for a in old_answers)

    fed.kill(victim)  # SIGKILL: nothing in north's memory survives
    deadline = time.monotonic() + 60
    while victim in fed.connected() and time.monotonic() < deadline:
        time.sleep(0.1)
    fed.spawn(victim)
    fed.wait_connected([victim], timeout=180)
    before, answers_before = len(_audit(fed, victim)), len(tap.answers)

    for old in old_requests:  # the relay delivers each stored frame in place of a fresh request

        def replay(conn, message, old=old):
            if conn.name != victim:
                return message
            fwd = pb.RelayToSite.FromString(message.SerializeToString())
            fwd.forward.sealed = old
            return fwd

        tap.on_forward = replay
        with pytest.raises(TamperedError, match=f"site '{victim}': tampered.*replayed"):
            backend._relay([(at, "info", None)], replay=False)
    replies = [a for site, a in tap.answers[answers_before:] if site == victim]
    assert len(replies) == len(old_requests) and not any(a.sealed for a in replies), replies
    assert all("replayed" in a.response.failure.text for a in replies)
    records = _audit(fed, victim)[before:]
    refused = [r for r in records if r.get("outcome") == "refused" and "replayed" in r.get("detail", "")]
    assert len(refused) == len(old_requests) and len(records) == len(old_requests), records

    # the job's own requests resume it as before: north lost the job, the backend rejoins it
    tap.on_forward = lambda conn, message: message
    infos = backend._relay([(i, "info", None) for i in range(len(ORDER))])
    assert [i.name for i in infos] == ORDER
    new_answers = [a.sealed for site, a in tap.answers[answers_before:] if site == victim and a.sealed]
    assert len(new_answers) >= 3 and all(a in plain for a in new_answers)  # SiteStateLost, join, info

    frames = [sealing.parse_frame(a) for a in old_answers + new_answers]
    assert len({f.nonce for f in frames}) == len(frames)  # no nonce twice under the job's answer key
    requests = [sealing.parse_frame(f.forward.sealed) for site, f in tap.forwards if site == victim]
    assert len({f.nonce for f in requests if f.cert}) == len(requests)
    for old in old_answers:  # the relay's XOR: old ^ new ^ known new plaintext (past the signature)
        c_old = sealing.parse_frame(old).ciphertext[64:-16]
        for new in new_answers:
            c_new, p_new = sealing.parse_frame(new).ciphertext[64:-16], plain[new]
            guess = bytes(x ^ y ^ z for x, y, z in zip(c_old, c_new, p_new))
            secret = plain[old][: len(guess)]
            assert sum(g == s for g, s in zip(guess, secret)) <= len(secret) // 8 + 4, (guess, secret)
    relay.close()


def test_an_unsealed_job_is_refused_by_a_sealed_site(fed, files):
    relay = RelayClient(fed.address, fed.admin_token, insecure=True)
    backend = _backend(fed, files, "unsealed", relay)
    relay.open_job("unsealed", ORDER)
    with pytest.raises(PrivacyError) as info:
        backend._relay([(i, "join_job", backend.join[i]) for i in range(len(ORDER))])
    assert info.value.rule == "sealed"
    relay.close()


def test_a_relay_that_strips_the_seal_is_refused_by_a_default_site(fed, files, monkeypatch):
    """A registry that takes the seal off a request and delivers a plaintext request of its own
    (a downgrade) to a site that did not opt out: the site refuses it naming the reason (rule
    "sealed", in its audit log and in its answer), answers nothing of it, and the job fails with
    one line naming the site."""
    job_id = "stripped"
    tap = _Tap(monkeypatch)
    backend, relay = _join(fed, files, job_id, _sealer(fed, files, job_id))  # honest so far
    victim = "east"
    before = len(_audit(fed, victim))

    def strip(conn, message):
        if conn.name != victim:
            return message
        fwd = pb.RelayToSite.FromString(message.SerializeToString())
        fwd.forward.ClearField("sealed")
        fwd.forward.request.CopyFrom(bpb.SiteRequest(method="info", empty=bpb.Empty()))  # its own, in the clear
        return fwd

    tap.on_forward = strip
    with pytest.raises(TamperedError) as info:
        backend._relay([(i, "info", None) for i in range(len(ORDER))])
    text = str(info.value)
    assert info.value.site == victim and text.startswith(f"site '{victim}': tampered") and "\n" not in text, text
    assert "serves only sealed jobs" in text, text  # the site's reason, carried in the job's line
    records = _audit(fed, victim)[before:]
    assert any(r.get("outcome") == "refused" and r.get("rule") == "sealed" for r in records), records
    assert not any(r.get("outcome") == "answered" for r in records), records  # nothing of the forgery answered
    # what the site sent back through the relay: a refusal naming the rule, nothing sealed, no info
    answer = [a for site, a in tap.answers if site == victim][-1]
    assert not answer.sealed and answer.response.WhichOneof("body") == "failure", answer
    assert (answer.response.failure.rule, answer.response.failure.site) == ("sealed", victim), answer
    relay.close()


# ---------------------------------------------------------------------- approval binds the content
def test_an_approve_only_site_refuses_a_job_whose_content_differs(tmp_path, files):
    two = {n: files[n] for n in ("east", "north")}
    names = sorted(two)
    with LocalFederation(tmp_path, two, accept_jobs="approve") as fed:
        fed.wait_connected(timeout=180)
        with pytest.raises(PrivacyError, match="is pending"):
            _join(fed, files, "bound", _sealer(fed, files, "bound", names), names)
        listed = cli_here("site", "jobs", "--config", fed.config_path("east"))
        assert listed.returncode == 0, listed.stderr
        assert "mu 0.001" in listed.stdout and "'minmax'" in listed.stdout and "at most 100" in listed.stdout
        assert fed.seal_keys["north"].public.fingerprint[:16] in listed.stdout and "content digest" in listed.stdout
        for name in names:
            done = cli_here("site", "approve", "bound", "--config", fed.config_path(name))
            assert done.returncode == 0 and "for content" in done.stdout, done.stderr
        _, relay = _join(fed, files, "bound", _sealer(fed, files, "bound", names), names)  # approved: joins
        relay.close()
        # the same job id with another mu is another job: pending again, named in `site jobs`
        with pytest.raises(PrivacyError, match="is pending"):
            _join(fed, files, "bound", _sealer(fed, files, "bound", names, mu=1e-1), names)
        listed = cli_here("site", "jobs", "--config", fed.config_path("east"))
        assert "pending" in listed.stdout and "mu 0.1" in listed.stdout


# ---------------------------------------------------------------------- a whole sealed job
def _local_z(files):
    from msa_fed.core.config import ClassifierConfig
    from msa_fed.runtime.coordinator import Coordinator
    from msa_fed.runtime.local import LocalSites

    kw, preds, _ = local_kwargs(files, ORDER)
    config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver={"objective": "minmax"})
    with Coordinator(LocalSites(kw), preds, config) as c:
        return c.fit()


def _secrets(message) -> set[bytes]:
    """The bytes of every array (NdArray data) and every float of a boundary message, recursively."""
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.message import Message

    out: set[bytes] = set()

    def walk(value, ftype=None):
        if isinstance(value, Message):
            if type(value).DESCRIPTOR.name == "NdArray" and len(value.data) >= 8:
                out.add(bytes(value.data))
            for field, x in value.ListFields():
                if field.message_type is not None and field.message_type.GetOptions().map_entry:
                    inner = field.message_type.fields_by_name["value"].type
                    for y in x.values():
                        walk(y, inner)
                elif isinstance(x, (str, bytes, int, float, Message)):
                    walk(x, field.type)
                else:  # a repeated field
                    for y in x:
                        walk(y, field.type)
        elif isinstance(value, float) and ftype == FieldDescriptor.TYPE_DOUBLE and value not in (0.0, 1.0):
            out.add(struct.pack("<d", value))

    walk(message)
    return out


def test_a_sealed_job_relays_nothing_readable_and_finds_the_same_z(fed, files, monkeypatch):
    from msa_fed.crypto import sealing
    from msa_fed.jobs.run import run_job

    tap = _Tap(monkeypatch)
    exchanged: list[tuple[str, bytes]] = []  # the job's plaintexts, kept in this process
    seal, open_ = JobSealer.seal, JobSealer.open

    def seal_and_keep(self, site, plaintext):
        exchanged.append(("request", plaintext))
        return seal(self, site, plaintext)

    def open_and_keep(self, site, seq, frame, request, method=""):
        answer = open_(self, site, seq, frame, request, method)
        exchanged.append(("answer", answer))
        return answer

    monkeypatch.setattr(JobSealer, "seal", seal_and_keep)
    monkeypatch.setattr(JobSealer, "open", open_and_keep)
    job = job_config("sealedjob", fed.address, insecure=True, **fed.sealing())
    _, model = run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))
    np.testing.assert_allclose(model.z, _local_z(files).z, rtol=0, atol=1e-9)
    # on samples this small the coordinator trains the classifier itself: the job needs no Ray
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()

    # what the registry relayed for the job: sealed frames, nothing in the clear
    mine = [(s, f) for s, f in tap.forwards if f.forward.job_id == "sealedjob"]
    assert {s for s, _ in mine} == set(NAMES) and len(mine) == len(exchanged) // 2
    assert all(f.forward.sealed and f.forward.request.ByteSize() == 0 for _, f in mine)
    assert all(a.sealed and a.response.ByteSize() == 0 for _, a in tap.answers)
    methods = {bpb.SiteRequest.FromString(p).method for kind, p in exchanged if kind == "request"}
    assert {"join_job", "set_domain_model", "set_qhat", "dc_evaluate"} <= methods
    secrets: set[bytes] = set()
    for kind, plain in exchanged:
        message = (bpb.SiteRequest if kind == "request" else bpb.SiteResponse).FromString(plain)
        secrets |= _secrets(message)
    secrets.add(struct.pack("<d", job.fit.eta))
    secrets |= {model.z.astype("<f8").tobytes(), np.asarray(model.qhat, "<f8").tobytes()}
    assert len(secrets) > 20  # z at every step, theta, Qhat and DC sums, eta
    relayed = tap.relayed()
    assert not [s for s in secrets if any(s in r for r in relayed)]
    # positive control: the same search finds them in what the job exchanged
    plain = [p for _, p in exchanged]
    assert sum(any(s in p for p in plain) for s in secrets) >= len(secrets) - 3

    # the registry's own key derives nothing that opens a frame
    registry_key = SiteKey.generate()
    job_key = JobKey.load(fed.job_key_path)
    for site, f in mine:
        _, seq, nonce, cert_bytes, ciphertext = parse_frame(f.forward.sealed)
        cert = sealing.JobCertificate.decode(cert_bytes, {job_key.fingerprint})  # public: the relay reads it
        secret = registry_key.agreement.exchange(sealing.X25519PublicKey.from_public_bytes(cert.agreement))
        for key in sealing._keys(secret, cert.digest, site, registry_key.public):
            with pytest.raises(sealing.InvalidTag):
                sealing.ChaCha20Poly1305(key).decrypt(
                    nonce,
                    ciphertext,
                    sealing._aad(sealing.TO_SITE, seq, "sealedjob", site, cert.digest),
                )

    # the sites' signed answers are kept with the model and verify against the pinned keys
    record = model.info["job"]["sealed_transcript"]
    counts = verify_transcript(record, {job_key.fingerprint})
    assert set(counts) == set(NAMES) and min(counts.values()) >= 3
    assert record["content_digest"] and len(record["answers"]) == len(mine)
    # `msa-fed job show` verifies the transcript stored with the model in the registry
    token = fed.workdir / "admin_token"
    token.write_text(fed.admin_token + "\n")
    show = ["job", "show", model.info["job"]["job_id"], "--registry", fed.address, "--insecure"]
    shown = cli_here(*show, "--admin-token-file", token, "--job-key", job_key.fingerprint)
    assert shown.returncode == 0 and f"{sum(counts.values())} signed answers verified" in shown.stdout, shown
    # a transcript whose answer was changed (say by whoever stores it) no longer verifies
    bad = dict(record, answers=[dict(a) for a in record["answers"]])
    bad["answers"][-1]["answer_sha256"] = "00" * 32
    ok, line = sealing.check_model_transcript({"info": {"job": {"sealed_transcript": bad}}}, [job_key.fingerprint])
    assert not ok and "DOES NOT VERIFY" in line and bad["answers"][-1]["site"] in line


def test_a_job_that_does_not_pin_a_sites_key_is_one_line_naming_the_key_to_set(fed, files):
    """The job pins every site's key: one site left out of [sealing] sites stops the job before it
    sends anything, naming the site and the key to set; no job key at all names the opt-out too."""
    from msa_fed.errors import ConfigError
    from msa_fed.jobs.run import run_job

    sealing = fed.sealing()
    partial = tuple(p for p in sealing["seal_sites"] if not p.startswith("west="))
    job = job_config("unpinned", fed.address, insecure=True, job_key=sealing["job_key"], seal_sites=partial)
    before = len(_audit(fed, "west"))
    with pytest.raises(ConfigError) as info:
        run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))
    text = str(info.value)
    assert "site(s) west:" in text and "[sealing] sites" in text and "\n" not in text, text
    bare = job_config("unsealed-file", fed.address, insecure=True)
    with pytest.raises(ConfigError, match=r"not sealed.*\[sealing\] job_key.*\[sealing\] allow_unsealed = true"):
        run_job(bare, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))
    assert len(_audit(fed, "west")) == before  # nothing reached a site


# ---------------------------------------------------------------------- mutual TLS for the job
def test_a_registry_requiring_client_certificates_runs_jobs_given_one(tmp_path, files):
    """The certificate on `msa-fed run`'s command line, or in the job file (Python API: JobConfig);
    none given: the job fails in one line naming the option."""
    from msa_fed.control.server import TlsConfig
    from msa_fed.jobs.config import JobConfig
    from msa_fed.jobs.run import run_job

    names = ("east", "north")
    pki = make_pki(tmp_path / "pki", clients=names + ("operator",))
    tls = TlsConfig.from_files(pki["server_cert"], pki["server_key"], pki["ca"])
    certs = {n: (pki[f"{n}_cert"], pki[f"{n}_key"]) for n in names}
    two = {n: files[n] for n in names}
    with LocalFederation(tmp_path / "fed", two, tls=tls, tls_ca=pki["ca"], client_certs=certs) as fed:
        fed.wait_connected(timeout=180)
        token = tmp_path / "admin_token"
        token.write_text(fed.admin_token + "\n")
        sealing = fed.sealing(names)
        pins = ", ".join(f'"{p}"' for p in sealing["seal_sites"])
        base = (
            f'name = "mtls"\n[registry]\naddress = "{fed.address}"\ntls_ca = "{pki["ca"]}"\n'
            f'admin_token_file = "{token}"\n'
            "{cert}"
            '[run]\ndata_channel = "plain"\nsite_timeout_s = 60\n'
            f'[model]\nmu = 0.001\n[sealing]\njob_key = "{sealing["job_key"]}"\nsites = [{pins}]\n'
        )
        bare, with_cert = tmp_path / "bare.toml", tmp_path / "with-cert.toml"
        bare.write_text(base.format(cert=""))
        with_cert.write_text(
            base.format(cert=f'tls_cert = "{pki["operator_cert"]}"\ntls_key = "{pki["operator_key"]}"\n')
        )
        cli = ["run", "--quiet", "--job", bare]

        # the job command in this process: its options, exit status and output are what is tested
        refused = cli_here(*cli, "--output", tmp_path / "out0")
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error")]
        assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-2000:]
        assert "requires a client certificate (mutual TLS)" in errors[0], errors  # in words, at once
        assert "[registry] tls_cert and [registry] tls_key" in errors[0], errors

        cert_flags = ["--tls-cert", pki["operator_cert"], "--tls-key", pki["operator_key"]]
        done = cli_here(*cli, *cert_flags, "--output", tmp_path / "out1")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "stored combined model version" in done.stdout

        config = JobConfig.from_toml(with_cert)
        assert config.tls_cert == pki["operator_cert"]
        _, model = run_job(config, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=tmp_path / "out2")
        assert model.site_names == list(names) and np.isclose(model.z.sum(), 1.0)
        assert verify_transcript(model.info["job"]["sealed_transcript"])
