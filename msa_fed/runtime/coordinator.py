"""The coordinator: trains the domain model, gathers Qhat and solves for z with the sites.

One code path for both runtimes.  The coordinator talks to its sites only through
``call_all(method, message)``: with ``runtime="local"`` the sites are :class:`SiteWorker`
objects in this process, with ``runtime="ray"`` they are Ray actors (see
:mod:`msa_fed.runtime.ray_sites`).  Every message that crosses is one of
:mod:`msa_fed.runtime.messages` and can be recorded.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from msa_fed.core.dc_solver import solve_dc
from msa_fed.core.dc_terms import DCSums, sum_all
from msa_fed.core.density import KDEDomainModel
from msa_fed.core.domain_classifier import ClassifierConfig, DomainClassifier, fit_maxent
from msa_fed.core.features import FEATURE_MAPS, feature_map_state, make_feature_map
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.artifacts.model import CombinedModel
from msa_fed.runtime import messages as m
from msa_fed.runtime.progress import Progress


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs besides the sites; built once at the edge (API, CLI, job file)."""

    task: str = "classification"
    method: str = "dmsa"                  # "dmsa" (Maxent classifier) or "gmsa" (KDEs)
    features: Any = "standard"            # domain-classifier feature map (see msa_fed.core.features)
    eta: float = 1e-2                     # smoothing: a small positive number, as in the paper
    random_state: int = 0
    min_points: int = 20                  # a site never aggregates over fewer points (privacy)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    solver: dict = field(default_factory=dict)   # options of msa_fed.core.dc_solver.solve_dc
    bandwidth: Any = None                 # GMSA: None = 5-fold CV per domain
    checkpoint_dir: str | None = None     # DC state written after every iteration; resumed from
    verbose: bool = False

    @property
    def loss(self) -> str:
        return "cross_entropy" if self.task == "classification" else "squared"

    def validate(self) -> "RunConfig":
        if self.task not in ("classification", "regression"):
            raise ConfigError(f"task must be 'classification' or 'regression'; got {self.task!r}")
        if self.method not in ("dmsa", "gmsa"):
            raise ConfigError(f"method must be 'dmsa' or 'gmsa'; got {self.method!r}")
        if not (np.isfinite(self.eta) and self.eta >= 0):
            raise ConfigError(f"eta must be a finite number >= 0; got {self.eta!r}")
        if int(self.min_points) < 1:
            raise ConfigError(f"min_points must be >= 1; got {self.min_points!r}")
        self.classifier.validate()
        return self


class Coordinator:
    """Owns the sites' lifecycle and runs one DMSA/GMSA fit.

    ``backend`` is an object with ``start(coordinator) -> list[SiteInfo]``,
    ``call_all(method, msgs)`` (one message per site), ``call_one(i, method, msg, replay)``,
    ``call_shards(method, msg)`` (every holder of classifier rows: the sites and their helpers)
    and ``shutdown()``: :class:`msa_fed.runtime.local.LocalSites` or
    :class:`msa_fed.runtime.ray_sites.RaySites`.
    """

    def __init__(self, backend, predictors: list, config: RunConfig, recorder: m.Recorder | None = None,
                 solver_callback: Callable | None = None):
        self.backend = backend
        self.predictors = list(predictors)
        self.config = config.validate()
        self.recorder = recorder
        self.solver_callback = solver_callback
        self.infos: list[m.SiteInfo] | None = None
        self._setup_log: list[tuple[str, Any]] = []
        self._sample_digest = ""
        self._ckpt: dict | None = None  # checkpoint state, loaded lazily (see _checkpoint)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Coordinator":
        self.infos = self.backend.start(self)
        widths = {i.n_features for i in self.infos}
        if len(widths) != 1:
            detail = ", ".join(f"{i.name}: {i.n_features}" for i in self.infos)
            raise ConfigError(f"feature widths differ between sites ({detail})")
        self._check_min_points()
        return self

    def _check_min_points(self):
        """Fail before any work when a site would refuse to aggregate (the sites enforce it too)."""
        need = int(self.config.min_points)
        few = [f"site {i.name!r} has {n} {what} points" for i in self.infos
               for n, what in ((i.n_labeled, "labelled"), (i.n_unlabeled, "unlabelled")) if n < need]
        if few:
            raise PrivacyError(f"{'; '.join(few)}: fewer than min_points={need}, the least a site "
                               "aggregates over; add data to the site or leave it out of the run")

    def shutdown(self):
        self.backend.shutdown()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.shutdown()
            raise

    def __exit__(self, *exc):
        self.shutdown()
        return False

    # ------------------------------------------------------------------ messaging
    def call_all(self, method: str, msg) -> list:
        """Send ``msg`` (one message, or a list with one per site) to every site and gather."""
        msgs = msg if isinstance(msg, list) else [msg] * len(self.infos)
        return self.backend.call_all(method, msgs)

    def record(self, direction, site, method, message):
        """Hand one crossing to the recorder (``message`` None: a request without payload)."""
        if self.recorder is not None:
            self.recorder.record(direction, site, method, message)

    def replay_setup(self, site_index: int):
        """After a site restarted: resend the state it had been given, in order."""
        for method, msg in self._setup_log:
            self.backend.call_one(site_index, method, msg, replay=False)

    def _setup_all(self, method: str, msg) -> list:
        self._setup_log = [(mm, x) for mm, x in self._setup_log if mm != method] + [(method, msg)]
        return self.call_all(method, msg)

    # ------------------------------------------------------------------ steps
    @property
    def p(self) -> int:
        return len(self.infos)

    @property
    def n_features(self) -> int:
        return self.infos[0].n_features

    def _classes(self):
        if self.config.task != "classification":
            return None
        return np.unique(np.concatenate([np.asarray(i.classes) for i in self.infos]))

    def _fingerprint(self) -> str:
        cfg = self.config
        key = json.dumps({
            "sites": [(i.name, i.n_labeled, i.n_unlabeled, i.n_features) for i in self.infos],
            "task": cfg.task, "method": cfg.method, "features": repr(cfg.features), "eta": cfg.eta,
            "classifier": repr(cfg.classifier), "seed": cfg.random_state,
            "samples": self._sample_digest,
        }, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def _checkpoint(self) -> dict:
        """The checkpoint of this problem (same fingerprint), read from disk once per run and
        then kept in memory: the solver writes after every iteration and must not re-read it."""
        d = self.config.checkpoint_dir
        if d is None:
            return {}
        if self._ckpt is None:
            f = Path(d) / "dc_state.json"
            state = json.loads(f.read_text()) if f.is_file() else {}
            fingerprint = self._fingerprint()
            self._ckpt = state if state.get("fingerprint") == fingerprint else {"fingerprint": fingerprint}
        return {k: v for k, v in self._ckpt.items() if k != "fingerprint"}

    def _write_checkpoint(self, **state):
        d = self.config.checkpoint_dir
        if d is None:
            return
        self._checkpoint()  # make sure the cache holds this problem's state
        self._ckpt.update(state)
        Path(d).mkdir(parents=True, exist_ok=True)
        tmp = Path(d) / "dc_state.json.tmp"
        tmp.write_text(json.dumps(self._ckpt))
        os.replace(tmp, Path(d) / "dc_state.json")

    def train_domain_model(self, progress: Progress):
        cfg = self.config
        samples = [r.X for r in self.call_all("unlabeled_sample", None)]
        digest = hashlib.sha256()
        for X in samples:
            digest.update(np.ascontiguousarray(X, dtype=np.float64).tobytes())
        self._sample_digest = digest.hexdigest()
        if cfg.method == "gmsa":
            fmap = None if cfg.features in (None, "none") else make_feature_map(cfg.features, cfg.random_state)
            progress.note("GMSA: fitting one kernel density estimate per domain (5-fold CV bandwidth)")
            return KDEDomainModel(bandwidth=cfg.bandwidth, feature_map=fmap, random_state=cfg.random_state).fit(samples)
        fmap = make_feature_map(cfg.features, cfg.random_state)
        weights = np.concatenate([np.full(len(X), 1.0 / (self.p * len(X))) for X in samples])
        try:
            fmap.fit(np.vstack(samples), sample_weight=weights)
        except TypeError:
            fmap.fit(np.vstack(samples))
        builtin = any(type(fmap) is c for c in FEATURE_MAPS.values())
        state = feature_map_state(fmap) if builtin else None
        ccfg = cfg.classifier
        setup = m.ShardSetup(feature_map=state, custom_feature_map=None if builtin else fmap,
                             n_sources=self.p, dtype=ccfg.dtype, device=ccfg.device, seed=cfg.random_state)
        self._setup_log = [(mm, x) for mm, x in self._setup_log if mm != "setup_shard"] + [("setup_shard", setup)]
        self.backend.call_shards("setup_shard", setup)
        D = int(np.asarray(fmap.transform(samples[0][:1])).shape[1])
        ckpt = self._checkpoint()
        if "theta" in ckpt:
            progress.note("domain classifier: resumed from checkpoint")
            return DomainClassifier(fmap, np.asarray(ckpt["theta"]), self.p, ccfg.mu, {"resumed": True})

        # synchronous data-parallel training: every step's loss and gradient are the sums of the
        # shard holders' answers (sites and helpers), equal to the pooled computation
        losses = []

        def oracle(theta):
            parts = self.backend.call_shards("classifier_loss_grad", m.ThetaRequest(theta=theta))
            losses.append(sum(r.loss for r in parts))
            return losses[-1], sum(r.grad for r in parts)

        def minibatch(theta, step):
            parts = self.backend.call_shards("classifier_loss_grad", m.ThetaRequest(
                theta=theta, step=step, batch_size=ccfg.batch_size))
            losses.append(sum(r.loss for r in parts))
            return losses[-1], sum(r.grad for r in parts)

        bar = progress.bar("domain classifier", unit="it" if ccfg.optimizer == "lbfgs" else "epoch",
                           total=None if ccfg.optimizer == "lbfgs" else ccfg.epochs)

        curve: list[float] = []  # the loss per iteration (epoch): the report's convergence plot

        def advance(i, _):
            bar.update(1)
            if losses:  # L-BFGS: the last loss; SGD: the mean mini-batch loss of the epoch
                shown = losses[-1] if ccfg.optimizer == "lbfgs" else float(np.mean(losses))
                bar.set_postfix_str(f"loss={shown:.5g}")
                curve.append(float(shown))
                losses.clear()

        theta, info = fit_maxent(oracle, D, self.p, ccfg, minibatch_oracle=minibatch,
                                 n_points=max(len(X) for X in samples), progress=advance)
        info = {**info, "history": curve}
        bar.close()
        progress.note(f"domain classifier: {info['optimizer']} objective {info['objective']:.6g} "
                      f"after {info['n_iter']} iterations")
        self._write_checkpoint(theta=theta.tolist())
        return DomainClassifier(fmap, theta, self.p, ccfg.mu, info)

    def _domain_spec(self, dm) -> m.DomainModelSpec:
        fmap = dm.feature_map
        builtin = fmap is not None and any(type(fmap) is c for c in FEATURE_MAPS.values())
        state = feature_map_state(fmap) if builtin else None
        custom = None if (builtin or fmap is None) else fmap
        if isinstance(dm, DomainClassifier):
            return m.DomainModelSpec(kind="maxent", n_sources=self.p, feature_map=state,
                                     custom_feature_map=custom, theta=dm.theta_)
        return m.DomainModelSpec(kind="kde", n_sources=self.p, feature_map=state, custom_feature_map=custom,
                                 bandwidths=dm.bandwidths_, samples=tuple(dm.samples_))

    def prepare_dc(self, domain_model) -> tuple[np.ndarray, "DistributedOracle"]:
        """Send the domain model to the sites, gather Qhat (p,) from their partial sums, send it
        back; returns (qhat, the loss oracle whose sums the sites compute)."""
        parts = self._setup_all("set_domain_model", self._domain_spec(domain_model))
        qhat = np.sum([r.sums for r in parts], axis=0)
        self._setup_all("set_qhat", m.QhatBroadcast(qhat=qhat, eta=self.config.eta))
        return qhat, DistributedOracle(self)

    def fit(self) -> CombinedModel:
        cfg = self.config
        if self.infos is None:
            self.start()
        progress = Progress(cfg.verbose)
        self._setup_log = []
        dm = self.train_domain_model(progress)
        qhat, oracle = self.prepare_dc(dm)
        ckpt = self._checkpoint()
        solver_opts = dict(cfg.solver)
        solver_opts.setdefault("random_state", cfg.random_state)
        solver_opts.setdefault("objective", "minmax")
        shown = "max_k L_k" if solver_opts["objective"] == "minmax" else "Gamma"  # what the solver minimises
        if "z" in ckpt:
            solver_opts["z0"] = np.asarray(ckpt["z"])
            # "gamma" holds the value the solver last reported: its objective during the solve, Gamma at the end
            progress.note(f"DC solver: resuming from checkpoint at iteration {ckpt.get('iteration')}, "
                          f"{ckpt.get('gamma_name', shown)}={ckpt.get('gamma'):.3g}")
        bar = progress.bar("DC solver", unit="it", total=None)

        def callback(it, z, gamma):
            bar.update(1)
            bar.set_postfix_str(f"{shown}={gamma:.4g}")
            self._write_checkpoint(z=np.asarray(z).tolist(), gamma=float(gamma), gamma_name=shown, iteration=int(it))
            if self.solver_callback is not None:
                self.solver_callback(it, z, gamma)

        res = solve_dc(oracle, cfg.eta, callback=callback, **solver_opts)
        bar.close()
        progress.note(f"DC solver ({res.method}): Gamma={res.gamma:.3g} after {res.n_iter} iterations, "
                      f"{res.n_evaluations} distributed evaluations; converged={res.converged}")
        self._write_checkpoint(z=res.z.tolist(), gamma=res.gamma, gamma_name="Gamma", iteration=res.n_iter, done=True)
        info = {"solver": {"method": res.method, "n_iter": res.n_iter, "n_evaluations": res.n_evaluations,
                           "converged": res.converged, "restarts": res.restarts},
                "classifier": getattr(dm, "info_", {}),
                "n_labeled": [i.n_labeled for i in self.infos],
                "n_unlabeled": [i.n_unlabeled for i in self.infos]}
        return CombinedModel(method=cfg.method, task=cfg.task, site_names=[i.name for i in self.infos],
                             domain_model=dm, qhat=qhat, z=res.z, eta=cfg.eta, predictors=self.predictors,
                             n_features=self.n_features, classes=self._classes(), gamma=res.gamma,
                             domain_losses=res.losses, history=res.history, info=info)


class DistributedOracle:
    """The DC loss oracle whose sums are computed at the sites and added here."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.n_sources = coordinator.p

    def evaluate(self, z, eta, what, global_bound=None) -> DCSums:
        parts = self.coordinator.call_all(
            "dc_evaluate", m.DCRequest(z=np.asarray(z, dtype=np.float64), eta=float(eta), what=tuple(what),
                                       global_bound=global_bound))
        return sum_all(r.sums for r in parts)

    def max_bound(self) -> float:
        return max(r.value for r in self.coordinator.call_all("max_bound", None))
