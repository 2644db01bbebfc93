"""The command tree is declared in msa_fed/cli.py: every group there has commands, every group
the modules fill is declared there, and a module of the tree that does not import is an error
naming it (one line from the command), never a group silently missing."""

from __future__ import annotations

import pytest

from msa_fed import cli


def test_every_group_is_declared_and_has_commands():
    groups = cli.groups_of(cli.build_parser())
    assert list(groups) == list(cli.GROUPS), "declare every command group in msa_fed/cli.py GROUPS"
    assert all(groups.values()), {name: cmds for name, cmds in groups.items() if not cmds}
    assert {"serve", "audit", "publish", "approve"} <= set(groups["site"]) and "export" in groups["model"]


def test_a_group_no_one_declared_is_seen(tmp_path, monkeypatch):
    (tmp_path / "msa_fed_test_newgroup.py").write_text(
        "from msa_fed.clitools import command_group\n"
        "def register(sub):\n"
        "    command_group(sub, 'undeclared').add_parser('list').set_defaults(func=lambda a: 0)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_SUBSYSTEMS", (*cli._SUBSYSTEMS, "msa_fed_test_newgroup"))
    groups = cli.groups_of(cli.build_parser())
    assert "undeclared" in groups and "undeclared" not in cli.GROUPS  # the first test fails for it


@pytest.mark.parametrize(
    "module, source, cause",
    [
        ("msa_fed_test_broken_cli", "import a_module_that_is_not_installed\n", "a_module_that_is_not_installed"),
        ("msa_fed_test_raising_cli", "raise ImportError('cannot import name x')\n", "cannot import name x"),
        ("msa_fed.no_such_cli", None, "msa_fed.no_such_cli"),
    ],
)
def test_a_module_that_does_not_import_is_an_error_naming_it(tmp_path, monkeypatch, capsys, module, source, cause):
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_SUBSYSTEMS", (*cli._SUBSYSTEMS, module))
    with pytest.raises(cli.BrokenCommands, match=f"the commands of {module} cannot be loaded .*{cause}"):
        cli.build_parser()
    assert cli.main(["site", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the commands of {module} cannot be loaded") and err.count("\n") == 1
    assert "Traceback" not in err
