"""Every command that dials the registry takes the same connection flags, declared once
(``msa_fed.control.ops.cli.connection_options``), and reads them the same way."""

from __future__ import annotations

import argparse

import pytest

import msa_fed.cli as top_cli
from msa_fed.cli import build_parser

#: the flags of every connection: the address, the TLS files, the certificate's name, the timeout
COMMON = {"--registry", "--insecure", "--tls-ca", "--tls-cert", "--tls-key", "--server-name", "--timeout"}
TOKENS = ({"--admin-token-file"}, {"--token", "--token-file"})  # the admin's, a site's
#: commands with a --registry that dial nothing: the address they write into the kit's files
NOT_DIALING = {("consortium", "init")}


def _leaves(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*prefix, name))
    if prefix and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        yield prefix, parser


def _flags(parser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_every_command_taking_a_registry_takes_the_same_connection_flags():
    dialing = {cmd: _flags(p) for cmd, p in _leaves(build_parser()) if "--registry" in _flags(p)}
    dialing = {cmd: flags for cmd, flags in dialing.items() if cmd not in NOT_DIALING}
    assert ("run",) in dialing and ("site", "heartbeat") in dialing and ("model", "list") in dialing
    assert len(dialing) >= 20
    for cmd, flags in dialing.items():
        assert COMMON <= set(flags), (cmd, COMMON - set(flags))
        assert any(t <= set(flags) for t in TOKENS), cmd
        for flag in COMMON - {"--registry"}:  # one declaration: the same help and default everywhere
            reference = _flags(dict(_leaves(build_parser()))[("model", "list")])[flag]
            assert (flags[flag].help, flags[flag].default, flags[flag].type) == (
                reference.help,
                reference.default,
                reference.type,
            ), (cmd, flag)


@pytest.mark.parametrize("timeout", ["0", "inf", "nan"])
def test_a_bad_timeout_is_one_error_line_for_site_and_admin_commands(tmp_path, capsys, timeout):
    (tmp_path / "admin.token").write_text("mft1.admin.admin.secret\n")
    conn = ("--registry", "127.0.0.1:1", "--insecure", "--timeout", timeout)
    for argv in (
        ("site", "heartbeat", *conn, "--token", "mft1.site.a.secret"),
        ("model", "list", *conn, "--admin-token-file", str(tmp_path / "admin.token")),
    ):
        rc = top_cli.main(list(argv))
        err = capsys.readouterr().err
        assert rc == 1 and err == f"error: --timeout must be a finite number > 0; got {float(timeout)!r}\n", err
