"""Run another party's ONNX predictor at every call in a limited worker process, never in ours.

The sandbox (:mod:`msa_fed.artifacts.sandbox`) checks a predictor once, at upload, on a probe
batch.  A hostile predictor can behave on the probe and misbehave on other rows (say only when
every input is a whole number, as ages are): loop for ever, allocate gigabytes, answer confident
nonsense.  So every call of a peer's predictor runs here:

- a small pool of long-lived worker processes per process (:class:`PredictorPool`), each forked
  from the sandbox's helper (:mod:`msa_fed.artifacts.zygote`; a fresh ``python -I -B`` when
  there is none) and limited like a sandbox child (RLIMIT_AS, no file writes, few descriptors,
  empty working directory, minimal environment, own session) before it reads a byte of a model;
- one request = one JSON header and raw little-endian bytes each way over a socket pair: float32
  rows in (once for all the models of the request, with the bytes of those the worker has not
  loaded yet), each model's output tensor out in turn (float32 or float64, its shape in the
  header and checked against the predictor's declaration).  Nothing is pickled in either
  direction.  :func:`answered_together` puts all of a site's peers' predictors in one request;
- a per-model wall-clock limit scaled to the batch (:meth:`IsolationLimits.call_limit`); a worker
  that runs past it, dies, answers out of protocol or runs out of memory is killed and replaced,
  and the call raises :class:`msa_fed.errors.PeerFault` naming the predictor's owner, in one
  line: ``site 'b''s predictor exceeded 2.5 s on 512 rows`` (out of memory: only once it is so
  alone in a fresh worker on at most :data:`MIN_SPLIT_ROWS` rows, see
  :meth:`PredictorPool.run_many`).

:func:`isolate` turns a loaded :class:`~msa_fed.artifacts.loader.OnnxPredictor` into one whose
``predict`` / ``predict_proba`` go through the pool (same class surface; it saves and exports
as the same ONNX bytes).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from msa_fed.artifacts.isolated_worker import _HEADER, MAX_HEADER_BYTES, send_parts
from msa_fed.artifacts.loader import OnnxClassifier, OnnxPredictor, OnnxRegressor
from msa_fed.errors import PeerFault

#: rows per call: a larger batch is sent in chunks of this many rows (each with its own limit)
CHUNK_ROWS = 1 << 16
#: a model that runs out of memory runs again alone on halves of its rows down to this many
MIN_SPLIT_ROWS = 1024
#: largest output accepted from a worker (values per row times rows, checked before reading)
MAX_OUTPUT_VALUES_PER_ROW = 10_000


@dataclass(frozen=True)
class IsolationLimits:
    """Limits of every call of a peer's predictor.

    memory_bytes : RLIMIT_AS of a worker (numpy, onnx and onnxruntime take about 250 MiB of it;
        the rest is the model's).
    base_s, per_row_s : the wall-clock limit of one call on n rows is base_s + n * per_row_s
        (measured: a scikit-learn export answers 512 rows in under 5 ms here, under load; the
        base covers a loaded machine's scheduling).
    load_s : limit of the first load of a model in a worker (session construction).
    workers : processes in the pool (calls beyond that wait for a free worker).
    """

    memory_bytes: int = 1 << 30
    base_s: float = 2.0
    per_row_s: float = 1e-3
    load_s: float = 60.0
    workers: int = 2
    max_files: int = 32

    def __post_init__(self):
        for name in ("memory_bytes", "workers", "max_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"IsolationLimits.{name} must be a positive integer; got {v!r}")
        for name in ("base_s", "per_row_s", "load_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"IsolationLimits.{name} must be a finite number >= 0; got {v!r}")
        if self.base_s <= 0 or self.load_s <= 0:
            raise ValueError("IsolationLimits.base_s and load_s must be > 0")

    def call_limit(self, rows: int) -> float:
        """Seconds one call on ``rows`` rows may take."""
        return float(self.base_s + rows * self.per_row_s)


# --------------------------------------------------------------------------- worker side


# --------------------------------------------------------------------------- caller side


class _Violation(Exception):
    """A worker broke a limit or the protocol: ``what`` completes "site 'x''s predictor ..."."""

    def __init__(self, what: str, memory: bool = False):
        super().__init__(what)
        self.what = what
        self.memory = memory


class _OutOfMemory(Exception):
    """A model ran out of memory or ended its worker: ``done`` the outputs of the models before it
    in the request, ``fault`` the error naming its owner, ``shared`` whether other models' sessions
    were in the worker with it (then it is not blamed yet: see :meth:`PredictorPool.run_many`)."""

    def __init__(self, done: list, fault: PeerFault, shared: bool):
        super().__init__(str(fault))
        self.done, self.fault, self.shared = done, fault, shared


class _Call:
    """Where one request to a worker is: the model whose owner a failure names, the phase and its
    limit, the outputs read so far, whether other models shared the worker."""

    __slots__ = ("owner", "rows", "phase", "limit", "outs", "shared")

    def __init__(self, limits: IsolationLimits, owner: str, rows: int):
        self.owner, self.rows = owner, rows
        self.phase, self.limit = "send", limits.load_s
        self.outs: list[np.ndarray] = []
        self.shared = False


class _Worker:
    """One long-lived limited process and its socket (used by one caller at a time)."""

    def __init__(self, limits: IsolationLimits):
        from msa_fed.artifacts.sandbox import SANDBOX_START

        self.limits = limits
        self.loaded: set[str] = set()
        self._cwd = tempfile.TemporaryDirectory(prefix="msa_fed_predictor_", ignore_cleanup_errors=True)
        req = {
            "serve": True,
            "model_bytes": 0,
            "memory_bytes": limits.memory_bytes,
            "cpu_seconds": 10**9,  # a long-lived worker: the wall clock of each call is the limit
            "max_files": limits.max_files,
        }
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._job: tuple | None = None
        try:
            if SANDBOX_START == "zygote":
                self._start_in_zygote(req, theirs)
            if self.pid is None:
                self._spawn(req, theirs)
        finally:
            theirs.close()

    def _start_in_zygote(self, req: dict, theirs: socket.socket) -> None:
        from msa_fed.artifacts import zygote

        helper = zygote._get()
        if helper is None:
            return
        try:
            jid, job = helper.submit({"req": req, "cwd": self._cwd.name}, theirs.fileno())
        except OSError:
            return
        if job.got_pid.wait(zygote.START_TIMEOUT_S) and job.pid is not None:
            self.pid, self._job = job.pid, (helper, jid, job)
        else:
            helper.forget(jid)

    def _spawn(self, req: dict, theirs: socket.socket) -> None:
        from msa_fed.artifacts.sandbox import _BOOT, CHILD_ENV, package_root

        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _BOOT, json.dumps(req), package_root()],
            stdin=theirs.fileno(),
            stdout=theirs.fileno(),
            stderr=subprocess.DEVNULL,
            cwd=self._cwd.name,
            env=dict(CHILD_ENV),
            close_fds=True,
            start_new_session=True,
        )
        self.pid = self._proc.pid

    # -------------------------------------------------------------- one exchange
    def _recv_exactly(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            chunk = self.sock.recv(min(1 << 20, n - len(buf)))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def send(self, header: dict, payloads: list, deadline: float) -> None:
        """One request: the JSON header, then each payload (bytes or a C-contiguous array), in
        as few writes as the socket takes (the worker wakes once for a small request)."""
        raw = json.dumps(header).encode()
        send_parts(self.sock, [_HEADER.pack(len(raw)) + raw, *payloads], deadline)

    def answer(self, deadline: float, max_out: int | None) -> np.ndarray | None:
        """Read one answer frame: ``{"ok": true}`` (``max_out`` None: a model loaded) or an output
        array of at most ``max_out`` values; raises TimeoutError, EOFError, OSError, _Violation."""
        (size,) = _HEADER.unpack(self._recv_exactly(_HEADER.size, deadline))
        if size > MAX_HEADER_BYTES:
            raise _Violation("answered out of protocol")
        try:
            answer = json.loads(self._recv_exactly(size, deadline))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _Violation("answered out of protocol") from None
        if not isinstance(answer, dict):
            raise _Violation("answered out of protocol")
        if answer.get("ok") is not True:
            if answer.get("code") == "memory":
                raise _Violation(f"exceeded the memory limit ({self.limits.memory_bytes >> 20} MiB)", memory=True)
            raise _Violation("failed")
        if max_out is None:
            return None
        shape, dtype = answer.get("shape"), answer.get("dtype")
        if (
            dtype not in ("<f4", "<f8")
            or not isinstance(shape, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            or int(np.prod(shape, dtype=np.int64)) > max_out
        ):
            raise _Violation("answered out of protocol")
        out = np.empty(shape, dtype=dtype)
        view, got = out.data.cast("B"), 0
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            n = self.sock.recv_into(view[got:], min(1 << 22, len(view) - got))
            if n == 0:
                raise EOFError
            got += n
        return out

    def kill(self) -> None:
        from msa_fed.artifacts.sandbox import kill_group

        kill_group(self.pid)
        try:
            self.sock.close()
        except OSError:
            pass
        if self._proc is not None:
            self._proc.wait()
        if self._job is not None:
            helper, jid, job = self._job
            job.ended.wait(5.0)
            helper.forget(jid)
        self._cwd.cleanup()


class PredictorPool:
    """A bounded pool of :class:`_Worker` processes (thread-safe; workers start on first use)."""

    def __init__(self, limits: IsolationLimits | None = None):
        self.limits = limits or IsolationLimits()
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._starting = 0  # workers being started in the background (prestart)
        self._preloading = 0  # workers loading models in the background (prestart)
        self._closed = False
        self._fits: dict[str, int] = {}  # sha256 -> rows it ran on alone after running out of memory
        self.restarts = 0  # workers killed after a violation (for tests and the operator's log)

    def prestart(self, items: list[tuple[OnnxPredictor, str]] | tuple = ()) -> threading.Thread | None:
        """Start, in the background, a worker where none runs yet, so that the first call finds it
        ready (starting one takes seconds: the fork, the limits, onnxruntime's import), and load
        ``items``' models (``(predictor, owner)`` pairs) into it, so that the first call sends only
        rows and waits for no session.  A model that breaks a limit while loading ends that worker
        quietly: the call that needs it loads it again and raises :class:`PeerFault` there.
        Returns the background thread (None: nothing to do)."""
        with self._cond:
            start = not self._count and not self._starting
            if start:
                self._count += 1
                self._starting += 1
        if not start and not items:
            return None
        target = self._start_one if start else self._preload
        thread = threading.Thread(target=target, args=(list(items),), name="msa-fed-predictor-worker", daemon=True)
        thread.start()
        return thread

    def _start_one(self, items: list[tuple[OnnxPredictor, str]]) -> None:
        worker = None
        try:
            worker = _Worker(self.limits)
        except Exception:  # noqa: BLE001 - the first call starts one again and reports why it cannot
            pass
        if worker is not None and items and not self._load(worker, items):
            worker = None
        with self._cond:
            self._starting -= 1
            if worker is None:
                self._count -= 1
            else:
                self._idle.append(worker)
            self._cond.notify_all()

    def _preload(self, items: list[tuple[OnnxPredictor, str]]) -> None:
        with self._cond:
            while not self._idle:  # a worker runs or is starting: load into the next idle one
                if self._closed or not (self._count or self._starting):
                    return
                self._cond.wait()
            worker = self._idle.pop()
            self._preloading += 1
        ok = self._load(worker, items)
        with self._cond:
            self._preloading -= 1
            if ok:
                self._idle.append(worker)
            else:  # killed by _load: its slot is free again
                self._count -= 1
            self._cond.notify_all()

    def _load(self, worker: _Worker, items: list[tuple[OnnxPredictor, str]]) -> bool:
        """Load ``items``' models that ``worker`` does not hold yet (one request, each within
        ``load_s``); False, the worker killed, where one broke a limit or the protocol."""
        new = list({h.sha256: h for h, _ in items if h.sha256 not in worker.loaded}.values())
        if not new:
            return True
        try:
            worker.send(
                {"op": "load", "models": [{"sha256": h.sha256, "nbytes": len(h.data)} for h in new]},
                [h.data for h in new],
                time.monotonic() + len(new) * self.limits.load_s,
            )
            for h in new:
                worker.answer(time.monotonic() + self.limits.load_s, None)
                worker.loaded.add(h.sha256)
            return True
        except (TimeoutError, EOFError, OSError, _Violation):
            worker.kill()
            with self._cond:
                self.restarts += 1
            return False

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and (self._starting or self._preloading or self._count >= self.limits.workers):
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        return self._spawn()

    def _release(self, worker: _Worker, broken: bool) -> None:
        if broken:
            worker.kill()
        with self._cond:
            if broken:
                self._count -= 1
                self.restarts += 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def run(self, predictor: OnnxPredictor, X: np.ndarray, owner: str) -> np.ndarray:
        """The output tensor of ``predictor`` on float32 rows ``X`` (n, d), computed in a worker.

        Raises :class:`PeerFault` naming ``owner`` when the predictor breaks a limit."""
        return self.run_many([(predictor, owner)], X)[0]

    def run_many(self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray) -> list[np.ndarray]:
        """The output tensors of several predictors (``(predictor, owner)`` pairs) on the same
        float32 rows ``X`` (n, d), in one request to one worker: the rows cross once, the models
        not loaded there yet cross with them, and the answers come back model by model.

        Each model has its own limits (:meth:`IsolationLimits.call_limit`, counted from the
        previous model's answer, and ``load_s`` for a load); the first to break one raises
        :class:`PeerFault` naming its owner (the models after it are not run).  A model that
        runs out of memory (or ends its worker) is blamed only once it does so alone in a fresh
        worker on at most :data:`MIN_SPLIT_ROWS` rows: before that it runs again alone, its rows
        halved (an honest model's peak grows with the rows, and other models' sessions share a
        worker's limit)."""
        X = np.ascontiguousarray(X, dtype="<f4")
        if not items:
            return []
        with self._cond:  # rows a model ran on after running out of memory on more: chunks that size
            step = min([CHUNK_ROWS, *(self._fits.get(h.sha256, CHUNK_ROWS) for h, _ in items)])
        parts = [self._run_rows(items, X[a : a + step]) for a in range(0, max(X.shape[0], 1), step)]
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate([part[i] for part in parts], axis=0) for i in range(len(items))]

    def _run_rows(self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray) -> list[np.ndarray]:
        outs: list[np.ndarray] = []
        while len(outs) < len(items):
            try:
                outs += self._run_chunk(items[len(outs) :], X)
            except _OutOfMemory as oom:
                outs += oom.done
                outs.append(self._run_alone(items[len(outs)], X, oom))
        return outs

    def _run_alone(self, item: tuple[OnnxPredictor, str], X: np.ndarray, oom: _OutOfMemory) -> np.ndarray:
        rows = int(X.shape[0])
        if rows <= MIN_SPLIT_ROWS and not oom.shared:
            raise oom.fault
        halves = [X] if rows <= MIN_SPLIT_ROWS else [X[: rows // 2], X[rows // 2 :]]
        outs = []
        for part in halves:
            try:
                outs.append(self._run_chunk([item], part, alone=True)[0])
            except _OutOfMemory as again:
                outs.append(self._run_alone(item, part, again))
                continue
            if len(halves) > 1:
                with self._cond:
                    sha = item[0].sha256
                    self._fits[sha] = min(self._fits.get(sha, CHUNK_ROWS), int(part.shape[0]))
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    def start_many(self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray) -> Callable[[], list[np.ndarray]]:
        """:meth:`run_many` in two halves: the request is sent now (the rows, and the models the
        worker has not loaded), and the function returned reads its answers, with the same
        limits, retries and faults as :meth:`run_many` (each model's limit counted from when the
        answers are read).  Meanwhile the worker computes in its own process, so the caller can
        do its own work (open its own predictor's session) on another core instead of waiting.
        The function must be called (it gives the worker back).  Rows that take more than one
        chunk are sent when it is called."""
        X = np.ascontiguousarray(X, dtype="<f4")
        if not items:
            return lambda: []
        with self._cond:
            step = min([CHUNK_ROWS, *(self._fits.get(h.sha256, CHUNK_ROWS) for h, _ in items)])
        if X.shape[0] > step:
            return lambda: self.run_many(items, X)
        try:
            collect = self._start_chunk(items, X)
        except _OutOfMemory as oom:
            outs = self._after_out_of_memory(items, X, oom)
            return lambda: outs

        def finish() -> list[np.ndarray]:
            try:
                return collect()
            except _OutOfMemory as oom:
                return self._after_out_of_memory(items, X, oom)

        return finish

    def _after_out_of_memory(
        self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray, oom: _OutOfMemory
    ) -> list[np.ndarray]:
        """The outputs of ``items`` on ``X`` once a request of them ran out of memory (``oom``):
        its answers so far, the model that ran out alone (:meth:`_run_alone`), the rest again."""
        outs = [*oom.done, self._run_alone(items[len(oom.done)], X, oom)]
        if len(outs) < len(items):
            outs += self._run_rows(items[len(outs) :], X)
        return outs

    def _run_chunk(
        self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray, alone: bool = False
    ) -> list[np.ndarray]:
        """``items`` on ``X`` in one request (``alone``: in a worker that holds no other model)."""
        return self._start_chunk(items, X, alone)()

    def _start_chunk(
        self, items: list[tuple[OnnxPredictor, str]], X: np.ndarray, alone: bool = False
    ) -> Callable[[], list[np.ndarray]]:
        """Send ``items`` on ``X`` as one request (``alone``: to a worker that holds no other
        model); the function that reads its answers (and gives the worker back).  A failure
        to send gives the worker back and raises as reading would."""
        rows = int(X.shape[0])
        worker = self._acquire()
        if alone and worker.loaded - {items[0][0].sha256}:
            worker = self._replace(worker)
        call = _Call(self.limits, items[0][1], rows)
        models = []
        try:
            sending: set[str] = set()
            blobs = []
            for predictor, _ in items:
                new = predictor.sha256 not in worker.loaded and predictor.sha256 not in sending
                models.append({"sha256": predictor.sha256, "nbytes": len(predictor.data) if new else 0})
                if new:
                    sending.add(predictor.sha256)
                    blobs.append(predictor.data)
            budget = len(blobs) * self.limits.load_s + len(items) * self.limits.call_limit(rows)
            worker.send(
                {"op": "runs", "rows": rows, "cols": int(X.shape[1]), "models": models},
                [*blobs, X],
                time.monotonic() + budget,
            )
        except BaseException as exc:
            self._release(worker, True)
            raise self._fault(call, exc) from None

        def collect() -> list[np.ndarray]:
            broken = True
            try:
                for (predictor, name), model in zip(items, models):
                    call.owner = name  # the one a violation from here on names
                    call.shared = bool(call.outs) or bool(worker.loaded - {predictor.sha256})
                    if model["nbytes"]:
                        call.phase, call.limit = "load", self.limits.load_s
                        worker.answer(time.monotonic() + call.limit, None)
                        worker.loaded.add(predictor.sha256)
                    call.phase, call.limit = "run", self.limits.call_limit(rows)
                    out = worker.answer(time.monotonic() + call.limit, rows * MAX_OUTPUT_VALUES_PER_ROW)
                    assert out is not None  # a run answers an array
                    if out.ndim == 0 or out.shape[0] != rows:
                        raise _Violation(f"answered {out.shape[0] if out.ndim else 0} rows")
                    call.outs.append(out)
                broken = False
                return call.outs
            except BaseException as exc:
                raise self._fault(call, exc) from None
            finally:
                self._release(worker, broken)

        return collect

    def _fault(self, call: _Call, exc: BaseException) -> BaseException:
        """What a request that failed with ``exc`` raises: a :class:`PeerFault` naming the
        owner of the model it was at, :class:`_OutOfMemory` where the worker ran out of memory
        or ended (see :meth:`run_many`); any other exception as it is."""
        owner, rows = call.owner, call.rows
        if isinstance(exc, TimeoutError):
            what = f"exceeded {call.limit:.3g} s" + (" loading" if call.phase == "load" else "")
            return PeerFault(owner, f"site {owner!r}'s predictor {what} on {rows} rows")
        if isinstance(exc, _Violation):
            fault = PeerFault(owner, f"site {owner!r}'s predictor {exc.what} on {rows} rows")
            return _OutOfMemory(call.outs, fault, call.shared) if exc.memory else fault
        if isinstance(exc, (EOFError, OSError)):
            # the worker died: RLIMIT_AS can end it outside onnxruntime's allocator too
            fault = PeerFault(owner, f"site {owner!r}'s predictor ended its worker process on {rows} rows")
            return _OutOfMemory(call.outs, fault, call.shared)
        return exc

    def _replace(self, worker: _Worker) -> _Worker:
        """A new worker in place of ``worker`` (which holds other models)."""
        worker.kill()
        return self._spawn()

    def _spawn(self) -> _Worker:
        """A new worker for a slot already counted; the slot is given back if it cannot start."""
        try:
            return _Worker(self.limits)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._starting or self._preloading:
                self._cond.wait()
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for w in idle:
            w.kill()


_default_pool: PredictorPool | None = None
_default_lock = threading.Lock()


def default_pool() -> PredictorPool:
    """This process's pool (created on first use with the default limits)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = PredictorPool()
        return _default_pool


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same values bit for bit (NaN where NaN; -0.0 is not 0.0: such
    rows are computed again), compared as bytes (no float comparisons, no NaN masks)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous):
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


class _Isolated:
    """Mixin: ``_run`` goes through a :class:`PredictorPool`; ``owner`` names the predictor's site."""

    owner: str
    pool: PredictorPool | None

    def _run(self, X: np.ndarray) -> np.ndarray:
        answered = self.__dict__.get("_answered")
        if answered is not None and _same_bits(answered[0], X):
            return answered[1]
        pool = self.pool or default_pool()
        out: np.ndarray = pool.run(self, X, self.owner)  # type: ignore[arg-type]  # a mixin of OnnxPredictor
        return out

    def __reduce__(self):  # the bytes again, through the loader (a copy runs in-process unless isolated again)
        return OnnxPredictor.__reduce__(self)


class IsolatedRegressor(_Isolated, OnnxRegressor):
    """An :class:`OnnxRegressor` whose every call runs in a limited worker process."""


class IsolatedClassifier(_Isolated, OnnxClassifier):
    """An :class:`OnnxClassifier` whose every call runs in a limited worker process."""


def isolate(predictor: OnnxPredictor, owner: str, pool: PredictorPool | None = None) -> OnnxPredictor:
    """``predictor`` (loaded by :func:`msa_fed.artifacts.loader.load_predictor`), run in ``pool``
    (default: this process's) at every call; a violation raises :class:`PeerFault` naming ``owner``."""
    if not isinstance(predictor, OnnxPredictor):
        raise TypeError(f"isolate takes an OnnxPredictor; got {type(predictor).__name__}")
    args = (predictor.data, predictor.kind, predictor.n_features_in_, 1, predictor.sha256)
    out: OnnxPredictor
    if isinstance(predictor, OnnxClassifier):
        out = IsolatedClassifier(*args, classes=list(predictor.classes_))
    else:
        out = IsolatedRegressor(*args)
    out.owner = str(owner)
    out.pool = pool
    return out


def is_isolated(predictor) -> bool:
    """Whether ``predictor`` runs in a limited worker process at every call (see :func:`isolate`)."""
    return isinstance(predictor, _Isolated)


def prestart(predictors) -> list[threading.Thread]:
    """Start, in the background, a worker for the isolated ones among ``predictors`` where their
    pool has none yet, and load their models into it (a site does it when a job's predictors
    arrive: the worker is ready, the models' sessions open, by the time the site first evaluates
    them, and that evaluation is one request of rows and one answer per model).  Returns the
    background threads (for a caller that wants to wait for them)."""
    by_pool: dict[int, tuple[PredictorPool, list]] = {}
    for h in predictors:
        if is_isolated(h):
            pool = h.pool or default_pool()
            by_pool.setdefault(id(pool), (pool, []))[1].append((h, h.owner))
    threads = [pool.prestart(items) for pool, items in by_pool.values()]
    return [t for t in threads if t is not None]


def answered_together(predictors: list, X) -> list:
    """``predictors`` with every isolated one replaced by a copy that already holds its output on
    ``X`` (n, d): all of them computed in one request per pool (:meth:`PredictorPool.start_many`:
    one round trip, the rows sent once) instead of one request each, sent before the in-process
    predictors new to this process open their sessions and read after.  A copy answers a call on
    exactly these rows from what it holds and any other call through its pool; the predictors
    that are not isolated are returned as they are.  A limit broken raises :class:`PeerFault`
    naming the predictor's owner, as the call itself would."""
    out = list(predictors)
    if not any(is_isolated(h) for h in out):
        return out
    # the conversions the predictor's own call makes (to float64 at the site, then float32)
    X32 = np.ascontiguousarray(np.asarray(X, dtype=np.float64), dtype=np.float32)
    if X32.ndim != 2 or X32.shape[0] == 0:
        return out
    by_pool: dict[int, tuple[PredictorPool, list[int]]] = {}
    for k, h in enumerate(predictors):
        if is_isolated(h) and h.n_features_in_ == X32.shape[1]:
            pool = h.pool or default_pool()
            by_pool.setdefault(id(pool), (pool, []))[1].append(k)
    answers: dict[int, list[np.ndarray]] = {}
    asked = list(by_pool.values())
    # each pool's request goes out first; in-process predictors new to this process (a site's
    # own, once per job) open their sessions here while the workers compute, in their own
    # processes, and the answers are read after: no thread, no wait for this one's GIL
    opening = [h for h in out if not is_isolated(h) and isinstance(h, OnnxPredictor) and h._session is None]
    started: list[tuple[PredictorPool, Callable[[], list[np.ndarray]]]] = []
    failed: list[BaseException] = []
    try:
        for pool, ks in asked:
            started.append((pool, pool.start_many([(predictors[k], predictors[k].owner) for k in ks], X32)))
        for h in opening:
            try:
                h._ensure_session()
            except Exception:  # noqa: BLE001 - the predictor's own call raises it again, in its words
                pass
    except BaseException as exc:  # noqa: BLE001 - raised below, once every request sent is read
        failed.append(exc)
    for pool, finish in started:  # every request sent is read (its worker given back)
        try:
            answers[id(pool)] = finish()
        except BaseException as exc:  # noqa: BLE001 - raised below, once every worker is back
            failed.append(exc)
    if failed:
        raise failed[0]
    for pool, ks in asked:
        for k, o in zip(ks, answers[id(pool)]):
            h = predictors[k]
            copy = isolate(h, h.owner, h.pool)
            copy._answered = (X32, o)  # type: ignore[attr-defined]
            out[k] = copy
    return out
