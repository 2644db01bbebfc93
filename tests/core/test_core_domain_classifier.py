"""The conditional-Maxent domain classifier against scikit-learn's LogisticRegression."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose
from sklearn.linear_model import LogisticRegression

from msa_fed.core.domain_classifier import (
    ClassifierConfig,
    MaxentShard,
    balanced_shards,
    fit_maxent,
    sum_oracle,
    train_domain_classifier,
    unpack,
)
from msa_fed.core.features import StandardFeatures

MU = 1e-2
SIZES = (60, 110, 170)  # unequal on purpose: the balancing weights 1 / (p m_k) matter


def samples(sizes=SIZES, d=4, seed=0):
    rng = np.random.default_rng(seed)
    means = rng.normal(scale=1.0, size=(len(sizes), d))
    return [rng.normal(size=(m, d)) * (1.0 + 0.3 * k) + means[k] for k, m in enumerate(sizes)]


def objective(theta, Phis, mu):
    """F(W, b) = mu ||W||^2 - sum_k sum_{x in U_k} log p(k | x) / (p m_k), written out."""
    p = len(Phis)
    D = Phis[0].shape[1]
    W, b = unpack(theta, D, p)
    total = mu * np.sum(W * W)
    for k, Phi in enumerate(Phis):
        logits = Phi @ W.T + b
        logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        total -= logp[:, k].sum() / (p * Phi.shape[0])
    return total


def sklearn_fit(Phis, mu):
    p = len(Phis)
    X = np.vstack(Phis)
    y = np.concatenate([np.full(len(P), k) for k, P in enumerate(Phis)])
    sw = np.concatenate([np.full(len(P), 1.0 / (p * len(P))) for P in Phis])
    clf = LogisticRegression(C=1.0 / (2.0 * mu), tol=1e-12, max_iter=10_000).fit(X, y, sample_weight=sw)
    return np.hstack([clf.coef_, clf.intercept_[:, None]]).ravel(), clf


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lbfgs_optimum_matches_sklearn(dtype):
    Xs = samples()
    cfg = ClassifierConfig(mu=MU, dtype=dtype)
    model = train_domain_classifier(Xs, StandardFeatures(), cfg)
    Phis = [model.feature_map.transform(X) for X in Xs]
    theta_sk, clf = sklearn_fit(Phis, MU)
    f_ours, f_sk = objective(model.theta_, Phis, MU), objective(theta_sk, Phis, MU)
    assert abs(f_ours - f_sk) <= 1e-4 * abs(f_sk), (f_ours, f_sk)
    assert model.info_["objective"] == pytest.approx(f_ours, rel=1e-6)
    Xtest = np.vstack(Xs) + 0.5
    assert_allclose(model.predict_proba(Xtest), clf.predict_proba(model.feature_map.transform(Xtest)), atol=1e-3)
    P = model.predict_proba(Xtest)
    assert_allclose(P.sum(1), 1.0, atol=1e-12)


def test_gradient_oracle_matches_finite_differences():
    Xs = samples(d=3)
    shards = balanced_shards(Xs, ClassifierConfig(dtype="float64"))
    oracle = sum_oracle(shards)
    rng = np.random.default_rng(1)
    theta = rng.normal(size=3 * 4) * 0.3
    loss, grad = oracle(theta)
    # the oracle is the data term of F (no regulariser)
    assert loss == pytest.approx(objective(theta, Xs, 0.0), rel=1e-12)
    fd = np.empty_like(theta)
    for j in range(theta.size):
        e = np.zeros_like(theta)
        e[j] = 1e-6
        fd[j] = (oracle(theta + e)[0] - oracle(theta - e)[0]) / 2e-6
    assert np.max(np.abs(fd - grad)) <= 1e-5 * np.max(np.abs(grad))


def test_float32_shards_accumulate_in_float64():
    """float32 products with float64 sums: the value and gradient agree with float64 closely."""
    rng = np.random.default_rng(2)
    Xs = [rng.normal(size=(5000, 20)) + k for k in range(3)]
    theta = rng.normal(size=3 * 21) * 0.1
    l64, g64 = sum_oracle(balanced_shards(Xs, ClassifierConfig(dtype="float64")))(theta)
    l32, g32 = sum_oracle(balanced_shards(Xs, ClassifierConfig(dtype="float32")))(theta)
    assert l32 == pytest.approx(l64, rel=1e-6)
    assert np.max(np.abs(g32 - g64)) <= 1e-5 * np.max(np.abs(g64))


def test_sgd_gets_close_to_the_optimum():
    Xs = samples()
    fmap = StandardFeatures()
    exact = train_domain_classifier(Xs, fmap, ClassifierConfig(mu=MU))
    sgd = train_domain_classifier(
        Xs, StandardFeatures(), ClassifierConfig(mu=MU, optimizer="sgd", epochs=60, batch_size=32, lr=0.05)
    )
    Phis = [exact.feature_map.transform(X) for X in Xs]
    f_exact, f_sgd = objective(exact.theta_, Phis, MU), objective(sgd.theta_, Phis, MU)
    assert f_exact <= f_sgd <= f_exact * (1 + 2e-2), (f_exact, f_sgd)
    X = np.vstack(Xs)
    assert np.max(np.abs(sgd.predict_proba(X) - exact.predict_proba(X))) < 0.1


def test_balanced_weighting_ignores_sample_size():
    """Each site weighs 1 / (p m_k): duplicating one site's sample leaves the optimum unchanged."""
    Xs = samples()
    a = train_domain_classifier(Xs, StandardFeatures(), ClassifierConfig(mu=MU, dtype="float64"))
    dup = [Xs[0], np.vstack([Xs[1], Xs[1]]), Xs[2]]
    b = train_domain_classifier(dup, StandardFeatures(), ClassifierConfig(mu=MU, dtype="float64"))
    assert b.info_["objective"] == pytest.approx(a.info_["objective"], rel=1e-9)
    X = np.vstack(Xs) * 1.1
    assert_allclose(b.predict_proba(X), a.predict_proba(X), atol=1e-5)
    # while an unbalanced fit (one weight per point) does move
    Phis = [a.feature_map.transform(X) for X in dup]
    shard = MaxentShard(
        np.vstack(Phis),
        np.concatenate([np.full(len(P), k) for k, P in enumerate(Phis)]),
        np.full(sum(len(P) for P in Phis), 1.0 / sum(len(P) for P in Phis)),
        3,
    )
    theta, _ = fit_maxent(sum_oracle([shard]), Phis[0].shape[1], 3, ClassifierConfig(mu=MU))
    assert np.max(np.abs(theta - a.theta_)) > 1e-2


def test_shards_split_anyhow_give_the_same_oracle():
    """The objective is a sum over shards: one shard per site or one for all, same numbers."""
    Xs = samples()
    p = len(Xs)
    per_site = sum_oracle(balanced_shards(Xs, ClassifierConfig(dtype="float64")))
    X = np.vstack(Xs)
    k = np.concatenate([np.full(len(x), i) for i, x in enumerate(Xs)])
    s = np.concatenate([np.full(len(x), 1.0 / (p * len(x))) for x in Xs])
    halves = [MaxentShard(X[i::2], k[i::2], s[i::2], p) for i in range(2)]
    theta = np.random.default_rng(3).normal(size=p * (X.shape[1] + 1))
    l1, g1 = per_site(theta)
    l2, g2 = sum_oracle(halves)(theta)
    assert l1 == pytest.approx(l2, rel=1e-12)
    assert_allclose(g1, g2, rtol=1e-10, atol=1e-14)


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="mu"):
        ClassifierConfig(mu=-1.0).validate()
    with pytest.raises(ValueError, match="optimizer"):
        ClassifierConfig(optimizer="adam").validate()
    with pytest.raises(ValueError, match="dtype"):
        ClassifierConfig(dtype="float16").validate()


def test_unusable_devices_are_clear_errors():
    import torch

    from msa_fed.core.domain_classifier import ClassifierConfig, MaxentShard

    with pytest.raises(ValueError, match="is not a torch device"):
        ClassifierConfig(device="gpu0").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            MaxentShard(np.zeros((3, 2)), np.zeros(3, dtype=int), np.ones(3), 2, device="cuda")
    else:  # pragma: no cover - GPU machines
        assert MaxentShard(np.zeros((3, 2)), np.zeros(3, dtype=int), np.ones(3), 2, device="cuda").Phi.is_cuda


# ---------------------------------------------------------------------------- against the former trainer
def _former_loss_grad(theta, Phi, k, s, p):
    """The former shard kernel, kept as the reference: one-hot labels inside every block, the
    gradient as R.T @ Phi (float64 here)."""
    import torch

    P = torch.as_tensor(Phi, dtype=torch.float64)
    Y = torch.nn.functional.one_hot(torch.as_tensor(k), p).to(torch.float64)
    sc = torch.as_tensor(s, dtype=torch.float64)
    D = Phi.shape[1]
    Wb = torch.as_tensor(np.asarray(theta).reshape(p, D + 1), dtype=torch.float64)
    logits = torch.addmm(Wb[:, D], P, Wb[:, :D].T)
    top = logits.amax(dim=1, keepdim=True)
    E = torch.exp(logits - top)
    S = E.sum(dim=1, keepdim=True)
    lse = (top + torch.log(S)).squeeze(1)
    loss = float((sc * (lse - (logits * Y).sum(1))).sum())
    R = (E / S - Y) * sc[:, None]
    grad = torch.cat([R.T @ P, R.sum(0)[:, None]], dim=1).reshape(-1)
    return loss, grad.numpy()


def _pooled(Phis):
    p = len(Phis)
    k = np.concatenate([np.full(len(P), i) for i, P in enumerate(Phis)])
    s = np.concatenate([np.full(len(P), 1.0 / (p * len(P))) for P in Phis])
    return np.vstack(Phis), k, s


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_shard_kernel_equals_the_former_one(dtype):
    """The label terms taken out of the blocks, blocks sized by the logits, the gradient as
    (Phi.T @ R).T: the same loss and gradient as the former kernel, full batch and mini-batch."""
    from msa_fed.core import domain_classifier as dc

    rng = np.random.default_rng(4)
    Phis = [rng.normal(size=(m, 6)) + rng.normal(size=6) for m in (700, 1100, 900, 1300)]
    X, k, s = _pooled(Phis)
    p = len(Phis)
    theta = rng.normal(size=p * 7) * 0.4
    ref_loss, ref_grad = _former_loss_grad(theta, X, k, s, p)
    tol = 1e-12 if dtype == "float64" else 2e-6
    for rows in (None, 256):  # one block, or many (block boundaries inside the shard)
        saved = dc.LOGIT_ELEMENTS
        if rows is not None:
            dc.LOGIT_ELEMENTS = rows * p
        try:
            loss, grad = MaxentShard(X, k, s, p, dtype=dtype).loss_grad(theta)
        finally:
            dc.LOGIT_ELEMENTS = saved
        assert loss == pytest.approx(ref_loss, rel=tol)
        assert np.max(np.abs(grad - ref_grad)) <= tol * np.max(np.abs(ref_grad))
    # a mini-batch: the label terms of the chosen rows only
    shard = MaxentShard(X, k, s, p, dtype=dtype, seed=5)
    loss, grad = shard.minibatch_loss_grad(theta, 3, 64)
    import torch

    gen = torch.Generator().manual_seed(hash((5, 3)) & 0x7FFFFFFF)
    idx = torch.randperm(len(X), generator=gen)[:64].numpy()
    ref_loss, ref_grad = _former_loss_grad(theta, X[idx], k[idx], s[idx], p)
    scale = len(X) / 64
    assert loss == pytest.approx(ref_loss * scale, rel=tol)
    assert np.max(np.abs(grad - ref_grad * scale)) <= tol * np.max(np.abs(ref_grad * scale))


def _former_fit(Xs, mu):
    """The former in-process trainer and the coordinator's polish, as they were: float32 shards
    (one per site) to the config's tolerances, then float64 L-BFGS to the round-off level."""
    from scipy.optimize import minimize

    fmap = StandardFeatures()
    from msa_fed.core.domain_classifier import fit_feature_map

    fit_feature_map(fmap, Xs)
    Phis = [fmap.transform(X) for X in Xs]
    X, k, s = _pooled(Phis)
    p, D = len(Phis), Phis[0].shape[1]

    def objective(theta, dtype):
        if dtype == "float32":  # float32 products, like the former default shards
            loss, grad = _former_loss_grad(theta.astype(np.float32).astype(np.float64), X.astype(np.float32), k, s, p)
        else:
            loss, grad = _former_loss_grad(theta, X, k, s, p)
        W = unpack(theta, D, p)[0]
        g = grad.reshape(p, D + 1).copy()
        g[:, :D] += 2 * mu * W
        return loss + mu * float(np.sum(W * W)), g.reshape(-1)

    x = minimize(
        objective,
        np.zeros(p * (D + 1)),
        args=("float32",),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 1000, "ftol": 1e-9, "gtol": 1e-7, "maxcor": 20},
    ).x
    x = minimize(
        objective,
        x,
        args=("float64",),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 1000, "ftol": 0.0, "gtol": 1e-10, "maxcor": 30},
    ).x
    return x, Phis


@pytest.mark.parametrize("seed", [0, 1])
def test_stacked_exact_fit_reaches_the_former_optimum(seed):
    """One float64 L-BFGS over the stacked sample (the coordinator's in-process path) ends where
    the former float32 fit and float64 polish ended: objective within 1e-6 (measured: ~1e-15)."""
    Xs = samples(sizes=(300, 520, 410, 260), d=5, seed=seed)
    model = train_domain_classifier(Xs, StandardFeatures(), ClassifierConfig(mu=1e-3), exact=True)
    former, Phis = _former_fit(Xs, 1e-3)
    f_new, f_old = objective(model.theta_, Phis, 1e-3), objective(former, Phis, 1e-3)
    assert abs(f_new - f_old) <= 1e-6 * abs(f_old), (f_new, f_old)
    assert abs(f_new - f_old) <= 1e-12  # in fact both are at the round-off level
    assert np.max(np.abs(model.theta_ - former)) < 1e-5
    assert model.info_["grad_norm"] < 1e-7 and model.info_["converged"]


# ---------------------------------------------------------------------------- Newton with a sampled Hessian
def _lbfgs_exact(Xs, mu):
    """The reference: float64 L-BFGS over the stacked sample to the round-off level (the in-process
    trainer before Newton, kept as fit_maxent's ``exact`` and as Newton's fallback)."""
    from msa_fed.core.domain_classifier import fit_feature_map, stacked_shard

    fmap = fit_feature_map(StandardFeatures(), Xs)
    Phis = [fmap.transform(X) for X in Xs]
    theta, info = fit_maxent(
        sum_oracle([stacked_shard(Phis)]), Phis[0].shape[1], len(Phis), ClassifierConfig(mu=mu), exact=True
    )
    return theta, info, Phis


def test_sampled_hessian_with_every_row_is_the_hessian_of_the_objective():
    """The Hessian's formula (all rows sampled) against central differences of the exact
    gradient; its one null direction (every intercept alike) carries 1/p instead of 0."""
    from msa_fed.core.domain_classifier import SampledHessian, _regularise, stacked_shard

    Xs = samples(d=3)
    p, D, mu = len(Xs), 3, 0.05
    shard = stacked_shard(Xs)
    theta = np.random.default_rng(5).normal(size=p * (D + 1)) * 0.5

    def grad(th):
        return shard.loss_grad(th)[1] + _regularise(th, mu, D, p)[1]

    fd = np.empty((theta.size, theta.size))
    for j in range(theta.size):
        e = np.zeros_like(theta)
        e[j] = 1e-5
        fd[:, j] = (grad(theta + e) - grad(theta - e)) / 2e-5
    H = SampledHessian(shard, shard.n_points)(theta, mu)
    gauge = np.zeros_like(theta)
    gauge[D :: D + 1] = 1.0
    assert_allclose(H - np.outer(gauge, gauge) / p, fd, atol=1e-7)
    assert np.abs(fd @ gauge).max() < 1e-8  # the null direction of F's Hessian


@pytest.mark.parametrize("sizes", [(300, 520, 410, 260), (900,) * 8])
def test_newton_reaches_the_lbfgs_optimum(sizes):
    """The in-process exact trainer (Newton; every row in the Hessian for the small problem, a
    sample of 2000 of 7200 rows for the larger) ends where the float64 L-BFGS reference ends:
    objective within 1e-12, weights within 1e-5, at a smaller gradient, in fewer evaluations."""
    from msa_fed.core import domain_classifier as dc

    Xs = samples(sizes=sizes, d=5, seed=len(sizes))
    p, D = len(Xs), 5
    if len(sizes) == 8:  # the Hessian's sample is a strict subset of the rows here
        assert dc.hessian_rows(sum(sizes), D, p) < sum(sizes)
    model = train_domain_classifier(Xs, StandardFeatures(), ClassifierConfig(mu=1e-3), exact=True)
    assert model.info_["method"] == "newton" and model.info_["converged"]
    ref, info, Phis = _lbfgs_exact(Xs, 1e-3)
    f_new, f_ref = objective(model.theta_, Phis, 1e-3), objective(ref, Phis, 1e-3)
    assert abs(f_new - f_ref) <= 1e-6 * abs(f_ref), (f_new, f_ref)
    assert abs(f_new - f_ref) <= 1e-12
    assert np.max(np.abs(model.theta_ - ref)) < 1e-5
    assert model.info_["grad_norm"] <= max(info["grad_norm"], 1e-9)
    assert model.info_["evaluations"] < info["n_iter"]
    X = np.vstack(Xs) + 0.3
    ref_model = dc.DomainClassifier(model.feature_map, ref, p, 1e-3)
    assert_allclose(model.predict_proba(X), ref_model.predict_proba(X), atol=1e-7)


def test_newton_hands_over_to_lbfgs_where_it_stalls(monkeypatch):
    """A Newton run cut short (one step allowed) finishes with L-BFGS from its last iterate: the
    same optimum."""
    from msa_fed.core import domain_classifier as dc

    Xs = samples(sizes=(300, 520, 410, 260), d=5, seed=2)
    monkeypatch.setattr(dc, "NEWTON_MAX_ITER", 1)
    model = train_domain_classifier(Xs, StandardFeatures(), ClassifierConfig(mu=1e-3), exact=True)
    assert model.info_["method"] == "newton, then L-BFGS" and model.info_["newton_iter"] == 1
    ref, _, Phis = _lbfgs_exact(Xs, 1e-3)
    assert abs(objective(model.theta_, Phis, 1e-3) - objective(ref, Phis, 1e-3)) <= 1e-12
    assert model.info_["converged"]


def test_newton_only_where_its_hessian_is_cheap():
    from msa_fed.core.domain_classifier import newton_pays

    assert newton_pays(128_000, 5, 64)  # the benchmark's p = 64 fit
    assert newton_pays(8_000, 5, 4)
    assert not newton_pays(100_000, 100, 8)  # many features: the Hessian is 808 x 808


def test_a_fit_with_the_newton_classifier_gives_the_lbfgs_fit_s_z_and_predictions(monkeypatch):
    """fit_dmsa (local runtime) with the Newton-trained classifier against the same fit with the
    L-BFGS reference trainer: the same z and predictions to tight tolerances."""
    from sklearn.linear_model import LogisticRegression as LR

    from msa_fed import SiteData, fit_dmsa
    from msa_fed.core import domain_classifier as dc

    rng = np.random.default_rng(7)
    sites = []
    for k in range(4):
        mean = rng.normal(size=3) * 1.5
        X = rng.normal(size=(400, 3)) + mean
        y = (X @ rng.normal(size=3) > mean.sum() * 0.3).astype(int)
        U = rng.normal(size=(500, 3)) + mean
        sites.append(SiteData(f"s{k}", X, y, U, LR().fit(X, y)))
    new = fit_dmsa(sites)
    assert new.domain_model.info_["method"] == "newton"
    monkeypatch.setattr(dc, "newton_pays", lambda *a: False)
    ref = fit_dmsa(sites)
    assert "method" not in ref.domain_model.info_
    assert np.max(np.abs(new.domain_model.theta_ - ref.domain_model.theta_)) < 1e-5
    assert_allclose(new.z, ref.z, atol=1e-6)
    X = rng.normal(size=(300, 3)) * 2
    assert_allclose(new.predict_proba(X), ref.predict_proba(X), atol=1e-6)
