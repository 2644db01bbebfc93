"""What a combined model says about a target population (see :mod:`msa_fed.core.target`).

``estimate_mixture`` (lambda over the sites from unlabelled target points), ``support``
(conformal p-values: is a point like some site's?) and ``check_target`` (both, the predicted
loss, the fraction out of support, the most atypical points) for a :class:`CombinedModel`.

The support score and the confusion-matrix estimator need something of each site's published
(unlabelled) sample in the model file: the **target reference**, built when the model is made
(:func:`build_reference`) and saved in the model's manifest (``"target"``) and arrays
(``target.*``), no pickle:

- per site, up to ``n_reference`` rows of its published sample (the neighbours of the score) and
  the leave-one-out scores of those rows (the conformal calibration);
- the confusion matrix of the domain classifier on those rows (p x p), and (classification) the
  spread of the model's log loss on them (the predicted loss's interval).

A site whose policy sets ``model_carries_sample = false`` has nothing of its sample in the file:
its p-value column is "unavailable" (NaN, and named in every report), the confusion-matrix
estimator is unavailable (EM needs nothing from the samples and still answers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msa_fed.artifacts.outputs import check_X
from msa_fed.core.target import (
    LossPrediction,
    MixtureEstimate,
    bbse_mixture,
    bootstrap_mixture,
    category_score,
    category_tables,
    combine_pvalues,
    conformal_pvalues,
    confusion_matrix,
    em_mixture,
    knn_distance,
    leave_one_out_category_score,
    leave_one_out_distance,
    predicted_loss,
)
from msa_fed.errors import ArtifactError

#: the estimator check_target and estimate_mixture use unless told, where the model carries the
#: confusion matrix (every site lets it carry its sample): BBSE was the closer on the paper's
#: synthetic and Adult domains, EM on the overlapping demo sites (BENCHMARKS.md, "target checks");
#: EM otherwise (it needs nothing of the samples)
DEFAULT_METHOD = "bbse"
METHODS = ("em", "bbse")
#: the neighbour whose distance is the score (r-th nearest reference row of the site)
NEIGHBOUR = 5
N_REFERENCE = 1000
#: the support scores: the distance to the r-th nearest reference row in the classifier's
#: feature space; on categorical inputs (a one-hot domain model) the rarity of the row's rarest
#: value (:func:`msa_fed.core.target.category_score`), whose p-values break ties at random
SCORES = ("knn_distance", "category_rarity")
#: at most this many bytes of reference rows per site in the model file (float64): wide inputs
#: get fewer rows (4 MiB: 1000 rows up to 524 features, 104 rows at 5000)
REFERENCE_BYTES = 4 << 20


@dataclass
class TargetReference:
    """What a model carries for target checks; ``available[k]`` False: nothing of site k.

    reference[k] : (m_k, d) rows of site k's published sample (inputs, not features);
    calibration[k] : (m_k,) sorted leave-one-out scores of those rows;
    score : "knn_distance" or "category_rarity" (one-hot domain models: categorical inputs);
    confusion : (p, p) C[i, j] = P(argmax Q = i | site j) on the reference rows, or None
    (a site carries nothing); scale : (d,) input scale when the domain model has no feature map;
    loss_sd : (p,) classification: the spread of the per-point log loss at site k when labels
    follow the model's own probabilities, on its reference rows (NaN: unknown).
    """

    available: list[bool]
    reference: list[np.ndarray]
    calibration: list[np.ndarray]
    confusion: np.ndarray | None
    neighbour: int = NEIGHBOUR
    scale: np.ndarray | None = None
    loss_sd: np.ndarray | None = None
    score: str = "knn_distance"
    _features: dict = field(default_factory=dict, repr=False, compare=False)

    # ----------------------------------------------------------------- file format
    def manifest(self, site_names: list[str]) -> dict:
        return {
            "score": self.score,
            "neighbour": self.neighbour,
            "sites": {
                name: {
                    "available": bool(ok),
                    "n_reference": int(self.reference[k].shape[0]),
                    "n_calibration": int(self.calibration[k].size),
                }
                for k, (name, ok) in enumerate(zip(site_names, self.available))
            },
            "confusion": self.confusion is not None,
            "loss_sd": self.loss_sd is not None,
        }

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for k, ok in enumerate(self.available):
            if ok:
                out[f"target.reference.{k}"] = self.reference[k]
                out[f"target.calibration.{k}"] = self.calibration[k]
        if self.confusion is not None:
            out["target.confusion"] = self.confusion
        if self.scale is not None:
            out["target.scale"] = self.scale
        if self.loss_sd is not None:
            out["target.loss_sd"] = self.loss_sd
        return out


def reference_from_file(doc: Any, arrays: dict[str, np.ndarray], site_names: list[str], n_features: int, where: str):
    """The :class:`TargetReference` of a saved model (None: the file carries none)."""
    if doc is None:
        return None
    p = len(site_names)
    try:
        sites = doc["sites"]
        neighbour = int(doc["neighbour"])
        score = str(doc.get("score", "knn_distance"))
        if score not in SCORES:
            raise ValueError(f"unknown score {score[:40]!r}")
        available = [bool(sites[name]["available"]) for name in site_names]
        if neighbour < 1:
            raise ValueError("neighbour < 1")
        empty = np.zeros((0, n_features))
        reference = [
            np.asarray(arrays[f"target.reference.{k}"], dtype=np.float64) if ok else empty
            for k, ok in enumerate(available)
        ]
        calibration = [
            np.sort(np.asarray(arrays[f"target.calibration.{k}"], dtype=np.float64).reshape(-1)) if ok else np.zeros(0)
            for k, ok in enumerate(available)
        ]
        confusion = np.asarray(arrays["target.confusion"], dtype=np.float64) if doc["confusion"] else None
        scale = np.asarray(arrays["target.scale"], dtype=np.float64) if "target.scale" in arrays else None
        loss_sd = np.asarray(arrays["target.loss_sd"], dtype=np.float64) if "target.loss_sd" in arrays else None
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{where}: the target reference is malformed ({exc!r})") from None
    for k, ok in enumerate(available):
        R, c = reference[k], calibration[k]
        if ok and (R.ndim != 2 or R.shape[1] != n_features or R.shape[0] < neighbour or c.size < 1):
            raise ArtifactError(f"{where}: the target reference of site {site_names[k]!r} has the wrong shape")
        if ok and not (np.isfinite(R).all() and np.isfinite(c).all()):
            raise ArtifactError(f"{where}: the target reference of site {site_names[k]!r} is not finite")
    if confusion is not None and (confusion.shape != (p, p) or not np.isfinite(confusion).all()):
        raise ArtifactError(f"{where}: the target confusion matrix must be a finite ({p}, {p}) array")
    if scale is not None and (scale.shape != (n_features,) or not (np.isfinite(scale).all() and (scale > 0).all())):
        raise ArtifactError(f"{where}: the target input scale must be {n_features} positive numbers")
    if loss_sd is not None and (loss_sd.shape != (p,) or np.any(loss_sd < 0)):
        raise ArtifactError(f"{where}: the target loss spread must be {p} numbers >= 0 (or NaN)")
    return TargetReference(available, reference, calibration, confusion, neighbour, scale, loss_sd, score)


# --------------------------------------------------------------------- building it
def _features(model, X: np.ndarray, ref: TargetReference) -> np.ndarray:
    """The space of the score: the domain model's feature map, else inputs divided by ``scale``."""
    fmap = getattr(model.domain_model, "feature_map", None)
    if fmap is not None:
        return np.asarray(fmap.transform(X), dtype=np.float64)
    return X / (ref.scale if ref.scale is not None else 1.0)


def categorical(model) -> bool:
    """Whether ``model``'s domain classifier sees its inputs as categories (a one-hot map)."""
    fmap = getattr(model.domain_model, "feature_map", None)
    if fmap is None:
        return False
    from msa_fed.core.features import OneHotFeatures

    return isinstance(fmap, OneHotFeatures) or getattr(fmap, "name", None) == "onehot"


def _scores(model, ref: TargetReference, k: int, X: np.ndarray, Phi: np.ndarray | None) -> np.ndarray:
    """Site k's support score (n,) of the rows ``X`` (their features ``Phi`` for the kNN score)."""
    if ref.score == "category_rarity":
        cached = ref._features.get(("tables", k))
        if cached is None:
            cached = ref._features[("tables", k)] = category_tables(ref.reference[k])
        return category_score(X, cached, ref.reference[k].shape[0])
    assert Phi is not None
    return knn_distance(Phi, _reference_features(model, ref, k), ref.neighbour)


def _reference_features(model, ref: TargetReference, k: int) -> np.ndarray:
    cached = ref._features.get(k)
    if cached is None or cached[0] is not model.domain_model:
        cached = ref._features[k] = (model.domain_model, _features(model, ref.reference[k], ref))
    return cached[1]


def build_reference(
    model,
    samples: list[np.ndarray],
    allowed: list[bool],
    *,
    n_reference: int = N_REFERENCE,
    neighbour: int = NEIGHBOUR,
    random_state: int = 0,
) -> TargetReference:
    """The target reference of ``model`` from the sites' published samples (one (m_k, d) array
    per site, in site order); ``allowed[k]`` False: site k's policy forbids carrying its sample.
    A site with fewer than 2 * ``neighbour`` published rows carries none."""
    p = len(samples)
    rng = np.random.default_rng([random_state, 32])
    pooled = np.vstack(samples)
    scale = None
    if getattr(model.domain_model, "feature_map", None) is None:
        sd = pooled.std(axis=0)
        scale = np.where(sd > 0, sd, 1.0)
    score = "category_rarity" if categorical(model) else "knn_distance"
    ref = TargetReference([False] * p, [], [], None, neighbour, scale, score=score)
    for k, X in enumerate(samples):
        X = np.asarray(X, dtype=np.float64)
        ok = bool(allowed[k]) and X.shape[0] >= 2 * neighbour
        if not ok:
            ref.reference.append(np.zeros((0, X.shape[1])))
            ref.calibration.append(np.zeros(0))
            continue
        cap = max(2 * neighbour, min(n_reference, REFERENCE_BYTES // (8 * max(X.shape[1], 1))))
        rows = np.sort(rng.permutation(X.shape[0])[:cap])
        ref.available[k] = True
        ref.reference.append(X[rows])
        if score == "category_rarity":
            cal = leave_one_out_category_score(X[rows])
        else:
            cal = leave_one_out_distance(_features(model, X[rows], ref), neighbour)
        ref.calibration.append(np.sort(cal))
    # on the reference rows (at most n_reference per site): the cost stays bounded however large
    # the published samples are.  The domain model runs once over all of them: its log Q(k | x)
    # gives the confusion matrix and the combination weights of the model's predictions.
    stacked = check_X(np.vstack(ref.reference), model.n_features_in_) if any(ref.available) else None
    log_Q = model.domain_model.predict_log_proba(stacked) if stacked is not None else None
    if all(ref.available):
        assert log_Q is not None
        cuts = np.cumsum([R.shape[0] for R in ref.reference])[:-1]
        ref.confusion = confusion_matrix(np.split(np.exp(log_Q), cuts))
    if model.task == "classification" and stacked is not None:
        assert log_Q is not None
        ref.loss_sd = _model_loss_sd(model, ref, stacked, log_Q)
    return ref


def _model_loss_sd(model, ref: TargetReference, rows: np.ndarray, log_Q: np.ndarray) -> np.ndarray:
    """Per site (NaN where it carries nothing): the spread of the log loss -log g(x, y) with y
    drawn from g(x, .) itself, over the site's reference rows x or over every site's, whichever
    is larger (one predict_proba over all the rows: ``rows``, the reference rows stacked, checked,
    and ``log_Q``, the domain model's log Q(k | x) on them).

    A site's reference can be a few dozen rows and lacks its commonest records (a published row
    equal to a labelled one stays home): on Adult's Doc site the spread over its own 49 rows
    came out at 0.38-0.47 against 0.50-0.54 over the labelled rows its loss was measured on
    (0.51-0.57 with the real labels); the whole reference's, 0.54-0.56, bounds it from above
    there."""
    sizes = [R.shape[0] for R in ref.reference]
    # model.predict_proba(rows), its numpy path given the domain model's answer already computed
    P = model._graph_or_numpy(rows, "probabilities", lambda X: model._predict_proba_numpy(X, log_Q))
    P = np.clip(P, 1e-300, 1.0)
    loss = -np.log(P)
    m1 = np.sum(P * loss, axis=1)
    m2 = np.sum(P * loss * loss, axis=1)

    def spread(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(max(float(b.mean() - a.mean() ** 2), 0.0)))

    pooled = spread(m1, m2)
    out = np.full(len(sizes), np.nan)
    start = 0
    for k, size in enumerate(sizes):
        if ref.available[k]:
            out[k] = max(spread(m1[start : start + size], m2[start : start + size]), pooled)
        start += size
    return out


# --------------------------------------------------------------------- the questions
@dataclass(frozen=True)
class Mixture:
    """lambda-hat over the sites with its interval (``estimate`` holds the bootstrap draws)."""

    method: str
    sites: list[str]
    estimate: MixtureEstimate

    def as_dict(self) -> dict:
        e = self.estimate
        return {
            "method": self.method,
            "level": e.level,
            "weights": {s: float(e.lam[k]) for k, s in enumerate(self.sites)},
            "low": {s: float(e.low[k]) for k, s in enumerate(self.sites)},
            "high": {s: float(e.high[k]) for k, s in enumerate(self.sites)},
        }


def _target_X(model, X) -> np.ndarray:
    """X as a float64 (n, d) array of finite numbers with n >= 1, or a ValueError naming the problem."""
    X = check_X(X, model.n_features_in_, "the target sample")
    if X.shape[0] == 0:
        raise ValueError("the target sample has no rows")
    return X


def estimate_mixture(
    model, X, *, method: str | None = None, n_boot: int = 200, level: float = 0.95, random_state: int = 0
) -> Mixture:
    """lambda-hat over ``model``'s sites from the unlabelled target rows ``X`` (n, d), with a
    ``level`` percentile interval from ``n_boot`` bootstrap resamples.  ``method``: "em" or
    "bbse" (None: BBSE where the model carries the confusion matrix, else EM)."""
    if method is None:
        ref = getattr(model, "target_reference", None)
        method = DEFAULT_METHOD if ref is not None and ref.confusion is not None else "em"
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {method!r}")
    X = _target_X(model, X)
    Q = model.domain_proba(X)
    if method == "em":
        first = em_mixture(Q)

        def estimator(Qb):
            return em_mixture(Qb, start=first)  # bootstrap resamples start at the estimate
    else:
        ref = getattr(model, "target_reference", None)
        if ref is None or ref.confusion is None:
            missing = [] if ref is None else [s for s, ok in zip(model.site_names, ref.available) if not ok]
            why = f"site(s) {missing} do not let the model carry their sample" if missing else "it carries none"
            raise ValueError(f"method 'bbse' needs the confusion matrix of the published samples; {why}")
        C = ref.confusion

        def estimator(Qb):
            return bbse_mixture(Qb, C)

    return Mixture(
        method,
        list(model.site_names),
        bootstrap_mixture(Q, estimator, n_boot=n_boot, level=level, random_state=random_state),
    )


@dataclass(frozen=True)
class Support:
    """p-values of target points: ``pvalue`` (n,) = max over the available sites of
    ``per_site`` (n, p) (a NaN column: the site carries nothing: ``unavailable``);
    ``distance`` (n,): min over the available sites of the score over the site's largest
    calibration score (above 1: farther out than every held-out point of every site; it orders
    points whose p-values tie at the smallest value)."""

    pvalue: np.ndarray
    per_site: np.ndarray
    unavailable: list[str]
    distance: np.ndarray

    def most_atypical(self, top: int) -> list[int]:
        """Indices of the ``top`` points with the smallest p-values (ties: the farthest first)."""
        order = np.lexsort((-np.nan_to_num(self.distance, nan=-np.inf), np.nan_to_num(self.pvalue, nan=np.inf)))
        return [int(i) for i in order[: max(0, int(top))]]


def support(model, X, *, random_state: int = 0, randomize_ties: bool = True) -> Support:
    """Conformal p-values of the rows of ``X`` (n, d) against every site's reference; a
    ValueError where the model carries no target reference.

    The categorical score's p-values break ties with one uniform number per row (the same for
    every site), drawn from ``random_state`` (``randomize_ties=False``: ties count against the
    point, the p-values of the exported ONNX graph); the nearest-neighbour score's are
    deterministic."""
    ref = getattr(model, "target_reference", None)
    X = _target_X(model, X)
    p = model.n_sources
    if ref is None:
        raise ValueError(
            "this model carries no target reference (made before target checks existed): support is unavailable"
        )
    P = np.full((X.shape[0], p), np.nan)
    D = np.full((X.shape[0], p), np.inf)
    Phi = None if ref.score == "category_rarity" else _features(model, X, ref)
    ties = None
    if ref.score == "category_rarity" and randomize_ties:
        ties = np.random.default_rng([random_state, 35]).random(X.shape[0])
    for k in range(p):
        if ref.available[k]:
            s = _scores(model, ref, k, X, Phi)
            P[:, k] = conformal_pvalues(s, ref.calibration[k], ties)
            D[:, k] = s / max(float(ref.calibration[k][-1]), np.finfo(np.float64).tiny)
    missing = [s for s, ok in zip(model.site_names, ref.available) if not ok]
    distance = np.where(np.isfinite(D).any(axis=1), D.min(axis=1), np.nan)
    return Support(combine_pvalues(P), P, missing, distance)


def loss_standard_errors(model) -> tuple[np.ndarray, str]:
    """Each site's L_k standard error (spread / sqrt(n_k), n_k its labelled points) and, in
    words, where the spread comes from.

    The sites report their mean loss, not its spread.  Classification: the spread of the log
    loss with labels drawn from the model's own probabilities on the site's published sample
    (the target reference's ``loss_sd``; it is larger than the real one where the model is less
    sure than it is right).  Otherwise (regression, or a site that carries no sample) the spread
    is taken to equal the loss (a coefficient of variation of 1)."""
    L = np.asarray(model.domain_losses, dtype=np.float64)
    n = np.asarray(model.info.get("n_labeled") or [np.nan] * L.size, dtype=np.float64)
    ref = getattr(model, "target_reference", None)
    spread = np.abs(L).copy()
    known = np.zeros(L.size, dtype=bool)
    if ref is not None and ref.loss_sd is not None:
        known = np.isfinite(ref.loss_sd)
        spread[known] = ref.loss_sd[known]
    if known.all():
        source = "loss spread from the model's own probabilities, over sqrt(n_k)"
    elif known.any():
        source = (
            "loss spread from the model's own probabilities where a site's sample is carried, "
            "else equal to the loss; over sqrt(n_k)"
        )
    else:
        source = "loss spread assumed equal to the loss (no measured spread), over sqrt(n_k)"
    se = np.where(np.isfinite(n) & (n > 0), spread / np.sqrt(np.maximum(n, 1.0)), spread)
    return se, source


@dataclass
class TargetReport:
    sites: list[str]
    n_points: int
    mixture: Mixture
    loss: LossPrediction | None
    loss_se_source: str
    alpha: float
    pvalue: np.ndarray | None
    unavailable: list[str]
    atypical: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def out_of_support(self) -> float | None:
        if self.pvalue is None:
            return None
        return float(np.mean(self.pvalue <= self.alpha))

    def as_dict(self) -> dict:
        return {
            "n_points": self.n_points,
            "mixture": self.mixture.as_dict(),
            "predicted_loss": None
            if self.loss is None
            else {
                "loss": self.loss.loss,
                "low": self.loss.low,
                "high": self.loss.high,
                "level": self.loss.level,
                "standard_errors": self.loss_se_source,
            },
            "support": {
                "alpha": self.alpha,
                "fraction_out_of_support": self.out_of_support,
                "n_out_of_support": None if self.pvalue is None else int(np.sum(self.pvalue <= self.alpha)),
                "unavailable_sites": self.unavailable,
                "most_atypical": [{"index": i, "pvalue": float(self.pvalue[i])} for i in self.atypical]
                if self.pvalue is not None
                else [],
            },
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        """The report in words."""
        mix = self.mixture.as_dict()
        pct = int(round(100 * mix["level"]))
        out = [f"target sample: {self.n_points} points"]
        out.append(f"mixture over the sites ({self.mixture.method}, {pct}% bootstrap interval):")
        for s in self.sites:
            out.append(f"  {s}: {mix['weights'][s]:.3f}  [{mix['low'][s]:.3f}, {mix['high'][s]:.3f}]")
        if self.loss is not None:
            out.append(
                f"predicted loss on the target: {self.loss.loss:.4g}  [{self.loss.low:.4g}, {self.loss.high:.4g}] "
                f"({pct}% interval; {self.loss_se_source})"
            )
        if self.pvalue is None:
            out.append("support: unavailable (the model carries no target reference)")
        else:
            k = int(np.sum(self.pvalue <= self.alpha))
            out.append(
                f"out of support at alpha={self.alpha:g}: {k} of {self.n_points} points "
                f"({100 * k / self.n_points:.1f}%; about {100 * self.alpha:g}% expected by chance)"
            )
            if self.atypical:
                shown = ", ".join(f"{i} (p={self.pvalue[i]:.3g})" for i in self.atypical)
                out.append(f"most atypical points (row index): {shown}")
        out.extend(self.notes)
        return out


def check_target(
    model,
    X,
    *,
    alpha: float = 0.01,
    method: str | None = None,
    n_boot: int = 200,
    level: float = 0.95,
    top: int = 10,
    random_state: int = 0,
) -> TargetReport:
    """The target report of ``X`` (n, d): :func:`estimate_mixture`, the predicted loss with its
    interval, the rows whose support p-value is <= ``alpha`` and the ``top`` most atypical."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); got {alpha!r}")
    X = _target_X(model, X)
    mixture = estimate_mixture(model, X, method=method, n_boot=n_boot, level=level, random_state=random_state)
    notes = []
    loss, source = None, ""
    if model.domain_losses is not None and np.all(np.isfinite(model.domain_losses)):
        se, source = loss_standard_errors(model)
        loss = predicted_loss(mixture.estimate, model.domain_losses, se, random_state=random_state)
    else:
        notes.append("predicted loss: unavailable (the model carries no per-site losses)")
    ref = getattr(model, "target_reference", None)
    pvalue, unavailable, atypical = None, [], []
    if ref is not None:
        sup = support(model, X, random_state=random_state)
        unavailable = sup.unavailable
        if not np.isnan(sup.pvalue).all():
            pvalue = sup.pvalue
            atypical = [i for i in sup.most_atypical(top) if pvalue[i] <= alpha]
        if unavailable:
            notes.append(
                f"support unavailable for site(s) {', '.join(unavailable)} (their policy keeps their sample out of "
                "the model): a point like only those sites' points counts as out of support"
            )
    report = TargetReport(
        list(model.site_names),
        int(X.shape[0]),
        mixture,
        loss,
        source,
        float(alpha),
        pvalue,
        unavailable,
        atypical,
        notes,
    )
    return report
