"""A process-local memo of pure computations, keyed by a digest of every input.

Several sites can live in one process (the local runtime, a cluster host): each verifies the
same domain model over the same published samples (:mod:`msa_fed.privacy.verify`), and the part
of that check that does not depend on the site is the same computation every time.  The memo
keeps its result for the next site of this process.

What makes a hit safe:

- the key is a SHA-256 digest of an injective encoding of *every* input of the computation
  (:func:`digest`: each value is written with its type and its length, arrays with their dtype
  and shape and bytes), so two inputs that differ in anything get different keys; a value the
  encoding does not know (any other type) is not memoised at all: the computation runs;
- an entry only ever holds what this process computed itself from those inputs: nothing read
  from another party is stored as a result, and the memo is never written to disk or sent
  anywhere (a site process has its own);
- a computation that refuses (raises) stores nothing: the next caller runs it again and
  refuses in its own name;
- entries are few (least recently used out first) and hold no large array.

An array is written into a key by its bytes, except a *frozen* one (:func:`frozen`: read-only,
its memory a Python ``bytes`` object, which nothing can write to): its bytes cannot change while
it lives, so their SHA-256 is computed once per array object (:func:`frozen_value`) and the key
holds that digest under a tag of its own.  The host of in-process sites freezes the job's
published samples once, and each of p sites then digests p samples without hashing them again.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


class Undigestible(TypeError):
    """A value :func:`digest` does not encode (the caller computes without the memo)."""


def _feed(h, value: Any) -> None:
    def tagged(tag: bytes, payload: bytes) -> None:
        h.update(tag + struct.pack("<Q", len(payload)) + payload)

    kind = type(value)  # exact types: a subclass (its own __eq__, __repr__) is not encoded
    if kind is np.ndarray or isinstance(value, np.generic):  # before float: np.float64 is a float
        a = np.asarray(value)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise Undigestible(f"array of dtype {a.dtype}")
        tagged(b"A" if kind is np.ndarray else b"G", repr((a.dtype.str, a.shape)).encode())
        if kind is np.ndarray and is_frozen(a):  # the digest of its bytes, computed once per array
            tagged(b"h", frozen_value(a, "sha256", _bytes_sha256))
        else:
            tagged(b"a", np.ascontiguousarray(a).tobytes())
    elif value is None:
        tagged(b"N", b"")
    elif kind is bool:
        tagged(b"B", b"1" if value else b"0")
    elif kind is int:
        tagged(b"I", str(value).encode())
    elif kind is float:
        tagged(b"F", struct.pack("<d", value))
    elif kind is str:
        tagged(b"S", value.encode("utf-8", "surrogatepass"))
    elif kind is bytes:
        tagged(b"Y", value)
    elif kind is tuple or kind is list:
        tagged(b"T" if kind is tuple else b"L", struct.pack("<Q", len(value)))
        for v in value:
            _feed(h, v)
    elif kind is dict:
        if not all(type(k) is str for k in value):
            raise Undigestible("dict with keys other than strings")
        tagged(b"D", struct.pack("<Q", len(value)))
        for k in sorted(value):
            _feed(h, k)
            _feed(h, value[k])
    else:
        raise Undigestible(type(value).__name__)


def _bytes_sha256(a: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(a).data).digest()


def frozen(X: Any, dtype: Any = np.float64) -> np.ndarray:
    """``X`` as a frozen array of ``dtype`` (C order): read-only, its memory a ``bytes`` object
    (a copy; ``X`` itself where it is one already).  numpy refuses to make such an array
    writeable again, and no Python code can write to a ``bytes`` object."""
    a = np.ascontiguousarray(X, dtype=dtype)
    if is_frozen(a):
        return a
    out: np.ndarray = np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)
    return out


def is_frozen(a: Any) -> bool:
    """Whether ``a`` is a read-only numpy array whose memory is a ``bytes`` object (:func:`frozen`)."""
    if type(a) is not np.ndarray or a.flags.writeable:
        return False
    base = a.base
    while type(base) is np.ndarray:
        base = base.base
    return type(base) is bytes


#: id of a frozen array -> (weak reference to it, its layout, {name: value})
_FROZEN: dict[int, tuple[weakref.ref, tuple, dict[str, Any]]] = {}
_FROZEN_LOCK = threading.Lock()


def _layout(a: np.ndarray) -> tuple:
    """What of a frozen array object can change in place (its memory cannot: an array that does
    not own its memory is never reallocated)."""
    return (a.shape, a.strides, a.dtype.str)


def _forget(key: int, ref: weakref.ref) -> None:
    with _FROZEN_LOCK:
        entry = _FROZEN.get(key)
        if entry is not None and entry[0] is ref:
            del _FROZEN[key]


def frozen_value(a: np.ndarray, name: str, compute: Callable[[np.ndarray], T]) -> T:
    """``compute(a)``, a pure function of the array's contents: for a frozen array (:func:`is_frozen`)
    computed once per array object and ``name`` while the array lives (its shape, strides and
    dtype checked at every use); for any other array at every call."""
    if not is_frozen(a):
        return compute(a)
    key, layout = id(a), _layout(a)
    with _FROZEN_LOCK:
        entry = _FROZEN.get(key)
        if entry is not None and entry[0]() is a and entry[1] == layout and name in entry[2]:
            return entry[2][name]
    value = compute(a)
    with _FROZEN_LOCK:
        entry = _FROZEN.get(key)
        if entry is None or entry[0]() is not a or entry[1] != layout:
            entry = (weakref.ref(a, functools.partial(_forget, key)), layout, {})
            _FROZEN[key] = entry
        entry[2][name] = value
    return value


def digest(*values: Any) -> bytes:
    """SHA-256 of an injective encoding of ``values`` (raises :class:`Undigestible` for a type it
    does not encode: None, bool, int, float, str, bytes, numpy arrays and scalars of plain dtypes,
    and tuples, lists and string-keyed dicts of these)."""
    h = hashlib.sha256(b"msa_fed.memo/1")
    try:
        _feed(h, values)
    except RecursionError:
        raise Undigestible("nested too deeply") from None
    return h.digest()


class ProcessMemo:
    """At most ``size`` results of one pure computation, by :func:`digest` of its inputs."""

    def __init__(self, size: int = 4):
        self.size = size
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()``'s result for the inputs ``key`` (a tuple of every input it reads),
        computed here or earlier in this process from equal inputs."""
        try:
            k = digest(*key)
        except Undigestible:
            return compute()
        with self._lock:
            if k in self._entries:
                self._entries.move_to_end(k)
                self.hits += 1
                return self._entries[k]
        result = compute()  # a refusal raises here and stores nothing
        with self._lock:
            self.misses += 1
            self._entries[k] = result
            self._entries.move_to_end(k)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return result

    def clear(self) -> None:
        """Forget every entry (and the counts of hits and misses)."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
