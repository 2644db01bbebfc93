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

Several models can share one child (:func:`probe_batch_in_sandbox`, used by ``load_model``
for its p predictors): one verdict line per model, the same verdicts as one child each.

Verdict: ``{"ok": true, "kind", "n_features", "classes", "rows", "maxrss_kb", "cpu_s"}`` or
``{"ok": false, "code", "args", "detail"}`` (``code`` is a key of structure.REASONS).

Measured (benchmarks/bench_artifacts.py, 2-core machine shared by other jobs, load average
16-32): a sandboxed load costs 160-330 ms from the helper, 500-780 ms from a fresh interpreter,
against 0.5-16 ms for the same checks in-process; a small model's child peaks near 210 MiB of
address space, hence the 1 GiB default of :data:`SANDBOX_MEMORY_BYTES`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from msa_fed.artifacts.sandbox_process import (  # noqa: F401  - _evaluate: benchmarks/bench_artifacts.py
    CHILD_ENV,
    MAX_VERDICT_BYTES,
    _evaluate,
    exchange,
    kill_group,
    package_root,
)
from msa_fed.artifacts.structure import DEFAULT_MAX_FEATURES

#: Address-space limit of the sandbox process (RLIMIT_AS).  A server charges this much to its
#: in-flight memory budget for every load it runs.
SANDBOX_MEMORY_BYTES = 1 << 30
SANDBOX_CPU_SECONDS = 30  # RLIMIT_CPU (soft; SIGKILL one second later at the hard limit)
SANDBOX_TIMEOUT_S = 60.0  # wall clock, start-up included (the machine may be loaded)
SANDBOX_MAX_FILES = 32  # RLIMIT_NOFILE: enough for the imports, nothing for a model


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


# --------------------------------------------------------------------------- parent

_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[2]); from msa_fed.artifacts.sandbox_process import main; sys.exit(main())"
)
#: "zygote": fork each sandbox from a pre-imported helper process (fast; see zygote.py);
#: "spawn": start a fresh interpreter per load.  The zygote falls back to spawn if it cannot start.
SANDBOX_START = "zygote"


def warm_up() -> None:
    """Start the fork helper now (it imports numpy and onnx while the caller does other work),
    so that a sandboxed load soon after does not wait for those imports."""
    if SANDBOX_START == "zygote":
        from msa_fed.artifacts.zygote import _get

        _get()


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
    payload, req = _request(data, kind, n_features, max_features, sample)
    return _launch(payload, req, limits or SandboxLimits())


def _request(data: bytes, kind, n_features, max_features: int, sample) -> tuple[bytes, dict]:
    """The bytes (model, then sample) and the JSON request of one model's check."""
    import numpy as np

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
    return payload, req


@dataclass(frozen=True)
class ProbeItem:
    """One model of a batch check (the arguments of :func:`probe_in_sandbox`)."""

    data: bytes
    kind: str | None = None
    n_features: int | None = None
    max_features: int = DEFAULT_MAX_FEATURES
    sample: object = None


def probe_batch_in_sandbox(items: list[ProbeItem], limits: SandboxLimits | None = None) -> list[dict]:
    """The verdicts of several models, checked in ONE sandboxed child; one verdict per item, in order.

    Each model gets the limits of a single load: the same address-space limit (the child holds
    one model's bytes, session and probe at a time), ``cpu_seconds`` of its own, and the wall
    clock of one load for the first.  A verdict equals :func:`probe_in_sandbox`'s on the same
    item; what one model does cannot change another's:

    - the checks are functions of a model's bytes alone; what a model can do to the child is
      spend its resources (memory, CPU, time) or end it, which can only make a later model fail;
    - so a success verdict is kept, and so is any verdict of the batch's first model (it ran in
      a child exactly like a single load's); a failure of a later model is checked again alone;
    - when the child dies or runs out of time, the verdicts it wrote stand (as above), the
      model it was checking and those after it are checked one by one, side by side.

    The batch's wall clock is one load's (``timeout_s``); models it leaves unchecked are checked
    alone.  ``maxrss_kb`` and ``cpu_s`` of a batch verdict are the child's peak and CPU seconds so far.
    """
    limits = limits or SandboxLimits()

    def single(i: int) -> dict:
        it = items[i]
        return probe_in_sandbox(
            it.data,
            kind=it.kind,
            n_features=it.n_features,
            max_features=it.max_features,
            sample=it.sample,
            limits=limits,
        )

    if len(items) <= 1:
        return [single(i) for i in range(len(items))]
    payloads, batch = [], []
    for it in items:
        payload, req = _request(it.data, it.kind, it.n_features, it.max_features, it.sample)
        payloads.append(payload)
        batch.append(req)
    out, timed_out, rc, elapsed = _run_child(
        b"".join(payloads), {"batch": batch}, limits, max_out=MAX_VERDICT_BYTES * len(items)
    )
    verdicts: list[dict | None] = []
    for line in out.split(b"\n"):
        if len(verdicts) == len(items):
            break
        try:
            verdict = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            break  # the last line of a child killed while writing, or no line at all
        if not isinstance(verdict, dict) or verdict.get("code") == "input":
            break
        verdicts.append(verdict)
    if not verdicts:
        # the first model ended the child: its verdict is a single load's (same child, same limits)
        verdicts.append(_verdict(out, timed_out, rc, elapsed, limits))
    verdicts += [None] * (len(items) - len(verdicts))
    again = [i for i, v in enumerate(verdicts) if v is None or (i > 0 and v.get("ok") is not True)]
    if again:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(again), 8)) as pool:
            for i, verdict in zip(again, pool.map(single, again)):
                verdicts[i] = verdict
    return [v for v in verdicts if v is not None]


def _launch(payload: bytes, req: dict, limits: SandboxLimits, start: str | None = None) -> dict:
    return _verdict(*_run_child(payload, req, limits, start), limits)


def _run_child(
    payload: bytes, req: dict, limits: SandboxLimits, start: str | None = None, max_out: int = MAX_VERDICT_BYTES
) -> tuple[bytes, bool, int | None, float]:
    """One sandboxed child for ``req``: (output, timed_out, exit status, seconds elapsed)."""
    req = {**req, "memory_bytes": limits.memory_bytes, "cpu_seconds": limits.cpu_seconds, "max_files": limits.max_files}
    started = time.monotonic()
    deadline = started + limits.timeout_s
    result = None
    if (start or SANDBOX_START) == "zygote":
        from msa_fed.artifacts.zygote import run_in_zygote

        result = run_in_zygote(payload, req, deadline, max_out)  # None: no zygote to be had
    if result is None:
        result = _spawn(payload, req, deadline, max_out)
    out, timed_out, rc = result
    return out, timed_out, rc, time.monotonic() - started


def _spawn(
    payload: bytes, req: dict, deadline: float, max_out: int = MAX_VERDICT_BYTES
) -> tuple[bytes, bool, int | None]:
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
            out, timed_out = exchange(
                proc.stdin.fileno(), proc.stdout.fileno(), payload, deadline, proc.stdin.close, max_out
            )
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
