"""Loaders for the paper's real data sets, read from the offline data directory.

The data directory is ``$MSA_FED_DATA`` when set, else ``../shared/data``
relative to the repository root (see ``shared/data/README.md`` for what each
folder holds).  This module is the one place that reads those environment
variables.  When the directory has a ``SHA256SUMS`` file (``sha256sum`` format,
paths relative to the directory; the shared one has), every file is checked
against it before it is read.  A missing, unlisted or altered file raises
:class:`~msa_fed.errors.ConfigError` naming the file, never a traceback from
deep inside numpy.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from msa_fed.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
#: the checksum file of a data directory
SUMS_FILE = "SHA256SUMS"

#: Image side every digits domain is brought to.
DIGIT_SIZE = 16

ADULT_COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
)
#: The categorical columns used as features (the paper's "categorical features").
ADULT_CATEGORICAL = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "native-country",
)
SENTIMENT_DOMAINS = ("kitchen", "dvd", "books", "electronics")


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """The data directory: ``path``, else ``$MSA_FED_DATA``, else ``<repo>/../shared/data``."""
    if path is not None:
        return Path(path)
    env = os.environ.get("MSA_FED_DATA")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data"


def cache_dir() -> Path:
    """Where trained experiment models are cached: ``$MSA_FED_CACHE``, else ``~/.cache/msa_fed``.

    Never inside the repository, so nothing cached is ever committed.
    """
    env = os.environ.get("MSA_FED_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "msa_fed"


def _read_sums(root: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` from ``root / SHA256SUMS``; None when there is no such file."""
    sums_path = root / SUMS_FILE
    if not sums_path.is_file():
        return None
    sums = {}
    for n, line in enumerate(sums_path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line.strip())
        if m is None:
            raise ConfigError(f"{sums_path}:{n}: not a sha256sum line")
        sums[m.group(2).removeprefix("./")] = m.group(1).lower()
    return sums


#: sha256 of files already checked, by (path, size, mtime): each file is hashed once per process
_CHECKED: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CHECKED:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        _CHECKED[key] = h.hexdigest()
    return _CHECKED[key]


def _require(path: Path, root: Path) -> Path:
    """``path`` (a file under the data directory ``root``) if it exists and matches ``root``'s
    SHA256SUMS; a ConfigError naming it otherwise."""
    if not path.is_file():
        raise ConfigError(
            f"data file not found: {path} (set MSA_FED_DATA to the directory described in shared/data/README.md)"
        )
    sums = _read_sums(root)
    if sums is not None:
        rel = path.relative_to(root).as_posix()
        if rel not in sums:
            raise ConfigError(f"data file {path} is not listed in {root / SUMS_FILE}")
        actual = _sha256(path)
        if actual != sums[rel]:
            raise ConfigError(
                f"data file {path} does not match its sha256 in {root / SUMS_FILE} (expected {sums[rel]}, got {actual})"
            )
    return path


# --------------------------------------------------------------------------- Adult
@dataclass(frozen=True)
class AdultData:
    """UCI Adult as integer-coded categorical features.

    X_train : ndarray of shape (32561, 8), float64 category codes (column order
        ``ADULT_CATEGORICAL``; each column's codes index ``categories[j]``).
    y_train : ndarray of shape (32561,), 1 when income > 50K else 0.
    doc_train : ndarray of shape (32561,), bool, education == Doctorate.
    X_test, y_test, doc_test : the same for ``adult.test`` (16281 rows).
    categories : tuple of tuples of str, the category names of each column.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    doc_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    doc_test: np.ndarray
    categories: tuple


def _read_adult_rows(path: Path, root: Path) -> list[list[str]]:
    rows = []
    with open(_require(path, root), encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("|"):
                continue
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != len(ADULT_COLUMNS):
                raise ConfigError(f"{path}: expected {len(ADULT_COLUMNS)} fields, got {len(fields)}")
            rows.append(fields)
    return rows


def load_adult(path: str | os.PathLike | None = None) -> AdultData:
    """Read ``adult/adult.data`` and ``adult/adult.test`` (labels of the test file end in '.')."""
    top = data_dir(path)
    train = _read_adult_rows(top / "adult" / "adult.data", top)
    test = _read_adult_rows(top / "adult" / "adult.test", top)
    cols = [ADULT_COLUMNS.index(c) for c in ADULT_CATEGORICAL]
    categories = tuple(tuple(sorted({r[j] for r in train} | {r[j] for r in test})) for j in cols)
    index = [{c: i for i, c in enumerate(cats)} for cats in categories]
    edu = ADULT_COLUMNS.index("education")

    def encode(rows):
        X = np.array([[index[a][r[j]] for a, j in enumerate(cols)] for r in rows], dtype=np.float64)
        y = np.array([r[-1].rstrip(".") == ">50K" for r in rows], dtype=np.int64)
        doc = np.array([r[edu] == "Doctorate" for r in rows], dtype=bool)
        return X, y, doc

    Xtr, ytr, dtr = encode(train)
    Xte, yte, dte = encode(test)
    return AdultData(Xtr, ytr, dtr, Xte, yte, dte, categories)


# ------------------------------------------------------------------------ Sentiment
_REVIEW = re.compile(r"<review>(.*?)</review>", re.S)
_RATING = re.compile(r"<rating>\s*([0-9.]+)\s*</rating>", re.S)
_TEXT = re.compile(r"<review_text>(.*?)</review_text>", re.S)


def load_sentiment(path: str | os.PathLike | None = None) -> dict[str, tuple[list[str], np.ndarray]]:
    """Read the labelled reviews of ``sentiment_acl``.

    Returns ``{domain: (texts, ratings)}`` for the domains of ``SENTIMENT_DOMAINS``,
    each with 2000 reviews (1000 positive then 1000 negative); ``ratings`` is a
    float64 array of shape (2000,) with values in {1, 2, 4, 5}.  The files are
    pseudo-XML with bare ``&`` and stray bytes, so they are parsed with a tolerant regex.
    """
    top = data_dir(path)
    out = {}
    for dom in SENTIMENT_DOMAINS:
        texts, ratings = [], []
        for part in ("positive", "negative"):
            f = _require(top / "sentiment_acl" / dom / f"{part}.review.gz", top)
            with gzip.open(f, "rb") as fh:
                raw = fh.read().decode("utf-8", errors="replace")
            for block in _REVIEW.findall(raw):
                r, t = _RATING.search(block), _TEXT.search(block)
                if r is None or t is None:
                    raise ConfigError(f"{f}: a review without <rating> or <review_text>")
                ratings.append(float(r.group(1)))
                texts.append(t.group(1).strip())
        out[dom] = (texts, np.asarray(ratings, dtype=np.float64))
    return out


# --------------------------------------------------------------------------- Digits
@dataclass(frozen=True)
class DigitsDomain:
    """One digits domain at ``DIGIT_SIZE`` x ``DIGIT_SIZE``, grey values in [0, 1].

    X : ndarray of shape (n, 16, 16), float32.  y : ndarray of shape (n,), int64.
    test_start : index where the domain's designated test rows begin (``None`` when
        the source has no fixed split and the experiment draws one).
    """

    X: np.ndarray
    y: np.ndarray
    test_start: int | None = None


def _resize(images: np.ndarray, size: int = DIGIT_SIZE) -> np.ndarray:
    """Bilinear resize (antialiased when shrinking) of (n, h, w) images to (n, size, size)."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))[:, None]
    if t.shape[-1] == size:
        return t[:, 0].numpy()
    out = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False, antialias=t.shape[-1] > size)
    return out[:, 0].clamp_(0.0, 1.0).numpy()


def _read_idx(path: Path, root: Path) -> np.ndarray:
    with gzip.open(_require(path, root), "rb") as fh:
        raw = fh.read()
    (magic,) = struct.unpack(">I", raw[:4])
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:  # unsigned byte data
        raise ConfigError(f"{path}: not an idx file of unsigned bytes (magic {magic:#x})")
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_digits_domains(path: str | os.PathLike | None = None) -> dict[str, DigitsDomain]:
    """The three digits domains, all resized to 16x16 in [0, 1].

    - ``mnist``: the MNIST test set (``digits/mnist_t10k``, 10000 images, 28x28
      downsampled); no fixed split, the experiment draws one.
    - ``usps``: ``digits/usps.npz``, 7291 train then 2007 test (native 16x16).
    - ``optdigits``: scikit-learn's ``load_digits`` (1797 images, 8x8 upsampled),
      standing in for SVHN, which is not available offline; no fixed split.
    """
    from sklearn.datasets import load_digits

    top = data_dir(path)
    root = top / "digits"
    mx = _read_idx(root / "mnist_t10k" / "t10k-images-idx3-ubyte.gz", top).astype(np.float32) / 255.0
    my = _read_idx(root / "mnist_t10k" / "t10k-labels-idx1-ubyte.gz", top).astype(np.int64)
    with np.load(_require(root / "usps.npz", top), allow_pickle=False) as z:
        ux = np.concatenate([z["train_data"], z["test_data"]]).astype(np.float32).reshape(-1, 16, 16)
        uy = np.concatenate([z["train_target"], z["test_target"]]).astype(np.int64)
        n_usps_train = len(z["train_target"])
    od = load_digits()
    ox = (od.images / 16.0).astype(np.float32)
    return {
        "mnist": DigitsDomain(_resize(mx), my),
        "usps": DigitsDomain(_resize(ux), uy, test_start=n_usps_train),
        "optdigits": DigitsDomain(_resize(ox), od.target.astype(np.int64)),
    }
