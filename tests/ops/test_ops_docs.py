"""docs/OPERATIONS.md is in step with the code: the tables of the site's policy keys and site.toml's
keys are the ones generated from where the keys are declared (a new key is one declaration), and
every operator command is documented."""

from __future__ import annotations

import argparse

from ops_helpers import REPO

from msa_fed.cli import build_parser
from msa_fed.federation import config_doc
from msa_fed.federation.config_doc import policy_table, replace_in, site_table
from msa_fed.privacy import policy as P

DOC = REPO / "docs" / "OPERATIONS.md"


def test_the_key_tables_are_the_generated_ones():
    for doc in ("docs/OPERATIONS.md", "cluster/README.md"):
        text = (REPO / doc).read_text()
        assert replace_in(text, doc) == text, f"run: python -m msa_fed.federation.config_doc --write {doc}"
    text = DOC.read_text()
    for section, keys in P.SECTIONS.items():
        for key in keys:
            assert f"| `[{section}] {key}` |" in text
    assert (
        "| `allow_unsealed` | true or false | `false` | Serve unsealed jobs" in (REPO / "cluster/README.md").read_text()
    )


def _with_new_key(monkeypatch, doc):
    """SitePolicy with one more key declared (a floor in [limits] that a job may raise)."""
    from dataclasses import dataclass

    from msa_fed.core.options import Number, option

    @dataclass(frozen=True)
    class Wider(P.SitePolicy):
        new_floor: float = option(0.5, doc, Number(0), section="limits", job="raise")

    sections, rules = P.declared(Wider)
    for name, value in (("SitePolicy", Wider), ("SECTIONS", sections), ("JOB_RULES", rules)):
        monkeypatch.setattr(P, name, value)
    return Wider


def test_a_new_policy_key_is_one_declaration(monkeypatch):
    import pytest

    from msa_fed.errors import ConfigError

    wider = _with_new_key(monkeypatch, "a new floor")
    # the file's parsing and its checks
    assert P.policy_from_mapping({"limits": {"new_floor": 2}, "dp": {"enabled": True}}).new_floor == 2.0
    assert wider().new_floor == 0.5
    with pytest.raises(ConfigError, match=r"site policy: new_floor must be a number >= 0; got -1"):
        P.policy_from_mapping({"limits": {"new_floor": -1}})
    with pytest.raises(ConfigError, match=r"unknown key 'new_floor' in \[budget\]"):
        P.policy_from_mapping({"budget": {"new_floor": 1.0}})
    # what a job may do with it: raise it, never lower it
    assert P.tighten(wider(), {"new_floor": 0.9}).new_floor == 0.9
    assert P.tighten(wider(), {"new_floor": 0.1}).new_floor == 0.5
    # the docs' table
    assert "| `[limits] new_floor` | `0.5` | may raise | a new floor |" in policy_table()


def test_a_policy_key_without_a_description_cannot_be_generated(monkeypatch):
    import pytest

    _with_new_key(monkeypatch, "")
    with pytest.raises(ValueError, match=r"key\(s\) declared without a description: new_floor"):
        policy_table()


def test_a_new_site_toml_key_is_one_declaration(tmp_path, monkeypatch):
    """A key added to SiteConfig reaches site.toml's parsing, its error lines and the docs' table."""
    from dataclasses import dataclass

    import pytest

    from msa_fed.core.options import Integer, option
    from msa_fed.errors import ConfigError
    from msa_fed.federation.config import SiteConfig

    @dataclass(frozen=True)
    class Wider(SiteConfig):
        new_limit: int = option(3, "a new limit", Integer(1))
        new_file: str | None = option(None, "a new file", path=True)

    toml = tmp_path / "site.toml"
    base = 'name = "east"\nregistry = "127.0.0.1:1"\ninsecure = true\ntoken_file = "t"\ndata = "d"\npredictor = "p"\n'
    toml.write_text(base + 'audit_log = "a"\nnew_limit = 7\nnew_file = "x/y.txt"\n')
    config = Wider.from_toml(toml)
    assert (config.new_limit, config.new_file) == (7, str(tmp_path.resolve() / "x" / "y.txt"))
    toml.write_text(base + 'audit_log = "a"\n')
    assert Wider.from_toml(toml).new_limit == 3
    toml.write_text(base + 'audit_log = "a"\nnew_limit = 0\n')
    with pytest.raises(ConfigError, match=r"site config '.*site.toml': new_limit must be an integer >= 1; got 0"):
        Wider.from_toml(toml)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['new_limit'\]"):
        SiteConfig.from_toml(toml)
    monkeypatch.setattr(config_doc, "SiteConfig", Wider)
    table = site_table()
    assert "| `new_limit` | an integer >= 1 | `3` | a new limit |" in table
    assert "| `new_file` | path to a file | `unset` | a new file |" in table


def _leaf_commands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _leaf_commands(sub, (*prefix, name))
                else:
                    yield (*prefix, name)


def test_every_operator_command_is_documented():
    text = DOC.read_text()
    commands = [c for c in _leaf_commands(build_parser()) if c[0] != "experiment"]  # research, not operations
    assert len(commands) > 20
    missing = [" ".join(c) for c in commands if f"msa-fed {' '.join(c)}" not in text]
    assert missing == []
