"""The worker's side of :mod:`msa_fed.artifacts.isolated`: the loop that runs a peer's ONNX
predictor inside a sandboxed process (limits set by :mod:`msa_fed.artifacts.sandbox_process`
before it starts), and the framing both sides share: a 4-byte big-endian length, a JSON header,
then raw little-endian array bytes. Nothing is pickled in either direction."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time

import numpy as np

#: a frame header: 4 bytes (big-endian length) then that many bytes of JSON
_HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16
_MAX_PARTS = 64  # buffers per sendmsg (well under IOV_MAX)


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(1 << 20, n - got))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, header: dict, payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    _write_all(fd, _HEADER.pack(len(raw)) + raw)
    if payload:
        _write_all(fd, payload)


def send_parts(sock: socket.socket, parts, deadline: float | None = None) -> None:
    """Write ``parts`` (bytes or C-contiguous arrays) in as few system calls as the socket takes
    (one ``sendmsg`` for a frame and its payload: the reader wakes once, not once per part).
    ``deadline`` (``time.monotonic``): the socket times out there (TimeoutError)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        n = sock.sendmsg(views[:_MAX_PARTS])
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


def _recv_into(sock: socket.socket, buf) -> bool:
    """Fill ``buf`` (a writable buffer) from ``sock``; False at EOF."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(1 << 22, len(view) - got))
        if n == 0:
            return False
        got += n
    return True


def _fail(wfd: int, exc: BaseException) -> None:
    """Answer a failure: ``code`` "memory" where the message says an allocation failed."""
    detail = f"{type(exc).__name__}: {exc}"[:2000]
    alloc = ("bad_alloc", "Failed to allocate", "alloc failed")
    memory = isinstance(exc, MemoryError) or any(s in detail for s in alloc)
    _send(wfd, {"ok": False, "code": "memory" if memory else "error", "detail": detail})


def serve(rfd: int, wfd: int) -> int:
    """The worker's loop (limits already set): requests on ``rfd``, answers on ``wfd``.

    One request runs several models on the same rows (a site evaluates all its peers' predictors
    on its points at once: one round trip, the rows sent once)::

        {"op": "runs", "rows", "cols", "models": [{"sha256", "nbytes"}, ...]}
        + the ONNX bytes of each model with nbytes > 0 (not loaded yet), in order
        + rows*cols little-endian float32

    answered model by model, in order: a model sent with its bytes first answers ``{"ok": true}``
    once loaded, then every model ``{"ok": true, "dtype": "<f4"|"<f8", "shape": [...]}`` + its
    output's bytes (the frame and its bytes in one write).  A request that only loads models
    (a site sends its peers' models while a job is being admitted, before any rows)::

        {"op": "load", "models": [{"sha256", "nbytes"}, ...]} + the ONNX bytes of each, in order

    answers ``{"ok": true}`` per model once loaded.  A failure answers
    ``{"ok": false, "code": "memory"|"error", "detail"}`` in place of the frame it stops (the
    caller then ends this process).  Ends at EOF."""
    import onnx  # noqa: F401 - imported while the worker waits for its first request
    import onnxruntime  # noqa: F401

    from msa_fed.artifacts.structure import open_session

    sessions: dict[str, tuple] = {}
    sock = socket.socket(fileno=os.dup(rfd))  # rows straight into an array, no copies
    while True:
        raw = _read_exactly(rfd, _HEADER.size)
        if raw is None:
            return 0
        (size,) = _HEADER.unpack(raw)
        if size > MAX_HEADER_BYTES:
            return 2
        body = _read_exactly(rfd, size)
        if body is None:
            return 0
        try:
            req = json.loads(body)
            if req["op"] not in ("runs", "load"):
                raise ValueError("unknown op")
            load_only = req["op"] == "load"
            models = [(str(m["sha256"]), int(m["nbytes"])) for m in req["models"]]
            blobs = []
            for _, nbytes in models:
                data = _read_exactly(rfd, nbytes) if nbytes else b""
                if data is None:
                    return 0
                blobs.append(data)
            X = None
            if not load_only:
                X = np.empty((int(req["rows"]), int(req["cols"])), dtype="<f4")
                if not _recv_into(sock, X):
                    return 0
        except Exception as exc:  # noqa: BLE001 - every failure is an answer
            _fail(wfd, exc)
            continue
        for (sha, nbytes), data in zip(models, blobs):
            try:
                if nbytes:
                    if hashlib.sha256(data).hexdigest() != sha:
                        raise ValueError("sha256 mismatch")
                    sessions[sha] = open_session(data, 1, memory_arena=False)
                    _send(wfd, {"ok": True})
                if X is None:
                    continue
                session, input_name, output_name = sessions[sha]
                out = np.asarray(session.run([output_name], {input_name: X})[0])
                if out.dtype.kind != "f":
                    raise TypeError(f"output dtype {out.dtype}")
                dtype = "<f8" if out.dtype.itemsize == 8 else "<f4"
                out = np.ascontiguousarray(out, dtype=dtype)
                raw = json.dumps({"ok": True, "dtype": dtype, "shape": list(out.shape)}).encode()
                send_parts(sock, [_HEADER.pack(len(raw)) + raw, out])
            except Exception as exc:  # noqa: BLE001 - MemoryError included: every failure is an answer
                _fail(wfd, exc)
                break
        del blobs
