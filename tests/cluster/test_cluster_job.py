"""The federated job on a real multi-process Ray cluster on one machine.

`ray start --head` plus one `ray start --address ... --resources '{"site:<name>": 1}'` worker
process per site (one cluster for the module), the registry server as its own process, sites
registering and publishing through the `msa-fed` CLI (run in the test's process: its gRPC calls
reach the registry's process all the same), a job driver as an `msa-fed run` process attached to
the cluster, and `ray job submit` running cluster/jobs/run_msa.py.  Every process is started in
its own process group and killed at the end, even on failure.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn
from msa_fed.experiments.demo_data import make_federation

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SITES = ("north", "east", "west")
JOB_SITES = ("east", "west")  # the Ray cluster gets a node for these two sites only
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes started in their own process groups, output to log files (a pipe nobody
    reads would fill up and block them)."""

    def __init__(self, log_dir: Path):
        self.procs = []
        self.log_dir = log_dir

    def start(self, args, env=None, **kw):
        log = open(self.log_dir / f"proc{len(self.procs)}.log", "w")
        p = subprocess.Popen(args, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT, **kw)
        p.log_path = Path(log.name)
        log.close()
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 20
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def node_ports() -> list[str]:
    """Ports that every Ray node binds at a fixed default: several nodes on one host (and any
    other Ray on it) would collide, so each node gets free ones."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]


def cli(*args, env=None, check=True):
    """``msa-fed ARGS`` in a new process (the job driver: it starts its own local Ray)."""
    out = subprocess.run([str(BIN / "msa-fed"), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"msa-fed {' '.join(args)} failed: {out.stdout}\n{out.stderr}")
    return out


def setup_cli(*args) -> str:
    """``msa-fed ARGS`` of the set-up (tokens, site register and publish) in this process
    (tests/cli_runner.py: the same command without a new interpreter's imports); its stdout."""
    rc, out, err = run_cli(*args)
    if rc != 0:
        raise AssertionError(f"msa-fed {' '.join(map(str, args))} failed: {out}\n{err}")
    return out


def wait_for(predicate, timeout, what, interval=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


#: tries at starting a Ray node (a failed one costs about 40 s: only under heavy load)
START_TRIES = 5
#: what `ray start --block` prints once its node is up (a worker node: registered with the head's GCS)
RAY_STARTED = "block forever"


def started_or_exited(proc) -> bool:
    """Whether the `ray start --block` process ``proc`` printed that its node is up, or exited.
    A read of its log file: polling `ray status` instead (a Python process and a GCS connection
    per look) took CPU from the very nodes it waited for on a two-core machine."""
    return proc.poll() is not None or RAY_STARTED in proc.log_path.read_text(errors="replace")


def kill_group(proc) -> None:
    """Kill what is left of the process group of ``proc`` (a `ray start` that exited: the
    processes it had started, a GCS or a raylet, may still run)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Registry process + sites registered over gRPC via the CLI; yields paths and tokens."""
    tmp = tmp_path_factory.mktemp("federation")
    env = dict(os.environ, GRPC_VERBOSITY="ERROR")
    procs = Procs(tmp)
    try:
        db = tmp / "registry.db"
        admin = setup_cli("admin", "issue-token", "--db", str(db), "--admin").strip().splitlines()[-1]
        (tmp / "admin_token").write_text(admin)
        port = free_port()
        address = f"127.0.0.1:{port}"
        server = procs.start(
            [str(BIN / "msa-fed"), "registry", "serve", "--db", str(db), "--listen", address, "--insecure"], env=env
        )

        def up():
            if server.poll() is not None:
                raise AssertionError(f"registry exited: {server.log_path.read_text()}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(up, 30, "the registry to listen")
        fed = make_federation(n_labeled=200, n_unlabeled=300, n_test=1000)
        for name in SITES:
            d = fed[name]
            token = setup_cli("admin", "issue-token", "--db", str(db), "--site", name).strip().splitlines()[-1]
            h = LogisticRegression().fit(d["X_train"], d["y_train"])
            (tmp / f"{name}.onnx").write_bytes(export_sklearn(h, n_features=2))
            np.save(tmp / f"{name}_unlabeled.npy", d["X_unlabeled"])
            np.savez(
                tmp / f"{name}.npz", X_labeled=d["X_labeled"], y_labeled=d["y_labeled"], X_unlabeled=d["X_unlabeled"]
            )
            common = ["--registry", address, "--token", token, "--insecure"]
            setup_cli("site", "register", *common, "--name", name)
            setup_cli(
                "site",
                "publish",
                *common,
                "--predictor",
                str(tmp / f"{name}.onnx"),
                "--unlabeled",
                str(tmp / f"{name}_unlabeled.npy"),
                "--labeled",
                str(tmp / f"{name}.npz"),
            )
        yield dict(tmp=tmp, address=address, admin=admin, fed=fed, env=env, db=db)
    finally:
        procs.stop_all()


def write_job(tmp: Path, address: str, sites=(), name="job", ray_address: str | None = None) -> Path:
    job = tmp / f"{name}.toml"
    job.write_text(
        f'name = "{name}"\n[registry]\naddress = "{address}"\ninsecure = true\n'
        f'admin_token_file = "{tmp / "admin_token"}"\n'
        f'[model]\ntask = "classification"\nfeatures = "standard"\n'
        f'[run]\ntopology = "cluster"\nsites = {json.dumps(list(sites))}\nsite_data = "{tmp}/{{site}}.npz"\n'
        + (f'ray_address = "{ray_address}"\n' if ray_address else "")
    )
    return job


def cluster_env(f: dict, tmp: Path) -> dict:
    """The environment of the cluster's processes and of the clients that reach it (`ray status`,
    `ray job submit`, a job driver attaching to it)."""
    # Ray's token authentication stays on: every process of this cluster shares one token
    env = dict(
        f["env"],
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        # a loaded two-core machine starts a node's dashboard agent slowly; the raylet's
        # default wait for it is short and kills the node
        RAY_agent_register_timeout_ms="120000",
        MSA_FED_OUTPUT_ROOT=str(tmp / "job-outputs"),  # the submitted job saves its model here
        # a node told to stop (SIGTERM) stops at once: no drain of up to 30 s for running work,
        # which the module's end (or a node started again) would wait out for nothing
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )
    env.pop("RAY_ADDRESS", None)
    # conftest's loopback switch: `ray start` refuses workers under it
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


@pytest.fixture(scope="module")
def ray_cluster(federation, tmp_path_factory):
    """`ray start --head` and one `ray start --address ...` worker node per site of JOB_SITES
    (carrying its ``site:<name>`` resource), token authentication on; shared by the tests that
    need a running cluster, stopped at the end of the module.  Yields the clients' environment
    and the head's GCS and dashboard ports."""
    tmp = tmp_path_factory.mktemp("ray-cluster")
    env = cluster_env(federation, tmp)
    procs = Procs(tmp)
    ray_bin = str(BIN / "ray")
    # nobody reads the workers' output through a driver here (the job's own log is the job
    # supervisor's file): no log monitor process per node
    common = ["--num-cpus=1", "--object-store-memory=200000000", "--disable-usage-stats", "--include-log-monitor=false"]
    try:
        # the head's own raylet has the same fixed waits (below): started again, on fresh
        # ports, up to START_TRIES times
        for _attempt in range(START_TRIES):
            gcs_port, dash_port = free_port(), free_port()
            head = procs.start(
                [
                    ray_bin,
                    "start",
                    "--head",
                    "--block",
                    f"--port={gcs_port}",
                    *common,
                    f"--dashboard-port={dash_port}",
                    "--dashboard-host=127.0.0.1",
                    "--include-dashboard=true",
                    *node_ports(),
                ],
                env=env,
            )
            wait_for(lambda: started_or_exited(head), 120, "the Ray head")
            if head.poll() is None:
                break
            kill_group(head)
        else:
            raise AssertionError(f"the Ray head exited {START_TRIES} times:\n{head.log_path.read_text()[-2000:]}")

        # one worker node per site, started one after the other (two cores: parallel starts time out)
        for name in JOB_SITES:
            # `ray start` gives its raylet a fixed 30 s to register with the head's GCS and then
            # exits ("timed out during startup"), and the raylet itself aborts when its node's
            # dashboard agent has not written its ports within about 15 s (fixed in Ray): a
            # loaded two-core machine exceeds both at times.  A node whose command exited is
            # started again, and its log is shown if it never stays up.  `ray start --block`
            # prints RAY_STARTED once the GCS lists its node.
            for _attempt in range(START_TRIES):
                node = procs.start(
                    [
                        ray_bin,
                        "start",
                        "--block",
                        f"--address=127.0.0.1:{gcs_port}",
                        *common,
                        f"--resources={json.dumps({f'site:{name}': 1})}",
                        *node_ports(),
                    ],
                    env=env,
                )
                wait_for(lambda: started_or_exited(node), 300, f"the node of site {name}")
                if node.poll() is None:
                    break
                kill_group(node)
            else:
                raise AssertionError(
                    f"the node of site {name} exited {START_TRIES} times:\n{node.log_path.read_text()[-2000:]}"
                )

        def status() -> str:
            out = subprocess.run(
                [ray_bin, "status", f"--address=127.0.0.1:{gcs_port}"], env=env, capture_output=True, text=True
            )
            return out.stdout

        # every site node up: the head lists their resources (`ray status` reads the head's
        # resource view, which follows a node's registration within a few seconds); one look
        # for all nodes (a `ray status` is a Python process and a GCS connection: CPU taken
        # from the nodes on a two-core machine)
        def all_listed() -> bool:
            view = status()
            return all(f"site:{n}" in view for n in JOB_SITES)

        wait_for(
            lambda: all_listed() or head.poll() is not None,
            120,
            "the site nodes in the head's view",
            1,
        )
        assert head.poll() is None, head.log_path.read_text()[-2000:]
        yield dict(env=env, gcs=f"127.0.0.1:{gcs_port}", dashboard=f"http://127.0.0.1:{dash_port}", bin=ray_bin)
    finally:
        procs.stop_all()


def test_job_fails_before_training_on_bad_setup(federation, ray_cluster, tmp_path):
    """A wrong admin token, and a registered site without a Ray node: one clear line each."""
    f = federation
    job = write_job(f["tmp"], f["address"], name="bad")
    # wrong admin token: refused by the registry before any Ray work (in this process, which
    # starts no Ray: the second run below is the driver process that does)
    bad_token = tmp_path / "bad_token"
    bad_token.write_text("admin.operator.not-the-secret")
    rc, _, err = run_cli("run", "--job", str(job), "--admin-token-file", str(bad_token))
    assert rc != 0
    assert err.strip().startswith("error: UNAUTHENTICATED"), err
    assert "Traceback" not in err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    # a registered site with no Ray node carrying its resource: the job driver attaches to the
    # cluster (RAY_ADDRESS), whose nodes carry the resources of east and west only; the error
    # names the one site without a node
    out = cli("run", "--job", str(job), env=dict(ray_cluster["env"], RAY_ADDRESS=ray_cluster["gcs"]), check=False)
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and out.stderr.strip().endswith(ours[0]), out.stderr  # (Ray may warn first)
    assert ours[0].startswith("error: site(s) north are registered but no Ray node carries the resource 'site:north';")
    assert "site:east" not in ours[0] and "site:west" not in ours[0]


def test_job_rejects_corrupted_artifact(federation, tmp_path):
    """A predictor whose stored bytes were altered in the registry is refused before training
    (the job, run in this process: it fails before it would start or reach any Ray)."""
    import hashlib
    import sqlite3

    f = federation
    # publish a fourth site whose ONNX file is then truncated inside the database
    db = f["db"]
    token = setup_cli("admin", "issue-token", "--db", str(db), "--site", "broken").strip().splitlines()[-1]
    common = ["--registry", f["address"], "--token", token, "--insecure"]
    setup_cli("site", "register", *common, "--name", "broken")
    rng = np.random.default_rng(1)
    X = rng.normal(size=(100, 2))
    onnx = export_sklearn(LogisticRegression().fit(X, (X[:, 0] > 0).astype(int)), n_features=2)
    (tmp_path / "broken.onnx").write_bytes(onnx)
    setup_cli("site", "publish", *common, "--predictor", str(tmp_path / "broken.onnx"))
    job = write_job(f["tmp"], f["address"], sites=("north", "broken"), name="corrupt")
    sha = hashlib.sha256(onnx).hexdigest()
    with sqlite3.connect(db) as con:  # flip the stored bytes behind the registry's back
        changed = con.execute("update blobs set data = substr(data, 1, 100) where sha256 = ?", (sha,)).rowcount
    assert changed == 1
    rc, _, err = run_cli("run", "--job", str(job))
    assert rc != 0
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    assert any(word in err for word in ("sha256", "DATA_LOSS", "corrupt", "rejected")), err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_ray_job_submit_end_to_end(federation, ray_cluster):
    f, c = federation, ray_cluster
    env = c["env"]
    intruder = subprocess.run(
        [c["bin"], "status", f"--address={c['gcs']}"],
        capture_output=True,
        text=True,
        env=dict(env, RAY_AUTH_TOKEN=secrets.token_hex(32)),
    )
    assert intruder.returncode != 0 and "InvalidAuthToken" in intruder.stderr
    # the job names its cluster: run_msa.py's default ("auto") is the Ray started last on this
    # machine, which another test's Ray (or another run's) may be by the time the driver starts
    job = write_job(f["tmp"], f["address"], sites=JOB_SITES, name="submitted", ray_address=c["gcs"])
    submit = [
        c["bin"],
        "job",
        "submit",
        f"--address={c['dashboard']}",
        "--working-dir",
        str(REPO),  # the documented command: the checkout's .rayignore leaves its .git out
        "--",
        sys.executable,
        "cluster/jobs/run_msa.py",
        "--job",
        str(job),
        "--quiet",
    ]
    lost_dir_retries = 1
    for _ in range(30):  # the head's job agent comes up some seconds after the head itself
        sub = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=420)
        out = sub.stderr + sub.stdout
        if "No available agent to submit job" in out:
            time.sleep(3)
            continue
        # Ray may delete the unpacked working dir under a running driver (ray-project/ray#49254;
        # run_msa.py preloads msa_fed to narrow the window): one more submission, not more
        if sub.returncode != 0 and "No module named 'msa_fed" in out and lost_dir_retries:
            lost_dir_retries -= 1
            continue
        break
    assert sub.returncode == 0, sub.stdout[-3000:] + sub.stderr[-3000:]
    assert "stored combined model version" in sub.stdout

    from msa_fed.control.registry.client import RegistryClient
    from msa_fed.jobs.run import model_from_bytes

    with RegistryClient(f["address"], f["admin"], insecure=True) as admin:
        data, record = admin.download_combined_model()
    manifest = json.loads(record.manifest_json)
    assert manifest["sites"] == list(JOB_SITES)
    assert len(manifest["predictor_sha256"]) == 2
    model = model_from_bytes(data)
    fed = f["fed"]
    accs = [np.mean(model.predict(fed[n]["X_test"]) == fed[n]["y_test"]) for n in JOB_SITES]
    unif = []
    for n in JOB_SITES:
        X = fed[n]["X_test"]
        P = np.mean([model.predictors[k].predict_proba(X) for k in range(2)], axis=0)
        unif.append(np.mean(P.argmax(1) == fed[n]["y_test"]))
    assert np.mean(accs) > np.mean(unif) + 0.1, (accs, unif)
    assert abs(sum(model.z) - 1) < 1e-9
