"""Attacks on the federated topology, with real processes on loopback.

- a process holding site A's token cannot serve as site B (raw gRPC client: refused at Hello;
  the site agent itself refuses a token of another site); a site token cannot open jobs, send
  requests or fetch predictors of a job that does not name it;
- a revoked site is cut off mid-stream: its stream closes within the relay's sweep, its process
  stops with one error line, relayed calls to it are refused, and a new job naming it fails
  saying so; a deregistered site likewise;
- a site process refuses to start when its predictor or X_unlabeled is not what it published;
- a hostile "site" answering with malformed or unexpected messages makes the job fail naming it,
  never run anything;
- killing a site mid-solve ends the job within site_timeout_s with an error naming the site; the
  job resumed from its checkpoint once the site is back gives the same z; a site that comes back
  within site_timeout_s gets the job's state replayed and the job carries on to the same z.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import threading
import time

import grpc
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fedhelpers import fit_config, local_kwargs, site_files  # noqa: E402

from msa_fed.artifacts.predictors import sha256_hex  # noqa: E402
from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.boundary import wire  # noqa: E402
from msa_fed.boundary.proto import relay_pb2 as pb  # noqa: E402
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc  # noqa: E402
from msa_fed.core.domain_classifier import ClassifierConfig  # noqa: E402
from msa_fed.errors import RegistryError, SiteError  # noqa: E402
from msa_fed.federation.local import LocalFederation  # noqa: E402
from msa_fed.federation.relay_client import RelayClient  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.federated import FederatedSites, SiteUnreachable  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402

NAMES = ("east", "north", "west")
DCA = {"objective": "gamma", "method": "dca"}


@pytest.fixture(scope="module")
def files():
    return site_files(NAMES, seed=1)


@pytest.fixture(scope="module")
def shared(tmp_path_factory, files):
    with LocalFederation(tmp_path_factory.mktemp("fed"), files, heartbeat_interval_s=0.5, sealed=False) as f:
        f.wait_connected(timeout=180)
        yield f


@pytest.fixture
def fed(shared):
    """The module's federation, with all three site processes running (restarted if a test
    stopped one)."""
    for name in NAMES:
        proc = shared.procs.get(name)
        if proc is None or proc.poll() is not None:
            shared.spawn(name)
    shared.wait_connected(timeout=180)
    return shared


@pytest.fixture
def own_fed(tmp_path, files):
    """A federation of its own, for a test that revokes and deregisters sites."""
    two = {n: files[n] for n in ("north", "west")}
    with LocalFederation(tmp_path, two, heartbeat_interval_s=0.5, sealed=False) as f:
        f.wait_connected(timeout=180)
        yield f


def _stream(address: str, token: str, first: pb.SiteToRelay):
    """A raw site stream (what an attacker holding ``token`` could open)."""
    channel = grpc.insecure_channel(address)
    out: queue.Queue = queue.Queue()
    out.put(first)

    def gen():
        while True:
            item = out.get()
            if item is None:
                return
            yield item

    call = pb_grpc.RelayStub(channel).Connect(gen(), metadata=(("authorization", f"Bearer {token}"),))
    return channel, out, call


def test_a_token_of_site_a_cannot_serve_as_b(fed):
    channel, out, call = _stream(fed.address, fed.tokens["east"], pb.SiteToRelay(hello=pb.Hello(site="west")))
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not serve as site 'west'" in info.value.details()
    out.put(None)
    channel.close()
    # no Hello first: refused
    channel, out, call = _stream(fed.address, fed.tokens["east"], pb.SiteToRelay(heartbeat=pb.Heartbeat()))
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    out.put(None)
    channel.close()
    assert fed.connected() == sorted(NAMES)  # west still served by its own process
    # the site agent with west's config but east's token refuses to start
    cfg = fed.workdir / "west" / "site.toml"
    shutil.copy(fed.workdir / "east" / "token.txt", fed.workdir / "west" / "east-token.txt")
    bad = fed.workdir / "west" / "impostor.toml"
    # its own state files: west's are locked by west's running process (one site serve per site)
    text = cfg.read_text().replace('token_file = "token.txt"', 'token_file = "east-token.txt"')
    bad.write_text(text.replace('audit_log = "audit.jsonl"', 'audit_log = "impostor/audit.jsonl"'))
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "msa_fed.cli", "site", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1 and "error: the token belongs to site 'east', not 'west'" in done.stderr
    assert "Traceback" not in done.stderr


def test_site_tokens_cannot_drive_jobs(fed):
    with RelayClient(fed.address, fed.tokens["east"], insecure=True) as as_site:
        with pytest.raises(RegistryError, match="PERMISSION_DENIED"):
            as_site.open_job("evil", ["east", "west"])
        with pytest.raises(RegistryError, match="PERMISSION_DENIED"):
            as_site.call("evil", [("west", "max_bound", None)], 5)
    with RelayClient(fed.address, fed.admin_token, insecure=True) as admin:
        admin.open_job("two", ["north", "west"])  # does not name east
        # requests for a site the job does not name are refused by the registry
        res = admin.call("two", [("east", "ping", None)], 5)
        assert isinstance(res[0], SiteUnreachable) and res[0].status == "PERMISSION_DENIED"
    channel = grpc.insecure_channel(fed.address)
    stub = pb_grpc.RelayStub(channel)

    def fetch(method: str, request_type, site: str, token: str) -> list:
        return list(
            getattr(stub, method)(
                request_type(job_id="two", site=site), metadata=(("authorization", f"Bearer {token}"),), timeout=30
            )
        )

    refused = [
        # east may not fetch predictors through a job that does not name it
        ("FetchPredictor", pb.FetchPredictorRequest, "west", fed.tokens["east"]),
        # nor samples: a site reads the published samples of the sites of its own jobs only
        ("FetchSample", pb.FetchSampleRequest, "west", fed.tokens["east"]),
        # the admin token cannot use the site's route
        ("FetchSample", pb.FetchSampleRequest, "north", fed.admin_token),
    ]
    for method, request_type, site, token in refused:
        with pytest.raises(grpc.RpcError) as info:
            fetch(method, request_type, site, token)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method, site)
    # west, named by the job, reads north's sample: the bytes the registry pinned at publication
    chunks = fetch("FetchSample", pb.FetchSampleRequest, "north", fed.tokens["west"])
    data = b"".join(c.chunk for c in chunks[1:])
    assert chunks[0].artifact.kind == "sample" and hashlib.sha256(data).hexdigest() == chunks[0].artifact.sha256
    channel.close()


def test_the_site_process_answers_only_its_methods(fed):
    with RelayClient(fed.address, fed.admin_token, insecure=True) as admin:
        admin.open_job("probe", list(NAMES))
        # methods that would hand out the sample or run classifier steps are not served by the process
        res = admin.call("probe", [("east", "max_bound", None)], 30)
        assert isinstance(res[0], wire.RemoteError) and res[0].kind == "SiteStateLost"  # not joined yet
        req = wire.to_proto("unlabeled_sample", None, wire.REQUESTS)
        r = admin._stub.Call(
            pb.CallRequest(job_id="probe", timeout_s=30, calls=[pb.SiteCall(site="east", request=req)]),
            metadata=admin._metadata,
            timeout=60,
        )
        method, err = wire.from_proto(r.results[0].response, wire.RESPONSES)
        assert isinstance(err, wire.RemoteError) and err.kind == "PrivacyError" and "does not answer" in err.text


def test_a_revoked_site_is_cut_off_mid_stream(own_fed):
    fed = own_fed
    names = ["north", "west"]
    with RelayClient(fed.address, fed.admin_token, insecure=True) as admin:
        admin.open_job("live", names)
        assert all(isinstance(r, wire.RemoteError) for r in admin.call("live", [(n, "ping", None) for n in names], 30))
        fed.registry.revoke_token("site", "west")  # as `msa-fed admin revoke-token` does
        proc = fed.procs["west"]
        proc.wait(60)  # cut off by the relay's sweep; the process stops for good
        assert proc.returncode == 1
        log = fed.log_text("west")
        assert "error: the registry refused site 'west': PERMISSION_DENIED" in log and "Traceback" not in log
        assert "west" not in fed.connected()
        res = admin.call("live", [("west", "ping", None)], 5)
        assert isinstance(res[0], SiteUnreachable) and res[0].status == "UNAVAILABLE"
        with pytest.raises(RegistryError, match="site 'west' has no active token"):
            admin.open_job("next", names)
        # a process with the revoked token cannot come back
        channel, out, call = _stream(fed.address, fed.tokens["west"], pb.SiteToRelay(hello=pb.Hello(site="west")))
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out.put(None)
        channel.close()
        # deregistering a site cuts it off too
        fed.registry.deregister(_admin(), "north")
        fed.procs["north"].wait(60)
        assert "north" not in fed.connected() and fed.procs["north"].returncode == 1


def _admin():
    from msa_fed.control.registry.records import Principal

    return Principal("admin", "operator")


def test_a_site_refuses_to_start_on_unpublished_files(fed, files):
    import subprocess
    import sys

    folder = fed.workdir / "east"
    other = fed.workdir / "east-other"
    other.mkdir()
    for name in ("token.txt", "site.toml", "predictor.onnx"):
        shutil.copy(folder / name, other / name)
    d = files["east"]
    X2 = d.X_unlabeled.copy()
    X2[0, 0] += 1.0
    np.savez(other / "data.npz", X_labeled=d.X_labeled, y_labeled=d.y_labeled, X_unlabeled=X2)
    cli = [sys.executable, "-m", "msa_fed.cli", "site", "serve", "--config", str(other / "site.toml")]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and "is not the sample site 'east' published" in done.stderr
    np.savez(other / "data.npz", X_labeled=d.X_labeled, y_labeled=d.y_labeled, X_unlabeled=d.X_unlabeled)
    (other / "predictor.onnx").write_bytes(files["west"].predictor)
    done = subprocess.run(cli, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and "is not the predictor site 'east' published" in done.stderr


def _hostile_site(address: str, token: str, name: str, answer):
    """A fake site process: connects as ``name`` and answers every request with ``answer(forward)``."""
    channel, out, call = _stream(address, token, pb.SiteToRelay(hello=pb.Hello(site=name)))

    def serve():
        try:
            for msg in call:
                if msg.WhichOneof("part") == "forward":
                    out.put(pb.SiteToRelay(answer=pb.Answer(call_id=msg.forward.call_id, response=answer(msg.forward))))
        except grpc.RpcError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return channel, out


@pytest.mark.parametrize("kind", ["wrong type", "bad array", "wrong method"])
def test_a_hostile_site_makes_the_job_fail_naming_it(fed, files, kind):
    from msa_fed.boundary.proto import boundary_pb2 as bpb

    fed.kill("west")  # west's token is now held by a hostile process
    fed.procs.pop("west")

    def answer(fwd):
        if kind == "wrong type":  # an unlabelled "sample" in place of the site's summary
            return wire.to_proto(fwd.request.method, m.UnlabeledSample(X=np.zeros((3, 2))), wire.RESPONSES)
        if kind == "bad array":
            return bpb.SiteResponse(
                method=fwd.request.method,
                info=bpb.SiteSummary(name="west", classes=bpb.NdArray(dtype="|O8", shape=[1], data=bytes(8))),
            )
        return wire.to_proto("dc_evaluate", m.BoundMax(1.0), wire.RESPONSES)

    deadline = time.monotonic() + 60
    while "west" in fed.connected() and time.monotonic() < deadline:
        time.sleep(0.1)
    channel, out = _hostile_site(fed.address, fed.tokens["west"], "west", answer)
    fed.wait_connected(["west"], timeout=60)
    try:
        with RelayClient(fed.address, fed.admin_token, insecure=True) as relay:
            backend = FederatedSites(
                list(NAMES),
                relay,
                [files[n].X_unlabeled for n in NAMES],
                job_id="h-" + kind.replace(" ", "-"),
                predictor_sha256=[sha256_hex(files[n].predictor) for n in NAMES],
                classes=np.array([0, 1]),
                site_timeout_s=20,
                data_channel="plain",
            )
            with pytest.raises(SiteError) as info:
                backend.start(_Recorder())
            backend.shutdown()
        assert info.value.site == "west"
        assert {
            "wrong type": "UnlabeledSample where a SiteInfo",
            "bad array": "not allowed",
            "wrong method": "answered",
        }[kind] in str(info.value)
    finally:
        out.put(None)
        channel.close()


class _Recorder:
    def __init__(self):
        self.records = []

    def record(self, *args):
        self.records.append(args)


def _federated(fed, files, classes, preds, ckpt, callback=None, timeout_s=120.0, job_id="solve"):
    """A federated fit of the module's sites through the relay: on published samples this small
    the coordinator trains the domain classifier itself (no stand-in actors, so no Ray)."""
    relay = RelayClient(fed.address, fed.admin_token, insecure=True)
    backend = FederatedSites(
        list(NAMES),
        relay,
        [files[n].X_unlabeled for n in NAMES],
        job_id=job_id,
        predictor_sha256=[sha256_hex(files[n].predictor) for n in NAMES],
        classes=classes,
        site_timeout_s=timeout_s,
        data_channel="plain",
    )
    config = fit_config(
        task="classification", classifier=ClassifierConfig(mu=1e-3), solver=DCA, checkpoint_dir=str(ckpt)
    )
    return relay, Coordinator(backend, preds, config, solver_callback=callback)


@pytest.fixture(scope="module")
def uninterrupted(files):
    """The fit of the module's sites in this process (runtime "local", the same ONNX predictors
    and solver as :func:`_federated`), every message recorded: (model, recorder)."""
    kw, preds, _ = local_kwargs(files, NAMES)
    rec = m.Recorder()
    config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver=DCA)
    return Coordinator(LocalSites(kw), preds, config, recorder=rec).start().fit(), rec


def test_a_site_killed_mid_solve_ends_the_job_naming_it_and_the_job_resumes(fed, files, tmp_path, uninterrupted):
    """A site killed mid-solve ends the job naming it; run again with the same checkpoint_dir,
    the job ends where an uninterrupted run ends and asks the sites only what they had not
    answered, counted at the sites for every request they see (their audit logs): the resumed
    run joins again and sends its set-up again (domain model, Qhat: answered as replays, not
    charged again, also at the site whose process restarted) and only the DC rounds not answered;
    over both runs each site is charged what an uninterrupted run charges (plus the one round
    the kill cut, at the sites that had answered it)."""

    _, preds, classes = local_kwargs(files, NAMES)
    full, rec = uninterrupted
    rounds = ("dc_evaluate", "max_bound")
    to_west = [(method, msg) for d, site, method, msg in rec.records if d == "to_site" and site == "west"]
    # the distinct rounds an uninterrupted run asks each site (the same for every site; a job
    # with a checkpoint_dir asks a round it asked before, e.g. a restart's start, only once)
    whole = len(
        {
            (method,) if msg is None else (method, msg.z.tobytes(), float(msg.eta), tuple(msg.what), msg.global_bound)
            for method, msg in to_west
            if method in rounds
        }
    )
    # what an uninterrupted run charges each site: one domain model; its Qhat, each DC round and
    # each z of its verdict requests count as DC evaluations
    assert [mm for mm, _ in to_west].count("set_domain_model") == [mm for mm, _ in to_west].count("set_qhat") == 1
    verdicts = [np.atleast_2d(msg.z).shape[0] for mm, msg in to_west if mm == "harm"]
    assert verdicts, to_west
    charges_whole = {"domain_model": 1, "dc_evaluation": 1 + whole + sum(verdicts)}
    killed_at = []
    timeout_s = 5.0
    # a generous timeout while the job sets up (the machine is shared), the short one from the kill on
    relay, coord = _federated(fed, files, classes, preds, tmp_path / "ckpt", None, timeout_s=120)

    def kill_west(it, z, gamma):
        if it == 2 and not killed_at:
            coord.backend.site_timeout_s = timeout_s
            fed.kill("west")
            killed_at.append(time.monotonic())

    coord.solver_callback = kill_west
    with pytest.raises(SiteError) as info:
        with coord:
            coord.fit()
    relay.close()
    assert killed_at, f"failed before the kill: {info.value}"
    # ended on the short time-out, naming the killed site (a hang is stopped by pytest-timeout)
    assert info.value.site == "west" and "site_timeout_s" in str(info.value)
    state = json.loads((tmp_path / "ckpt" / "dc_state.json").read_text())
    assert state["iteration"] >= 2 and not state.get("done")

    fed.spawn("west")
    fed.wait_connected(["west"], timeout=180)
    relay, coord = _federated(fed, files, classes, preds, tmp_path / "ckpt")
    with coord:
        resumed = coord.fit()
    relay.close()
    assert resumed.info["classifier"]["resumed"] is True
    assert not ray.is_initialized()  # samples this small: the coordinator trains, no stand-in actors
    np.testing.assert_allclose(resumed.z, full.z, rtol=0, atol=1e-9)
    # counted at the sites, every request of the job in the audit logs, run by run (a run starts
    # with its join; the first run ends at the kill, or with the job's end at the sites that lived)
    setup = ("set_domain_model", "set_qhat")
    for name in NAMES:
        log = [json.loads(x) for x in (fed.workdir / name / "audit.jsonl").read_text().splitlines()]
        runs: list[list[dict]] = []
        for e in log:
            if e.get("job") != "solve":
                continue
            if e.get("request") == "join_job":
                runs.append([])
            assert runs, (name, e)  # nothing of the job before its first join
            runs[-1].append(e)
        assert len(runs) == 2, (name, [[e["request"] for e in r] for r in runs])
        for run in runs:  # each run: answered (and the job's end noted), nothing refused
            assert {e["outcome"] for e in run} <= {"answered", "noted"}, (name, run)
            assert {e["request"] for e in run} <= {"join_job", *setup, *rounds, "harm", "end_job"}, (name, run)
        first, again = ([e["request"] for e in run] for run in runs)
        # the resumed run: one join, the set-up once as replays, no more than the rounds not answered
        assert again.count("join_job") == 1 and all(again.count(mm) == 1 for mm in setup), (name, again)
        replays = [e for e in runs[1] if e["request"] in setup]
        assert all("replay" in e["decisions"] and "charged" not in e for e in replays), (name, replays)
        asked = [sum(r.count(mm) for mm in rounds) for r in (first, again)]
        assert asked[0] >= 2 and asked[1] < whole, (name, asked, whole)
        assert sum(asked) == whole + (0 if name == "west" else 1), (name, asked, whole)
        assert first.count("harm") == 0 and again.count("harm") == len(verdicts), name
        # what the site counted toward its budgets over both runs: an uninterrupted run's, and the
        # round cut by the kill where the site had answered it
        charged: dict = {}
        for e in runs[0] + runs[1]:
            for kind, n in (e.get("charged") or {}).items():
                charged[kind] = charged.get(kind, 0) + n
        cut = 0 if name == "west" else 1
        assert charged == {**charges_whole, "dc_evaluation": charges_whole["dc_evaluation"] + cut}, (name, charged)


def test_a_site_back_within_the_timeout_gets_the_job_replayed(fed, files, tmp_path, uninterrupted):
    _, preds, classes = local_kwargs(files, NAMES)
    full, _ = uninterrupted

    def restart_west(it, z, gamma):
        if it == 1:
            fed.kill("west")
            fed.spawn("west")  # a new process: it has lost the job's state

    relay, coord = _federated(
        fed, files, classes, preds, tmp_path / "ckpt", restart_west, timeout_s=120, job_id="replay"
    )
    with coord:
        model = coord.fit()
    relay.close()
    np.testing.assert_allclose(model.z, full.z, rtol=0, atol=1e-9)
    assert not ray.is_initialized()  # samples this small: the coordinator trains, no stand-in actors
    log = [json.loads(x) for x in (fed.workdir / "west" / "audit.jsonl").read_text().splitlines()]
    joins = [
        e for e in log if e.get("request") == "join_job" and e.get("job") == "replay" and e.get("outcome") == "answered"
    ]
    assert len(joins) == 2  # joined, restarted, joined again (replayed)
    # the restarted process was given the domain model again (from the job's set-up log)
    models = [e for e in log if e.get("request") == "set_domain_model" and e.get("job") == "replay"]
    assert len(models) == 2 and all(e["outcome"] == "answered" for e in models)


def test_a_frozen_site_ends_the_job_within_the_timeout(fed, files):
    """A site process that stops answering without closing its connection (SIGSTOP: a frozen
    machine, a cut cable) ends the job within site_timeout_s naming it, and the relay drops its
    silent stream."""
    import os
    import signal

    timeout_s = 15.0  # the honest sites answer a ping within it however loaded the machine (5 s was not at load 30)
    with RelayClient(fed.address, fed.admin_token, insecure=True) as relay:
        relay.open_job("frozen", list(NAMES))
        backend = FederatedSites(
            list(NAMES),
            relay,
            [files[n].X_unlabeled for n in NAMES],
            job_id="frozen",
            predictor_sha256=[sha256_hex(files[n].predictor) for n in NAMES],
            classes=np.array([0, 1]),
            site_timeout_s=120,
            data_channel="plain",
        )
        backend.coordinator = _Recorder()
        infos = backend._relay([(i, "join_job", backend.join[i]) for i in range(3)])
        assert [i.name for i in infos] == list(NAMES)
        backend.site_timeout_s = timeout_s  # short from the freeze on (a generous one for the set-up)
        pid = fed.procs["west"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(SiteError) as info:
                backend._relay([(i, "ping", None) for i in range(3)])
            assert info.value.site == "west" and "site_timeout_s" in str(info.value)
            deadline = time.monotonic() + 120  # silence_timeout_s of the test federation is 10 s
            while "west" in fed.connected() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "west" not in fed.connected()
        finally:
            os.kill(pid, signal.SIGCONT)
        relay.close_job("frozen")
    fed.wait_connected(["west"], timeout=120)  # the site reconnects by itself once it runs again


def test_a_federated_job_on_small_samples_starts_no_ray_and_keeps_its_sigterm_handler(fed):
    """The coordinator trains the classifier itself on samples this small: the job runs end to end
    (registry, relay, the three site processes) without starting Ray, and the job's SIGTERM
    handler (a cancelled job ends recorded, as Ctrl-C does) is the one in place at its end."""
    import signal

    from fedhelpers import job_config, output_dir

    from msa_fed.jobs.run import run_job

    before = signal.getsignal(signal.SIGTERM)
    try:
        job = job_config("noray", fed.address, insecure=True, **fed.sealing())
        _, model = run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))
        assert not ray.is_initialized()
        assert model.z.shape == (3,) and abs(model.z.sum() - 1.0) < 1e-9
        assert getattr(signal.getsignal(signal.SIGTERM), "__qualname__", "") == "interrupt_on_sigterm.<locals>.handler"
    finally:
        signal.signal(signal.SIGTERM, before)
