"""One declaration per fit option: the API's keywords, the estimators' parameters, the job
file's keys and the option table in docs/OPTIONS.md are made from the configuration tree.
A test adds an option to the tree and follows it to each of them."""

from __future__ import annotations

import inspect
from dataclasses import make_dataclass

import pytest
from sklearn.base import clone

import msa_fed
from msa_fed.core.config import SolverConfig
from msa_fed.core.options import Integer, Number, option
from msa_fed.estimators import DMSA, GMSA, _init
from msa_fed.jobs.config import SCHEMA, job_schema
from msa_fed.runtime import config as tree
from msa_fed.runtime.config import (
    OPTIONS_DOC,
    OPTIONS_DOC_MARK,
    FitConfig,
    api_keywords,
    api_signature,
    fit_options,
    from_keywords,
    options_markdown,
)


@pytest.fixture
def with_new_options(monkeypatch):
    """The tree with two options more, each one declaration: a fit option in the job's [run]
    table, and a solver option (its own sub-configuration's table, inside solver_options)."""
    fit_plus = make_dataclass(
        "FitPlus",
        [("dummy_rate", float, option(0.5, "a dummy rate", Number(0.0, open_low=True), job="run"))],
        bases=(FitConfig,),
        frozen=True,
    )
    solver_plus = make_dataclass(
        "SolverPlus",
        [("patience", int, option(3, "a dummy patience", Integer(1)))],
        bases=(SolverConfig,),
        frozen=True,
    )
    monkeypatch.setitem(tree.SUBTREES, "solver", solver_plus)
    return fit_plus


def test_a_new_option_reaches_the_api_the_estimators_the_job_file_and_the_docs(with_new_options):
    root = with_new_options
    # the API: a keyword with its default, checked, into the tree
    signature = api_signature("dmsa", ("sites",), root=root)
    assert signature.parameters["dummy_rate"].default == 0.5
    assert signature.parameters["dummy_rate"].kind is inspect.Parameter.KEYWORD_ONLY
    assert api_signature("gmsa", ("sites",), root=root).parameters["dummy_rate"].default == 0.5
    config = from_keywords("dmsa", {"dummy_rate": 2, "solver_options": {"patience": 7}}, root=root)
    assert config.dummy_rate == 2.0 and config.solver.patience == 7
    assert from_keywords("gmsa", {}, root=root).dummy_rate == 0.5
    with pytest.raises(ValueError, match="dummy_rate must be a number > 0; got 0"):
        from_keywords("dmsa", {"dummy_rate": 0}, root=root)
    with pytest.raises(TypeError, match="solver_options: patience must be an integer >= 1; got 'x'"):
        from_keywords("dmsa", {"solver_options": {"patience": "x"}}, root=root)
    # the estimators: a parameter scikit-learn sees, stored by __init__ and kept by clone
    est_cls = type("DMSAPlus", (DMSA,), {"__init__": _init("dmsa", root=root)})
    est = est_cls(dummy_rate=0.25)
    assert est.get_params()["dummy_rate"] == 0.25 and est_cls().get_params()["dummy_rate"] == 0.5
    assert clone(est).dummy_rate == 0.25
    # the job file: a key of its table, the solver's in [solver]
    schema = job_schema(root)
    assert schema["run"]["dummy_rate"] == ("fit", "dummy_rate")
    assert schema["solver"]["patience"] == ("solver", "patience")
    # the docs' table: a row each
    table = options_markdown(root)
    assert "| `dummy_rate` | `dummy_rate` | `[run] dummy_rate` | a number > 0 | `0.5` | a dummy rate |" in table
    assert "| `solver.patience` | `solver_options` key `patience` | `[solver] patience` | an integer >= 1 |" in table


def test_the_real_surfaces_are_the_trees():
    for method, fit, est in (("dmsa", msa_fed.fit_dmsa, DMSA), ("gmsa", msa_fed.fit_gmsa, GMSA)):
        keywords = api_keywords(method)
        params = inspect.signature(fit).parameters
        assert list(params)[:2] == ["sites", "task"] and list(params)[-2:] == ["recorder", "solver_callback"]
        assert {k: p.default for k, p in params.items() if k in keywords} == keywords
        assert set(params) == set(keywords) | {"sites", "recorder", "solver_callback"}
        assert est().get_params() == keywords
    assert api_keywords("gmsa")["features"] is None and api_keywords("dmsa")["features"] == "standard"
    # the job-only options are not keywords of the API, and every job key of the fit is declared
    assert {"method", "topology", "site_timeout_s"}.isdisjoint(api_keywords("dmsa"))
    declared = {o.job for o in fit_options() if o.job}
    fit_keys = {(t, k) for t, keys in SCHEMA.items() for k, (target, _) in keys.items() if target != "job"}
    assert fit_keys == declared and ("model", "mu") in declared and ("run", "ray_address") in declared


def test_each_default_is_written_once():
    from msa_fed.core.config import MIN_POINTS

    assert FitConfig().min_points == MIN_POINTS == api_keywords("dmsa")["min_points"]
    from msa_fed.core.config import ClassifierConfig

    assert inspect.signature(msa_fed.fit_dmsa).parameters["mu"].default == ClassifierConfig().mu
    assert inspect.signature(DMSA).parameters["eta"].default == FitConfig().eta


def test_an_unknown_keyword_is_named_as_python_would():
    with pytest.raises(TypeError, match=r"^fit_dmsa\(\) got an unexpected keyword argument 'speed'$"):
        msa_fed.fit_dmsa([], speed=2)
    with pytest.raises(TypeError, match=r"^DMSA\(\) got an unexpected keyword argument 'speed'$"):
        DMSA(speed=2)


def test_the_options_doc_is_the_trees_table():
    text = OPTIONS_DOC.read_text()
    assert text[text.index(OPTIONS_DOC_MARK) + len(OPTIONS_DOC_MARK) :] == options_markdown(), (
        "docs/OPTIONS.md differs from the tree: "
        'python -c "from msa_fed.runtime.config import write_options_doc; write_options_doc()"'
    )
