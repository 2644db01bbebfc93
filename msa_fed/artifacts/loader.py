"""The safe loader of frozen ONNX predictors: bytes from anyone in, a checked predictor out.

:func:`load_predictor` checks, in order: type, size, sha256 and well-known foreign formats
(pickle, zip, .npy) in this process; then, in a sandboxed child process
(:mod:`msa_fed.artifacts.sandbox`), that the bytes are ONNX, that no tensor anywhere (graph,
subgraphs, function bodies, attributes, sparse tensors) refers to external data, that only the
standard operator domains are used, the declaration (input width bounded by ``max_features``
before any array is built), the ONNX checker, an onnxruntime session, and a probe batch of a
few hundred rows at several scales (plus the caller's sample) whose outputs must be finite and,
for probabilities, rows in [0, 1] summing to 1.  The process that calls :func:`load_predictor`
never parses the model: it gets the sandbox's JSON verdict and builds its own onnxruntime
session only when the predictor is first run, after re-checking the structure.

:func:`load_predictors` checks several models in one sandboxed child (the same verdicts).

A successful verdict is cached in-process by (sha256, expectations, sample, limits), so a job
driver or a site that loads the same model twice pays the sandbox start-up once.  Across
processes, :func:`load_predictors` takes a record on disk (``verified``,
:mod:`msa_fed.artifacts.verified_cache`, used by ``load_model``) keyed the same way plus the
checking code and the library versions.

Every refusal is an :class:`msa_fed.errors.ArtifactError` whose ``public_message`` is a fixed
reason (see :data:`msa_fed.artifacts.structure.REASONS`) and whose ``incident_id`` names the
WARNING record of logger ``msa_fed.artifacts`` holding the detail (library text, names found in
the model).  A server returns ``public_message`` and ``incident_id`` and nothing else.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msa_fed.artifacts.sandbox import ProbeItem, SandboxLimits, probe_batch_in_sandbox, probe_in_sandbox
from msa_fed.artifacts.structure import (
    DEFAULT_MAX_FEATURES,
    FOREIGN_FORMATS,
    KIND_PROBABILITIES,
    KIND_REGRESSION,
    KINDS,
    MAX_CLASSES,
    Refusal,
    _classes_ok,
    check_expectations,
    open_session,
    public_message,
)
from msa_fed.artifacts.verified_cache import VerifiedCache, entry_key
from msa_fed.errors import ArtifactError, ConfigError

log = logging.getLogger("msa_fed.artifacts")

DEFAULT_MAX_BYTES = 64 * 2**20
PROBE_CACHE_SIZE = 256


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


MAX_DETAIL_CHARS = 4000


def _printable(text: str) -> str:
    """``text`` on one line, control characters escaped (library text can carry a model's names
    and terminal escapes: no forged log lines), at most MAX_DETAIL_CHARS characters."""
    text = text[:MAX_DETAIL_CHARS]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def artifact_error(code: str, detail: str = "", /, **args) -> ArtifactError:
    """An ArtifactError with the public reason ``code``; the detail is logged with its incident id."""
    detail = _printable(detail) if isinstance(detail, str) else ""
    err = ArtifactError(public_message(code, args), detail=detail or None)
    log.warning(
        "artifact refused [incident %s]: %s%s",
        err.incident_id,
        err.public_message,
        f" | detail: {detail}" if detail else "",
    )
    return err


def _from_refusal(r: Refusal) -> ArtifactError:
    return artifact_error(r.code, r.detail, **r.args_)


# --------------------------------------------------------------------------- predictor objects


class OnnxPredictor:
    """A verified ONNX predictor run by onnxruntime (thread-safe).

    Attributes: ``kind``, ``n_features_in_``, ``sha256``, ``data`` (the ONNX bytes).
    :class:`OnnxClassifier` adds ``classes_`` and ``predict_proba``.  The onnxruntime session
    is built on first use, in this process, after the structure is checked again.  Pickling
    stores only the bytes; unpickling verifies them again (a cache hit in the same process).
    """

    def __init__(self, data: bytes, kind: str, n_features: int, intra_op_threads: int = 1, sha256: str | None = None):
        self.data = data
        self.sha256 = sha256 or sha256_hex(data)
        self.kind = kind
        self.n_features_in_ = n_features
        self._intra_op_threads = intra_op_threads
        self._lock = threading.Lock()
        self._session = None

    def __reduce__(self):
        return (_restore, (self.data, self.sha256, self._intra_op_threads))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self.kind!r}, n_features={self.n_features_in_}, sha256={self.sha256[:12]}...)"
        )

    def _ensure_session(self):
        with self._lock:
            if self._session is None:
                self._session = _session_for(self.data, self._intra_op_threads)
            return self._session

    def _validate(self, X) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"X must have shape (n_samples, {self.n_features_in_}); got {X.shape}")
        return X

    def _run(self, X: np.ndarray) -> np.ndarray:
        session, input_name, output_name = self._ensure_session()
        return np.asarray(session.run([output_name], {input_name: X})[0])

    def predict(self, X) -> np.ndarray:
        """Predictions for ``X`` (n, d): values (n,) float64."""
        X = self._validate(X)
        if X.shape[0] == 0:
            return np.zeros(0)
        return self._run(X).reshape(X.shape[0]).astype(np.float64)


class OnnxRegressor(OnnxPredictor):
    """An :class:`OnnxPredictor` of kind ``"regression"``."""


class OnnxClassifier(OnnxPredictor):
    """An :class:`OnnxPredictor` of kind ``"probabilities"``: ``classes_`` and ``predict_proba``."""

    def __init__(self, *args, classes: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.classes_ = np.asarray(classes)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities for ``X`` (n, d): array (n, n_classes) float64, columns in ``classes_`` order."""
        X = self._validate(X)
        if X.shape[0] == 0:
            return np.zeros((0, len(self.classes_)))
        return self._run(X).astype(np.float64)

    def predict(self, X) -> np.ndarray:
        """Most probable class label of each row of ``X`` (n, d): array (n,).

        Raises :class:`ArtifactError` when a row's probabilities are NaN or infinite (an
        argmax over them would silently answer the first class)."""
        P = self.predict_proba(X)
        bad = ~np.isfinite(P).all(axis=1)
        if bad.any():
            raise ArtifactError(
                f"predictor sha256 {self.sha256[:12]}... returned NaN or infinite probabilities "
                f"for {int(bad.sum())} of {P.shape[0]} rows (first row {int(np.argmax(bad))})"
            )
        return self.classes_[np.argmax(P, axis=1)]


def _session_for(data: bytes, intra_op_threads: int):
    """(session, input name, output name) for bytes the sandbox accepted, structure re-checked here."""
    try:
        return open_session(data, intra_op_threads)
    except Refusal as r:
        raise _from_refusal(r) from None
    except Exception as exc:  # noqa: BLE001 - the sandbox parsed and ran these bytes; anything here is odd
        raise artifact_error("ort_load", f"{type(exc).__name__}: {exc}") from None


def _restore(data: bytes, sha256: str, intra_op_threads: int) -> OnnxPredictor:
    return load_predictor(data, expected_sha256=sha256, intra_op_threads=intra_op_threads)


# --------------------------------------------------------------------------- loading


def _sniff_foreign_format(data: bytes) -> str | None:
    """Name a well-known non-ONNX format (one of structure.FOREIGN_FORMATS), or None."""
    if data[:1] == b"\x80" and len(data) > 1 and 1 <= data[1] <= 5:
        return FOREIGN_FORMATS[0]
    if data[:4] == b"PK\x03\x04":
        return FOREIGN_FORMATS[1]
    if data[:6] == b"\x93NUMPY":
        return FOREIGN_FORMATS[2]
    return None


class _ProbeCache:
    """Successful sandbox verdicts by key, least recently used dropped first (thread-safe)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        return None

    def put(self, key, verdict) -> None:
        with self._lock:
            self._items[key] = verdict
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


PROBE_CACHE = _ProbeCache(PROBE_CACHE_SIZE)


def _checked_verdict(verdict) -> tuple[str, int, list | None]:
    """(kind, n_features, classes) of a success verdict, every field type-checked (the child
    ran hostile bytes: its answer is input too)."""
    if not isinstance(verdict, dict):
        raise artifact_error("sandbox", f"verdict is {type(verdict).__name__}")
    if verdict.get("ok") is not True:
        code = verdict.get("code")
        detail = verdict.get("detail")
        args = verdict.get("args")
        raise artifact_error(
            code if isinstance(code, str) else "sandbox",
            detail if isinstance(detail, str) else "",
            **(args if isinstance(args, dict) else {}),
        )
    kind, width, classes = verdict.get("kind"), verdict.get("n_features"), verdict.get("classes")
    if kind not in KINDS or isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise artifact_error("sandbox", f"malformed verdict: kind {kind!r:.40}, width {width!r:.40}")
    if kind == KIND_PROBABILITIES:
        if not _classes_ok(classes):
            raise artifact_error("bad_classes", "malformed classes in the verdict", limit=MAX_CLASSES)
    elif classes is not None:
        raise artifact_error("sandbox", "a regression verdict with classes")
    return kind, width, classes


def _check_sample(sample, n_features) -> np.ndarray | None:
    if sample is None:
        return None
    sample = np.asarray(sample)
    if sample.ndim != 2 or sample.shape[0] < 1 or sample.dtype.kind not in "biuf":
        raise ConfigError(
            f"sample must be a non-empty 2-D numeric array; got shape {sample.shape}, dtype {sample.dtype}"
        )
    sample = np.ascontiguousarray(sample[:2048], dtype=np.float32)
    if not np.all(np.isfinite(sample)):
        raise ConfigError("sample must contain only finite values")
    if n_features is not None and sample.shape[1] != int(n_features):
        raise ConfigError(f"sample has {sample.shape[1]} columns but n_features={n_features}")
    return sample


def load_predictor(
    data: bytes,
    *,
    expected_sha256: str | None = None,
    n_features: int | None = None,
    kind: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    intra_op_threads: int = 1,
    max_features: int = DEFAULT_MAX_FEATURES,
    sample=None,
    limits: SandboxLimits | None = None,
) -> OnnxPredictor:
    """Verify ONNX bytes from anyone and return a ready :class:`OnnxPredictor` (module docstring).

    Parameters
    ----------
    data : the ONNX bytes.
    expected_sha256 : hex digest the bytes must have.
    n_features, kind : expectations; a mismatch with the declaration is an error.  They also
        stand in for the declaration when an ONNX file carries none.
    max_bytes : largest accepted artifact.
    max_features : widest accepted declared input; checked before any probe array is built.
    sample : optional array (rows, n_features), e.g. the site's published unlabelled sample;
        its first 2048 rows join the probe batch.
    limits : :class:`SandboxLimits` of the sandboxed first load (memory, CPU, wall clock).

    Raises :class:`ArtifactError` (``public_message`` + ``incident_id``; detail in the log) for
    anything wrong with the bytes, ``ConfigError`` for a wrong argument.
    """
    pre = _precheck(data, expected_sha256, n_features, kind, max_bytes, max_features, sample, limits)
    verdict = PROBE_CACHE.get(pre.key)
    if verdict is None:
        verdict = probe_in_sandbox(
            pre.data,
            kind=kind,
            n_features=pre.n_features,
            max_features=pre.max_features,
            sample=pre.sample,
            limits=pre.limits,
        )
    return _finish(pre, verdict, kind, intra_op_threads)


def load_predictors(datas: list[bytes], *, intra_op_threads: int = 1, **checks: Any) -> list[OnnxPredictor]:
    """:func:`load_predictor` on several models, whose first loads share ONE sandboxed child
    (:func:`msa_fed.artifacts.sandbox.probe_batch_in_sandbox`: the same limits and the same
    verdict per model as one by one; a model that ends the child sends the rest to their own).

    ``checks`` are :func:`prepare_predictors`' keywords: ``expected_sha256`` lists one digest (or
    None) per model; ``verified``, a :class:`~msa_fed.artifacts.verified_cache.VerifiedCache`
    whose success verdicts stand in for the sandbox (looked up by the models' content) and that
    records new ones.  Raises the error of the first model, in order, that is refused."""
    return prepare_predictors(datas, **checks).load(intra_op_threads)


class PreparedPredictors:
    """Models past the in-process checks (type, size, sha256, foreign formats), with the verdicts
    already known (this process's cache, then the ``verified`` record); :meth:`load` runs the
    sandbox for the others.  ``needs_sandbox`` says whether it will (a caller can start the
    sandbox's helper early, and only then)."""

    def __init__(self, pres: list[_Prechecked], kind, verified: VerifiedCache | None):
        self._pres, self._kind, self._verified = pres, kind, verified
        self._verdicts = []
        for pre in pres:
            verdict = PROBE_CACHE.get(pre.key)
            if verdict is None and verified is not None:
                verdict = verified.get(_record_key(pre))
            self._verdicts.append(verdict)

    @property
    def needs_sandbox(self) -> bool:
        return any(v is None for v in self._verdicts)

    def load(self, intra_op_threads: int = 1) -> list[OnnxPredictor]:
        pres, kind, verdicts = self._pres, self._kind, list(self._verdicts)
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if todo:
            items = [
                ProbeItem(pres[i].data, kind, pres[i].n_features, pres[i].max_features, pres[i].sample) for i in todo
            ]
            for i, verdict in zip(todo, probe_batch_in_sandbox(items, pres[0].limits)):
                verdicts[i] = verdict
        out = [_finish(pre, verdict, kind, intra_op_threads) for pre, verdict in zip(pres, verdicts)]
        if self._verified is not None:
            for i in todo:  # checked by _finish: only accepted verdicts reach the record
                self._verified.put(_record_key(pres[i]), verdicts[i])
        return out


def prepare_predictors(
    datas: list[bytes],
    *,
    expected_sha256: list[str | None] | None = None,
    n_features: int | None = None,
    kind: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_features: int = DEFAULT_MAX_FEATURES,
    limits: SandboxLimits | None = None,
    verified: VerifiedCache | None = None,
) -> PreparedPredictors:
    """The first half of :func:`load_predictors` (its arguments): the in-process checks and the
    known verdicts; raises the error of the first model, in order, that is refused here."""
    expected = list(expected_sha256) if expected_sha256 is not None else [None] * len(datas)
    if len(expected) != len(datas):
        raise ConfigError(f"expected_sha256 lists {len(expected)} digests for {len(datas)} models")
    pres = [_precheck(d, e, n_features, kind, max_bytes, max_features, None, limits) for d, e in zip(datas, expected)]
    return PreparedPredictors(pres, kind, verified)


def _record_key(pre: _Prechecked) -> dict:
    """The key of ``pre``'s verdict in a :class:`VerifiedCache` (the same fields as PROBE_CACHE's)."""
    _, kind, n_features, max_features, sample_digest, sample_shape, limits = pre.key
    return entry_key(pre.digest, kind, n_features, max_features, sample_digest, sample_shape, limits)


@dataclass(frozen=True)
class _Prechecked:
    data: bytes
    digest: str
    n_features: int | None
    max_features: int
    sample: np.ndarray | None
    limits: SandboxLimits
    key: tuple


def _precheck(data, expected_sha256, n_features, kind, max_bytes, max_features, sample, limits) -> _Prechecked:
    """The checks of :func:`load_predictor` done in this process, before any sandbox."""
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"kind must be one of {KINDS}; got {kind!r}")
    if n_features is not None and (
        isinstance(n_features, bool) or not isinstance(n_features, (int, np.integer)) or n_features < 1
    ):
        raise ConfigError(f"n_features must be a positive integer; got {n_features!r}")
    if isinstance(max_features, bool) or not isinstance(max_features, (int, np.integer)) or max_features < 1:
        raise ConfigError(f"max_features must be a positive integer; got {max_features!r}")
    n_features = None if n_features is None else int(n_features)
    max_features = int(max_features)
    limits = limits or SandboxLimits()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise artifact_error("not_bytes", f"got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise artifact_error("empty")
    if len(data) > max_bytes:
        raise artifact_error("too_large", size=len(data), limit=int(max_bytes))
    digest = sha256_hex(data)
    if expected_sha256 is not None and digest != str(expected_sha256).lower():
        raise artifact_error(
            "sha256", f"expected {str(expected_sha256)[:80]!r}", digest=digest, expected=str(expected_sha256).lower()
        )
    foreign = _sniff_foreign_format(data)
    if foreign is not None:
        raise artifact_error("foreign", what=foreign)
    if n_features is not None and n_features > max_features:
        raise artifact_error("too_wide", width=n_features, limit=max_features)
    sample = _check_sample(sample, n_features)
    key = (
        digest,
        kind,
        n_features,
        max_features,
        None if sample is None else sha256_hex(sample.tobytes()),
        sample.shape if sample is not None else None,
        limits,
    )
    return _Prechecked(data, digest, n_features, max_features, sample, limits, key)


def _finish(pre: _Prechecked, verdict, kind, intra_op_threads: int) -> OnnxPredictor:
    """The predictor of a sandbox verdict (checked again here; a success is cached)."""
    d_kind, d_width, classes = _checked_verdict(verdict)
    try:
        check_expectations(d_kind, d_width, kind, pre.n_features, pre.max_features)
    except Refusal as r:
        raise _from_refusal(r) from None
    PROBE_CACHE.put(pre.key, verdict)
    data, digest = pre.data, pre.digest
    if d_kind == KIND_REGRESSION:
        return OnnxRegressor(data, d_kind, d_width, intra_op_threads, digest)
    assert classes is not None  # a probabilities model declares its classes (checked in the sandbox's verdict)
    return OnnxClassifier(data, d_kind, d_width, intra_op_threads, digest, classes=classes)


def load_predictor_file(path, **kwargs: Any) -> OnnxPredictor:
    """:func:`load_predictor` on the bytes of ``path`` (refuses files over ``max_bytes`` before reading)."""
    path = Path(path)
    max_bytes = kwargs.get("max_bytes", DEFAULT_MAX_BYTES)
    if not path.is_file():
        raise ConfigError(f"predictor file {str(path)!r} is not a regular file")
    size = path.stat().st_size
    if size > max_bytes:
        raise artifact_error("too_large", str(path), size=size, limit=int(max_bytes))
    return load_predictor(path.read_bytes(), **kwargs)
