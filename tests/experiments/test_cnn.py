"""The digits CNN, its predictor wrapper, the hidden-layer feature map and the weight cache."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from sklearn.base import clone

from msa_fed.experiments import cnn


def _toy(n=300, seed=0):
    """Two easily told-apart classes of 16x16 images: a bright left half or right half."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    X = rng.random((n, 16, 16)).astype(np.float32) * 0.2
    X[y == 0, :, :8] += 0.7
    X[y == 1, :, 8:] += 0.7
    return X, y


FAST = cnn.CNNConfig(hidden=16, epochs=3, batch_size=32)


def test_trained_cnn_learns_and_predictor_contract():
    X, y = _toy()
    model = cnn.train_cnn(X, y, seed=0, config=FAST)
    h = cnn.CNNPredictor(model)
    Xt, yt = _toy(200, seed=1)
    P = h.predict_proba(Xt.reshape(-1, 256))
    assert P.shape == (200, 10) and P.dtype == np.float64
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
    assert np.mean(h.predict(Xt.reshape(-1, 256)) == yt) > 0.95
    np.testing.assert_array_equal(h.classes_, np.arange(10))
    # flattened and image-shaped inputs give the same scores
    np.testing.assert_allclose(h.predict_proba(Xt), P)


def test_training_is_deterministic_given_the_seed():
    X, y = _toy(128)
    a = cnn.train_cnn(X, y, seed=3, config=FAST)
    b = cnn.train_cnn(X, y, seed=3, config=FAST)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb)


def test_cache_round_trip_outside_the_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_FED_CACHE", str(tmp_path))
    X, y = _toy(128)
    first = cnn.train_cached("toy", X, y, seed=1, config=FAST)
    files = list((tmp_path / "digits").glob("toy-seed1-*.pt"))
    assert len(files) == 1 and cnn.code_version() in files[0].name

    def boom(*a, **k):
        raise AssertionError("a cached model must not be retrained")

    monkeypatch.setattr(cnn, "train_cnn", boom)
    second = cnn.train_cached("toy", X, y, seed=1, config=FAST)
    Xt = _toy(50, seed=2)[0]
    np.testing.assert_allclose(cnn.CNNPredictor(first).predict_proba(Xt), cnn.CNNPredictor(second).predict_proba(Xt))
    # the weights file is a plain state_dict that loads with weights_only=True
    state = torch.load(files[0], weights_only=True)
    assert set(state) == set(first.state_dict())
    with pytest.raises(AssertionError, match="must not be retrained"):
        cnn.train_cached("toy", X, y, seed=2, config=FAST)  # another seed is another model


def test_hidden_features_concatenate_and_standardise():
    X, y = _toy(200)
    models = [cnn.train_cnn(X, y, seed=s, config=FAST) for s in (0, 1)]
    fmap = cnn.HiddenFeatures(models).fit(X.reshape(-1, 256))
    H = fmap.transform(X.reshape(-1, 256))
    assert H.shape == (200, 2 * FAST.hidden)
    live = H.std(axis=0) > 0
    np.testing.assert_allclose(H.mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(H.std(axis=0)[live], 1.0, rtol=1e-9)
    # raw features of the first block are the first network's last hidden layer
    with torch.no_grad():
        raw0 = models[0].hidden(torch.from_numpy(X[:, None])).double().numpy()
    np.testing.assert_allclose(
        H[:, : FAST.hidden] * fmap.scale_[: FAST.hidden] + fmap.mean_[: FAST.hidden], raw0, rtol=1e-5, atol=1e-5
    )
    # scikit-learn can clone the unfitted map (fit_dmsa clones custom feature maps)
    fresh = clone(fmap)
    assert not hasattr(fresh, "mean_") and len(fresh.models) == 2


def test_the_digits_experiments_frozen_wrappers_compute_an_input_once(monkeypatch):
    """The digits experiment's predictor and feature map give what the plain ones give, bit for
    bit; an input they saw is not passed through the network again (unless its weights or mode
    changed), and writing to an answer changes no later one."""
    from msa_fed.experiments import digits

    monkeypatch.setattr(digits, "_MEMO", type(digits._MEMO)())
    X, y = _toy(64)
    models = [cnn.train_cnn(X, y, seed=s, config=replace(FAST, epochs=1)) for s in (0, 1)]
    Xt = _toy(50, seed=2)[0].reshape(-1, 256)
    passes: list[int] = []
    forward, hidden = cnn.DigitCNN.forward, cnn.DigitCNN.hidden
    monkeypatch.setattr(cnn.DigitCNN, "forward", lambda self, x: passes.append(len(x)) or forward(self, x))

    plain, frozen = cnn.CNNPredictor(models[0]), digits.FrozenCNNPredictor(models[0])
    expected = plain.predict_proba(Xt)
    del passes[:]
    first = frozen.predict_proba(Xt)
    np.testing.assert_array_equal(first, expected)
    assert passes == [50]
    first[:] = 0.0  # the caller's copy
    np.testing.assert_array_equal(digits.FrozenCNNPredictor(models[0]).predict_proba(Xt.copy()), expected)
    assert passes == [50]  # another wrapper, an equal input: from the memo
    np.testing.assert_array_equal(
        digits.FrozenCNNPredictor(models[1]).predict_proba(Xt), cnn.CNNPredictor(models[1]).predict_proba(Xt)
    )
    assert len(passes) == 3  # another network: computed (the plain one's pass included)
    Xt2 = Xt.copy()
    Xt2[0, 0] += 0.5
    np.testing.assert_array_equal(frozen.predict_proba(Xt2), plain.predict_proba(Xt2))
    assert len(passes) == 5  # another input: computed
    with torch.no_grad():
        models[0].out.bias[0] += 1.0  # other weights: computed again, not the old answer
    changed = frozen.predict_proba(Xt)
    np.testing.assert_array_equal(changed, plain.predict_proba(Xt))
    assert len(passes) == 7 and not np.array_equal(changed, expected)
    models[0].train()  # dropout on: another mode, never the eval answers
    assert not np.array_equal(frozen.predict_proba(Xt), expected)
    models[0].eval()

    monkeypatch.setattr(cnn.DigitCNN, "hidden", lambda self, x: passes.append(len(x)) or hidden(self, x))
    del passes[:]
    fmap = digits.FrozenHiddenFeatures(models).fit(Xt)
    np.testing.assert_array_equal(fmap.transform(Xt), cnn.HiddenFeatures(models).fit(Xt).transform(Xt))
    assert passes == [50] * 6  # the frozen map's fit (two networks), the plain map's fit and transform
    np.testing.assert_array_equal(clone(fmap).fit(Xt).transform(Xt), fmap.transform(Xt))
    assert len(passes) == 6  # a clone holds copies of the networks: the same weights, from the memo
