"""The data loaders read the offline data sets with the row counts of shared/data/README.md."""

import numpy as np
import pytest

from msa_fed.cli import main
from msa_fed.errors import ConfigError
from msa_fed.experiments import data


def test_adult_row_counts_and_domains():
    a = data.load_adult()
    assert a.X_train.shape == (32561, len(data.ADULT_CATEGORICAL))
    assert a.X_test.shape == (16281, len(data.ADULT_CATEGORICAL))
    assert a.doc_train.sum() == 413 and a.doc_test.sum() == 181
    # codes index the category lists; the Doc domain is exactly education == Doctorate
    edu = data.ADULT_CATEGORICAL.index("education")
    doc_code = a.categories[edu].index("Doctorate")
    assert np.array_equal(a.doc_train, a.X_train[:, edu] == doc_code)
    for j, cats in enumerate(a.categories):
        assert a.X_train[:, j].max() < len(cats) and a.X_train[:, j].min() >= 0
    # labels: about 24% earn >50K in both files (test labels end with '.' in the file)
    assert 0.2 < a.y_train.mean() < 0.3 and 0.2 < a.y_test.mean() < 0.3
    assert set(np.unique(a.y_test)) == {0, 1}


def test_sentiment_reviews_and_ratings():
    s = data.load_sentiment()
    assert set(s) == set(data.SENTIMENT_DOMAINS)
    for texts, ratings in s.values():
        assert len(texts) == len(ratings) == 2000
        assert set(np.unique(ratings)) == {1.0, 2.0, 4.0, 5.0}
        # 1000 positive reviews (4 or 5 stars) first, then 1000 negative ones
        assert np.all(ratings[:1000] >= 4) and np.all(ratings[1000:] <= 2)
        assert all(isinstance(t, str) and t for t in texts)


def test_digits_domains_shapes_and_counts():
    d = data.load_digits_domains()
    counts = {"mnist": 10000, "usps": 7291 + 2007, "optdigits": 1797}
    for name, n in counts.items():
        dom = d[name]
        assert dom.X.shape == (n, 16, 16) and dom.X.dtype == np.float32
        assert dom.X.min() >= 0.0 and dom.X.max() <= 1.0
        assert np.array_equal(np.unique(dom.y), np.arange(10))
    assert d["usps"].test_start == 7291
    # every domain has ink bright on a dark background (none is inverted): corners are dark
    for dom in d.values():
        corners = dom.X[:, [0, 0, -1, -1], [0, -1, 0, -1]]
        assert corners.mean() < 0.05 and dom.X.max(axis=(1, 2)).min() > 0.4


def test_missing_data_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_FED_DATA", str(tmp_path))
    with pytest.raises(ConfigError, match=r"adult\.data"):
        data.load_adult()
    (tmp_path / "sentiment_acl").mkdir()
    with pytest.raises(ConfigError, match=r"kitchen/positive\.review\.gz"):
        data.load_sentiment()


def test_cli_reports_missing_data_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MSA_FED_DATA", str(tmp_path))
    rc = main(["experiment", "adult", "--quick"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: data file not found:") and "adult.data" in err
    assert "Traceback" not in err


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("MSA_FED_DATA", raising=False)
    assert data.data_dir() == data.REPO_ROOT.parent / "shared" / "data"
    monkeypatch.setenv("MSA_FED_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    assert data.data_dir("/x/y") == data.data_dir("/x/y")
