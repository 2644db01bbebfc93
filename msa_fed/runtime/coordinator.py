"""The coordinator: trains the domain model, gathers Qhat and solves for z with the sites.

One code path for every runtime.  The coordinator talks to its sites only through a backend
(:class:`msa_fed.runtime.backend.Backend`): with ``runtime="local"`` the sites are
:class:`SiteWorker` objects in this process, with ``runtime="ray"`` they are Ray actors (see
:mod:`msa_fed.runtime.ray_sites`).  Every message that crosses is one of
:mod:`msa_fed.boundary.messages` and can be recorded.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from typing import Any, Callable, cast

import numpy as np

from msa_fed.artifacts.isolated import is_isolated
from msa_fed.artifacts.model import CombinedModel
from msa_fed.core.combination import class_union
from msa_fed.core.dc_solver import solve_dc
from msa_fed.core.dc_terms import DCSums, batch_rows, sum_all
from msa_fed.core.density import KDEDomainModel
from msa_fed.core.domain_classifier import (
    DomainClassifier,
    fit_feature_map,
    polish_maxent,
    train_domain_classifier,
)
from msa_fed.core.config import WHEN_HARMED
from msa_fed.core.influence import influence_table
from msa_fed.core.features import make_feature_map
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.memo import frozen
from msa_fed.boundary import messages as m
from msa_fed.runtime.backend import Backend, NullRecorder, SetupLog
from msa_fed.runtime.checkpoint import Checkpoint, KeptAnswers
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.plausibility import AnswerChecker
from msa_fed.runtime.progress import Progress, RunBars, solver_summary


#: DC evaluations the noisy-oracle solver spends when a site answers with DP noise
DP_EVALUATIONS = 30


class Coordinator:
    """Owns the sites' lifecycle and runs one DMSA/GMSA fit.

    backend : a :class:`msa_fed.runtime.backend.Backend`; config : the run's
    :class:`msa_fed.runtime.config.FitConfig`, checked where it entered (``build_config``, the
    job file; one built by hand is checked here); recorder : gets every boundary crossing;
    solver_callback : called as callback(iteration, z, value) after each solver iteration;
    verbose : progress bars (None: the config's ``verbose``).
    """

    def __init__(
        self,
        backend: Backend,
        predictors: list,
        config: FitConfig,
        recorder: m.Recorder | None = None,
        solver_callback: Callable | None = None,
        verbose: bool | None = None,
    ):
        if not isinstance(config, FitConfig):
            raise TypeError(f"config must be a FitConfig; got {type(config).__name__}")
        self.backend = backend
        self.predictors = list(predictors)
        self.config = config.validate()  # at once for a checked config (build_config, the job file)
        self.verbose = config.verbose if verbose is None else bool(verbose)
        self.recorder = recorder if recorder is not None else NullRecorder()
        self.solver_callback = solver_callback
        self.infos: list[m.SiteInfo] = []  # set by start()
        self.setup_log = SetupLog()
        self.checkpoint = Checkpoint(config.checkpoint_dir)
        self.epsilon: dict[str, float] = {}  # DP: epsilon each site reports having spent on this job
        self.dp_sites: list[str] = []  # sites that answer with DP (their Qhat partial says so)
        self.samples: list[np.ndarray] = []  # the published samples (set by train_domain_model)
        # refusals a site's policy made that the run went on after (a backend that keeps its own
        # record of the sites' decisions, ``consortium()``, keeps these too)
        self.refusals: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Coordinator":
        self.infos = self.backend.start(self.recorder, self.setup_log)
        widths = {i.n_features for i in self.infos}
        if len(widths) != 1:
            detail = ", ".join(f"{i.name}: {i.n_features}" for i in self.infos)
            raise ConfigError(f"feature widths differ between sites ({detail})")
        self._check_min_points()
        return self

    def _check_min_points(self):
        """Fail before any work when a site would refuse to aggregate (the sites enforce it too)."""
        need = int(self.config.min_points)
        few = [
            f"site {i.name!r} has {n} {what} points"
            for i in self.infos
            for n, what in ((i.n_labeled, "labelled"), (i.n_unlabeled, "unlabelled"))
            if n < need
        ]
        if few:
            raise PrivacyError(
                f"{'; '.join(few)}: fewer than min_points={need}, the least a site "
                "aggregates over; add data to the site or leave it out of the run"
            )

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

    def _setup_all(self, method: str, msg) -> list:
        """A set-up message: logged (a restarted site gets it again), then sent to every site."""
        self.setup_log.add(method, msg)
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
        return class_union(cast(np.ndarray, i.classes) for i in self.infos)  # classification: every site has them

    def _fingerprint(self, sample_digest: str) -> str:
        cfg = self.config
        key = json.dumps(
            {
                "sites": [(i.name, i.n_labeled, i.n_unlabeled, i.n_features) for i in self.infos],
                "task": cfg.task,
                "method": cfg.method,
                "features": repr(cfg.features),
                "eta": cfg.eta,
                "classifier": repr(cfg.classifier),
                "seed": cfg.random_state,
                "samples": sample_digest,
            },
            sort_keys=True,
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def train_domain_model(self, progress: Progress):
        cfg = self.config
        # frozen (read-only, immutable memory): every site of this process that checks them and
        # verifies the model with them digests each once (msa_fed.privacy.memo)
        samples = [frozen(r.X) for r in self.call_all("unlabeled_sample", None)]
        self.samples = samples  # the model's target reference is built from them (published data)
        share = getattr(self.backend, "share_samples", None)
        if share is not None:  # in-process and cluster sites get the job's samples from their host (to verify models)
            share(samples)
        digest = hashlib.sha256()
        for X in samples:
            digest.update(np.ascontiguousarray(X, dtype=np.float64).tobytes())
        ckpt = self.checkpoint.bind(self._fingerprint(digest.hexdigest()))
        if cfg.method == "gmsa":
            fmap = None if cfg.features is None else make_feature_map(cfg.features, cfg.random_state)
            progress.note("GMSA: fitting one kernel density estimate per domain (5-fold CV bandwidth)")
            return KDEDomainModel(bandwidth=cfg.bandwidth, feature_map=fmap, random_state=cfg.random_state).fit(samples)
        ccfg = cfg.classifier
        if "theta" in ckpt:
            progress.note("domain classifier: resumed from checkpoint")
            fmap = fit_feature_map(make_feature_map(cfg.features, cfg.random_state), samples)
            return DomainClassifier(fmap, np.asarray(ckpt["theta"]), self.p, ccfg.mu, {"resumed": True})

        # synchronous data-parallel training: every step's loss and gradient are the sums of the
        # shard holders' answers (sites and helpers), equal to the pooled computation
        losses = []

        def gather(request):
            parts = self.backend.call_shards("classifier_loss_grad", request)
            losses.append(sum(r.loss for r in parts))
            return losses[-1], sum(r.grad for r in parts)

        def oracles(fmap, dtype=ccfg.dtype):
            state, custom = m.feature_map_fields(fmap)
            setup = m.ShardSetup(
                feature_map=state,
                custom_feature_map=custom,
                n_sources=self.p,
                dtype=dtype,
                device=ccfg.device,
                seed=cfg.random_state,
            )
            self.setup_log.add("setup_shard", setup)
            self.backend.call_shards("setup_shard", setup)
            return (
                lambda theta: gather(m.ThetaRequest(theta=theta)),
                lambda theta, step: gather(m.ThetaRequest(theta=theta, step=step, batch_size=ccfg.batch_size)),
            )

        bar = progress.bar(
            "domain classifier",
            unit="it" if ccfg.optimizer == "lbfgs" else "epoch",
            total=None if ccfg.optimizer == "lbfgs" else ccfg.epochs,
        )

        curve: list[float] = []  # the loss per iteration (epoch): the report's convergence plot

        def advance(i, objective):
            bar.update(1)
            # L-BFGS: the objective it minimises (log loss + L2 penalty), the number its summary
            # gives; SGD: the mean mini-batch log loss of the epoch (no full pass per epoch)
            if objective is not None:
                bar.set_postfix_str(f"objective={objective:.6g}")
                curve.append(float(objective))
            elif losses:
                shown = float(np.mean(losses))
                bar.set_postfix_str(f"mini-batch loss={shown:.5g}")
                curve.append(shown)
            losses.clear()

        # in-process sites: one stacked L-BFGS here, on the published samples the coordinator
        # holds (the shards would run one after another in this process anyway, each call with
        # its own overhead), to the public optimum; else data-parallel among the shard holders
        stacked = ccfg.optimizer == "lbfgs" and bool(getattr(self.backend, "trains_in_process", False))
        model = train_domain_classifier(
            samples,
            make_feature_map(cfg.features, cfg.random_state),
            ccfg,
            random_state=cfg.random_state,
            progress=advance,
            oracles=None if stacked else oracles,
            exact=stacked,
        )
        model.info_ = {**model.info_, "history": curve}
        bar.close()
        # the sites accept only the public optimum (msa_fed/privacy/verify.py): polish in float64
        # (a custom map is an in-process caller's own and is not verified: no polish)
        if not stacked and m.feature_map_fields(model.feature_map)[0] is not None:
            if ccfg.dtype != "float64":
                oracle64, _ = oracles(model.feature_map, "float64")
            else:
                oracle64 = lambda theta: gather(m.ThetaRequest(theta=theta))  # noqa: E731
            model.theta_, polished = polish_maxent(
                oracle64, model.theta_, model.n_features_, self.p, ccfg.mu, ccfg.max_iter
            )
            model.info_.update(polished)
        info = model.info_
        steps = "iterations" if info["optimizer"] == "lbfgs" else "steps"
        progress.note(
            f"domain classifier ({info['optimizer']}): objective {info['objective']:.6g} "
            f"(log loss + L2 penalty) after {info['n_iter']} {steps}"
        )
        self.checkpoint.update(theta=model.theta_.tolist())
        return model

    def prepare_dc(self, domain_model) -> tuple[np.ndarray, "DistributedOracle"]:
        """Send the domain model to the sites, gather Qhat (p,) from their partial sums, send it
        back; returns (qhat, the loss oracle whose sums the sites compute)."""
        parts = self._setup_all("set_domain_model", m.domain_model_spec(domain_model, self.p))
        self.note_epsilon(parts)
        # every answer is checked against what an honest site's answer satisfies (plausibility.py)
        self.answers = AnswerChecker([i.name for i in self.infos], [i.n_labeled for i in self.infos], self.config.loss)
        self.answers.qhat_partials(parts)
        self.qhat_parts = np.array([np.asarray(r.sums, dtype=np.float64) for r in parts])  # (sites, p)
        qhat = np.sum([r.sums for r in parts], axis=0)
        self.dp_sites = [i.name for i, r in zip(self.infos, parts) if getattr(r, "dp", False)]
        if self.epsilon:  # noisy partials (DP at some site): back to a probability vector
            qhat = np.maximum(qhat, 1e-6)
            qhat = qhat / qhat.sum()
        self.answers.qhat(parts, qhat)
        oracle = DistributedOracle(self.backend, self.p, on_parts=self.note_epsilon, checker=self.answers)
        broadcast = m.QhatBroadcast(qhat=qhat, eta=self.config.eta)
        first = self._first_request()
        together = getattr(self.backend, "call_all_then", None)
        if first is None or together is None:
            self._setup_all("set_qhat", broadcast)
            return qhat, oracle
        # the solver's first request rides with set_qhat (one round less through the relay); the
        # answers are checked, like any, when the solver asks for exactly that request
        self.setup_log.add("set_qhat", broadcast)
        _, answers = together("set_qhat", [broadcast] * self.p, "dc_evaluate", [first] * self.p)
        oracle.prime(first, answers)
        return qhat, oracle

    def _first_request(self) -> m.DCRequest | None:
        """The DC request the solver asks first, where the run's settings fix it in advance: a
        min-max solve from the uniform z, without DP noise (each answer would spend epsilon), a
        checkpoint (a resumed run takes its first answers from it), a guarantee, a global bound
        or a given start; else None."""
        cfg, solver = self.config, self.config.solver
        if solver.objective != "minmax" or solver.z0 is not None or solver.guarantee is not None:
            return None
        if (solver.bound or "pointwise") == "global" or self.epsilon or self.dp_sites or self.checkpoint.enabled:
            return None
        z = np.full(self.p, 1.0 / self.p)  # solve_dc's first start
        return m.DCRequest(z=z, eta=float(cfg.eta), what=("L", "dL"), global_bound=None)

    def note_epsilon(self, parts):
        """Record the epsilon each site says it has spent (sites with DP off report 0)."""
        for info, r in zip(self.infos, parts):
            eps = float(getattr(r, "epsilon", 0.0) or 0.0)
            if eps > 0:
                self.epsilon[info.name] = max(eps, self.epsilon.get(info.name, 0.0))

    def fit(self) -> CombinedModel:
        cfg = self.config
        if not self.infos:
            self.start()
        progress = Progress(self.verbose)
        self.setup_log.clear()
        dm = self.train_domain_model(progress)
        qhat, live = self.prepare_dc(dm)
        ckpt = self.checkpoint.state
        oracle: DistributedOracle | KeptAnswers = live
        kept = None
        if self.checkpoint.enabled:  # the rounds answered are kept: a resumed run asks only the others
            oracle = kept = KeptAnswers(live, self.checkpoint, np.asarray(qhat, dtype=np.float64).tobytes())
        solver = cfg.solver
        solver_opts: dict[str, Any] = dict(
            objective=solver.objective,
            method=solver.method,
            tol=solver.tol,
            max_iter=solver.max_iter,
            n_restarts=solver.n_restarts,
            all_starts=solver.all_starts,
            bound=solver.bound,
            z0=None if solver.z0 is None else np.asarray(solver.z0),
            random_state=cfg.random_state,
        )
        shown = "max_k L_k" if solver.objective == "minmax" else "Gamma"  # what the solver minimises
        if kept is not None and ckpt.get("answers"):  # the solver retraces its path from the kept answers
            progress.note(
                f"DC solver: resuming from checkpoint: {len(ckpt['answers'])} rounds the sites answered are "
                "kept; the sites are asked only the others"
            )
        elif "z" in ckpt:
            solver_opts["z0"] = np.asarray(ckpt["z"])
            # "gamma" holds the value the solver last reported: its objective during the solve, Gamma at the end
            progress.note(
                f"DC solver: resuming from checkpoint at iteration {ckpt.get('iteration')}, "
                f"{ckpt.get('gamma_name', shown)}={ckpt.get('gamma'):.3g}"
            )
        bar = RunBars(progress, "DC solver")  # a bar per run: restarts number their iterations anew

        def callback(it, z, gamma):
            bar.step(it, f"{shown}={gamma:.4g}")
            self.checkpoint.update(z=np.asarray(z).tolist(), gamma=float(gamma), gamma_name=shown, iteration=int(it))
            if self.solver_callback is not None:
                self.solver_callback(it, z, gamma)

        guarantee = None  # the own-loss guarantee's record, when it is asked for
        if solver.guarantee is not None:
            own, guarantee = self.own_losses(progress)
            if own is not None:
                solver_opts.update(guarantee=solver.guarantee, own_losses=own)
        if self.epsilon or self.dp_sites:  # a site answers with DP noise: few, chosen evaluations
            from msa_fed.privacy.solver import solve_noisy

            dp = sorted(set(self.epsilon) | set(self.dp_sites))
            progress.note(f"DC solver: differential privacy at {', '.join(dp)}: {DP_EVALUATIONS} noisy evaluations")
            res = solve_noisy(
                oracle,
                cfg.eta,
                n_evaluations=DP_EVALUATIONS,
                random_state=solver_opts.get("random_state", 0),
                callback=callback,
            )
        else:
            res = solve_dc(oracle, cfg.eta, callback=callback, **solver_opts)
        bar.close()
        if kept is not None and kept.kept:
            progress.note(
                f"DC solver: {kept.kept} rounds answered from the checkpoint, {kept.asked} asked of the sites"
            )
        objective = "minmax" if self.epsilon else res.objective  # the DP solve minimises max_k L_k
        progress.note(solver_summary(res, objective, runs=bar.runs))
        if solver.guarantee is not None:
            from msa_fed.core.harm import guarantee_line

            guarantee = dict(guarantee or getattr(res, "guarantee", None) or {})
            guarantee["line"] = guarantee_line(guarantee, [i.name for i in self.infos])
            progress.note(guarantee["line"])
        self.checkpoint.update(z=res.z.tolist(), gamma=res.gamma, gamma_name="Gamma", iteration=res.n_iter, done=True)
        # z the converged min-max point over all domains: the re-solves known without asking are skipped
        minmax_point = (
            res.objective == "minmax" and solver.guarantee is None and bool(res.converged) and not self.dp_sites
        )

        def report() -> dict:
            table = influence_table(
                oracle, cfg.eta, res.z, res.losses, [i.name for i in self.infos], minmax_point=minmax_point
            )
            progress.note(f"influence report: {table['evaluations']} evaluations; flagged: {table['flagged']}")
            return table

        influence = None
        # asked for (True, or WHEN_HARMED: once a verdict shows a harm); never with DP noise, where
        # re-solves would spend more of the sites' epsilon
        if cfg.influence is True and not self.epsilon:
            influence = report()
        site_check = self.site_check(res.z, influence, progress)
        if cfg.influence == WHEN_HARMED and not self.epsilon and site_check and any(site_check["harmed"]):
            progress.note("a site's verdict shows a harm: the influence report follows")
            influence = report()
        info = {
            "influence": influence,
            "site_check": site_check,
            "guarantee": guarantee if solver.guarantee is not None else None,
            "solver": {
                "method": res.method,
                "n_iter": res.n_iter,
                "n_evaluations": res.n_evaluations,
                "converged": res.converged,
                "restarts": res.restarts,
                "objective": objective,
            },
            "classifier": getattr(dm, "info_", {}),
            "consortium": self.consortium(),
            "n_labeled": [i.n_labeled for i in self.infos],
            "n_unlabeled": [i.n_unlabeled for i in self.infos],
        }
        model = CombinedModel(
            method=cfg.method,
            task=cfg.task,
            site_names=[i.name for i in self.infos],
            domain_model=dm,
            qhat=qhat,
            z=res.z,
            eta=cfg.eta,
            predictors=self.predictors,
            n_features=self.n_features,
            classes=self._classes(),
            gamma=res.gamma,
            domain_losses=res.losses,
            history=res.history,
            info=info,
            epsilon_by_site={i.name: self.epsilon.get(i.name, 0.0) for i in self.infos},
        )
        # target checks (mixture, support): rows of the published samples whose sites allow it
        from msa_fed.artifacts.target_check import build_reference

        allowed = [bool(getattr(i, "sample_in_model", True)) for i in self.infos]
        build = partial(build_reference, model, list(self.samples), allowed, random_state=cfg.random_state)
        if any(is_isolated(h) for h in model.predictors):
            # a peer's isolated predictor runs in a worker of this job: built while it is there
            model.target_reference = build()
        else:
            # built on first use (a target check, a save): its own cost (the domain model and the
            # combined model over the reference rows, the rows' leave-one-out distances; 1.3 s of
            # a 6.9 s fit at p = 64) is not the fit's when the model only predicts
            model.defer_target_reference(build)
        return model

    def consortium(self) -> dict:
        """What the run saw of the sites' own decisions: ``{"refusals": [...], "approvals": [...]}``
        (the backend's record where it keeps one: the federated topology's, with the approvals of
        sites whose operator admitted the job; else the refusals the run went on after)."""
        kept = getattr(self.backend, "consortium", None)
        if callable(kept):
            return kept()
        return {"refusals": [dict(r) for r in self.refusals], "approvals": []}

    def own_losses(self, progress: Progress) -> tuple[np.ndarray | None, dict | None]:
        """Each site's own predictor's loss on its labelled points, for the own-loss guarantee
        (solver option ``guarantee``): one verdict request per site at the uniform z before the
        solve (the request every fit ends with: same policy, clipping and budget; its ``own``
        is the number used).  Returns (the p losses, None), or (None, the record of a guarantee
        not applied): with DP at a site the solve is the noisy one, which
        takes no constraints, and the request would spend a DP answer the site did not plan."""
        dp = sorted(set(self.epsilon) | set(self.dp_sites))
        if dp:
            reason = f"differential privacy at {', '.join(dp)} (the noisy solve takes no constraints)"
            return None, {
                "status": "not applied",
                "holds": False,
                "reason": reason,
                "slack": self.config.solver.guarantee,
            }
        zs = np.full((1, self.p), 1.0 / self.p)
        parts = self.call_all("harm", m.HarmRequest(z=zs, eta=float(self.config.eta)))
        self.answers.harm(parts, 1)
        own = np.array([float(r.own) for r in parts])
        progress.note(
            "own-loss guarantee: each site's own predictor's loss, measured at the site: "
            + ", ".join(f"{i.name}={o:.4f}" for i, o in zip(self.infos, own))
        )
        return own, None

    def site_check(self, z: np.ndarray, influence: dict | None, progress: Progress) -> dict | None:
        """Every site's verdict on the model (msa_fed/core/harm.py): one request per site, the
        model's z and, with the influence analysis, each mixture re-solved without a site; once a
        site is harmed, its accusations (and from them the suspects) come from re-solves without
        each site and its labelled points (:meth:`without_each_site`).  A refusal by a site's
        policy (its budget spent, say) leaves the model without verdicts, said in one line."""
        from msa_fed.core.harm import harm_lines
        from msa_fed.core.harm import site_check as check

        zs = np.atleast_2d(np.asarray(z, dtype=np.float64))
        if influence is not None:
            zs = np.vstack([zs, np.asarray(influence["z_without"], dtype=np.float64)])
        try:
            parts = self.call_all("harm", m.HarmRequest(z=zs, eta=float(self.config.eta)))
        except PrivacyError as exc:
            progress.note(f"the sites' verdicts on the model: not measured ({exc})")
            now = time.time()
            refusal = {"site": exc.site, "request": "harm", "rule": exc.rule, "detail": exc.detail}
            self.refusals.append({**refusal, "count": 1, "first": now, "last": now})
            return None
        self.note_epsilon(parts)
        self.answers.harm(parts, zs.shape[0])
        verdicts = (
            [i.name for i in self.infos],
            np.stack([np.asarray(r.combined, dtype=np.float64) for r in parts]),
            np.array([float(r.own) for r in parts]),
            np.array([float(r.tolerance) for r in parts]),
            [bool(r.noisy) for r in parts],
            [bool(r.signs_off) for r in parts],
        )
        lone = self.config.suspects == "any"
        out = check(*verdicts, lone=lone)
        if any(out["harmed"]) and not self.epsilon:  # a harm: whose exclusion, data and all, removes it
            table, rounds = self.without_each_site(progress)
            if table is not None:
                out = check(*verdicts, without_sites=table, lone=lone)
                out["rounds_without_site"] = rounds  # each one a query every site answered
        for line in harm_lines(out):
            progress.note(line)
        return out

    def without_each_site(self, progress: Progress) -> tuple[np.ndarray | None, int]:
        """((p, p), rounds): site k's measured loss (row k) at the min-max mixture re-solved without site j,
        its domain and its labelled points (column j, :class:`WithoutSite`).  Asked only once a
        site is harmed: the p solves advance in lockstep (one batched request per site per round,
        :class:`msa_fed.core.influence.Lockstep`; the rounds are those of the longest solve), then
        one more verdict request per site (a refusal by a site's policy leaves the naming to the
        influence analysis, said in one line)."""
        zs, rounds, failed = self.exclusion_solves()
        if failed is not None:
            progress.note(f"the sites' verdicts without each site and its data: not measured ({failed})")
            return None, rounds
        p, eta = self.p, float(self.config.eta)
        try:
            parts = self.call_all("harm", m.HarmRequest(z=zs, eta=eta))
        except PrivacyError as exc:
            progress.note(f"the sites' verdicts without each site and its data: not measured ({exc})")
            return None, rounds
        self.note_epsilon(parts)
        self.answers.harm(parts, p)
        progress.note(f"the sites' verdicts without each site and its data: {rounds} rounds and one verdict request")
        return np.stack([np.asarray(r.combined, dtype=np.float64) for r in parts]), rounds

    def exclusion_solves(self, lockstep: bool = True) -> tuple[np.ndarray, int, PrivacyError | None]:
        """((p, p) z's: row j the min-max mixture without site j and its labelled points, rounds,
        the refusal that stopped them or None).  ``lockstep``: the p solves together, one batched
        request per site per round; else one after another, one request per z (the reference the
        tests compare with: the same z's to rounding)."""
        from msa_fed.core.influence import Lockstep, run_threads

        p, eta = self.p, float(self.config.eta)
        zs = np.zeros((p, p))
        if p == 2:  # one site left: its vertex
            zs[0, 1] = zs[1, 0] = 1.0
            return zs, 0, None
        lock = Lockstep(SiteParts(self.backend, p, self.answers), p) if lockstep else None
        done = [0] * p
        errors: list[BaseException] = []

        def run(j: int) -> None:
            try:
                oracle = WithoutSite(self.backend, p, j, self.qhat_parts, self.answers, lockstep=lock)
                res = solve_dc(oracle, eta, n_restarts=0, random_state=self.config.random_state, warn=False)
                zs[j] = np.insert(res.z, j, 0.0)
                done[j] = res.n_evaluations
            except BaseException as exc:  # noqa: BLE001 - re-raised (or reported) in the caller's thread
                errors.append(exc)
            finally:
                if lock is not None:
                    lock.done()

        if lock is None:
            for j in range(p):
                run(j)
                if errors:
                    break
        else:
            run_threads(run, list(range(p)), "exclusion")
        rounds = lock.rounds if lock is not None else sum(done)
        if errors:
            if isinstance(errors[0], PrivacyError):
                return zs, rounds, errors[0]
            raise errors[0]
        return zs, rounds, None


class SiteParts:
    """Every site's own sums at each z of a batch, checked (the exclusion solves: each drops one
    site's sums from the total, :class:`WithoutSite`); the oracle of their :class:`Lockstep`."""

    def __init__(self, backend: Backend, p: int, checker: AnswerChecker | None):
        self.backend, self.checker = backend, checker
        self.n_sources = p

    def evaluate_batch(self, zs, eta, what, global_bound=None) -> list[list[DCSums]]:
        zs = np.asarray(zs, dtype=np.float64)
        msg = m.DCRequest(z=zs, eta=float(eta), what=tuple(what), global_bound=None)
        parts = self.backend.call_all("dc_evaluate", [msg] * self.n_sources)
        if self.checker is not None:
            self.checker.dc_partials_batch(parts, zs, msg.eta, msg.what)
        per_site = [batch_rows(r.sums) for r in parts]
        return [[rows[i] for rows in per_site] for i in range(zs.shape[0])]

    def max_bound(self) -> float:
        raise NotImplementedError("the exclusion re-solves are min-max solves (no bound)")


class WithoutSite:
    """The min-max problem of the federation without site j: its domain and its labelled points.

    Every site computes its partial sums at z with z_j = 0, and the sums of the sites other than
    j are added; domain k's weights over their points, sum_{i not at j} w_k(i), are read off the
    Qhat partials (site s's share of domain k's mass is its partial of Qhat(k) over Qhat(k)), so
    L_k is the weighted mean over the remaining points.  z has p - 1 entries (j left out).
    With ``lockstep`` (a :class:`Lockstep` over :class:`SiteParts`) the request goes in the
    round's batch of every exclusion solve; else one request per z."""

    def __init__(
        self,
        backend: Backend,
        p: int,
        j: int,
        qhat_parts: np.ndarray,
        checker: AnswerChecker | None,
        lockstep: Any = None,
    ):
        self.backend, self.p, self.j, self.checker = backend, p, j, checker
        self.lockstep = lockstep
        self.n_sources = p - 1
        self.keep = [s for s in range(p) if s != j]
        parts = np.asarray(qhat_parts, dtype=np.float64)
        mass = parts[self.keep].sum(axis=0) / np.maximum(parts.sum(axis=0), 1e-300)  # (p,)
        self.mass = np.maximum(mass, 1e-12)[self.keep]

    def evaluate(self, z, eta, what, global_bound=None) -> DCSums:
        full = np.insert(np.asarray(z, dtype=np.float64), self.j, 0.0)
        what = ("L", "dL")
        if self.lockstep is not None:
            sums = self.lockstep.evaluate(self.j, full, float(eta), what, None)
        else:
            msg = m.DCRequest(z=full, eta=float(eta), what=what, global_bound=None)
            parts = self.backend.call_all("dc_evaluate", [msg] * self.p)
            if self.checker is not None:
                self.checker.dc_partials(parts, msg.z, msg.eta, msg.what)
            sums = [r.sums for r in parts]
        total = sum_all(sums[s] for s in self.keep)
        k = self.keep
        assert total.L is not None and total.dL is not None
        return DCSums(L=total.L[k] / self.mass, dL=total.dL[np.ix_(k, k)] / self.mass[:, None], n=int(total.n))

    def max_bound(self) -> float:
        raise NotImplementedError("the exclusion re-solves are min-max solves (no bound)")


class DistributedOracle:
    """The DC loss oracle whose sums are computed at the sites (through the backend) and added here."""

    def __init__(self, backend: Backend, n_sources: int, on_parts=None, checker: AnswerChecker | None = None):
        self.backend = backend
        self.n_sources = n_sources
        self.on_parts = on_parts  # sees every round's partials (the coordinator notes DP epsilon)
        self.checker = checker  # checks every site's answer before it is used
        self._primed: tuple[m.DCRequest, list] | None = None  # answers asked ahead (prime)

    def prime(self, msg: m.DCRequest, parts: list) -> None:
        """The sites' answers to ``msg``, asked ahead (with the set-up's last request): the first
        :meth:`evaluate` of exactly that request takes them (checked then, as any answers) instead
        of asking again; any other request drops them."""
        self._primed = (msg, parts)

    def _take_primed(self, msg: m.DCRequest) -> list | None:
        primed, self._primed = self._primed, None
        if primed is None:
            return None
        had, parts = primed
        same = (
            had.z.shape == msg.z.shape
            and had.z.tobytes() == msg.z.tobytes()
            and had.eta == msg.eta
            and tuple(had.what) == tuple(msg.what)
            and had.global_bound == msg.global_bound
        )
        return parts if same else None

    def evaluate(self, z, eta, what, global_bound=None) -> DCSums:
        msg = m.DCRequest(
            z=np.asarray(z, dtype=np.float64), eta=float(eta), what=tuple(what), global_bound=global_bound
        )
        parts = self._take_primed(msg)
        if parts is None:
            parts = self.backend.call_all("dc_evaluate", [msg] * self.n_sources)
        if self.on_parts is not None:
            self.on_parts(parts)
        if self.checker is not None:
            self.checker.dc_partials(parts, msg.z, msg.eta, msg.what)
        return sum_all(r.sums for r in parts)

    def evaluate_batch(self, zs, eta, what, global_bound=None) -> list[DCSums]:
        """The sums at each row of ``zs`` (m, p): one request per site for all of them (the
        influence analysis's re-solves, in lockstep); each site's answer checked row by row
        (:meth:`AnswerChecker.dc_partials_batch`), the sites' rows added as whole arrays."""
        zs = np.asarray(zs, dtype=np.float64)
        msg = m.DCRequest(z=zs, eta=float(eta), what=tuple(what), global_bound=global_bound)
        self._primed = None
        parts = self.backend.call_all("dc_evaluate", [msg] * self.n_sources)
        if self.on_parts is not None:
            self.on_parts(parts)
        if self.checker is not None:
            self.checker.dc_partials_batch(parts, zs, msg.eta, msg.what)
        return batch_rows(sum_all(r.sums for r in parts))

    def max_bound(self) -> float:
        parts = self.backend.call_all("max_bound", [None] * self.n_sources)
        if self.checker is not None:
            self.checker.bound(parts)
        return max(r.value for r in parts)
