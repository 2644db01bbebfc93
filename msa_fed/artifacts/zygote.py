"""A fork server for the sandbox: one helper process that has imported numpy and onnx once and
forks a fresh, limited child for every load.

Importing numpy and onnx is most of a fresh interpreter's start-up (measured on the shared
2-core machine: about 75% of 0.3-2 s); a fork of the helper costs milliseconds.  The helper is
started like a sandbox child (``python -I -B``, minimal environment, empty working directory,
no inherited descriptor but its control socket) and is single-threaded when it forks:
onnxruntime, which starts a thread when imported, is imported only in the forked child, after
the limits are set.  The helper never sees a model's bytes: each load has its own socket pair,
whose far end is passed to the helper (SCM_RIGHTS) and becomes the child's stdin and stdout.

Per load, the helper answers ``{"id", "pid"}`` after the fork and ``{"id", "rc"}`` when it has
reaped the child (rc as in ``subprocess``: negative for a signal).  The child calls
:func:`os.setsid`, so the caller kills its whole group on timeout.  The helper exits when the
caller's end of the control socket closes (the caller's process ended).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger("msa_fed.artifacts")

_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[2]); from msa_fed.artifacts.zygote import zygote_main; "
    "sys.exit(zygote_main(int(sys.argv[1])))"
)
START_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- helper process


def zygote_main(ctl_fd: int) -> int:
    """The helper's loop: fork a sandbox child per request, report pids and exit statuses."""
    import numpy  # noqa: F401  - the expensive imports, once
    import numpy.random  # noqa: F401  - the probe's generator
    import onnx
    import onnx.checker  # noqa: F401

    import msa_fed.artifacts.sandbox_process  # noqa: F401
    import msa_fed.artifacts.structure  # noqa: F401

    _warm_checker()

    ctl = socket.socket(fileno=ctl_fd)
    children: dict[int, int] = {}  # pid -> request id
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    try:
        while True:
            for _ in sel.select(0.01 if children else None):
                msg, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 1)
                if not msg:
                    return 0  # the caller is gone
                job = json.loads(msg)
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    ctl.send(json.dumps({"id": job.get("id"), "rc": None}).encode())
                    continue
                pid = os.fork()
                if pid == 0:
                    _forked_child(fds[0], job)  # never returns
                os.close(fds[0])
                children[pid] = job["id"]
                ctl.send(json.dumps({"id": job["id"], "pid": pid}).encode())
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                ctl.send(json.dumps({"id": children.pop(pid, None), "rc": os.waitstatus_to_exitcode(status)}).encode())
    finally:
        for pid in children:
            try:
                os.killpg(pid, 9)
            except OSError:
                pass


def _warm_checker() -> None:
    """Run the ONNX checker once on a one-node model built here, so that its one-time set-up (the
    operator schemas; measured: 36 ms) is done once in the helper, not in every forked child.
    Single-threaded, like the imports above."""
    from onnx import TensorProto, checker, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "warm", [x], [y])
    checker.check_model(helper.make_model(graph))


def _forked_child(fd: int, job: dict) -> None:
    code = 70
    try:
        os.setsid()
        os.dup2(fd, 0)
        os.dup2(fd, 1)
        os.closerange(3, 1 << 16)  # the control socket, the selector, fd: nothing but 0, 1, 2
        os.chdir(job["cwd"])
        from msa_fed.artifacts.sandbox_process import child

        code = child(job["req"])
    finally:
        os._exit(code)


# --------------------------------------------------------------------------- caller side


class _Job:
    def __init__(self):
        self.pid: int | None = None
        self.rc: int | None = None
        self.got_pid = threading.Event()
        self.ended = threading.Event()


class _Zygote:
    """The caller's handle on its helper process; thread-safe."""

    def __init__(self):
        from msa_fed.artifacts.sandbox_process import CHILD_ENV, package_root

        self._cwd = tempfile.TemporaryDirectory(prefix="msa_fed_zygote_", ignore_cleanup_errors=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOT, str(theirs.fileno()), package_root()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=self._cwd.name,
                env=dict(CHILD_ENV),
                close_fds=True,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="msa_fed-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.sock.recv(1 << 16)
                if not msg:
                    break
                answer = json.loads(msg)
                with self._lock:
                    job = self._jobs.get(answer.get("id"))
                if job is None:
                    continue
                if "pid" in answer:
                    job.pid = answer["pid"]
                    job.got_pid.set()
                else:
                    job.rc = answer.get("rc")
                    job.got_pid.set()
                    job.ended.set()
        except (OSError, ValueError):
            pass
        finally:
            self.alive = False
            with self._lock:
                for job in self._jobs.values():
                    job.got_pid.set()
                    job.ended.set()

    def submit(self, request: dict, fd: int) -> tuple[int, _Job]:
        job = _Job()
        with self._lock:
            if not self.alive:
                raise OSError("the sandbox helper has exited")
            jid = next(self._ids)
            self._jobs[jid] = job
            socket.send_fds(self.sock, [json.dumps({**request, "id": jid}).encode()], [fd])
        return jid, job

    def forget(self, jid: int) -> None:
        with self._lock:
            self._jobs.pop(jid, None)

    def close(self) -> None:
        self.alive = False
        try:
            # shutdown, not only close: the reader thread is blocked in recv on this socket, and
            # Linux keeps a socket open (the helper sees no end of file) while a call still uses
            # it; measured: the helper then sat out the whole 5 s wait below on every close
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._cwd.cleanup()


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()
_zygote_failed_at = 0.0


def _get() -> _Zygote | None:
    global _zygote, _zygote_failed_at
    with _zygote_lock:
        if _zygote is not None and _zygote.alive and _zygote.proc.poll() is None:
            return _zygote
        if _zygote is not None:
            _zygote.close()
            _zygote = None
        if time.monotonic() - _zygote_failed_at < 5.0:
            return None  # it failed a moment ago: spawn meanwhile
        try:
            _zygote = _Zygote()
        except OSError:
            _zygote_failed_at = time.monotonic()
            return None
        return _zygote


def shutdown() -> None:
    """Stop this process's helper (a later load starts a new one)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


atexit.register(shutdown)


def run_in_zygote(
    payload: bytes, req: dict, deadline: float, max_out: int | None = None
) -> tuple[bytes, bool, int | None] | None:
    """One load in a child forked by the helper: (output, timed_out, exit status), or None when
    no helper could be had (the caller then spawns)."""
    from msa_fed.artifacts.sandbox_process import MAX_VERDICT_BYTES, exchange, kill_group

    zygote = _get()
    if zygote is None:
        return None
    with tempfile.TemporaryDirectory(prefix="msa_fed_sandbox_", ignore_cleanup_errors=True) as cwd:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                jid, job = zygote.submit({"req": req, "cwd": cwd}, theirs.fileno())
            except OSError:
                return None
            finally:
                theirs.close()
            try:
                # the first fork waits for the helper's imports
                if not job.got_pid.wait(max(min(deadline - time.monotonic(), START_TIMEOUT_S), 0.01)):
                    return b"", True, None
                if job.pid is None:  # the helper died or refused: a fresh interpreter instead
                    log.info("the sandbox's fork helper did not take a load; starting a fresh process")
                    return None
                out, timed_out = exchange(
                    ours.fileno(),
                    ours.fileno(),
                    payload,
                    deadline,
                    lambda: ours.shutdown(socket.SHUT_WR),
                    max_out or MAX_VERDICT_BYTES,
                )
                if timed_out:
                    return out, True, None
                if not job.ended.wait(max(deadline - time.monotonic(), 0.01)):
                    return out, True, None
                return out, False, job.rc
            finally:
                if not job.ended.is_set():
                    kill_group(job.pid)
                    job.ended.wait(5.0)
                zygote.forget(jid)
        finally:
            ours.close()
