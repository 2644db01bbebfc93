"""Control-plane benchmark: RPC throughput and latency, upload throughput, with and without TLS.

    .venv/bin/python benchmarks/bench_control.py            # full run (about a minute)
    .venv/bin/python benchmarks/bench_control.py --quick    # smoke run (a few seconds of load)

The registry runs as a separate process (``msa-fed registry serve``, SQLite
database in a temporary folder, WAL, synchronous=FULL), so the server and the
benchmark's client threads do not share a GIL.  For each transport
(plaintext loopback, TLS) it measures:

- register and heartbeat: ``--clients`` threads, each with its own channel and
  site token, issue ``--calls`` RPCs in total; throughput (RPC/s) and per-call
  latency percentiles; then one client alone (``--calls / 4`` RPCs), whose
  latency has no queueing in it;
- upload: one client publishes an unlabelled sample of ``--upload-mb`` MB and
  an ONNX predictor of about ``--upload-mb / 2`` MB (validated by the server
  with onnxruntime), ``--repeats`` times each with fresh content; MB/s counts
  payload bytes over the whole RPC, validation and commit included;
- under attack: the heartbeat and health-check load again, while one hostile
  site (a separate process, one site token) keeps ``--attack-streams`` upload
  streams open that send a header and then nothing (re-opened as soon as they
  are refused or cut off), two threads that upload ``--upload-mb`` MB samples
  back to back, and ten threads that open heartbeat calls whose request never
  comes; then again while the site only uploads big samples back to back (two
  at a time, its limit: each is received, checked and refused or stored).
  The rows sit beside the calm ones.

Prints a table and writes JSON to ``benchmarks/results/control.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from msa_fed.artifacts.predictors import META_KIND, META_N_FEATURES  # noqa: E402
from msa_fed.control.registry.client import RegistryClient  # noqa: E402
from msa_fed.control.registry.service import Registry  # noqa: E402
from msa_fed.control.registry.sqlite_store import SqliteStore  # noqa: E402


def make_pki(folder: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 (EC P-256)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {k: str(v) for k, v in paths.items()}


def big_predictor(n_bytes: int, seed: int) -> bytes:
    """A valid ONNX regression predictor (3 features) padded with an unused initializer to ~n_bytes."""
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["y"])],
        "bench",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [
            numpy_helper.from_array(rng.normal(size=(3, 1)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.normal(size=n_bytes // 4).astype(np.float32), "padding"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {META_KIND: "regression", META_N_FEATURES: "3"})
    return model.SerializeToString()


def start_server(db: Path, tls: dict | None) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "msa_fed.cli",
        "registry",
        "serve",
        "--db",
        str(db),
        "--listen",
        "127.0.0.1:0",
        "--log-level",
        "WARNING",
        "--max-sample-mb",
        "1024",
        "--max-predictor-mb",
        "512",
    ]
    cmd += ["--tls-cert", tls["cert"], "--tls-key", tls["key"]] if tls else ["--insecure"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            match = re.search(r"listening on (\S+)", proc.stdout.readline())
            if match:
                return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"registry exited with status {proc.returncode}")
    proc.kill()
    raise SystemExit("registry did not start")


def attacker(
    address: str, token: str, seconds: float, streams: int, upload_mb: float, tls_ca: str | None, kind: str = "stalled"
) -> dict:
    """One hostile site for ``seconds``.

    ``kind`` "stalled": ``streams`` stalled uploads kept open, ten heartbeat calls whose request never comes, and
    two threads of big uploads back to back; "big": only the big uploads (each one is received and checked).
    """
    from msa_fed.boundary.proto import registry_pb2 as pb
    from msa_fed.boundary.proto import registry_pb2_grpc as pb_grpc
    from msa_fed.control.server import MAX_MESSAGE_BYTES

    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if tls_ca:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()), options)
    else:
        channel = grpc.insecure_channel(address, options)
    stub = pb_grpc.RegistryStub(channel)
    md = (("authorization", f"Bearer {token}"),)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Timer(seconds, stop.set).start()
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(key: str):
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def stalled_stream():
        while not stop.is_set():
            header = pb.PredictorHeader(upload_id=os.urandom(8).hex(), sha256="0" * 64, size=2**20)

            def messages(header=header):
                yield pb.UploadPredictorRequest(header=header)
                stop.wait()

            try:
                stub.UploadPredictor(messages(), metadata=md, timeout=seconds + 30)
                count("stalled: OK")
            except grpc.RpcError as exc:
                count(f"stalled: {exc.code().name}")
                time.sleep(0.01)

    def half_open_calls():
        """Heartbeats that send their headers and never their request message."""
        call = channel.stream_unary(
            "/msa_fed.v1.Registry/Heartbeat", request_serializer=lambda m: m, response_deserializer=lambda b: b
        )
        while not stop.is_set():

            def nothing():
                stop.wait()
                return
                yield

            try:
                call(nothing(), metadata=md, timeout=seconds + 30)
                count("half-open: OK")
            except grpc.RpcError as exc:
                count(f"half-open: {exc.code().name}")
                time.sleep(0.01)

    rows = max(1, int(upload_mb * 2**20 / (4 * 3)))
    data = np.random.default_rng(7).normal(size=(rows, 3)).astype("<f4").tobytes()

    def big_uploads():
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        while not stop.is_set():
            header = pb.SampleHeader(upload_id=os.urandom(8).hex(), sha256=digest, rows=rows, cols=3, dtype="float32")

            def messages(header=header):
                yield pb.UploadSampleRequest(header=header)
                for start in range(0, len(data), 2**20):
                    yield pb.UploadSampleRequest(chunk=data[start : start + 2**20])

            try:
                stub.UploadSample(messages(), metadata=md, timeout=seconds + 30)
                count("big: OK")
            except grpc.RpcError as exc:
                count(f"big: {exc.code().name}")
                time.sleep(0.01)

    threads = [threading.Thread(target=big_uploads) for _ in range(2)]
    if kind == "stalled":
        threads += [threading.Thread(target=stalled_stream) for _ in range(streams)]
        threads += [threading.Thread(target=half_open_calls) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    return counts


def start_attacker(
    address: str, token: str, seconds: float, streams: int, upload_mb: float, tls_ca: str | None, kind: str
):
    cmd = [
        sys.executable,
        __file__,
        "--attacker",
        address,
        "--attacker-token",
        token,
        "--attack-seconds",
        str(seconds),
        "--attack-streams",
        str(streams),
        "--upload-mb",
        str(upload_mb),
        "--attack-kind",
        kind,
    ]
    if tls_ca:
        cmd += ["--attacker-tls-ca", tls_ca]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def rpc_load(address, tokens, names, op: str, calls: int, client_kwargs) -> dict:
    """``calls`` RPCs of ``op`` spread over one thread per token; throughput and latency."""
    per_thread = calls // len(tokens)
    latencies: list[list[float]] = [[] for _ in tokens]
    barrier = threading.Barrier(len(tokens) + 1)
    errors: list[str] = []

    def work(i):
        try:
            with RegistryClient(address, tokens[i], retries=0, **client_kwargs) as client:
                client.register(names[i])  # connect (and handshake) before timing
                fn = {
                    "register": lambda: client.register(names[i]),
                    "heartbeat": client.heartbeat,
                    "health": client.health,
                }[op]
                barrier.wait()
                for _ in range(per_thread):
                    t0 = time.perf_counter()
                    fn()
                    latencies[i].append(time.perf_counter() - t0)
        except Exception as exc:  # reported, and fails the run
            errors.append(repr(exc))
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(tokens))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{op} failed: {errors[0]}")
    flat = [x for lat in latencies for x in lat]
    return {
        "calls": len(flat),
        "seconds": wall,
        "rpc_per_s": len(flat) / wall,
        "p50_ms": 1e3 * percentile(flat, 50),
        "p99_ms": 1e3 * percentile(flat, 99),
        "max_ms": 1e3 * max(flat),
    }


def upload_load(address, token, name, upload_mb: float, repeats: int, client_kwargs) -> dict:
    rows = int(upload_mb * 2**20 / (4 * 3))  # 3 columns: the width of big_predictor
    out = {}
    with RegistryClient(address, token, retries=0, transfer_timeout=600, **client_kwargs) as client:
        client.register(name)
        sample_times, predictor_times = [], []
        predictor_bytes = 0
        for r in range(repeats):
            X = np.random.default_rng(r).normal(size=(rows, 3)).astype(np.float32)
            t0 = time.perf_counter()
            client.upload_sample(X)
            sample_times.append(time.perf_counter() - t0)
        for r in range(repeats):
            data = big_predictor(int(upload_mb * 2**20 / 2), seed=r)
            predictor_bytes = len(data)
            t0 = time.perf_counter()
            client.upload_predictor(data)
            predictor_times.append(time.perf_counter() - t0)
        sample_mb = rows * 3 * 4 / 1e6
        out["sample"] = {
            "mb": sample_mb,
            "seconds_median": statistics.median(sample_times),
            "mb_per_s": sample_mb / statistics.median(sample_times),
        }
        out["predictor"] = {
            "mb": predictor_bytes / 1e6,
            "seconds_median": statistics.median(predictor_times),
            "mb_per_s": predictor_bytes / 1e6 / statistics.median(predictor_times),
        }
    return out


def under_attack(address, tokens, names, evil_token, args, client_kwargs, tls_ca) -> dict:
    """The heartbeat and health rows again while one site floods the registry with uploads (two kinds of flood)."""
    with RegistryClient(address, evil_token, retries=0, **client_kwargs) as evil:
        evil.register("attacker")
    out = {}
    for kind, label in (("stalled", "under attack"), ("big", "big uploads")):
        proc = start_attacker(address, evil_token, 600.0, args.attack_streams, args.upload_mb, tls_ca, kind)
        try:
            time.sleep(5.0)  # let the flood build up
            if proc.poll() is not None:
                raise SystemExit(f"the attacker exited with status {proc.returncode}")
            for op in ("heartbeat", "health"):
                out[f"{op} ({label})"] = rpc_load(address, tokens, names, op, args.calls, client_kwargs)
        finally:
            proc.terminate()
            try:
                stdout, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
        out[f"attack ({label})"] = json.loads(stdout) if stdout.strip() else {"note": "stopped before reporting"}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads (default 8)")
    parser.add_argument("--calls", type=int, default=4000, help="RPCs per measurement (default 4000)")
    parser.add_argument("--upload-mb", type=float, default=32.0, help="sample size in MB (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="uploads per kind (default 3)")
    parser.add_argument("--attack-streams", type=int, default=40, help="stalled upload streams of the attacker")
    parser.add_argument("--attack-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--attacker", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--attacker-token", help=argparse.SUPPRESS)
    parser.add_argument("--attacker-tls-ca", help=argparse.SUPPRESS)
    parser.add_argument("--attack-kind", default="stalled", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "control.json"))
    args = parser.parse_args(argv)
    if args.attacker:  # the hostile site's process
        print(
            json.dumps(
                attacker(
                    args.attacker,
                    args.attacker_token,
                    args.attack_seconds,
                    args.attack_streams,
                    args.upload_mb,
                    args.attacker_tls_ca,
                    args.attack_kind,
                )
            )
        )
        return 0
    if args.quick:
        args.calls, args.upload_mb, args.repeats = 400, 4.0, 1

    results = {
        "config": {"clients": args.clients, "calls": args.calls, "upload_mb": args.upload_mb, "repeats": args.repeats},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "grpc": grpc.__version__,
            "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg(),
        },
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pki = make_pki(tmp)
        for mode in ("plaintext", "tls"):
            db = tmp / f"{mode}.db"
            with SqliteStore(db) as store:
                reg = Registry(store)
                names = [f"bench-{i}" for i in range(args.clients)] + ["uploader"]
                tokens = [reg.issue_token("site", n) for n in names]
                evil_token = reg.issue_token("site", "attacker")
            client_kwargs = {"insecure": True} if mode == "plaintext" else {"tls_ca": pki["ca"]}
            proc, address = start_server(db, pki if mode == "tls" else None)
            try:
                run = {
                    op: rpc_load(address, tokens[:-1], names[:-1], op, args.calls, client_kwargs)
                    for op in ("register", "heartbeat", "health")
                }
                for op in ("register", "heartbeat"):  # one client alone: latency without queueing
                    run[f"{op} (1 client)"] = rpc_load(
                        address, tokens[:1], names[:1], op, max(args.calls // 4, 100), client_kwargs
                    )
                run["upload"] = upload_load(address, tokens[-1], names[-1], args.upload_mb, args.repeats, client_kwargs)
                run.update(
                    under_attack(
                        address,
                        tokens[:-1],
                        names[:-1],
                        evil_token,
                        args,
                        client_kwargs,
                        pki["ca"] if mode == "tls" else None,
                    )
                )
            finally:
                proc.terminate()
                proc.wait(30)
            results["runs"][mode] = run

    print(
        f"control plane, {args.clients} client threads ({args.calls} RPCs) or 1 client "
        f"({max(args.calls // 4, 100)} RPCs) per row, loopback, "
        f"{os.cpu_count()} CPUs (load average at start {results['machine']['loadavg_at_start'][0]:.1f})"
    )
    print(f"{'transport':<10} {'operation':<24} {'throughput':>14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for mode, run in results["runs"].items():
        for op in (
            "register",
            "heartbeat",
            "health",
            "register (1 client)",
            "heartbeat (1 client)",
            "heartbeat (under attack)",
            "health (under attack)",
            "heartbeat (big uploads)",
            "health (big uploads)",
        ):
            r = run[op]
            print(
                f"{mode:<10} {op:<24} {r['rpc_per_s']:>10.0f} RPC/s {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                f"{r['max_ms']:>8.1f}"
            )
        for kind in ("sample", "predictor"):
            u = run["upload"][kind]
            label = f"upload {kind} {u['mb']:.0f} MB"
            print(f"{mode:<10} {label:<24} {u['mb_per_s']:>11.1f} MB/s")
        for label in ("under attack", "big uploads"):
            print(f"{mode:<10} attacker's calls ({label}): {json.dumps(run[f'attack ({label})'], sort_keys=True)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
