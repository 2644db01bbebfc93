"""Labelled inputs never leave the site: every path that publishes or serves a sample from a
site's data refuses one that shares a row with its labelled inputs, with one line."""

from __future__ import annotations

import numpy as np
import pytest

from msa_fed.cli import main
from msa_fed.errors import ConfigError
from msa_fed.privacy.consortium import check_disjoint, shared_rows
from msa_fed.site.data import load_site_data
from msa_fed.site.worker import SiteWorker


def _data(tmp_path, overlap: int):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    Xu = rng.normal(size=(50, 3))
    Xu[:overlap] = X[5 : 5 + overlap]
    path = tmp_path / "data.npz"
    np.savez(path, X_labeled=X, y_labeled=np.arange(40) % 2, X_unlabeled=Xu)
    np.save(tmp_path / "sample.npy", Xu)
    return X, Xu, path


def test_rows_are_compared_in_their_published_form():
    X = np.array([[0.1, -0.0], [1.0, 2.0]])
    assert shared_rows(X, np.array([[0.1, 0.0]])) == 1  # -0.0 is 0.0
    assert shared_rows(X, np.array([[0.1 + 1e-12, 0.0]])) == 1  # equal as float32: published equal
    assert shared_rows(X, np.array([[0.1 + 1e-6, 0.0]])) == 0
    check_disjoint("a", X, np.array([[5.0, 5.0]]))
    with pytest.raises(ConfigError, match="^site 'a': the unlabelled sample shares rows with the labelled inputs"):
        check_disjoint("a", X, X[:1])


def test_a_site_data_file_with_a_published_labelled_row_is_refused(tmp_path):
    """The site's data file is what `site serve` and a Ray site read: both refuse it."""
    _X, _Xu, path = _data(tmp_path, overlap=1)
    with pytest.raises(ConfigError, match="shares rows with the labelled inputs") as err:
        load_site_data("east", path)
    assert "\n" not in str(err.value) and "1 row" not in str(err.value)  # no count leaves the site
    worker = SiteWorker("east", 0, data_path=path, predictors=[], task="classification")
    with pytest.raises(ConfigError, match="shares rows"):
        worker.info()
    _X, _Xu, ok = _data(tmp_path, overlap=0)
    assert load_site_data("east", ok)["X_unlabeled"].shape == (50, 3)


def test_site_publish_refuses_a_sample_holding_labelled_inputs(tmp_path, capsys):
    _X, _Xu, path = _data(tmp_path, overlap=2)
    argv = ["site", "publish", "--registry", "127.0.0.1:9", "--token", "t", "--insecure"]
    assert main(argv + ["--unlabeled", str(tmp_path / "sample.npy"), "--labeled", str(path)]) == 1
    err = capsys.readouterr().err
    assert "2 of the 50 rows of the sample are labelled inputs" in err and "--drop-shared" in err
    assert len(err.strip().splitlines()) == 1
    # a .npy of the labelled inputs works too
    np.save(tmp_path / "labelled.npy", np.load(path)["X_labeled"])
    assert main(argv + ["--unlabeled", str(tmp_path / "sample.npy"), "--labeled", str(tmp_path / "labelled.npy")]) == 1
    assert "are labelled inputs of this site" in capsys.readouterr().err
