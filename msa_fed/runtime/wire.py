"""A pickle-free byte encoding of the boundary messages, for the direct data channel.

Ray moves messages between its own processes with pickle; the data channel
(:mod:`msa_fed.runtime.channel`) carries them between the coordinator and a site's actor over
a socket, and nothing received there is ever unpickled.  A message is encoded as

    u32 header length | JSON header | raw array bytes

The header names the message type, which must be one of the boundary types of
:mod:`msa_fed.runtime.messages` allowed in that direction, and gives each field as JSON: numbers,
strings, booleans, None, tuples (``{"tu": [...]}``), the DC sums (``{"dc": {...}}``) and numeric
arrays (``{"nd": [dtype, shape, offset, nbytes]}``, the bytes after the header).  Decoding
checks every part (types, dtypes, sizes, offsets) and raises :class:`WireError` on anything else:
a peer can make a call fail, never run code or allocate more than the frame it sent.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import fields

import numpy as np

from msa_fed.core.dc_terms import DCSums
from msa_fed.runtime import messages as m

_U32 = struct.Struct("!I")
#: numeric dtypes an array may have on the wire (no objects, no strings)
_DTYPE_KINDS = "biuf"
_MAX_DEPTH = 8


class WireError(ValueError):
    """A frame that is not a valid encoded boundary message."""


def _types(classes) -> dict[str, type]:
    return {c.__name__: c for c in classes}


REQUESTS = _types(m.REQUEST_TYPES)
RESPONSES = _types(m.RESPONSE_TYPES)


def _enc(v, blobs: list, offset: list[int], depth: int = 0):
    if depth > _MAX_DEPTH:
        raise WireError("message nested too deeply")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else {"fl": repr(f)}
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in _DTYPE_KINDS:
            raise WireError(f"cannot send an array of dtype {v.dtype}")
        data = np.ascontiguousarray(v).tobytes()
        spec = {"nd": [v.dtype.str, list(v.shape), offset[0], len(data)]}
        blobs.append(data)
        offset[0] += len(data)
        return spec
    if isinstance(v, DCSums):
        return {"dc": {f.name: _enc(getattr(v, f.name), blobs, offset, depth + 1) for f in fields(v)}}
    if isinstance(v, (tuple, list)):
        return {"tu": [_enc(x, blobs, offset, depth + 1) for x in v]}
    raise WireError(f"cannot send a value of type {type(v).__name__}")


def encode(method: str, msg: m.Message | None, allowed: dict[str, type]) -> bytes:
    """The bytes of (method, msg); msg must be one of ``allowed`` (or None)."""
    blobs: list[bytes] = []
    offset = [0]
    if msg is None:
        header = {"m": method, "t": None}
    else:
        name = type(msg).__name__
        if allowed.get(name) is not type(msg):
            raise WireError(f"{name} is not a message that may cross here")
        header = {"m": method, "t": name,
                  "f": {f.name: _enc(getattr(msg, f.name), blobs, offset) for f in fields(msg)}}
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([_U32.pack(len(head)), head, *blobs])


def encode_error(kind: str, text: str) -> bytes:
    """An error answer: the library error type's name and its message."""
    head = json.dumps({"err": str(kind), "msg": str(text)}, separators=(",", ":")).encode()
    return _U32.pack(len(head)) + head


def _dec(v, body: memoryview, depth: int = 0):
    if depth > _MAX_DEPTH:
        raise WireError("message nested too deeply")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        (key, val), = v.items()
        if key == "tu" and isinstance(val, list):
            return tuple(_dec(x, body, depth + 1) for x in val)
        if key == "fl" and val in ("inf", "-inf", "nan"):
            return float(val)
        if key == "nd":
            return _array(val, body)
        if key == "dc" and isinstance(val, dict):
            names = [f.name for f in fields(DCSums)]
            if set(val) != set(names):
                raise WireError("malformed DC sums")
            return DCSums(*(_dec(val[n], body, depth + 1) for n in names))
    raise WireError(f"unexpected value in a message: {str(v)[:80]!r}")


def _array(spec, body: memoryview) -> np.ndarray:
    try:
        dtype_str, shape, start, nbytes = spec
        dtype = np.dtype(dtype_str)
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError) as exc:
        raise WireError(f"malformed array: {exc}") from None
    if dtype.kind not in _DTYPE_KINDS or any(s < 0 for s in shape) or len(shape) > 8:
        raise WireError(f"array of dtype {dtype} shape {shape} not allowed")
    if not (isinstance(start, int) and isinstance(nbytes, int) and 0 <= start and start + nbytes <= len(body)):
        raise WireError("array bytes outside the frame")
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise WireError(f"array of shape {shape} and dtype {dtype} does not fill {nbytes} bytes")
    return np.frombuffer(body[start:start + nbytes], dtype=dtype).reshape(shape)


def decode(frame: bytes, allowed: dict[str, type]):
    """(method, message) of an encoded frame, or ("", WireRemoteError) for an error answer."""
    view = memoryview(frame)
    if len(view) < 4:
        raise WireError("truncated frame")
    (n,) = _U32.unpack(view[:4])
    if n > len(view) - 4:
        raise WireError("truncated frame header")
    try:
        header = json.loads(bytes(view[4:4 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("frame header is not an object")
    body = view[4 + n:]
    if "err" in header:
        return "", RemoteError(str(header.get("err")), str(header.get("msg", "")))
    method, name = header.get("m"), header.get("t")
    if not isinstance(method, str):
        raise WireError("frame names no method")
    if name is None:
        return method, None
    cls = allowed.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"{str(name)[:80]!r} is not a message that may cross here")
    raw = header.get("f")
    names = [f.name for f in fields(cls)]
    if not isinstance(raw, dict) or set(raw) != set(names):
        raise WireError(f"{name}: fields {sorted(raw) if isinstance(raw, dict) else raw!r}, expected {names}")
    try:
        return method, cls(**{k: _dec(raw[k], body) for k in names})
    except TypeError as exc:
        raise WireError(f"{name}: {exc}") from None


class RemoteError(Exception):
    """An error the other end reported: ``kind`` is the error type's name."""

    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind}: {text}")
        self.kind, self.text = kind, text
