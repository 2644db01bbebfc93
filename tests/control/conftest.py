"""Fixtures of the control-plane tests: both stores, a registry, a real server on port 0."""

from __future__ import annotations

import pytest
from registry_fixtures import connect, registry, server, store  # noqa: F401 - the shared fixtures


@pytest.fixture
def tokens(registry):  # noqa: F811 - the shared fixture, requested
    """Tokens of sites 'a' and 'b' and of the admin."""
    return {
        "a": registry.issue_token("site", "a"),
        "b": registry.issue_token("site", "b"),
        "admin": registry.issue_token("admin", "admin"),
    }


@pytest.fixture
def run(capsys, monkeypatch):
    """``run(*argv)`` -> (exit status, stdout, stderr) of ``msa-fed`` in-process, with the control
    plane's commands alone (isolated from the other subsystems' commands and their import time)."""
    import msa_fed.cli as top_cli

    monkeypatch.setattr(top_cli, "COMMANDS", {"msa_fed.control.cli": top_cli.COMMANDS["msa_fed.control.cli"]})

    def invoke(*argv):
        rc = top_cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return invoke
