"""The command tree is declared in msa_fed/cli.py: every group there has commands, every module
adds exactly what COMMANDS declares for it, the tree does not depend on the modules' order, and a
module of the tree that does not import is an error naming it (one line from the command), never
a group silently missing."""

from __future__ import annotations

import sys

import pytest

from msa_fed import cli


def tree(parser) -> dict[str, set[str]]:
    """{top-level name: its commands} of a built parser (a top-level command: no commands)."""
    (sub,) = (a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: set(commands) for name, commands in cli._tree(sub).items()}


def test_every_group_is_declared_and_has_commands():
    groups = cli.groups_of(cli.build_parser())
    assert list(groups) == list(cli.GROUPS), "declare every command group in msa_fed/cli.py GROUPS"
    assert all(groups.values()), {name: cmds for name, cmds in groups.items() if not cmds}
    assert {"serve", "audit", "publish", "approve"} <= set(groups["site"]) and "export" in groups["model"]
    assert set(cli.GROUPS) <= set().union(*cli.COMMANDS.values())  # each group is filled by a declared module


def test_the_tree_does_not_depend_on_the_modules_order(monkeypatch):
    built = tree(cli.build_parser())
    assert {"run", "demo", "experiment"} <= set(built) and "issue-token" in built["admin"]
    monkeypatch.setattr(cli, "COMMANDS", dict(reversed(cli.COMMANDS.items())))
    assert tree(cli.build_parser()) == built


@pytest.mark.parametrize("order", ["declared", "reversed"])
def test_site_config_reaches_the_commands_of_lower_layers_in_any_order(order, tmp_path, monkeypatch, capsys):
    """``site audit|status|register|publish --config site.toml``: the federation layer reads
    site.toml for commands the privacy and control layers declare, after every module registered
    (registered the other way round, the wrappers once found nothing to wrap)."""
    if order == "reversed":
        monkeypatch.setattr(cli, "COMMANDS", dict(reversed(cli.COMMANDS.items())))
    missing = tmp_path / "nowhere" / "site.toml"
    rc = cli.main(["site", "audit", "--config", str(missing)])
    err = capsys.readouterr().err
    assert rc == 1 and "not available in this command set" not in err and "site.toml" in err


def _module(tmp_path, monkeypatch, name: str, source: str | None) -> None:
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))


def test_a_module_that_adds_what_it_does_not_declare_is_an_error(tmp_path, monkeypatch, capsys):
    _module(
        tmp_path,
        monkeypatch,
        "msa_fed_test_newgroup",
        "from msa_fed.clitools import command_group\n"
        "def register(sub):\n"
        "    command_group(sub, 'undeclared').add_parser('list').set_defaults(func=lambda a: 0)\n"
        "    command_group(sub, 'model').add_parser('extra').set_defaults(func=lambda a: 0)\n",
    )
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "msa_fed_test_newgroup": frozenset({"model"})})
    with pytest.raises(cli.BrokenCommands, match=r"msa_fed_test_newgroup add to \['model', 'undeclared'\]"):
        cli.build_parser()
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "msa_fed_test_newgroup": frozenset({"model", "undeclared"})})
    assert "undeclared" in cli.groups_of(cli.build_parser())  # declared: then the first test fails for it


@pytest.mark.parametrize(
    "module, source, cause",
    [
        ("msa_fed_test_broken_cli", "import a_module_that_is_not_installed\n", "a_module_that_is_not_installed"),
        ("msa_fed_test_raising_cli", "raise ImportError('cannot import name x')\n", "cannot import name x"),
        ("msa_fed.no_such_cli", None, "msa_fed.no_such_cli"),
    ],
)
def test_a_module_that_does_not_import_is_an_error_naming_it(tmp_path, monkeypatch, capsys, module, source, cause):
    _module(tmp_path, monkeypatch, module, source)
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, module: frozenset({"model"})})
    with pytest.raises(cli.BrokenCommands, match=f"the commands of {module} cannot be loaded .*{cause}"):
        cli.build_parser()
    assert cli.main(["site", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the commands of {module} cannot be loaded") and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("module", sorted(cli.COMMANDS))
def test_each_module_of_the_tree_that_fails_to_import_is_reported(monkeypatch, capsys, module):
    """A real module of the tree made unimportable (None in sys.modules: ImportError on import):
    every command answers one line naming it, its groups are never silently left out."""
    monkeypatch.setitem(sys.modules, module, None)
    assert cli.main(["registry", "serve", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the commands of msa_fed.") and "cannot be loaded" in err and module in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_main_leaves_the_callers_environment_as_it_found_it(monkeypatch, capsys):
    """main() quiets gRPC (GRPC_VERBOSITY=NONE, before any `import grpc`) for its own run only: a
    caller in the same process gets its environment back, and a value the caller set is kept."""
    import os

    seen: list[str | None] = []

    def command(argv):
        seen.append(os.environ.get("GRPC_VERBOSITY"))
        return 0

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    with monkeypatch.context() as m:
        m.setattr(cli, "_main", command)
        assert cli.main([]) == 0
        assert seen == ["NONE"] and "GRPC_VERBOSITY" not in os.environ
        monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
        assert cli.main([]) == 0
        assert seen == ["NONE", "ERROR"] and os.environ["GRPC_VERBOSITY"] == "ERROR"
    monkeypatch.delenv("GRPC_VERBOSITY")
    # the real parser, ending the way a mistyped command does (argparse exits): the same
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    assert "GRPC_VERBOSITY" not in os.environ
    assert "invalid choice" in capsys.readouterr().err
