"""The federated topology end to end, with real processes on loopback: a registry (gRPC, SQLite),
three `msa-fed site serve` subprocesses that dial out to it, and a local Ray.

- the federated job's z equals runtime="local"'s and the cluster topology's (same ONNX
  predictors, same data) to 1e-9, and the model stored in the registry loads and predicts;
- what crossed the relay is only what boundary.proto allows, and the site's request log shows
  every request it answered (hash-chained);
- a site process holds no listening TCP socket, only its outgoing connection to the registry;
- a site with accept_jobs = "approve" refuses a job until `msa-fed site approve` admits it.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fedhelpers import (  # noqa: E402,E501
    NAMES,
    cli_here,
    cli_run,
    fit_config,
    job_config,
    local_kwargs,
    output_dir,
    port_of,
    site_files,
    tcp_sockets,
)

from msa_fed.core.config import ClassifierConfig  # noqa: E402
from msa_fed.errors import PrivacyError  # noqa: E402
from msa_fed.federation.local import LocalFederation  # noqa: E402
from msa_fed.jobs.config import JobConfig  # noqa: E402
from msa_fed.jobs.run import model_from_bytes, run_job  # noqa: E402
from msa_fed.privacy.audit import AuditError, verify_log  # noqa: E402
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.local import LocalSites  # noqa: E402

ORDER = sorted(NAMES)  # a job takes the registered sites in name order


@pytest.fixture(scope="module")
def files():
    return site_files()


#: the module's local Ray (the ``local_ray`` fixture below) carries each site's resource
RAY_RESOURCES = {f"site:{n}": 1 for n in NAMES}
#: this process's SIGTERM handler when the module's Ray started: "own" (set just before
#: ensure_ray) and "after" (in place once ensure_ray returned)
SIGTERM_AROUND_RAY: dict = {}


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for the module (2 CPUs, each site's resource; conftest.py's, with a check):
    started by ensure_ray while this process has a SIGTERM handler of its own, which
    :func:`test_ray_started_by_ensure_ray_keeps_the_processs_own_sigterm_handler` reads."""
    import signal

    from msa_fed.runtime.ray_actors import ensure_ray

    ray.shutdown()  # a Ray left by another module of this worker: ensure_ray must start one here

    def own(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, own)
    try:
        ensure_ray(num_cpus=2, resources=RAY_RESOURCES)
        SIGTERM_AROUND_RAY.update(own=own, after=signal.getsignal(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, before)
    yield ray
    ray.shutdown()


def test_ray_started_by_ensure_ray_keeps_the_processs_own_sigterm_handler(local_ray):
    """Ray's driver installs its own SIGTERM handler on ray.init (it exits with status 15 and no
    record); ensure_ray puts back the one the process had set before (a job's, which ends it
    recorded, as Ctrl-C does).  The module's Ray is started that way (its fixture)."""
    assert local_ray.is_initialized() and SIGTERM_AROUND_RAY["own"] is not None
    assert SIGTERM_AROUND_RAY["after"] is SIGTERM_AROUND_RAY["own"]


@pytest.fixture(scope="module")
def federation(tmp_path_factory, files):
    # unsealed (the sites opt out): the boundary-message audit reads what the relay carries
    with LocalFederation(tmp_path_factory.mktemp("fed"), files, sealed=False) as fed:
        fed.wait_connected(timeout=180)
        yield fed


def _job(fed, **kw) -> JobConfig:
    return job_config(kw.pop("name", "fedjob"), fed.address, insecure=True, **fed.sealing(), **kw)


def _run(job, fed):
    return run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))


def _local_z(files, sharded=False):
    kw, preds, _ = local_kwargs(files, ORDER)
    config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver={"objective": "minmax"})
    with Coordinator(LocalSites(kw, sharded=sharded), preds, config) as c:
        return c.fit()


#: the address of each RegistryClient the driver opened while the module's job ran
OPENED: list[str] = []


@pytest.fixture(scope="module")
def federated(local_ray, federation):
    from msa_fed.control.registry.client import RegistryClient

    init = RegistryClient.__init__

    def counted(self, address, *args, **kwargs):
        OPENED.append(address)
        init(self, address, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RegistryClient, "__init__", counted)
        return _run(_job(federation), federation)


def test_the_job_connects_to_the_registry_once(federated, federation):
    """Plan, artifacts, samples, the job's record and log, the stored model: one connection."""
    from msa_fed.control.ops.client import OpsClient
    from msa_fed.control.registry.client import RegistryClient

    record, model = federated
    assert OPENED == [federation.address]
    with RegistryClient(federation.address, federation.admin_token, insecure=True) as admin:
        job = OpsClient(admin).get_job(model.info["job"]["job_id"])
        assert job.status == "succeeded" and job.model_version == record.version


def test_federated_z_equals_local_and_cluster(federated, federation, files, local_ray):
    record, model = federated
    assert model.site_names == ORDER
    local = _local_z(files)
    np.testing.assert_allclose(model.z, local.z, rtol=0, atol=1e-9)
    np.testing.assert_allclose(model.qhat, local.qhat, rtol=0, atol=1e-12)
    # the cluster topology: site actors on the sites' Ray nodes, reading the same files
    cluster_job = _job(
        federation, name="clusterjob", topology="cluster", site_data=str(federation.workdir / "{site}" / "data.npz")
    )
    _, cluster = _run(cluster_job, federation)
    # the cluster job trains its classifier across the site actors (data-parallel), the federated
    # one in the coordinator on the published samples: the same optimum to the fit's tolerance
    np.testing.assert_allclose(cluster.z, model.z, rtol=0, atol=1e-7)
    # every site's verdict, measured at the site (its process; its actor in the cluster topology)
    assert set(model.harm) == set(ORDER) and cluster.harm == pytest.approx(model.harm, abs=1e-7)
    assert model.harm == pytest.approx(local.harm, abs=1e-9)

    # the stored model loads from the registry's bytes and predicts as the job's model does
    from msa_fed.control.registry.client import RegistryClient

    with RegistryClient(federation.address, federation.admin_token, insecure=True) as admin:
        data, rec = admin.download_combined_model(record.version)
    stored = model_from_bytes(data)
    X = np.vstack([files[n].X_labeled for n in ORDER])
    np.testing.assert_array_equal(stored.predict(X), model.predict(X))
    # no site refused anything or waited for an approval: the report says so, per site
    from msa_fed.jobs.report import report_html

    assert stored.info["consortium"] == {"refusals": [], "approvals": []}
    section = report_html(stored).split("<h2>Refusals and approvals</h2>")[1].split("<h2>")[0]
    assert "No site refused a request of this job" in section
    assert all(f"<td>{n}</td><td>none needed</td><td>none</td>" in section for n in ORDER)
    np.testing.assert_allclose(stored.predict_proba(X), model.predict_proba(X), atol=1e-12)
    assert 0.5 < float(np.mean(stored.predict(X) == np.concatenate([files[n].y_labeled for n in ORDER])))


def test_each_site_logged_what_it_answered(federated, federation):
    """One audit log per site: the policy's hash-chained log, its length anchored in the site's
    ledger (next to the log by default), holding the policy's checks and the agent's records."""
    import json

    from msa_fed.privacy.ledger import Ledger

    for name in NAMES:
        path = federation.workdir / name / "audit.jsonl"
        ledger_path = federation.workdir / name / "audit.ledger.db"
        assert ledger_path.is_file()  # budgets and the log's anchor survive a restart of the site process
        ledger = Ledger(str(ledger_path))
        try:
            anchor = ledger.anchor(str(path.resolve()))
        finally:
            ledger.close()
        summary = verify_log(path, anchor)
        assert summary["lines"] > 0 and anchor is not None and anchor[0] == summary["lines"]
        assert "fedjob" in summary["jobs"]
        records = [json.loads(x) for x in path.read_text().splitlines()]
        answered = {}
        for r in records:
            if r.get("job") == "fedjob" and r.get("outcome") == "answered":
                answered[r["request"]] = answered.get(r["request"], 0) + 1
        # the labelled-data queries came to the site's process; classifier training never did
        assert answered.get("join_job", 0) >= 1 and answered.get("set_domain_model") == 1
        assert answered.get("dc_evaluate", 0) >= 1
        assert answered.get("harm") == 1  # the site's verdict on the model, one request
        assert "classifier_loss_grad" not in answered and "unlabeled_sample" not in answered
        # the policy's own checks wrote their decisions (e.g. the concentration of the domain model)
        (model_rec,) = [r for r in records if r.get("job") == "fedjob" and r.get("request") == "set_domain_model"]
        assert model_rec["decisions"] and model_rec["site"] == name
        # the site verified the model against the job's samples, fetched from the registry
        assert 0 <= model_rec["decisions"]["verify_deviation"] <= 1e-3
        # `msa-fed site audit` verifies the same log against the same ledger
        out = cli_here("site", "audit", "--log", path, "--ledger", ledger_path)
        assert out.returncode == 0 and "chain intact" in out.stdout and "matches the ledger" in out.stdout, out
    # an edited line breaks the chain
    path = federation.workdir / "north" / "audit.jsonl"
    lines = path.read_text().splitlines()
    tampered = federation.workdir / "tampered.jsonl"
    tampered.write_text("\n".join(lines[:1] + [lines[1].replace("answered", "refused")] + lines[2:]) + "\n")
    with pytest.raises(AuditError, match="line 3 does not chain"):
        verify_log(tampered)


def test_site_processes_listen_on_no_socket(federated, federation):
    own = tcp_sockets(__import__("os").getpid())
    # positive control: this process runs the registry, and the check sees its listening socket
    assert any(state == "0A" and port_of(local) == federation.server.port for state, local, _ in own)
    for name in NAMES:
        proc = federation.procs[name]
        assert proc.poll() is None, federation.log_text(name)
        sockets = tcp_sockets(proc.pid)
        assert not [s for s in sockets if s[0] == "0A"], f"site {name} listens: {sockets}"
        # and it does hold its outgoing connection to the registry
        assert any(state == "01" and port_of(remote) == federation.server.port for state, _, remote in sockets)


def test_the_relay_fills_the_connected_column_of_list_sites(federation):
    """registry.site_connected is the relay's: `admin list-sites` (the Operations service) shows
    each connected site process as connected, and a stopped one as not connected."""
    from msa_fed.control.ops.client import OpsClient
    from msa_fed.control.registry.client import RegistryClient

    def connected() -> dict:
        with RegistryClient(federation.address, federation.admin_token, insecure=True) as admin:
            return {s.name: s.connected for s in OpsClient(admin).site_statuses()}

    assert connected() == {n: True for n in NAMES}
    assert federation.registry.site_connected("nowhere") is False


#: the two sites of the approval tests, each with accept_jobs = "approve"
APPROVING = ("east", "north")


@pytest.fixture(scope="module")
def approving(tmp_path_factory, files):
    """A federation of two sites that serve a job only once their operators approve it, shared by
    the approval tests (each runs its own job)."""
    two = {n: files[n] for n in APPROVING}
    with LocalFederation(tmp_path_factory.mktemp("approve"), two, accept_jobs="approve") as fed:
        fed.wait_connected(timeout=180)
        yield fed


def _job_state(fed, site: str, job_id: str) -> str:
    """The state `msa-fed site jobs --json` gives ``job_id`` at ``site``."""
    import json

    listed = cli_here("site", "jobs", "--config", fed.config_path(site), "--json")
    assert listed.returncode == 0, listed.stderr
    (state,) = [j["state"] for j in json.loads(listed.stdout) if j["job_id"] == job_id]
    return state


def test_a_site_may_require_approval(local_ray, approving, files):
    """accept_jobs = "approve": the job fails naming the pending job, `msa-fed site jobs` lists it,
    `msa-fed site approve` admits it, and the same job then runs."""
    fed = approving
    job = _job(fed, name="needs-approval", site_timeout_s=30, approval_wait_s=0)
    with pytest.raises(PrivacyError, match="job needs-approval was not approved within 0 s"):
        _run(job, fed)
    listed = cli_here("site", "jobs", "--config", fed.config_path("east"))
    assert listed.returncode == 0 and "needs-approval" in listed.stdout and "pending" in listed.stdout
    assert _job_state(fed, "east", "needs-approval") == "pending"
    for name in APPROVING:
        done = cli_here("site", "approve", "needs-approval", "--config", fed.config_path(name))
        assert done.returncode == 0, done.stderr
    _, model = _run(job, fed)
    assert model.site_names == ["east", "north"] and np.isclose(model.z.sum(), 1.0)
    assert _job_state(fed, "east", "needs-approval") == "served"


def test_a_sites_own_policy_refuses_and_the_job_reports_it_typed(local_ray, tmp_path, files):
    """Each site process enforces its own policy file: a site whose policy asks for more labelled
    points than it holds refuses; the job fails with a PrivacyError naming the rule and the site
    (relayed typed, one line), and the refusal is in that site's audit log."""
    import json

    two = {n: files[n] for n in ("east", "north")}
    n_east = files["east"].X_labeled.shape[0]
    strict = f"[limits]\nmin_points = {n_east + 1}\n"
    with LocalFederation(tmp_path, two, policies={"east": strict}) as fed:
        fed.wait_connected(timeout=180)
        with pytest.raises(PrivacyError) as info:
            _run(_job(fed, name="too-strict", site_timeout_s=60), fed)
        assert (info.value.rule, info.value.site) == ("min_points", "east"), str(info.value)
        assert str(info.value).startswith("site 'east' refuses") and "\n" not in str(info.value)
        records = [json.loads(x) for x in (fed.workdir / "east" / "audit.jsonl").read_text().splitlines()]
        assert any(
            r.get("job") == "too-strict" and r.get("outcome") == "refused" and r.get("rule") == "min_points"
            for r in records
        ), records[-3:]


def _audited_fit(federation, files, job_id, **kw):
    """A federated fit through the relay, every message recorded: (model, methods crossed,
    stand-in actors started)."""
    from msa_fed.artifacts.predictors import sha256_hex
    from msa_fed.boundary import messages as m
    from msa_fed.federation.relay_client import RelayClient
    from msa_fed.runtime.federated import FederatedSites

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "runtime"))
    from inspect_messages import audit

    _, preds, classes = local_kwargs(files, ORDER)
    rec = m.Recorder()
    with RelayClient(federation.address, federation.admin_token, insecure=True) as relay:
        backend = FederatedSites(
            ORDER,
            relay,
            [files[n].X_unlabeled for n in ORDER],
            job_id=job_id,
            predictor_sha256=[sha256_hex(files[n].predictor) for n in ORDER],
            classes=classes,
            data_channel="plain",
            **kw,
        )
        config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver={"objective": "minmax"})
        with Coordinator(backend, preds, config, recorder=rec) as c:
            model = c.fit()
            started = len(backend.stand_ins.sites)
    assert np.isclose(model.z.sum(), 1.0)
    assert audit(rec.records, {n: files[n].X_labeled.shape[0] for n in ORDER}) == []
    return model, {method for _, _, method, _ in rec.records}, started


def test_only_boundary_messages_cross_and_no_labelled_point(local_ray, federation, files):
    """The privacy audit of every message the coordinator exchanged in a federated run (the
    runtime tests' audit): boundary types only, nothing of a site's labelled size, no labels;
    labelled-data methods went to the site processes, classifier training to the stand-ins
    (asked for: the data-parallel path)."""
    from msa_fed.runtime.federated import ACTOR_METHODS, RELAY_METHODS

    _, methods, started = _audited_fit(federation, files, "audited", classifier_in_process=False)
    assert {"join_job", "set_domain_model", "set_qhat", "dc_evaluate"} <= methods
    assert {"setup_shard", "classifier_loss_grad"} <= methods and started == len(ORDER)
    assert methods <= RELAY_METHODS | ACTOR_METHODS | {"open_channel"}  # the stand-ins' data channel


def test_a_small_job_trains_its_classifier_in_the_coordinator_without_ray(federation, files):
    """On published samples this small the coordinator trains the domain classifier itself, on
    the samples it holds (one stacked L-BFGS): no stand-in actor starts (no Ray at all), nothing
    but the site processes' requests crosses (the boundary audit), and z is the local
    runtime's (the same training, to 1e-9) and the data-parallel training's (the sharded
    in-process run, the reference of the Ray runtime: the same optimum, to 1e-6)."""
    from msa_fed.runtime.federated import RELAY_METHODS

    model, methods, started = _audited_fit(federation, files, "audited-stacked")
    assert started == 0
    assert methods <= RELAY_METHODS | {"unlabeled_sample"}  # the samples it holds (recorded, not sent)
    assert {"join_job", "set_domain_model", "set_qhat", "dc_evaluate"} <= methods
    np.testing.assert_allclose(model.z, _local_z(files).z, rtol=0, atol=1e-9)
    np.testing.assert_allclose(model.z, _local_z(files, sharded=True).z, rtol=0, atol=1e-6)


def test_the_solvers_first_request_rides_with_set_qhat_through_the_relay(federation, files, monkeypatch):
    """set_qhat and the solver's first DC request travel in one relay Call (one round less): each
    site gets set_qhat first and answers it first (its audit log), every site answers exactly the
    solver's evaluations (nothing asked twice or in vain), and z is the local runtime's."""
    import json

    from msa_fed.federation.relay_client import RelayClient

    rounds: list[list[tuple[str, str]]] = []
    call = RelayClient.call

    def counted(self, job_id, calls, timeout_s):
        if job_id == "riding":
            rounds.append([(site, method) for site, method, _ in calls])
        return call(self, job_id, calls, timeout_s)

    monkeypatch.setattr(RelayClient, "call", counted)
    model, _, _ = _audited_fit(federation, files, "riding")
    np.testing.assert_allclose(model.z, _local_z(files).z, rtol=0, atol=1e-9)
    (setup,) = [r for r in rounds if ("north", "set_qhat") in r]
    assert setup == [(n, "set_qhat") for n in ORDER] + [(n, "dc_evaluate") for n in ORDER]
    n = model.info["solver"]["n_evaluations"]
    assert sum(method == "dc_evaluate" for r in rounds for _, method in r) == n * len(ORDER)
    for name in ORDER:
        lines = (federation.workdir / name / "audit.jsonl").read_text().splitlines()
        asked = [
            r["request"] for r in map(json.loads, lines) if r.get("job") == "riding" and r["outcome"] == "answered"
        ]
        assert asked.index("set_qhat") < asked.index("dc_evaluate") and asked.count("dc_evaluate") == n


def test_an_approval_wait_is_one_audit_line_and_every_count_agrees(local_ray, approving, files):
    """While one site waits for its operator, the job asks it again every few seconds: the site
    that approved first gets one join (not one per retry), the waiting site one audit line; and
    after the job, the site's status, its audit log, its end-of-job line and its budget lines
    count the same requests the same way (JobCounts)."""
    import json
    import re
    import sqlite3
    import threading
    import time

    from msa_fed.federation.config import SiteConfig
    from msa_fed.federation.site_status import site_status, status_lines
    from msa_fed.runtime.federated import APPROVAL_POLL_S
    from msa_fed.site.methods import COUNTED

    fed, two = approving, {n: files[n] for n in APPROVING}

    def approve(name):  # a process of its own: the job runs in this one meanwhile (cli_here swaps sys.stdout)
        done = cli_run("site", "approve", "waits", "--config", fed.config_path(name))
        assert done.returncode == 0, done.stderr

    def records(name):
        lines = (fed.workdir / name / "audit.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("job") == "waits"]

    def asked(name) -> int:  # the sealed requests the site took for the job (its seal floor, in its ledger)
        with sqlite3.connect(str(SiteConfig.from_toml(fed.config_path(name)).ledger_path)) as db:
            return sum(seq for (seq,) in db.execute("SELECT seq FROM seal_floors"))

    job = _job(fed, name="waits", site_timeout_s=60, approval_wait_s=240)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(out=_run(job, fed)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not all(records(n) for n in two) and time.monotonic() < deadline:
        time.sleep(0.5)
    approve("north")
    # east keeps the job waiting: it is asked again every APPROVAL_POLL_S
    north_joined = time.monotonic() + 120
    while not [r for r in records("north") if r["request"] == "join_job" and r["outcome"] == "answered"]:
        assert time.monotonic() < north_joined, fed.log_text("north")
        time.sleep(0.2)
    before = asked("east")
    while asked("east") < before + 3:
        assert time.monotonic() < north_joined + 4 * APPROVAL_POLL_S + 60, fed.log_text("east")
        time.sleep(0.2)
    approve("east")
    runner.join(timeout=600)
    assert "out" in result, "the job did not finish"
    record, model = result["out"]
    assert np.isclose(model.z.sum(), 1.0)

    # the model the registry stores keeps what the job saw of the sites' decisions, and its
    # report lists them per site: the waits (join refused under accept_jobs, east more than
    # once) and each operator's approval, after the wait began
    from msa_fed.control.registry.client import RegistryClient
    from msa_fed.jobs.report import report_html
    from msa_fed.jobs.run import model_from_bytes

    with RegistryClient(fed.address, fed.admin_token, insecure=True) as admin:
        stored = model_from_bytes(admin.download_combined_model(record.version)[0])
    kept = stored.info["consortium"]
    assert sorted(a["site"] for a in kept["approvals"]) == sorted(two), kept
    assert all(a["waited_since"] <= a["admitted_at"] for a in kept["approvals"]), kept
    waits = {r["site"]: r for r in kept["refusals"]}
    assert sorted(waits) == sorted(two) and len(kept["refusals"]) == 2, kept
    assert all((r["request"], r["rule"]) == ("join_job", "accept_jobs") for r in waits.values()), kept
    assert waits["east"]["count"] >= 3 and waits["east"]["first"] < waits["east"]["last"], kept
    section = report_html(stored).split("<h2>Refusals and approvals</h2>")[1].split("<h2>")[0]
    for name in two:
        assert f"<td>{name}</td><td>admitted by the operator of site {name} (msa-fed site approve) at" in section
    assert section.count("join_job (rule accept_jobs): ") == 2 and "2 approval(s)" in section

    for name in two:
        recs = records(name)
        joins = [r for r in recs if r["request"] == "join_job" and r["outcome"] == "answered"]
        waited = [r for r in recs if r.get("rule") == "accept_jobs"]
        assert len(joins) == 1 and len(waited) == 1, [(r["request"], r["outcome"]) for r in recs]
    assert asked("east") >= before + 3  # east was asked again, and recorded the wait once

    # one definition of what a job's requests are, in every place that shows them
    deadline = time.monotonic() + 60
    while not all("job waits ended" in fed.log_text(n) for n in two):
        assert time.monotonic() < deadline, fed.log_text("north")
        time.sleep(0.2)
    for name in two:
        recs = records(name)
        answered = [r for r in recs if r["outcome"] == "answered" and r["request"] in COUNTED]
        charged: dict = {}
        for r in recs:
            for kind, n in r.get("charged", {}).items():
                charged[kind] = charged.get(kind, 0) + n
        assert charged.get("dc_evaluation", 0) >= 2 and charged.get("domain_model") == 1, charged
        # the site's end-of-job line (counted by the running chain, not read from the log)
        (end,) = re.findall(
            r"job waits ended; answered (\d+) .*; refused (\d+); charged to the rolling day: (.*)",
            fed.log_text(name),
        )
        assert int(end[0]) == len(answered) and int(end[1]) == 0
        assert end[2] == ", ".join(
            f"{n} {k.replace('_', ' ')}{'s' if n != 1 else ''}" for k, n in sorted(charged.items())
        )
        status = site_status(SiteConfig.from_toml(fed.config_path(name)), ask_registry=False)
        (row,) = [j for j in status["jobs"] if j["job"] == "waits"]
        assert sum(row["answered"].values()) == len(answered) and row["refused"] == {}
        assert row["charged"] == charged and row["waited_for_approval"]
        # the budget lines (the ledger) count what the records charged, over every job the site
        # served (the approval tests share the module's approving sites)
        charged_all: dict = {}
        for r in map(json.loads, (fed.workdir / name / "audit.jsonl").read_text().splitlines()):
            for kind, n in r.get("charged", {}).items():
                charged_all[kind] = charged_all.get(kind, 0) + n
        assert charged.keys() <= charged_all.keys(), (charged, charged_all)
        for kind, n in charged_all.items():
            assert status["budgets"][kind]["used"] == n, (kind, status["budgets"])
        (line,) = [x for x in status_lines(status) if x.startswith("  job waits: ")]
        assert f"answered {len(answered)}, refused 0" in line
