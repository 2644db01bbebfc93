"""docs/OPERATIONS.md is in step with the code: the policy keys' table is the one generated from
where they are declared, and every operator command is documented."""

from __future__ import annotations

import argparse

from ops_helpers import REPO

from msa_fed.cli import build_parser
from msa_fed.privacy import policy as P
from msa_fed.privacy.policy_doc import reference_table, replace_in

DOC = REPO / "docs" / "OPERATIONS.md"


def test_the_policy_keys_table_is_the_generated_one():
    text = DOC.read_text()
    assert replace_in(text) == text, "run: python -m msa_fed.privacy.policy_doc --write docs/OPERATIONS.md"
    table = reference_table()
    for section, keys in P.SECTIONS.items():
        for key in keys:
            assert f"| `[{section}] {key}` |" in table


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
    assert "| `[limits] new_floor` | `0.5` | may raise | a new floor |" in reference_table()


def test_a_policy_key_without_a_description_cannot_be_generated(monkeypatch):
    import pytest

    _with_new_key(monkeypatch, "")
    with pytest.raises(ValueError, match=r"\[limits\] new_floor"):
        reference_table()


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
