"""The combined model g (DESIGN.md section 5, step 3) and its pickle-free file format.

A deployed model needs the domain model Q(k | x) (Maxent classifier, or KDEs for GMSA),
Qhat(k), z, eta and the frozen predictors h_k.  ``save(path)`` writes a directory:

    path/manifest.json       format version, method, task, sites, z, eta, Gamma, losses, ...
    path/arrays.npz          numeric state (loaded with allow_pickle=False); ``target.*``: the
                             rows of the published samples the target checks use (manifest key
                             "target"; msa_fed/artifacts/target_check.py)
    path/predictors/k.onnx   the frozen predictors, checked by sha256 on load
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from msa_fed import __version__
from msa_fed.artifacts.isolated import answered_together, is_isolated
from msa_fed.artifacts.outputs import check_X, checked_proba, checked_values
from msa_fed.core.domain_models import domain_model_state
from msa_fed.core.inference import StoredFeatureMap, stored_domain_model
from msa_fed.core.threads import blas_threads_for
from msa_fed.errors import ArtifactError

# Loading a model and predicting with it needs numpy and onnxruntime only: the combination
# arithmetic (scipy), the training feature maps (scikit-learn) and the Maxent trainer (torch) are
# imported where a method needs them (see msa_fed.core.inference).

FORMAT_VERSION = 1
#: the manifest keys :func:`load_model` reads (a manifest without one is refused, naming it)
MANIFEST_KEYS = (
    "method",
    "task",
    "sites",
    "n_features",
    "z",
    "eta",
    "qhat",
    "gamma",
    "domain_losses",
    "history",
    "classes",
    "info",
    "feature_map",
    "domain_model",
    "predictor_sha256",
)


def predictor_kind(task: str) -> str:
    """What the safe loader checks a frozen predictor's outputs as, for ``task``."""
    return "regression" if task == "regression" else "probabilities"


class CombinedModel:
    """g(x) = sum_k (z_k q_k(x) + eta/p) h_k(x) / (sum_k z_k q_k(x) + eta), q_k = Q(k|x)/Qhat(k).

    Attributes: method ("dmsa" or "gmsa"), task, site_names, z (p,), eta, qhat (p,), gamma,
    domain_losses (p,), history (Gamma per solver iteration), classes_ (classification),
    domain_model (has predict_log_proba), predictors (list of p), info (dict).
    """

    def __init__(
        self,
        *,
        method,
        task,
        site_names,
        domain_model,
        qhat,
        z,
        eta,
        predictors,
        n_features,
        classes=None,
        gamma=float("nan"),
        domain_losses=None,
        history=(),
        info=None,
        epsilon_by_site=None,
        target_reference=None,
    ):
        self.method = method
        self.task = task
        self.site_names = list(site_names)
        self.domain_model = domain_model
        self.qhat = np.asarray(qhat, dtype=np.float64)
        self.z = np.asarray(z, dtype=np.float64)
        self.eta = float(eta)
        self.predictors = list(predictors)
        self.n_features_in_ = int(n_features)
        self.classes_ = None if classes is None else np.asarray(classes)
        self.gamma = float(gamma)
        self.domain_losses = None if domain_losses is None else np.asarray(domain_losses, dtype=np.float64)
        self.history = [float(g) for g in history]
        self.info = dict(info or {})
        # differential privacy: the epsilon each site spent on the run (0: answered without DP)
        self.epsilon_by_site = {str(k): float(v) for k, v in (epsilon_by_site or {}).items()}
        # what the model carries of the sites' published samples for target checks (or None)
        self.target_reference = target_reference

    @property
    def target_reference(self):
        """What the model carries of the sites' published samples for target checks
        (:class:`msa_fed.artifacts.target_check.TargetReference`), or None.  A fit hands the model
        its builder (:meth:`defer_target_reference`): the reference is built on first use (a
        target check, :meth:`save`, :meth:`to_onnx` with ``support``, pickling), from the model
        as it is then, with the numbers the fit would have built."""
        if "_target_build" in self.__dict__:
            import threading

            # another thread waits for the build; a read from within the build finds none yet; a
            # build that fails is tried again at the next read
            with self.__dict__.setdefault("_target_lock", threading.RLock()):
                build = self.__dict__.get("_target_build")
                if build is not None and not self.__dict__.get("_target_building"):
                    self.__dict__["_target_building"] = True
                    try:
                        reference = build()
                    finally:
                        del self.__dict__["_target_building"]
                    self.__dict__["_target_reference"] = reference
                    del self.__dict__["_target_build"]
        return self.__dict__.get("_target_reference")

    @target_reference.setter
    def target_reference(self, value) -> None:
        self.__dict__.pop("_target_build", None)
        self.__dict__["_target_reference"] = value

    def defer_target_reference(self, build) -> None:
        """Build the target reference with ``build()`` (no arguments; returns it or None) on
        first use of :attr:`target_reference` instead of now."""
        self.__dict__.pop("_target_reference", None)
        self.__dict__["_target_build"] = build

    @property
    def n_sources(self) -> int:
        return self.z.size

    # the sites' verdicts (msa_fed/core/harm.py), kept in info["site_check"] (the manifest's info)
    @property
    def harm(self) -> dict[str, float]:
        """Site name -> the combined model's loss on the site's labelled data minus its own
        predictor's there, as the site measured it ({} when the sites were not asked)."""
        check = self.info.get("site_check") or {}
        return {str(n): float(h) for n, h in zip(check.get("sites", ()), check.get("harm", ()))}

    @property
    def suspects(self) -> tuple[str, ...]:
        """The sites whose exclusion removes the harm measured at two or more other sites (one site's
        word names nobody: msa_fed/core/harm.py; empty: nobody)."""
        return tuple(str(n) for n in (self.info.get("site_check") or {}).get("suspects", ()))

    @property
    def disputed(self) -> tuple[str, ...]:
        """The sites that do not sign the model off (their policy's accept = false, harmed)."""
        return tuple(str(n) for n in (self.info.get("site_check") or {}).get("disputed", ()))

    @property
    def guarantee(self) -> dict | None:
        """The own-loss guarantee's record (solver option ``guarantee``; None when it was off):
        ``status`` ("holds at the min-max point", "constrained", "infeasible" or "not applied"),
        ``holds``, ``slack``, ``own`` (each site's own predictor's loss), ``losses`` (L_k at z),
        ``excess`` (L_k - own_k - slack), ``max_loss_unconstrained``, ``evaluations`` (its extra
        rounds) and ``line`` (the outcome in words)."""
        record = self.info.get("guarantee")
        return dict(record) if isinstance(record, dict) else None

    @property
    def z_paper(self) -> np.ndarray:
        """z' of the paper's Proposition 1 (the weight on Q(k|x) itself)."""
        from msa_fed.core.combination import paper_z

        return paper_z(self.z, self.qhat)

    def __getstate__(self) -> dict:
        self.target_reference  # noqa: B018 - a deferred reference is built: its builder stays here
        state = dict(self.__dict__)
        state.pop("_graph", None)  # an onnxruntime session: rebuilt on first use
        state.pop("_graph_lock", None)
        state.pop("_target_lock", None)
        state.pop("_target_building", None)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if "target_reference" in state:  # the state of a model pickled before the reference was deferred
            state["_target_reference"] = state.pop("target_reference")
        self.__dict__.update(state)

    # ------------------------------------------------------------------ prediction
    def domain_proba(self, X) -> np.ndarray:
        """Q(k | x), ndarray (n, p), columns in site order."""
        X = check_X(X, self.n_features_in_)
        return np.exp(self.domain_model.predict_log_proba(X))

    def combination_weights(self, X) -> np.ndarray:
        return self._weights(check_X(X, self.n_features_in_))

    def _weights(self, X: np.ndarray, log_Q: np.ndarray | None = None) -> np.ndarray:
        """The weights a_k(x) (n, p) of g_z at checked rows X (``log_Q``: the domain model's
        log Q(k | x) on them where the caller has it already)."""
        from msa_fed.core.combination import combination_weights

        if log_Q is None:
            log_Q = self.domain_model.predict_log_proba(X)
        return combination_weights(log_Q, np.log(self.qhat), self.z, self.eta)

    def _who(self, k) -> str:
        return f"predictor {k} (site {self.site_names[k]!r})" if k < len(self.site_names) else f"predictor {k}"

    def _proba_of(self, k, X, h=None, out: np.ndarray | None = None) -> np.ndarray:
        """Predictor k's checked probabilities on X over the model's classes (n, c), written into
        ``out`` (an (n, c) view, zeros where the predictor lacks a class) where given."""
        h = self.predictors[k] if h is None else h
        P = checked_proba(h.predict_proba(X), X.shape[0], len(h.classes_), self._who(k), ArtifactError)
        if out is None:
            out = np.zeros((X.shape[0], self.classes_.size))
        cols = np.searchsorted(self.classes_, np.asarray(h.classes_))
        if cols.size != self.classes_.size:
            out[...] = 0.0
        out[:, cols] = P
        return out

    def to_onnx(self, dtype: str = "float64", *, provenance: dict | None = None, support: bool = False) -> bytes:
        """The whole model as one self-contained ONNX file (bytes): input ``X`` (n, d) of ``dtype``
        ("float64" or "float32"); outputs ``probabilities`` (n, c) and ``label`` (n,)
        (classification) or ``prediction`` (n,) (regression).  ``provenance``: extra metadata
        (``msa_fed.<key>``), e.g. the registry version.  Predictors that are not ONNX yet
        (scikit-learn or torch objects of a model fitted in this process) are exported as
        :meth:`save` exports them, so the file reproduces the saved model (float32 predictors),
        not the in-memory objects' float64 answers.  See :mod:`msa_fed.artifacts.onnx_graph`.
        ``support``: a last output ``support_pvalue`` (n,), :meth:`support`'s p-values, where the
        model carries a target reference (:mod:`msa_fed.artifacts.onnx_support`)."""
        from msa_fed.artifacts.onnx_graph import export_onnx

        return export_onnx(self, dtype, provenance=provenance, support=support)

    def _graph_session(self):
        """The onnxruntime session of the model's own float64 graph with row checks (built on first
        use), or None where the model has no such graph (a KDE domain model, predictors that are
        not verified ONNX predictors, a custom feature map): those predict in numpy."""
        import threading

        lock = self.__dict__.setdefault("_graph_lock", threading.Lock())
        key = (
            self.task,
            self.z.tobytes(),
            self.qhat.tobytes(),
            self.eta,
            id(self.domain_model),
            tuple(id(h) for h in self.predictors),
        )
        with lock:
            cached = self.__dict__.get("_graph")
            if cached is None or cached[0] != key:
                cached = self._graph = (key, _build_session(self))
            return cached[1]

    def _run_graph(self, X: np.ndarray, output: str) -> np.ndarray | None:
        """The graph's ``output`` on X, or None: no graph, no rows, or a row the checks refuse
        (the numpy path then names the predictor and the row)."""
        if X.shape[0] == 0:
            return None
        session = self._graph_session()
        if session is None:
            return None
        out, ok = session.run([output, "all_ok"], {"X": X})
        if not bool(ok) or not np.isfinite(out).all():
            return None
        return np.asarray(out)

    def _graph_or_numpy(self, X, output: str, numpy_path) -> np.ndarray:
        """``output`` at the rows X (checked here): from the whole-model graph where it runs, else part
        by part in numpy (``numpy_path``)."""
        X = check_X(X, self.n_features_in_)
        out = self._run_graph(X, output)
        return out if out is not None else numpy_path(X)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (n, c) over ``classes_`` (classification only)."""
        if self.task != "classification":
            raise ValueError("predict_proba is only defined for task='classification'")
        return self._graph_or_numpy(X, "probabilities", self._predict_proba_numpy)

    def _predict_proba_numpy(self, X: np.ndarray, log_Q: np.ndarray | None = None) -> np.ndarray:
        """predict_proba part by part: each predictor, the domain model, the combination in numpy
        (``log_Q``: the domain model's log Q(k | x) on X where the caller has it already)."""
        from msa_fed.core.combination import combine_proba

        with blas_threads_for(X.size * self.n_sources):
            a = self._weights(X, log_Q)
            hs = answered_together(self.predictors, X)  # peers' predictors: one request
            # each predictor's answer written in place (no list of p arrays stacked afterwards)
            P = np.empty((X.shape[0], self.n_sources, self.classes_.size))
            for k in range(self.n_sources):
                self._proba_of(k, X, hs[k], out=P[:, k, :])
        return _finite(combine_proba(a, P), "the combined probabilities")

    def predict(self, X) -> np.ndarray:
        """Regression: g(x).  Classification: the most probable class under g(x, .)."""
        if self.task == "classification":
            return self.classes_[np.argmax(self.predict_proba(X), axis=1)]
        return self._graph_or_numpy(X, "prediction", self._predict_numpy)

    def _predict_numpy(self, X: np.ndarray) -> np.ndarray:
        from msa_fed.core.combination import combine_regression

        with blas_threads_for(X.size * self.n_sources):
            a = self._weights(X)
            H = np.column_stack(
                [
                    checked_values(h.predict(X), X.shape[0], self._who(k), ArtifactError)
                    for k, h in enumerate(answered_together(self.predictors, X))
                ]
            )
        return _finite(combine_regression(a, H), "the combined prediction")

    # ------------------------------------------------------------------ the target population
    # (msa_fed.artifacts.target_check: lambda over the sites, the predicted loss, the support)
    def estimate_mixture(self, X, **options):
        """The target's mixture weights over the sites from unlabelled points X, with a bootstrap
        interval (:func:`msa_fed.artifacts.target_check.estimate_mixture`)."""
        from msa_fed.artifacts.target_check import estimate_mixture

        return estimate_mixture(self, X, **options)

    def support(self, X, **options):
        """Per-point conformal p-values (small: unlike every site's published sample)."""
        from msa_fed.artifacts.target_check import support

        return support(self, X, **options)

    def check_target(self, X, alpha: float = 0.01, **options):
        """Mixture, predicted loss, fraction out of support at ``alpha``, most atypical points."""
        from msa_fed.artifacts.target_check import check_target

        return check_target(self, X, alpha=alpha, **options)

    # ------------------------------------------------------------------ save / load
    def manifest(self) -> dict:
        return {
            "format": "msa_fed.combined_model",
            "format_version": FORMAT_VERSION,
            "code_version": __version__,
            "method": self.method,
            "task": self.task,
            "sites": self.site_names,
            "n_features": self.n_features_in_,
            "z": self.z.tolist(),
            "z_paper": self.z_paper.tolist(),
            "eta": self.eta,
            "qhat": self.qhat.tolist(),
            "gamma": self.gamma,
            "domain_losses": None if self.domain_losses is None else self.domain_losses.tolist(),
            "history": self.history,
            "classes": None if self.classes_ is None else self.classes_.tolist(),
            "info": _jsonable(self.info),
            "epsilon_by_site": self.epsilon_by_site,
            "target": None if self.target_reference is None else self.target_reference.manifest(self.site_names),
        }

    def save(self, path) -> Path:
        """Write the model to directory ``path`` (created; an existing model there is replaced)."""
        from msa_fed.artifacts.predictors import to_onnx

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "predictors").mkdir(exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        manifest = self.manifest()
        dm = self.domain_model
        fmap = getattr(dm, "feature_map", None)
        if isinstance(fmap, StoredFeatureMap):
            name, (params, fa) = fmap.name, fmap.get_state()
            manifest["feature_map"] = {"name": name, "params": params}
            arrays.update({f"feature_map.{k}": v for k, v in fa.items()})
        elif fmap is not None:
            from msa_fed.core.features import feature_map_state

            name, params, fa = feature_map_state(fmap)
            manifest["feature_map"] = {"name": name, "params": params}
            arrays.update({f"feature_map.{k}": v for k, v in fa.items()})
        else:
            manifest["feature_map"] = None
        kind, params, state = domain_model_state(dm)
        manifest["domain_model"] = {"kind": kind, **params}
        arrays.update(state)
        if self.target_reference is not None:
            arrays.update(self.target_reference.arrays())
        hashes = []
        for k, h in enumerate(self.predictors):
            data = to_onnx(h, self.n_features_in_)
            (path / "predictors" / f"{k}.onnx").write_bytes(data)
            hashes.append(hashlib.sha256(data).hexdigest())
        manifest["predictor_sha256"] = hashes
        tmp = path / "arrays.npz.tmp"
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]  # numpy's stub reads **kwds as allow_pickle
        os.replace(tmp, path / "arrays.npz")
        tmp = path / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, path / "manifest.json")
        return path


def _build_session(model: CombinedModel):
    """An onnxruntime session of ``model``'s float64 graph with row checks, or None (see
    :meth:`CombinedModel._graph_session`)."""
    from msa_fed.artifacts.loader import OnnxPredictor, artifact_error

    if getattr(type(model.domain_model), "kind", None) != "maxent":
        return None  # KDEs: the graph would hold (rows x sample) distances at once; numpy blocks them
    if not model.predictors or not all(isinstance(h, OnnxPredictor) for h in model.predictors):
        return None
    if any(is_isolated(h) for h in model.predictors):
        return None  # the graph would run a peer's predictor in this process, outside its limits
    from msa_fed.artifacts.onnx_graph import build_graph

    try:
        data = build_graph(model, "float64", checks=True).SerializeToString()
    except ArtifactError:
        return None  # a custom feature map, or a predictor that does not convert: numpy it is
    except Exception as exc:  # noqa: BLE001 - onnx's own errors; the numpy path still answers
        artifact_error("not_onnx", f"combined graph: {type(exc).__name__}: {exc}")
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(int(getattr(h, "_intra_op_threads", 1)) for h in model.predictors)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - verified predictors; a failure here is logged, numpy answers
        artifact_error("ort_load", f"combined graph: {type(exc).__name__}: {exc}")
        return None


def _finite(out: np.ndarray, what: str) -> np.ndarray:
    """``out`` unless some row holds NaN or inf (never argmax over NaN: it answers class 0)."""
    ok = np.isfinite(out).reshape(out.shape[0], -1).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        raise ArtifactError(f"{what} are NaN or inf for {bad.size} of {ok.size} rows (first row {int(bad[0])})")
    return out


def load_model(path) -> CombinedModel:
    """Load a model written by :meth:`CombinedModel.save` (no pickle anywhere).

    Each predictor is checked against the manifest's sha256, then in a sandboxed child unless
    this user's record of verified predictors (:mod:`msa_fed.artifacts.verified_cache`) holds a
    success verdict for the same bytes, checked by the same code and libraries."""
    from msa_fed.artifacts.loader import prepare_predictors
    from msa_fed.artifacts.sandbox import warm_up
    from msa_fed.artifacts.verified_cache import default_cache

    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise ArtifactError(f"no combined model at {str(path)!r}: manifest.json is missing")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{mf}: manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "msa_fed.combined_model":
        raise ArtifactError(f"{mf}: not a msa_fed combined model")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{mf}: format version {manifest.get('format_version')} is not supported "
            f"(this msa_fed reads version {FORMAT_VERSION})"
        )
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise ArtifactError(f"{mf}: manifest lacks the key(s) {missing}")
    if not isinstance(manifest["sites"], list):
        raise ArtifactError(f"{mf}: sites must be a list of site names")
    p = len(manifest["sites"])
    task = manifest["task"]
    hashes = manifest["predictor_sha256"]
    if not isinstance(hashes, list) or len(hashes) != p:
        raise ArtifactError(f"{mf}: predictor_sha256 must list one digest per site ({p})")

    def read(k: int) -> bytes:
        try:
            return (path / "predictors" / f"{k}.onnx").read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{path / 'predictors'}: cannot read predictor {k} ({exc.strerror})") from None

    # the in-process checks (size, sha256, ...), then the verdicts already known (by content)
    prepared = prepare_predictors(
        [read(k) for k in range(p)],
        expected_sha256=hashes,
        n_features=manifest["n_features"],
        kind=predictor_kind(task),
        verified=default_cache(),
    )
    if prepared.needs_sandbox:
        warm_up()  # the sandbox's helper starts while the arrays and the domain model are read
    try:
        with np.load(path / "arrays.npz", allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path / 'arrays.npz'}: cannot read arrays ({exc})") from None
    try:
        fmap = None
        if manifest["feature_map"] is not None:
            prefix = "feature_map."
            fa = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            fmap = StoredFeatureMap(manifest["feature_map"]["name"], manifest["feature_map"]["params"], fa)
        params = {k: v for k, v in manifest["domain_model"].items() if k != "kind"}
        dm = stored_domain_model(manifest["domain_model"]["kind"], params, arrays, fmap, p)
    except KeyError as exc:
        raise ArtifactError(f"{mf}: the domain model's state lacks the key {exc.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise ArtifactError(f"{mf}: the domain model's state is malformed ({exc})") from None
    from msa_fed.artifacts.target_check import reference_from_file

    target = reference_from_file(manifest.get("target"), arrays, manifest["sites"], manifest["n_features"], str(mf))
    # the predictors without a known verdict are checked in one sandboxed child (same limits and
    # verdicts as one by one)
    predictors = prepared.load()
    return CombinedModel(
        method=manifest["method"],
        task=task,
        site_names=manifest["sites"],
        domain_model=dm,
        qhat=manifest["qhat"],
        z=manifest["z"],
        eta=manifest["eta"],
        predictors=predictors,
        n_features=manifest["n_features"],
        classes=manifest["classes"],
        gamma=manifest["gamma"],
        domain_losses=manifest["domain_losses"],
        history=manifest["history"],
        info=manifest["info"],
        epsilon_by_site=_epsilons(manifest.get("epsilon_by_site"), mf),
        target_reference=target,
    )


def _epsilons(value, mf) -> dict:
    """The manifest's epsilon per site: a mapping of site names to finite numbers >= 0."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf") for v in value.values()
    ):
        raise ArtifactError(f"{mf}: epsilon_by_site must map site names to numbers >= 0")
    return value


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)
