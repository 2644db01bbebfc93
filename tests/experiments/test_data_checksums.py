"""The data loaders check every file against the data directory's SHA256SUMS before reading it
(a small Adult-format directory made here; the shared data sets are not needed)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from msa_fed.cli import main
from msa_fed.errors import ConfigError
from msa_fed.experiments import data

ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, "
    "2174, 0, 40, United-States, <=50K",
    "50, Self-emp-not-inc, 83311, Doctorate, 16, Married-civ-spouse, Exec-managerial, Husband, White, "
    "Male, 0, 0, 13, United-States, >50K",
]


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    """An Adult directory with a SHA256SUMS that lists both files, as ``sha256sum`` writes it."""
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_text("\n".join(ROWS) + "\n")
    (tmp_path / "adult" / "adult.test").write_text("|1x3 Cross validator\n" + ROWS[1] + ".\n")
    write_sums(tmp_path, ["adult/adult.data", "adult/adult.test"])
    monkeypatch.setenv("MSA_FED_DATA", str(tmp_path))
    return tmp_path


def write_sums(root, rels):
    lines = [f"{hashlib.sha256((root / r).read_bytes()).hexdigest()}  ./{r}" for r in rels]
    (root / data.SUMS_FILE).write_text("\n".join(lines) + "\n")


def test_files_matching_their_sums_are_read(data_root):
    a = data.load_adult()
    assert a.X_train.shape == (2, len(data.ADULT_CATEGORICAL)) and a.X_test.shape == (1, len(data.ADULT_CATEGORICAL))
    assert a.y_train.tolist() == [0, 1] and a.y_test.tolist() == [1]
    assert a.doc_train.tolist() == [False, True]


def test_an_altered_file_is_refused_naming_it(data_root):
    data.load_adult()  # hashed once while intact
    f = data_root / "adult" / "adult.data"
    f.write_text(f.read_text().replace(">50K", "<=50K"))  # one label flipped
    with pytest.raises(ConfigError, match=r"adult\.data does not match its sha256 in .*SHA256SUMS"):
        data.load_adult()


def test_a_file_the_sums_do_not_list_is_refused(data_root):
    write_sums(data_root, ["adult/adult.data"])
    with pytest.raises(ConfigError, match=r"adult\.test is not listed in .*SHA256SUMS"):
        data.load_adult()


def test_a_malformed_sums_file_is_named(data_root):
    (data_root / data.SUMS_FILE).write_text("not a checksum line\n")
    with pytest.raises(ConfigError, match=r"SHA256SUMS:1: not a sha256sum line"):
        data.load_adult()


def test_a_directory_without_sums_is_read_unchecked(data_root):
    (data_root / data.SUMS_FILE).unlink()
    assert data.load_adult().y_train.tolist() == [0, 1]


def test_the_cli_reports_an_altered_file_in_one_line(data_root, capsys):
    f = data_root / "adult" / "adult.test"
    f.write_bytes(f.read_bytes() + b" ")
    rc = main(["experiment", "adult", "--quick"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: data file ") and "adult.test does not match its sha256" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_the_shared_sums_list_every_file_the_loaders_read():
    """The shared directory's SHA256SUMS covers the files of every loader (paths only: no data read)."""
    sums = data._read_sums(data.data_dir())
    assert sums is not None, f"no {data.SUMS_FILE} in {data.data_dir()}"
    needed = [
        "adult/adult.data",
        "adult/adult.test",
        "digits/usps.npz",
        "digits/mnist_t10k/t10k-images-idx3-ubyte.gz",
        "digits/mnist_t10k/t10k-labels-idx1-ubyte.gz",
    ]
    needed += [
        f"sentiment_acl/{d}/{part}.review.gz" for d in data.SENTIMENT_DOMAINS for part in ("positive", "negative")
    ]
    assert [n for n in needed if n not in sums] == []
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in sums.values())
    assert np.all([k == k.strip() and not k.startswith("./") for k in sums])
