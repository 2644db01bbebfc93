"""A per-user record on disk of the predictors the sandbox accepted, so that loading the same
bytes again, in another process, does not start the sandbox again.

:func:`msa_fed.load_model` checks each predictor in a sandboxed child (:mod:`.sandbox`), which
costs a fresh interpreter importing numpy, onnx and onnxruntime (measured: most of a cold
``load_model``).  A success verdict is a function of the model's bytes, the expectations (kind,
width, sample), the limits and the checking code; this module stores it under a key made of
exactly those:

- the sha256 of the bytes the caller holds and will run (hashed from those bytes on every
  load, never taken from a file name, a manifest or a modification time: a changed file is a
  different key and is checked again, in full);
- the expectations and :class:`~msa_fed.artifacts.sandbox.SandboxLimits` of the load;
- :func:`stack_digest`: the source of the checking modules and the installed versions of
  python, numpy, onnx, onnxruntime and protobuf (an upgrade re-checks everything).

Only successes are stored; a verdict read back is checked again by the loader like one from the
child.  The record is trusted only as far as the directory is: it must be a real directory
(not a link) owned by this user and writable by nobody else, and each entry a regular file
owned by this user, not writable by others, holding its own full key (an entry renamed or
linked under another key's name does not match).  Anything else is a miss (logged once), never
an error: the sandbox then runs as without the record.  A sandboxed child runs as this user but
with a file-size limit of 0, so even a model that took over its child cannot write an entry.

Where: ``$MSA_FED_VERIFIED_CACHE`` (a directory; ``off`` turns the record off), else
``$XDG_CACHE_HOME/msa_fed/verified``, else ``~/.cache/msa_fed/verified``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import sys
import threading
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger("msa_fed.artifacts")

ENV = "MSA_FED_VERIFIED_CACHE"
OFF_VALUES = ("", "0", "off", "no", "false", "none")
FORMAT = "msa_fed.verified.1"
MAX_ENTRY_BYTES = 8 << 20  # a verdict lists at most MAX_CLASSES labels (structure.py)
#: the modules whose code decides a verdict
CHECK_MODULES = ("structure.py", "sandbox_process.py", "sandbox.py", "zygote.py", "verified_cache.py")
#: the installed distributions whose behaviour decides a verdict (by their dist-info names)
DISTRIBUTIONS = ("numpy", "onnx", "onnxruntime", "protobuf")
PACKAGES = ("numpy", "onnx", "onnxruntime")


def cache_dir() -> Path | None:
    """The directory of the record (module docstring), or None when it is turned off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF_VALUES else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no home directory to be found: no record
            return None
    return Path(base) / "msa_fed" / "verified"


_stack: str | None = None
_stack_lock = threading.Lock()


def stack_digest() -> str:
    """sha256 over what decides a verdict besides the model: the checking modules' source, the
    python version and the dist-info names (name and version) of numpy, onnx, onnxruntime and
    protobuf next to the packages this process would import.  Computed once per process without
    importing any of them (measured: importlib.metadata alone took 90 ms)."""
    global _stack
    with _stack_lock:
        if _stack is None:
            import importlib.util

            h = hashlib.sha256(f"{FORMAT}\0{sys.version}\0{sys.executable}\0".encode())
            here = Path(__file__).resolve().parent
            for name in CHECK_MODULES:
                h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
            sites = set()
            for pkg in PACKAGES:
                try:
                    spec = importlib.util.find_spec(pkg)
                    origin = spec.origin if spec is not None else None
                    h.update(f"{pkg}={origin}\0".encode())
                    if origin:
                        sites.add(os.path.dirname(os.path.dirname(origin)))
                        st = os.stat(origin)
                        h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\0".encode())
                except (ImportError, ValueError, OSError):
                    # a library this process cannot place: a key no other process shares
                    h.update(os.urandom(16))
            wanted = tuple(d + "-" for d in DISTRIBUTIONS)
            for site in sorted(sites):
                try:
                    names = os.listdir(site)
                except OSError:
                    names = []
                for entry in sorted(n for n in names if n.endswith(".dist-info")):
                    if entry.lower().replace("_", "-").startswith(wanted):
                        h.update(entry.encode() + b"\0")
            _stack = h.hexdigest()
        return _stack


def entry_key(digest: str, kind, n_features, max_features, sample_digest, sample_shape, limits) -> dict:
    """The full key of one verdict (a JSON object; its sha256 names the entry's file)."""
    return {
        "format": FORMAT,
        "stack": stack_digest(),
        "sha256": digest,
        "kind": kind,
        "n_features": n_features,
        "max_features": max_features,
        "sample_sha256": sample_digest,
        "sample_shape": None if sample_shape is None else list(sample_shape),
        "limits": asdict(limits),
    }


def _name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json"


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class VerifiedCache:
    """The record in directory ``path`` (created, mode 0700, when first written)."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"VerifiedCache({str(self.path)!r})"

    def _distrust(self, why: str) -> None:
        with _warned_lock:
            if (str(self.path), why) in _warned:
                return  # once per process, directory and reason
            _warned.add((str(self.path), why))
        log.warning("verified-model record %s not used: %s", self.path, why)

    def _open_dir(self, create: bool) -> int | None:
        """A descriptor of the directory if it is one we can trust (module docstring), else None."""
        if create:
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            except OSError as exc:
                self._distrust(f"cannot create it ({exc.strerror})")
                return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if create or exc.errno != errno.ENOENT:  # a missing directory is an empty record
                self._distrust(f"cannot open it ({exc.strerror})")
            return None
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            os.close(fd)
            self._distrust("it is not a directory of this user's, writable by this user alone")
            return None
        return fd

    def get(self, key: dict) -> dict | None:
        """The verdict stored under ``key``, or None (nothing there, or nothing to trust)."""
        dfd = self._open_dir(create=False)
        if dfd is None:
            return None
        try:
            try:
                fd = os.open(_name(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                return None  # no entry (or a link: refused by O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                    self._distrust("an entry is not a regular file of this user's")
                    return None
                if st.st_size > MAX_ENTRY_BYTES:
                    return None
                with os.fdopen(os.dup(fd), "rb") as fh:
                    raw = fh.read(MAX_ENTRY_BYTES + 1)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
        try:
            entry = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("verdict"), dict):
            return None  # another key's entry under this name, or a torn one
        verdict = entry["verdict"]
        return verdict if verdict.get("ok") is True else None

    def put(self, key: dict, verdict: dict) -> None:
        """Store a success ``verdict`` under ``key`` (atomically; a failure to write is logged once)."""
        if not isinstance(verdict, dict) or verdict.get("ok") is not True:
            return
        dfd = self._open_dir(create=True)
        if dfd is None:
            return
        name = _name(key)
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            data = json.dumps({"key": key, "verdict": verdict}, sort_keys=True).encode()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(os.dup(fd), "wb") as fh:
                    fh.write(data)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            self._distrust(f"cannot write an entry ({exc.strerror})")
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        finally:
            os.close(dfd)


def default_cache() -> VerifiedCache | None:
    """The record of :func:`cache_dir`, or None when it is turned off."""
    path = cache_dir()
    return None if path is None else VerifiedCache(path)
