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

import numpy as np

#: a frame header: 4 bytes (big-endian length) then that many bytes of JSON
_HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16


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


def _recv_into(sock: socket.socket, buf) -> bool:
    """Fill ``buf`` (a writable buffer) from ``sock``; False at EOF."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(1 << 22, len(view) - got))
        if n == 0:
            return False
        got += n
    return True


def serve(rfd: int, wfd: int) -> int:
    """The worker's loop (limits already set): requests on ``rfd``, answers on ``wfd``.

    ``{"op": "load", "sha256", "nbytes"}`` + ONNX bytes -> ``{"ok": true}``;
    ``{"op": "run", "sha256", "rows", "cols"}`` + rows*cols little-endian float32 ->
    ``{"ok": true, "dtype": "<f4"|"<f8", "shape": [...]}`` + the output's bytes;
    any failure -> ``{"ok": false, "code": "memory"|"error", "detail"}``.  Ends at EOF."""
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
        req = json.loads(body)
        try:
            if req["op"] == "load":
                data = _read_exactly(rfd, int(req["nbytes"]))
                if data is None:
                    return 0
                if hashlib.sha256(data).hexdigest() != req["sha256"]:
                    raise ValueError("sha256 mismatch")
                sessions[req["sha256"]] = open_session(data, 1)
                _send(wfd, {"ok": True})
            elif req["op"] == "run":
                rows, cols = int(req["rows"]), int(req["cols"])
                X = np.empty((rows, cols), dtype="<f4")
                if not _recv_into(sock, X):
                    return 0
                session, input_name, output_name = sessions[req["sha256"]]
                out = np.asarray(session.run([output_name], {input_name: X})[0])
                if out.dtype.kind != "f":
                    raise TypeError(f"output dtype {out.dtype}")
                dtype = "<f8" if out.dtype.itemsize == 8 else "<f4"
                out = np.ascontiguousarray(out, dtype=dtype)
                _send(wfd, {"ok": True, "dtype": dtype, "shape": list(out.shape)})
                sock.sendall(out.data.cast("B"))
            else:
                raise ValueError("unknown op")
        except MemoryError as exc:
            _send(wfd, {"ok": False, "code": "memory", "detail": f"MemoryError: {exc}"[:2000]})
        except Exception as exc:  # noqa: BLE001 - every failure is an answer
            detail = f"{type(exc).__name__}: {exc}"[:2000]
            code = (
                "memory" if any(s in detail for s in ("bad_alloc", "Failed to allocate", "alloc failed")) else "error"
            )
            _send(wfd, {"ok": False, "code": code, "detail": detail})
