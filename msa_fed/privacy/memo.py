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
"""

from __future__ import annotations

import hashlib
import struct
import threading
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
