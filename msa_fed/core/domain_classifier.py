"""Conditional Maxent domain classifier Q(k | x) (multinomial logistic regression), in torch.

Objective (paper eq. (LogisticRegression) with the balancing of DESIGN.md section 2):

    F(W, b) = mu ||W||^2 - sum_k sum_{x in U_k} 1 / (p m_k) log p_{W,b}(k | x)

where U_k is site k's unlabelled sample (m_k points) and p_{W,b}(k|x) = softmax(W Phi(x) + b)_k.
The intercept b is not penalised (as in scikit-learn), so mu = 1 / (2 C) for scikit-learn's
``LogisticRegression(C=C)`` with sample weights 1 / (p m_k).

The objective is a sum over shards (one per site, or more), so training is written against a
*gradient oracle*: ``theta -> (sum of shard losses, sum of shard gradients)``.  In one process
the shards are :class:`MaxentShard` objects; the Ray runtime calls the same class inside site
actors and adds their results: synchronous data-parallel training that is equal to the pooled
computation up to float rounding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from msa_fed.core.config import ClassifierConfig, parse_device
from msa_fed.core.inference import SoftmaxScores
from msa_fed.core.threads import blas_threads_for, one_blas_thread

# torch, scipy and scikit-learn are imported where training needs them: a fitted classifier
# (:class:`DomainClassifier`) and the feature-map helpers are numpy only, and a site that
# verifies and applies a domain model has none of the three (installed without the coordinator)
if TYPE_CHECKING:
    import torch


def n_params(n_features: int, n_sources: int) -> int:
    return n_sources * (n_features + 1)


def unpack(theta: np.ndarray, n_features: int, n_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """theta (p (D+1),) -> W (p, D), b (p,)."""
    Wb = np.asarray(theta).reshape(n_sources, n_features + 1)
    return Wb[:, :n_features], Wb[:, n_features]


SMALL_SHARD = 4_000_000
#: Entries of Phi per block of rows in MaxentShard._loss_grad_impl (16 MiB in float32): large,
#: since each torch call costs tens of microseconds; smaller blocks measured slower.
BLOCK_ELEMENTS = 1 << 22
#: Entries of the logits (rows x p) per block on a CPU: a block's intermediates stay in the
#: core's cache (2 MiB in float64); with few features a block of BLOCK_ELEMENTS entries of Phi
#: made logits of tens of MiB, each pass over them a trip to memory (p = 64, D = 5: 1.6x slower)
LOGIT_ELEMENTS = 1 << 18
#: The same on a GPU: whole shards in one block (each block costs kernel launches, and the
#: block's intermediates are only rows x p; 1 GiB of float64 Phi at most per block).
GPU_BLOCK_ELEMENTS = 1 << 27


def _torch_device(device: str) -> torch.device:
    """``device`` as a torch device that this process can use; ValueError otherwise."""
    import torch

    dev = parse_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"classifier device {device!r}: torch {torch.__version__} on this machine sees no CUDA "
            "device (CPU build or no GPU); use device='cpu'"
        )
    return dev


def label_terms(Phi: np.ndarray, k: np.ndarray, weight: np.ndarray, n_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """(sum_i s_i [k_i = c] Phi_i, sum_i s_i [k_i = c]) over the rows, per class c, in float64.

    The part of the loss and gradient that does not depend on theta: the weighted loss is
    sum_i s_i (lse_i - w_{k_i} . Phi_i - b_{k_i}), whose label term is <W, C> + <b, c>, and its
    gradient is sum_i s_i softmax_i Phi_i - C (and sum_i s_i softmax_i - c for b).
    """
    Phi = np.asarray(Phi, dtype=np.float64)
    s = np.asarray(weight, dtype=np.float64)
    k = np.asarray(k, dtype=np.int64)
    C = np.zeros((n_sources, Phi.shape[1]))
    np.add.at(C, k, s[:, None] * Phi)
    c: np.ndarray = np.bincount(k, weights=s, minlength=n_sources).astype(np.float64)
    return C, c


class MaxentShard:
    """One shard of the classifier's training set: features Phi (m, D) of points of one or
    more sites, their site indices k (m,) and per-point weights s (m,) = 1 / (p m_site)."""

    def __init__(
        self,
        Phi: np.ndarray,
        k: np.ndarray,
        weight: np.ndarray,
        n_sources: int,
        device: str = "cpu",
        dtype: str = "float64",
        seed: int = 0,
    ) -> None:
        import torch

        tdtype = getattr(torch, dtype)
        self.device = _torch_device(device)
        self.Phi = torch.as_tensor(np.ascontiguousarray(Phi), dtype=tdtype, device=self.device)
        self.k = torch.as_tensor(np.asarray(k, dtype=np.int64), device=self.device)
        self.s = torch.as_tensor(np.asarray(weight, dtype=np.float64), dtype=tdtype, device=self.device)
        self.n_sources = n_sources
        self.dtype = tdtype
        self.seed = seed
        # the label term of the whole shard, from the float64 inputs (exact whatever the dtype)
        self._labels = label_terms(Phi, k, weight, n_sources)

    @property
    def n_points(self) -> int:
        return int(self.Phi.shape[0])

    def _subset_labels(self, idx: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """:func:`label_terms` of the rows ``idx`` (a mini-batch), accumulated in float64."""
        import torch

        P = self.Phi[idx].to(torch.float64)
        s = self.s[idx].to(torch.float64)
        k = self.k[idx]
        C = torch.zeros((self.n_sources, P.shape[1]), dtype=torch.float64, device=self.device)
        C.index_add_(0, k, P * s[:, None])
        c = torch.zeros(self.n_sources, dtype=torch.float64, device=self.device).index_add_(0, k, s)
        return C.cpu().numpy(), c.cpu().numpy()

    def _loss_grad(
        self,
        theta: np.ndarray,
        Phi: torch.Tensor,
        s: torch.Tensor,
        labels: tuple[np.ndarray, np.ndarray],
        scale: float = 1.0,
    ) -> tuple[float, np.ndarray]:
        # Small shards run faster on one thread: intra-op threading costs more than it saves
        # below a few million entries (measured: 15x slower with 2 threads on a loaded 2-core box).
        import torch

        if Phi.numel() < SMALL_SHARD and Phi.device.type == "cpu":
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return self._loss_grad_impl(theta, Phi, s, labels, scale)
            finally:
                torch.set_num_threads(saved)
        return self._loss_grad_impl(theta, Phi, s, labels, scale)

    def _loss_grad_impl(
        self,
        theta: np.ndarray,
        Phi: torch.Tensor,
        s: torch.Tensor,
        labels: tuple[np.ndarray, np.ndarray],
        scale: float,
    ) -> tuple[float, np.ndarray]:
        """Loss sum and gradient over the rows of Phi (weights s, label terms ``labels``), in
        blocks of rows.

        Per block: logits, their log-sum-exp and the softmax weighted by s; the labels enter
        only through their precomputed float64 terms (:func:`label_terms`).  The products run
        in the shard's dtype; every sum across blocks of rows (the loss, the gradient) is
        accumulated in float64, so float32 storage costs float32 rounding within a block only.
        """
        import torch

        m, D = Phi.shape
        p = self.n_sources
        acc = torch.float64
        theta64 = np.asarray(theta, dtype=np.float64).reshape(p, D + 1)
        Wb = torch.as_tensor(theta64, device=self.device).to(self.dtype)
        # W contiguous, used through its transposed view: MKL's gemm with a transposed operand
        # (a contiguous copy of W.T ran 2.7x slower for p = 8, D = 100; measured)
        W = Wb[:, :D].contiguous()
        b = Wb[:, D].contiguous()
        lse_sum = torch.zeros((), dtype=acc, device=self.device)
        gWt = torch.zeros((D, p), dtype=acc, device=self.device)
        gb = torch.zeros(p, dtype=acc, device=self.device)
        if Phi.device.type == "cpu":
            rows = max(256, min(BLOCK_ELEMENTS // max(D, 1), LOGIT_ELEMENTS // max(p, 1)))
        else:
            rows = max(256, GPU_BLOCK_ELEMENTS // max(D, 1))
        for a in range(0, m, rows):
            P, sc = Phi[a : a + rows], s[a : a + rows]
            logits = torch.addmm(b, P, W.T)
            top = logits.amax(dim=1, keepdim=True)
            E = logits.sub_(top).exp_()
            S = E.sum(dim=1)
            lse_sum += (sc * (top.squeeze(1) + torch.log(S))).sum(dtype=acc)  # sum s log sum_k exp(logit_k)
            R = E.mul_((sc / S)[:, None])  # softmax weighted by s
            # P.T @ R (D, p), not R.T @ P: measured 2-8x faster for few features
            gWt += (P.T @ R).to(acc)
            gb += R.sum(0, dtype=acc)
        C, c = labels
        loss = float(lse_sum) - float(np.sum(theta64[:, :D] * C)) - float(theta64[:, D] @ c)
        grad = np.empty((p, D + 1))
        grad[:, :D] = gWt.T.cpu().numpy() - C
        grad[:, D] = gb.cpu().numpy() - c
        return loss * scale, grad.reshape(-1) * scale

    def loss_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """Weighted loss sum and its gradient over the whole shard (no regulariser)."""
        return self._loss_grad(theta, self.Phi, self.s, self._labels)

    def minibatch_loss_grad(self, theta: np.ndarray, step: int, batch_size: int) -> tuple[float, np.ndarray]:
        """Unbiased estimate of :meth:`loss_grad` from a mini-batch chosen by (seed, step)."""
        m = self.n_points
        if m == 0:
            return 0.0, np.zeros_like(theta)
        b = min(batch_size, m)
        import torch

        gen = torch.Generator().manual_seed(hash((self.seed, step)) & 0x7FFFFFFF)
        idx = torch.randperm(m, generator=gen)[:b].to(self.device)
        return self._loss_grad(theta, self.Phi[idx], self.s[idx], self._subset_labels(idx), scale=m / b)


#: theta -> (loss sum, gradient sum) over all shards
GradientOracle = Callable[[np.ndarray], tuple[float, np.ndarray]]
#: (theta, step) -> the same, estimated on one mini-batch per shard
MinibatchOracle = Callable[[np.ndarray, int], tuple[float, np.ndarray]]
#: progress(epoch or iteration, objective or None)
Progress = Callable[[int, float | None], object]


def _regularise(theta: np.ndarray, mu: float, n_features: int, n_sources: int) -> tuple[float, np.ndarray]:
    W, _ = unpack(theta, n_features, n_sources)
    reg = mu * float(np.sum(W * W))
    g = np.zeros_like(theta).reshape(n_sources, n_features + 1)
    g[:, :n_features] = 2.0 * mu * W
    return reg, g.reshape(-1)


def fit_maxent(
    gradient_oracle: GradientOracle,
    n_features: int,
    n_sources: int,
    config: ClassifierConfig,
    *,
    minibatch_oracle: MinibatchOracle | None = None,
    n_points: int | None = None,
    theta0: np.ndarray | None = None,
    progress: Progress | None = None,
    exact: bool = False,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Minimise F over theta = vec([W b]) with the given oracle; returns (theta, info).

    gradient_oracle(theta) -> (loss sum, gradient sum) over all shards (no regulariser).
    minibatch_oracle(theta, step) -> the same, estimated on one mini-batch per shard (SGD only).
    progress(epoch_or_iter, objective) is called as training advances (for progress bars).
    exact: L-BFGS runs to the round-off level of a float64 oracle (the stop of
    :func:`polish_maxent`) instead of the config's tolerances: the public optimum the sites verify.
    """
    from scipy.optimize import minimize
    from sklearn.exceptions import ConvergenceWarning

    config.validate()
    size = n_params(n_features, n_sources)
    theta = np.zeros(size) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    mu = config.mu
    info: dict[str, Any] = {"optimizer": config.optimizer}

    def objective(th: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = gradient_oracle(th)
        reg, greg = _regularise(th, mu, n_features, n_sources)
        return loss + reg, grad + greg

    if config.optimizer == "lbfgs":
        it = [0]

        def cb(intermediate_result: Any) -> None:  # scipy passes the iterate's objective under this name
            it[0] += 1
            if progress is not None:
                progress(it[0], float(intermediate_result.fun))

        # numpy/scipy BLAS on one thread: between oracle calls its idle workers spin and took
        # the cores from the oracle's own computation (measured: 2.5x slower per evaluation)
        with one_blas_thread():
            res = minimize(
                objective,
                theta,
                jac=True,
                method="L-BFGS-B",
                callback=cb,
                options=(
                    {"maxiter": config.max_iter, "ftol": 0.0, "gtol": POLISH_GTOL, "maxcor": 30}
                    if exact
                    else {"maxiter": config.max_iter, "ftol": config.tol, "gtol": config.gtol, "maxcor": 20}
                ),
            )
        theta = np.asarray(res.x)
        # run to round-off, L-BFGS ends on a line search that cannot tell objectives apart: a
        # success when the gradient is within the config's tolerance
        converged = bool(res.success) or (exact and float(np.max(np.abs(res.jac))) <= config.gtol)
        info.update(
            objective=float(res.fun),
            n_iter=int(res.nit),
            converged=converged,
            message=str(res.message),
            grad_norm=float(np.linalg.norm(res.jac)),
        )
        if not res.success and res.nit >= config.max_iter:
            warnings.warn(
                f"domain classifier: L-BFGS stopped on max_iter={config.max_iter}", ConvergenceWarning, stacklevel=2
            )
        return theta, info

    if minibatch_oracle is None or n_points is None:
        raise ValueError("the SGD optimizer needs a minibatch oracle and n_points")
    steps_per_epoch = max(1, math.ceil(n_points / config.batch_size))
    total = config.epochs * steps_per_epoch
    m1 = np.zeros(size)
    m2 = np.zeros(size)
    b1, b2, eps = 0.9, 0.999, 1e-8
    step = 0
    for epoch in range(config.epochs):
        with one_blas_thread():
            for _ in range(steps_per_epoch):
                loss, grad = minibatch_oracle(theta, step)
                _, greg = _regularise(theta, mu, n_features, n_sources)
                g = grad + greg
                step += 1
                m1 = b1 * m1 + (1 - b1) * g
                m2 = b2 * m2 + (1 - b2) * g * g
                lr = config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / total))
                theta = theta - lr * (m1 / (1 - b1**step)) / (np.sqrt(m2 / (1 - b2**step)) + eps)
        if progress is not None:
            progress(epoch + 1, None)  # the objective at an epoch's end would cost a full pass
    obj, _ = objective(theta)
    info.update(objective=float(obj), n_iter=step, converged=True, epochs=config.epochs)
    return theta, info


#: the polish's stopping tolerance on the largest gradient entry (float64 sums reach ~1e-12)
POLISH_GTOL = 1e-10


def polish_maxent(
    gradient_oracle: GradientOracle, theta: np.ndarray, n_features: int, n_sources: int, mu: float, max_iter: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """L-BFGS in float64 from ``theta`` until the gradient of F is at round-off level.

    A site accepts a domain model only close to the exact optimum of the public objective
    (:mod:`msa_fed.privacy.verify` bounds |W - W*| by |grad F| / (2 mu)); L-BFGS on its usual
    relative-decrease test, SGD and float32 products all stop further away (measured: gradient
    norms 5e-6 after float32 L-BFGS, 4e-2 after SGD on a 900-point problem).  The oracle must
    compute its sums in float64.  Returns (theta, {"polish_iter", "grad_norm"}).
    """
    from scipy.optimize import minimize

    def objective(th: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = gradient_oracle(th)
        reg, greg = _regularise(th, mu, n_features, n_sources)
        return loss + reg, grad + greg

    with one_blas_thread():
        res = minimize(
            objective,
            np.asarray(theta, dtype=np.float64),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": max_iter, "ftol": 0.0, "gtol": POLISH_GTOL, "maxcor": 30},
        )
        _, grad = objective(res.x)
    return np.asarray(res.x), {"polish_iter": int(res.nit), "grad_norm": float(np.linalg.norm(grad))}


#: Newton with a sampled Hessian (:func:`newton_maxent`) trains the in-process classifier where
#: one Hessian costs at most this many gradient evaluations (:func:`newton_pays`; measured at
#: p = 64, D = 5, n = 128 000: 13 evaluations and 4 Hessians against L-BFGS's 60 evaluations)
NEWTON_HESSIAN_COST = 4.0
#: rows of the Hessian's sample per parameter (at least :data:`NEWTON_MIN_ROWS`): its error then
#: costs a few percent of Newton's contraction (measured at p = 64, D = 5: the largest gradient
#: entry falls about 8x per step with 20 rows per parameter, 10x with 40)
NEWTON_ROWS_PER_PARAM = 20
NEWTON_MIN_ROWS = 2000
#: Newton steps before the trainer hands over to L-BFGS (never reached on the benchmark grid: 10-16)
NEWTON_MAX_ITER = 60
#: the Newton decrement g . H^-1 g, relative to |F|, below which a step is judged by the largest
#: gradient entry instead of the objective: the objective's decrease is then within a few
#: thousand rounding units of F, where comparing objectives compares rounding noise
NEWTON_ROUNDOFF = 1e-10


def hessian_rows(n_points: int, n_features: int, n_sources: int) -> int:
    """Rows of the Hessian's sample in :func:`newton_maxent` (all of them for small problems)."""
    return min(n_points, max(NEWTON_MIN_ROWS, NEWTON_ROWS_PER_PARAM * n_params(n_features, n_sources)))


def newton_pays(n_points: int, n_features: int, n_sources: int) -> bool:
    """Whether one sampled Hessian costs at most :data:`NEWTON_HESSIAN_COST` evaluations of the
    loss and gradient (multiply-adds: m (p (D + 1))^2 / 2 for the Hessian of m rows, n p (2 D +
    22) for an evaluation, its exponentials counted as 20)."""
    size = n_params(n_features, n_sources)
    hessian = hessian_rows(n_points, n_features, n_sources) * size * size / 2.0
    evaluation = n_points * n_sources * (2.0 * n_features + 22.0)
    return hessian <= NEWTON_HESSIAN_COST * evaluation


class SampledHessian:
    """The Hessian of F at theta from a fixed sample of the shard's rows (each class keeps its
    total weight), in float64: sum_i s_i (diag(q_i) - q_i q_i^T) (x) phi_i phi_i^T + 2 mu on W,
    with phi_i = (Phi_i, 1) and q_i = softmax_i, plus 1 1^T / p on the intercepts (F does not
    change when every intercept moves alike: that direction is the Hessian's null space, and
    the gradient has no component along it).

    Only the path of :func:`newton_maxent` depends on the sample; where it stops is set by the
    exact gradient."""

    def __init__(self, shard: MaxentShard, rows: int) -> None:
        k = shard.k.cpu().numpy()
        s = shard.s.double().cpu().numpy()
        n, p = k.size, shard.n_sources
        picked, weights = [], []
        for c in range(p):
            idx = np.flatnonzero(k == c)
            if idx.size == 0:
                continue
            count = min(idx.size, max(32, math.ceil(rows * idx.size / max(n, 1))))
            take = idx[np.unique(np.linspace(0, idx.size - 1, count).round().astype(np.int64))]
            picked.append(take)
            weights.append(s[take] * (s[idx].sum() / s[take].sum()))
        sel = np.concatenate(picked)
        Phi = shard.Phi[torch_index(sel, shard.device)].cpu().numpy().astype(np.float64)
        self.Phi1 = np.hstack([Phi, np.ones((sel.size, 1))])
        self.s = np.concatenate(weights)
        self.n_sources = p

    def __call__(self, theta: np.ndarray, mu: float) -> np.ndarray:
        m, q = self.Phi1.shape
        p = self.n_sources
        Wb = np.asarray(theta, dtype=np.float64).reshape(p, q)
        H = np.zeros((p * q, p * q))
        blocks = np.zeros((p, q * q))
        chunk = max(1, (1 << 21) // (p * q))  # rows per chunk: Z below is 16 MiB at most
        for a in range(0, m, chunk):
            X, s = self.Phi1[a : a + chunk], self.s[a : a + chunk]
            Q = X @ Wb.T
            Q -= Q.max(axis=1, keepdims=True)
            np.exp(Q, out=Q)
            Q /= Q.sum(axis=1, keepdims=True)
            # sum_i s_i q_ik phi_i phi_i^T per class: the diagonal blocks
            blocks += (Q * s[:, None]).T @ (X[:, :, None] * X[:, None, :]).reshape(len(X), q * q)
            # sum_i s_i (q_i (x) phi_i)(q_i (x) phi_i)^T, one product of Z with itself
            Z = (Q * np.sqrt(s)[:, None])[:, :, None] * X[:, None, :]
            Z = Z.reshape(len(X), p * q)
            H -= Z.T @ Z
        for c in range(p):
            H[c * q : (c + 1) * q, c * q : (c + 1) * q] += blocks[c].reshape(q, q)
        W_idx = (np.arange(p)[:, None] * q + np.arange(q - 1)[None, :]).ravel()
        b_idx = np.arange(p) * q + q - 1
        H[W_idx, W_idx] += 2.0 * mu
        H[np.ix_(b_idx, b_idx)] += 1.0 / p
        return H


def torch_index(idx: np.ndarray, device: Any) -> Any:
    import torch

    return torch.as_tensor(idx, dtype=torch.int64, device=device)


def newton_maxent(
    shard: MaxentShard,
    n_features: int,
    n_sources: int,
    config: ClassifierConfig,
    *,
    progress: Progress | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Minimise F to the round-off level of the float64 ``shard`` (the stop of
    :func:`fit_maxent`'s ``exact``) by Newton steps with a sampled Hessian
    (:class:`SampledHessian`, :func:`hessian_rows` rows); returns (theta, info) as
    :func:`fit_maxent` does.

    Each step solves H d = g with the sample's Hessian, the exact gradient g over every row; a
    backtracking line search on the exact F keeps far steps honest, and once the Newton
    decrement is within :data:`NEWTON_ROUNDOFF` of |F| a step is kept where it lowers the largest
    gradient entry (comparing objectives there compares rounding noise).  A Hessian is kept for
    the next step while its last full step shrank the gradient at least 4x.  The stop: the
    largest gradient entry at :data:`POLISH_GTOL`, or a step that no longer lowers it (the
    round-off level).  Should a step fail (a Hessian that cannot be factored, a line search
    that does not end, :data:`NEWTON_MAX_ITER` steps), L-BFGS takes over from the last iterate
    (:func:`fit_maxent`, ``exact``): the optimum is the same either way.
    """
    from scipy.linalg import LinAlgError, cho_factor, cho_solve

    config.validate()
    mu = config.mu
    hessian = SampledHessian(shard, hessian_rows(shard.n_points, n_features, n_sources))
    oracle = sum_oracle([shard])

    def objective(th: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = oracle(th)
        reg, greg = _regularise(th, mu, n_features, n_sources)
        return loss + reg, grad + greg

    info: dict[str, Any] = {"optimizer": config.optimizer, "method": "newton"}
    theta = np.zeros(n_params(n_features, n_sources))
    evaluations, hessians, it = 1, 0, 0
    with one_blas_thread():
        f, g = objective(theta)
        factor = None
        handover = ""
        gmax = float(np.max(np.abs(g)))
        while gmax > POLISH_GTOL:
            if it >= NEWTON_MAX_ITER:
                handover = f"{it} Newton steps"
                break
            if factor is None:
                try:
                    factor = cho_factor(hessian(theta, mu))
                except (LinAlgError, ValueError):
                    handover = "a sampled Hessian that is not positive definite"
                    break
                hessians += 1
            step = cho_solve(factor, g)
            decrement = float(g @ step)
            if not (math.isfinite(decrement) and decrement > 0.0):
                handover = "a step that is not a descent direction"
                break
            plain = decrement <= NEWTON_ROUNDOFF * max(1.0, abs(f))
            t = 1.0
            while True:
                trial = theta - t * step
                nf, ng = objective(trial)
                evaluations += 1
                ngmax = float(np.max(np.abs(ng)))
                if plain:
                    ok = ngmax < gmax
                    break
                if nf <= f - 1e-4 * t * decrement:  # Armijo, on a decrease well above rounding
                    ok = True
                    break
                t *= 0.5
                if t < 1e-6:
                    ok = False
                    break
            if not ok:
                if not plain:
                    handover = "a line search that found no decrease"
                elif gmax > config.gtol:
                    handover = "steps that no longer lower the gradient above the tolerance"
                break  # else the gradient is at the round-off level
            # keep the Hessian while it contracts well (the iterates move less and less)
            if not (t == 1.0 and ngmax <= 0.25 * gmax):
                factor = None
            theta, f, g, gmax = trial, nf, ng, ngmax
            it += 1
            if progress is not None:
                progress(it, f)
    if handover:
        theta, lbfgs = fit_maxent(oracle, n_features, n_sources, config, theta0=theta, exact=True)
        info.update(lbfgs, method="newton, then L-BFGS", handover=handover, newton_iter=it)
        info.update(evaluations=evaluations + lbfgs["n_iter"], hessians=hessians)
        return theta, info
    info.update(
        objective=float(f),
        n_iter=it,
        converged=gmax <= config.gtol,
        message="the largest gradient entry at " + ("the tolerance" if gmax <= POLISH_GTOL else "round-off"),
        grad_norm=float(np.linalg.norm(g)),
        evaluations=evaluations,
        hessians=hessians,
    )
    return theta, info


def sum_oracle(shards: Sequence[MaxentShard]) -> GradientOracle:
    """The in-process gradient oracle over shards (the pooled objective)."""

    def oracle(theta: np.ndarray) -> tuple[float, np.ndarray]:
        return _add_up([sh.loss_grad(theta) for sh in shards], theta)

    return oracle


def sum_minibatch_oracle(shards: Sequence[MaxentShard], batch_size: int) -> MinibatchOracle:
    """The in-process mini-batch oracle over shards."""

    def oracle(theta: np.ndarray, step: int) -> tuple[float, np.ndarray]:
        return _add_up([sh.minibatch_loss_grad(theta, step, batch_size) for sh in shards], theta)

    return oracle


def _add_up(parts: Sequence[tuple[float, np.ndarray]], theta: np.ndarray) -> tuple[float, np.ndarray]:
    """Sum of (loss, gradient) pairs, added in order (from 0 and zeros like theta)."""
    total, grad = 0.0, np.zeros_like(theta)
    for loss, g in parts:
        total += loss
        grad += g
    return total, grad


class DomainClassifier(SoftmaxScores):
    """Fitted Q(k | x): a feature map and softmax weights.  ``predict_proba`` columns follow
    site order.  Build with :func:`train_domain_classifier` or the runtime."""

    #: the name of this kind of domain model in saved models and messages (core.domain_models)
    kind = "maxent"

    def __init__(
        self, feature_map: Any, theta: np.ndarray, n_sources: int, mu: float, info: dict[str, Any] | None = None
    ) -> None:
        self.feature_map = feature_map
        self.n_sources = n_sources
        self.theta_ = np.asarray(theta, dtype=np.float64)
        self.n_features_ = self.theta_.size // n_sources - 1
        self.mu = mu
        self.info_ = info or {}

    @property
    def coef_(self) -> np.ndarray:
        return unpack(self.theta_, self.n_features_, self.n_sources)[0]

    @property
    def intercept_(self) -> np.ndarray:
        return unpack(self.theta_, self.n_features_, self.n_sources)[1]

    def decision_function(self, X: ArrayLike) -> np.ndarray:
        Phi = self.feature_map.transform(X)
        with blas_threads_for(Phi.size * self.n_sources):
            scores: np.ndarray = Phi @ self.coef_.T + self.intercept_
        return scores

    def get_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(params, arrays) without the feature map (saved beside it); see :meth:`from_state`."""
        return {"mu": self.mu}, {"theta": self.theta_}

    @classmethod
    def from_state(
        cls, params: dict[str, Any], arrays: dict[str, Any], feature_map: Any, n_sources: int
    ) -> DomainClassifier:
        return cls(feature_map, arrays["theta"], n_sources, params.get("mu", 0.0))


def shard_seed(seed: int, index: int) -> int:
    """The SGD mini-batch seed of site ``index``'s shard for the run seed ``seed``."""
    return int(seed) * 1000 + int(index)


def balanced_weights(X_unlabeled: Sequence[np.ndarray]) -> np.ndarray:
    """Per-point weights 1 / (p m_k) of the pooled unlabelled sample (each site weighs 1/p)."""
    p = len(X_unlabeled)
    weights: np.ndarray = np.concatenate([np.full(len(X), 1.0 / (p * len(X))) for X in X_unlabeled])
    return weights


def fit_with_weights(estimator: Any, X: np.ndarray, sample_weight: np.ndarray) -> Any:
    """``estimator.fit(X, sample_weight=...)``, or ``fit(X)`` for one that takes no weights."""
    try:
        return estimator.fit(X, sample_weight=sample_weight)
    except TypeError:
        return estimator.fit(X)


def fit_feature_map(feature_map: Any, X_unlabeled: Sequence[np.ndarray]) -> Any:
    """Fit ``feature_map`` on the pooled unlabelled sample, each site weighing 1/p; returns it."""
    fit_with_weights(feature_map, np.vstack(X_unlabeled), balanced_weights(X_unlabeled))
    return feature_map


def balanced_shards(Phis: Sequence[np.ndarray], config: ClassifierConfig, seed: int = 0) -> list[MaxentShard]:
    """One shard per site: site k's features with label k and weight 1 / (p m_k)."""
    p = len(Phis)
    return [
        MaxentShard(
            Phi,
            np.full(Phi.shape[0], k),
            np.full(Phi.shape[0], 1.0 / (p * Phi.shape[0])),
            p,
            device=config.device,
            dtype=config.dtype,
            seed=shard_seed(seed, k),
        )
        for k, Phi in enumerate(Phis)
    ]


def stacked_shard(Phis: Sequence[np.ndarray], device: str = "cpu", dtype: str = "float64") -> MaxentShard:
    """All sites' rows in one shard: site k's features with label k and weight 1 / (p m_k).

    The same objective as :func:`balanced_shards` in one oracle call per evaluation instead of p
    (each call costs a dozen torch calls of its own: at p = 64 sites of 2000 points they were
    most of the classifier's time)."""
    p = len(Phis)
    return MaxentShard(
        np.vstack(Phis),
        np.concatenate([np.full(Phi.shape[0], k) for k, Phi in enumerate(Phis)]),
        balanced_weights(Phis),
        p,
        device=device,
        dtype=dtype,
    )


#: (gradient oracle, mini-batch oracle) of a fitted feature map, computed outside this process
Oracles = Callable[[Any], tuple[GradientOracle, Callable[[np.ndarray, int], tuple[float, np.ndarray]]]]


def train_domain_classifier(
    X_unlabeled: Sequence[np.ndarray],
    feature_map: Any,
    config: ClassifierConfig,
    random_state: int | None = 0,
    progress: Progress | None = None,
    *,
    oracles: Oracles | None = None,
    exact: bool = False,
) -> DomainClassifier:
    """Fit the feature map on the pooled unlabelled sample (balanced) and train the classifier.

    oracles : None trains in this process: L-BFGS in float64 on one :func:`stacked_shard` of all
        sites (the config's dtype applies to shards), SGD on :func:`balanced_shards` (one
        mini-batch per site and step); else ``oracles(feature_map)`` (called with the fitted map)
        returns (gradient oracle, mini-batch oracle) whose sums are computed elsewhere (the
        runtime: at the sites).
    exact : in process with L-BFGS, train to the public optimum, the round-off level of the
        float64 sums (:func:`fit_maxent`'s ``exact``; no polish needed after it).  Measured
        against float32 products and a float64 polish, to the same optimum: 0.55x the CPU time
        at D = 100, p = 8 (the polish restarts L-BFGS without its memory), 0.85x at D = 5, p = 64.
        Where a sampled Hessian is cheap (:func:`newton_pays`: few features times sites) the
        exact fit takes Newton steps instead (:func:`newton_maxent`, to the same optimum: 14
        evaluations and 4 Hessians against L-BFGS's 60 evaluations at D = 5, p = 64).
    """
    p = len(X_unlabeled)
    fit_feature_map(feature_map, X_unlabeled)
    seed = int(random_state) if random_state is not None else 0
    n_points = max(len(X) for X in X_unlabeled)
    if oracles is not None:
        oracle, minibatch = oracles(feature_map)
        D = int(np.asarray(feature_map.transform(X_unlabeled[0][:1])).shape[1])
    else:
        Phis = [np.asarray(feature_map.transform(X), dtype=np.float64) for X in X_unlabeled]
        D = Phis[0].shape[1]
        if config.optimizer == "lbfgs":
            shard = stacked_shard(Phis, config.device, "float64")
            Phis.clear()  # the stacked copy replaces the per-site ones (memory)
            if exact and newton_pays(shard.n_points, D, p):
                theta, info = newton_maxent(shard, D, p, config, progress=progress)
            else:
                theta, info = fit_maxent(sum_oracle([shard]), D, p, config, progress=progress, exact=exact)
            return DomainClassifier(feature_map, theta, p, config.mu, info)
        shards = balanced_shards(Phis, config, seed=seed)
        oracle, minibatch = sum_oracle(shards), sum_minibatch_oracle(shards, config.batch_size)
    theta, info = fit_maxent(oracle, D, p, config, minibatch_oracle=minibatch, n_points=n_points, progress=progress)
    return DomainClassifier(feature_map, theta, p, config.mu, info)
