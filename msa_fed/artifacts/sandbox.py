"""Run the first load and the probe of an untrusted ONNX model in a separate, limited process.

Each load gets its own child process: forked from a helper that has imported numpy and onnx
once (:mod:`msa_fed.artifacts.zygote`, the default), or a fresh ``python -I -B`` (the fallback,
``SANDBOX_START = "spawn"``).  Either way the child runs with close_fds, a minimal
environment, an empty temporary working directory and its own session (so that a wall-clock
timeout kills the whole group).  It sets its rlimits (address space, CPU time, open files,
file size 0, no core file) before it reads a byte of the model or imports onnxruntime, then
reads the model (and the optional probe sample) from stdin, runs every check of
:mod:`msa_fed.artifacts.structure`, the ONNX checker, an onnxruntime session and the probe
batch, and writes one JSON verdict on a private copy of its stdout (what onnxruntime or numpy
may print goes to /dev/null).  Nothing crosses the boundary as pickle.

Verdict: ``{"ok": true, "kind", "n_features", "classes", "rows", "maxrss_kb"}`` or
``{"ok": false, "code", "args", "detail"}`` (``code`` is a key of structure.REASONS).

Measured (benchmarks/bench_artifacts.py, 2-core machine shared by other jobs, load average
16-32): a sandboxed load costs 160-330 ms from the helper, 500-780 ms from a fresh interpreter,
against 0.5-16 ms for the same checks in-process; a small model's child peaks near 210 MiB of
address space, hence the 1 GiB default of :data:`SANDBOX_MEMORY_BYTES`.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

#: Address-space limit of the sandbox process (RLIMIT_AS).  A server charges this much to its
#: in-flight memory budget for every load it runs.
SANDBOX_MEMORY_BYTES = 1 << 30
SANDBOX_CPU_SECONDS = 30  # RLIMIT_CPU (soft; SIGKILL one second later at the hard limit)
SANDBOX_TIMEOUT_S = 60.0  # wall clock, start-up included (the machine may be loaded)
SANDBOX_MAX_FILES = 32  # RLIMIT_NOFILE: enough for the imports, nothing for a model
MAX_VERDICT_BYTES = 4 << 20  # room for MAX_CLASSES labels


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed load (see the module constants for the defaults)."""

    memory_bytes: int = SANDBOX_MEMORY_BYTES
    cpu_seconds: int = SANDBOX_CPU_SECONDS
    timeout_s: float = SANDBOX_TIMEOUT_S
    max_files: int = SANDBOX_MAX_FILES

    def __post_init__(self):
        for name in ("memory_bytes", "cpu_seconds", "max_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer; got {value!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"SandboxLimits.timeout_s must be a positive finite number; got {t!r}")


# --------------------------------------------------------------------------- child


def _set_limits(req: dict) -> None:
    import resource

    mem = int(req["memory_bytes"])
    cpu = int(req["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    nofile = int(req["max_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(1 << 20, n - got))
        if not chunk:
            raise EOFError(f"stdin ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _evaluate(data: bytes, req: dict, sample) -> dict:
    """Every check, in order; returns the success verdict or raises structure.Refusal."""
    import onnx
    from google.protobuf.message import DecodeError

    from msa_fed.artifacts import structure as st

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise st.Refusal("not_onnx", f"{type(exc).__name__}: {exc}") from None
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise st.Refusal("no_graph")
    st.check_structure(model)
    d_kind, d_width, classes = st.read_declaration(model, req["kind"], req["n_features"], req["max_features"])
    st.check_expectations(d_kind, d_width, req["kind"], req["n_features"], req["max_features"])
    st.check_io(model, d_width)
    if sample is not None and sample.shape[1] != d_width:
        raise st.Refusal("sample", cols=int(sample.shape[1]), width=d_width)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001 - the checker raises several types
        raise st.Refusal("checker", f"{type(exc).__name__}: {exc}") from None
    del model
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4
    options.add_session_config_entry("session.load_model_format", "ONNX")
    try:
        session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
        raise st.Refusal("ort_load", f"{type(exc).__name__}: {exc}") from None
    probe = st.make_probe(d_width, sample)
    try:
        out = session.run([session.get_outputs()[0].name], {session.get_inputs()[0].name: probe})[0]
    except Exception as exc:  # noqa: BLE001
        raise st.Refusal("probe_failed", f"{type(exc).__name__}: {exc}") from None
    classes = st.check_outputs(out, d_kind, probe.shape[0], classes)
    return {"ok": True, "kind": d_kind, "n_features": d_width, "classes": classes, "rows": int(probe.shape[0])}


def main() -> int:
    """Child entry point: ``argv[1]`` is the JSON request; model (and sample) bytes on stdin."""
    return child(json.loads(sys.argv[1]))


def child(req: dict) -> int:
    """The sandboxed side of one load: fd 0 gives the request's bytes, the verdict goes to fd 1.

    Sets the limits first (nothing of the model has been read yet), then evaluates."""
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # whatever a library prints never mixes with the verdict
    os.close(devnull)
    _set_limits(req)
    if req.get("serve"):  # a long-lived predictor worker (msa_fed.artifacts.isolated)
        from msa_fed.artifacts.isolated import serve

        return serve(0, result_fd)
    verdict: dict
    if req.get("self_check"):
        verdict = _self_check()
    else:
        verdict = _run_request(req)
    import resource

    verdict["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    os.write(result_fd, json.dumps(verdict).encode() + b"\n")
    os.close(result_fd)
    return 0


def _self_check() -> dict:
    """What a model would find around it: working directory, environment, descriptors, limits."""
    import resource

    names = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")
    return {
        "ok": True,
        "cwd_entries": sorted(os.listdir(".")),
        "env": sorted(os.environ),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "rlimits": {n: list(resource.getrlimit(getattr(resource, n))) for n in names},
        "modules": sorted(m for m in ("numpy", "onnx", "onnxruntime") if m in sys.modules),
    }


def _run_request(req: dict) -> dict:
    try:
        data = _read_exactly(0, int(req["model_bytes"]))
        sample = None
        rows, cols = int(req["sample_rows"]), int(req["sample_cols"])
        if rows:
            import numpy as np

            sample = np.frombuffer(_read_exactly(0, rows * cols * 4), dtype="<f4").reshape(rows, cols)
        verdict = _evaluate(data, req, sample)
    except MemoryError as exc:
        verdict = {"ok": False, "code": "memory", "args": {}, "detail": f"MemoryError: {exc}"}
    except Exception as exc:  # noqa: BLE001 - every failure becomes a verdict
        from msa_fed.artifacts.structure import Refusal

        if isinstance(exc, Refusal):
            verdict = {"ok": False, "code": exc.code, "args": exc.args_, "detail": exc.detail[:4000]}
        else:
            verdict = {"ok": False, "code": "probe_failed", "args": {}, "detail": f"{type(exc).__name__}: {exc}"[:4000]}
        if any(sign in verdict["detail"] for sign in ("bad_alloc", "Failed to allocate", "alloc failed")):
            verdict["code"] = "memory"  # onnxruntime's and protobuf's words for an allocation refused by RLIMIT_AS
    return verdict


# --------------------------------------------------------------------------- parent

_BOOT = "import sys; sys.path.insert(0, sys.argv[2]); from msa_fed.artifacts.sandbox import main; sys.exit(main())"
#: "zygote": fork each sandbox from a pre-imported helper process (fast; see zygote.py);
#: "spawn": start a fresh interpreter per load.  The zygote falls back to spawn if it cannot start.
SANDBOX_START = "zygote"
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}


def package_root() -> str:
    import msa_fed

    return os.path.dirname(os.path.dirname(os.path.abspath(msa_fed.__file__)))


def kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def exchange(wfd: int, rfd: int, payload: bytes, deadline: float, close_write) -> tuple[bytes, bool]:
    """Write ``payload`` to ``wfd`` (then ``close_write()``) while reading ``rfd`` to EOF, keeping
    at most MAX_VERDICT_BYTES; returns (output, timed_out).  Never blocks past ``deadline``
    (time.monotonic).  ``wfd`` and ``rfd`` may be the same socket."""
    os.set_blocking(wfd, False)
    os.set_blocking(rfd, False)
    sel = selectors.DefaultSelector()
    view, out = memoryview(payload), bytearray()
    want = {rfd: selectors.EVENT_READ}
    want[wfd] = want.get(wfd, 0) | selectors.EVENT_WRITE
    for fd, events in want.items():
        sel.register(fd, events)
    writing, reading = True, True

    def done_writing():
        nonlocal writing
        writing = False
        if wfd == rfd:
            sel.modify(wfd, selectors.EVENT_READ)
        else:
            sel.unregister(wfd)
        close_write()

    try:
        if not view:
            done_writing()
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), True
            for key, events in sel.select(min(left, 1.0)):
                if writing and key.fd == wfd and events & selectors.EVENT_WRITE:
                    try:
                        n = os.write(wfd, view[: 1 << 16])
                    except BlockingIOError:
                        n = 0
                    except OSError:  # the child is gone or stopped reading: its verdict says why
                        n, view = 0, view[:0]
                    view = view[n:]
                    if not view:
                        done_writing()
                if reading and key.fd == rfd and events & selectors.EVENT_READ:
                    try:
                        chunk = os.read(rfd, 1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        reading = False
                        break
                    if len(out) < MAX_VERDICT_BYTES:
                        out += chunk[: MAX_VERDICT_BYTES - len(out)]
        return bytes(out), False
    finally:
        sel.close()


def sandbox_self_check(limits: SandboxLimits | None = None, start: str | None = None) -> dict:
    """Start a sandbox child and report what a model would find around it (no model is loaded):
    ``cwd_entries``, ``env`` (names), ``fds`` (open descriptors), ``rlimits``, ``modules`` (of
    numpy, onnx, onnxruntime: those imported before the limits were set; the zygote pre-imports
    numpy and onnx, never onnxruntime)."""
    return _launch(b"", {"self_check": True, "model_bytes": 0}, limits or SandboxLimits(), start)


def probe_in_sandbox(
    data: bytes, *, kind=None, n_features=None, max_features: int, sample=None, limits: SandboxLimits | None = None
) -> dict:
    """Run the checks and the probe of ``data`` in a sandboxed child; return its verdict dict.

    ``sample`` is an optional float32 array (rows, cols) appended to the probe batch.  A child
    killed by a limit or the timeout, or one that answers no JSON, gives a failure verdict
    (``code`` "timeout", "cpu", "memory" or "sandbox") with the reason in ``detail``.
    """
    import numpy as np

    limits = limits or SandboxLimits()
    payload = bytes(data)
    rows = cols = 0
    if sample is not None:
        sample = np.ascontiguousarray(sample, dtype="<f4")
        rows, cols = sample.shape
        payload += sample.tobytes()
    req = {
        "model_bytes": len(data),
        "sample_rows": rows,
        "sample_cols": cols,
        "kind": kind,
        "n_features": n_features,
        "max_features": int(max_features),
    }
    return _launch(payload, req, limits)


def _launch(payload: bytes, req: dict, limits: SandboxLimits, start: str | None = None) -> dict:
    req = {**req, "memory_bytes": limits.memory_bytes, "cpu_seconds": limits.cpu_seconds, "max_files": limits.max_files}
    started = time.monotonic()
    deadline = started + limits.timeout_s
    result = None
    if (start or SANDBOX_START) == "zygote":
        from msa_fed.artifacts.zygote import run_in_zygote

        result = run_in_zygote(payload, req, deadline)  # None: no zygote to be had
    if result is None:
        result = _spawn(payload, req, deadline)
    out, timed_out, rc = result
    return _verdict(out, timed_out, rc, time.monotonic() - started, limits)


def _spawn(payload: bytes, req: dict, deadline: float) -> tuple[bytes, bool, int | None]:
    """One fresh interpreter for one load: (output, timed_out, exit status)."""
    with tempfile.TemporaryDirectory(prefix="msa_fed_sandbox_", ignore_cleanup_errors=True) as cwd:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOT, json.dumps(req), package_root()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=cwd,
                env=dict(CHILD_ENV),
                close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:  # no process to be had (limits of this host): a refusal, logged
            return f"cannot start the sandbox: {exc}".encode(), False, None
        assert proc.stdin is not None and proc.stdout is not None  # both are pipes (Popen above)
        try:
            out, timed_out = exchange(proc.stdin.fileno(), proc.stdout.fileno(), payload, deadline, proc.stdin.close)
            if not timed_out:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            kill_group(proc.pid)  # the group: nothing the model started outlives the load
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
    return out, timed_out, proc.returncode


def _verdict(out: bytes, timed_out: bool, rc: int | None, elapsed: float, limits: SandboxLimits) -> dict:
    if timed_out:
        return {"ok": False, "code": "timeout", "args": {}, "detail": f"killed after {elapsed:.1f} s wall clock"}
    if rc is None:
        return {"ok": False, "code": "sandbox", "args": {}, "detail": out.decode("utf-8", "replace")[:500]}
    try:
        verdict = json.loads(out.decode("utf-8").strip() or "null")
    except (UnicodeDecodeError, ValueError, RecursionError):
        verdict = None
    if isinstance(verdict, dict) and rc == 0:
        return verdict
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and elapsed < limits.timeout_s:
        return {"ok": False, "code": "cpu", "args": {}, "detail": f"exit status {rc} after {elapsed:.1f} s"}
    return {
        "ok": False,
        "code": "sandbox",
        "args": {},
        "detail": f"exit status {rc} after {elapsed:.1f} s with {len(out)} bytes of output",
    }


if __name__ == "__main__":
    sys.exit(main())
