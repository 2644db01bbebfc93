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


def test_a_policy_key_without_a_description_cannot_be_generated(monkeypatch):
    import pytest

    monkeypatch.setitem(P.SECTIONS, "budget", {**P.SECTIONS["budget"], "new_budget": "ledger"})
    with pytest.raises(ValueError, match=r"\[budget\] new_budget"):
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
