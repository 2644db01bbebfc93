"""A small CNN for 16x16 digits, its predictor wrapper and the hidden-layer feature map.

The digits experiment trains one :class:`DigitCNN` per domain (and one on all
domains for the ``joint`` baseline) on CPU.  :class:`CNNPredictor` turns a trained
network into a frozen predictor over flattened images (``predict_proba`` +
``classes_``), which is what ``SiteData`` expects, and :class:`HiddenFeatures` is
the domain classifier's feature map: the concatenated last hidden layers of the
domain CNNs (as in the paper), standardised.

Trained weights are cached under :func:`msa_fed.experiments.data.cache_dir` (outside
the repository), keyed by a caller-supplied key that includes the seed and a hash
of this file, saved with ``torch.save(state_dict)`` and loaded with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.base import BaseEstimator, TransformerMixin
from torch import nn

from msa_fed.experiments.data import DIGIT_SIZE, cache_dir

N_CLASSES = 10


@dataclass(frozen=True)
class CNNConfig:
    hidden: int = 128  # width of the last hidden layer (the domain-classifier features)
    epochs: int = 12  # enough for the per-domain training sets (0.7k to 6k images) to converge
    batch_size: int = 64  # small batches: a few hundred optimiser steps even for optdigits
    lr: float = 1e-3  # Adam default
    weight_decay: float = 1e-4  # light L2 so the softmax scores stay calibrated enough for the loss
    augment: bool = True  # random +-1 pixel shifts; cheap and helps the small domains


class DigitCNN(nn.Module):
    """conv(1->32) pool conv(32->64) pool fc(1024->hidden) fc(hidden->10); input (n, 1, 16, 16)."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = DIGIT_SIZE // 4
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64 * side * side, hidden), nn.ReLU(), nn.Dropout(0.3))
        self.out = nn.Linear(hidden, N_CLASSES)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Last hidden layer, shape (n, hidden)."""
        return self.fc(self.conv(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x))


def _as_images(X) -> torch.Tensor:
    X = np.asarray(X, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(X.reshape(-1, 1, DIGIT_SIZE, DIGIT_SIZE)))


def _shift(xb: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift every image of the batch by one random offset in {-1, 0, 1}^2 (zero fill)."""
    dy, dx = (int(v) - 1 for v in torch.randint(0, 3, (2,), generator=gen))
    out = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
    if dy:
        out[:, :, 0 if dy > 0 else -1, :] = 0
    if dx:
        out[:, :, :, 0 if dx > 0 else -1] = 0
    return out


def train_cnn(
    X: np.ndarray, y: np.ndarray, *, seed: int, config: CNNConfig = CNNConfig(), sample_weight: np.ndarray | None = None
) -> DigitCNN:
    """Train a DigitCNN with Adam on (n, 16, 16) or (n, 256) images; returns it in eval mode."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = DigitCNN(config.hidden)
    xs, ys = _as_images(X), torch.as_tensor(np.asarray(y), dtype=torch.long)
    ws = torch.ones(len(ys)) if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    model.train()
    for _ in range(config.epochs):
        perm = torch.randperm(len(ys), generator=gen)
        for start in range(0, len(ys), config.batch_size):
            idx = perm[start : start + config.batch_size]
            xb = _shift(xs[idx], gen) if config.augment else xs[idx]
            loss = (loss_fn(model(xb), ys[idx]) * ws[idx]).sum() / ws[idx].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def code_version() -> str:
    """Short hash of this file: a change to the network or its training invalidates the cache."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def train_cached(
    key: str,
    X: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    config: CNNConfig = CNNConfig(),
    sample_weight=None,
    use_cache: bool = True,
) -> DigitCNN:
    """``train_cnn`` with the weights cached under ``cache_dir()/digits``.

    ``key`` must identify the training data (domain, split, seed); the file name adds the
    config and :func:`code_version`, so a stale cache is never read.
    """
    cfg = hashlib.sha256(repr(sorted(asdict(config).items())).encode()).hexdigest()[:8]
    path = cache_dir() / "digits" / f"{key}-seed{seed}-{cfg}-{code_version()}.pt"
    if use_cache and path.is_file():
        model = DigitCNN(config.hidden)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    model = train_cnn(X, y, seed=seed, config=config, sample_weight=sample_weight)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(path)
    return model


class CNNPredictor:
    """A trained DigitCNN as a frozen predictor over flattened images X of shape (n, 256)."""

    classes_ = np.arange(N_CLASSES)

    def __init__(self, model: DigitCNN, batch_size: int = 2048):
        self.model = model.eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        """Softmax scores, shape (n, 10), rows summing to 1 (float64)."""
        xs = _as_images(X)
        out = [
            torch.softmax(self.model(xs[i : i + self.batch_size]).double(), dim=1)
            for i in range(0, len(xs), self.batch_size)
        ]
        return torch.cat(out).numpy() if out else np.zeros((0, N_CLASSES))

    def predict(self, X) -> np.ndarray:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]


class HiddenFeatures(BaseEstimator, TransformerMixin):
    """Feature map images -> standardised concatenation of the CNNs' last hidden layers.

    Parameters
    ----------
    models : list of trained DigitCNN (one per domain).

    ``transform(X)`` maps X of shape (n, 256) to shape (n, sum of hidden widths).
    """

    def __init__(self, models=None):
        self.models = models

    @torch.no_grad()
    def _raw(self, X) -> np.ndarray:
        xs = _as_images(X)
        parts = []
        for m in self.models:
            m.eval()
            parts.append(torch.cat([m.hidden(xs[i : i + 4096]) for i in range(0, len(xs), 4096)]))
        return torch.cat(parts, dim=1).double().numpy()

    def fit(self, X, y=None, sample_weight=None):
        H = self._raw(X)
        self.mean_ = H.mean(axis=0)
        self.scale_ = H.std(axis=0)
        self.scale_[self.scale_ < 1e-8] = 1.0
        self.n_features_out_ = H.shape[1]
        return self

    def transform(self, X) -> np.ndarray:
        return (self._raw(X) - self.mean_) / self.scale_
