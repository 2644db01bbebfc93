"""The process side of the sandbox (:mod:`msa_fed.artifacts.sandbox`), shared by its two launchers
(a fresh interpreter, or a fork of :mod:`msa_fed.artifacts.zygote`): the child's entry point (its
rlimits, every check of the model, one JSON verdict) and the parent's pipe exchange with it.

Below both launchers, so that neither imports the other's module to reach it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time

MAX_VERDICT_BYTES = 4 << 20  # room for MAX_CLASSES labels
#: the environment of a sandboxed child: one thread per library, a fixed locale, nothing else
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}


# --------------------------------------------------------------------------- child


def _set_limits(req: dict) -> None:
    import resource

    mem = int(req["memory_bytes"])
    cpu = int(req["cpu_seconds"])
    n = len(req.get("batch") or ()) or 1  # a batch: cpu seconds per model (soft limit raised per model)
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, (cpu + 1) * n))
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
        from msa_fed.artifacts.isolated_worker import serve

        return serve(0, result_fd)
    if req.get("batch"):
        return _run_batch(req, result_fd)
    verdict: dict
    if req.get("self_check"):
        verdict = _self_check()
    else:
        verdict = _run_request(req)

    _usage(verdict)
    os.write(result_fd, json.dumps(verdict).encode() + b"\n")
    os.close(result_fd)
    return 0


def _usage(verdict: dict) -> None:
    """The child's peak memory and CPU seconds so far (what its limits count) on ``verdict``."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    verdict["maxrss_kb"] = usage.ru_maxrss
    verdict["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)


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


def _run_batch(req: dict, result_fd: int) -> int:
    """Several models in one child: one JSON verdict line per model, written as soon as it is known.

    Each model gets ``cpu_seconds`` of its own (the soft RLIMIT_CPU is moved up before each one;
    the hard limit bounds the batch to what its loads would cost one by one).  Its bytes are read
    only when its turn comes.  A model that kills the child leaves the verdicts already written;
    the parent checks the rest (:func:`msa_fed.artifacts.sandbox.probe_batch_in_sandbox`)."""
    import gc
    import math
    import resource

    cpu = int(req["cpu_seconds"])
    common = {k: v for k, v in req.items() if k != "batch"}
    for item in req["batch"]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu)
        resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))
        verdict = _run_request({**common, **item})
        _usage(verdict)
        os.write(result_fd, json.dumps(verdict).encode() + b"\n")
        if verdict.get("code") == "input":
            break  # the byte stream is out of step: the parent checks the rest one by one
        gc.collect()  # nothing of this model stays for the next one
    os.close(result_fd)
    return 0


def _run_request(req: dict) -> dict:
    try:
        data = _read_exactly(0, int(req["model_bytes"]))
        sample = None
        rows, cols = int(req["sample_rows"]), int(req["sample_cols"])
        if rows:
            import numpy as np

            sample = np.frombuffer(_read_exactly(0, rows * cols * 4), dtype="<f4").reshape(rows, cols)
    except EOFError as exc:
        return {"ok": False, "code": "input", "args": {}, "detail": str(exc)}
    try:
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


def exchange(
    wfd: int, rfd: int, payload: bytes, deadline: float, close_write, max_out: int = MAX_VERDICT_BYTES
) -> tuple[bytes, bool]:
    """Write ``payload`` to ``wfd`` (then ``close_write()``) while reading ``rfd`` to EOF, keeping
    at most ``max_out`` bytes; returns (output, timed_out).  Never blocks past ``deadline``
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
                    if len(out) < max_out:
                        out += chunk[: max_out - len(out)]
        return bytes(out), False
    finally:
        sel.close()


if __name__ == "__main__":
    sys.exit(main())
