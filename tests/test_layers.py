"""The layers of msa_fed: every import points down a declared order, and no module imports itself
back through others.  The imports are read from the source (ast), nothing is imported, so the
check is instant and also sees imports inside functions and under ``TYPE_CHECKING``.

Every package (subpackages too) and top-level module is named in :data:`LAYERS` or
:data:`SUBPACKAGES` explicitly: a new one fails :func:`test_every_package_and_top_level_module_is_named`
until it is placed."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import msa_fed

PACKAGE = Path(msa_fed.__file__).parent

#: bottom to top; a module may import its own layer and the layers below it, never one above.
#: Each entry: a layer's name and the packages or modules it holds ("msa_fed.core" holds
#: msa_fed.core and msa_fed.core.*; the root "msa_fed" holds itself only).  The longest entry
#: that holds a module decides its layer (msa_fed.control.ops.cli is in "control.ops").
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the package's root (its version and lazy names), the error types, argparse helpers
    ("base", ("msa_fed", "msa_fed.errors", "msa_fed.clitools")),
    ("core", ("msa_fed.core",)),  # pure math (tests/core/test_core_purity.py: no ray, no grpc)
    ("crypto", ("msa_fed.crypto",)),  # sealed, signed job traffic (cryptography's constructions)
    ("artifacts", ("msa_fed.artifacts",)),  # ONNX export, the sandboxed loader, the combined model
    ("privacy", ("msa_fed.privacy",)),  # policy as data, pure checks, DP accounting, the audit log
    # the boundary messages, their codec and the direct data channel, all generated protobuf
    ("boundary", ("msa_fed.boundary",)),
    ("site", ("msa_fed.site",)),  # what a site does (never the control plane)
    ("runtime", ("msa_fed.runtime",)),  # coordinator, local, Ray and federated backends
    ("api", ("msa_fed.api", "msa_fed.estimators")),  # the in-process API: fit_dmsa, DMSA, ...
    # the gRPC control plane, bottom to top: addresses and the channel builder; the registry, its
    # store, servicer and client; operations over the registry's store; the server side (the
    # interceptors, the relay, the server) and the registry's commands
    ("control.transport", ("msa_fed.control.transport",)),
    ("control.registry", ("msa_fed.control.registry",)),
    ("control.ops", ("msa_fed.control.ops",)),
    ("control", ("msa_fed.control",)),
    ("federation", ("msa_fed.federation",)),  # the site process and the federated topology
    ("experiments", ("msa_fed.experiments",)),
    ("jobs", ("msa_fed.jobs",)),
    ("cli", ("msa_fed.cli",)),
)

#: subpackages that sit in their parent's layer (a subpackage with a layer of its own is in LAYERS)
SUBPACKAGES: frozenset[str] = frozenset({"msa_fed.boundary.proto"})


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, source: str, known: set[str]) -> set[str]:
    """The msa_fed modules that the module ``name`` imports: import statements anywhere (relative
    ones resolved; ``from pkg import sub`` is the submodule), literal ``import_module`` calls, and
    ``from msa_fed import X`` through the root package's lazy names."""
    found: set[str] = set()
    is_package = MODULES.get(name, Path()).name == "__init__.py"
    lazy: dict[str, str] = getattr(msa_fed, "_LAZY", {})
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif target == "msa_fed" and alias.name in lazy:
                    found.add(lazy[alias.name])
                else:
                    found.add(target)
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return {m for m in found if m in known and m != name}


def layer_of(name: str) -> int | None:
    """Index in LAYERS of the longest entry that holds ``name``: the entry itself or, for an
    entry below the root, a module inside it."""
    held = [
        (len(entry), i)
        for i, (_, entries) in enumerate(LAYERS)
        for entry in entries
        if name == entry or (entry != "msa_fed" and name.startswith(entry + "."))
    ]
    return max(held)[1] if held else None


def top_level_names(package: Path) -> set[str]:
    """``msa_fed``, each package at any depth, and each module directly in ``msa_fed``."""
    names = {"msa_fed"}
    for init in package.rglob("__init__.py"):
        if init.parent != package:
            names.add("msa_fed." + ".".join(init.parent.relative_to(package).parts))
    names.update(f"msa_fed.{path.stem}" for path in package.glob("*.py") if path.name != "__init__.py")
    return names


@cache
def graph() -> dict[str, set[str]]:
    known = set(MODULES)
    return {name: imports_of(name, path.read_text(), known) for name, path in MODULES.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_scanner_resolves_every_import_form():
    known = {"msa_fed", "msa_fed.api", "msa_fed.core", "msa_fed.core.config", "msa_fed.core.simplex", "msa_fed.ctl"}
    src = (
        "import msa_fed.core.config\n"
        "from . import simplex\n"  # relative, a submodule
        "from msa_fed import fit_dmsa, __version__\n"  # a lazy name, and the root itself
        "def f():\n    import importlib\n    importlib.import_module('msa_fed.ctl')\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from msa_fed.api import SiteData\n"
    )
    assert imports_of("msa_fed.core.dc", src, known) == {
        "msa_fed.core.config",
        "msa_fed.core.simplex",
        "msa_fed.api",
        "msa_fed",
        "msa_fed.ctl",
    }


def test_cycle_finder_finds_a_circle_and_only_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_every_module_has_a_layer():
    assert [name for name in MODULES if layer_of(name) is None] == []
    assert len(MODULES) > 80


def test_every_package_and_top_level_module_is_named():
    """A new package does not fall silently into a layer: it is named, or this fails."""
    named = {entry for _, entries in LAYERS for entry in entries} | SUBPACKAGES
    assert sorted(top_level_names(PACKAGE) - named) == []
    assert sorted(named - top_level_names(PACKAGE)) == []  # no stale entry either


def test_an_unknown_package_has_no_layer(tmp_path):
    pkg = tmp_path / "msa_fed"
    (pkg / "newpkg").mkdir(parents=True)
    (pkg / "control" / "newpart").mkdir(parents=True)
    for init in ("", "newpkg", "control", "control/newpart"):
        (pkg / init / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("")
    (pkg / "control" / "mod.py").write_text("")
    assert top_level_names(pkg) == {
        "msa_fed",
        "msa_fed.newpkg",
        "msa_fed.helpers",
        "msa_fed.control",
        "msa_fed.control.newpart",  # a new subpackage is named too, or the test above fails
    }
    assert layer_of("msa_fed.newpkg") is None and layer_of("msa_fed.newpkg.mod") is None
    assert layer_of("msa_fed.helpers") is None
    assert layer_of("msa_fed.core.dc_solver") == layer_of("msa_fed.core") == 1
    assert layer_of("msa_fed.errors") == layer_of("msa_fed") == 0
    # a subpackage with its own layer: its modules are there, its parent's other modules are not
    assert layer_of("msa_fed.control.ops.cli") == layer_of("msa_fed.control.ops") < layer_of("msa_fed.control.cli")
    assert layer_of("msa_fed.control.transport.address") < layer_of("msa_fed.control.registry.client")


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if layer_of(name) is not None and layer_of(target) is not None and layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_no_import_cycle():
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("msa_fed.privacy", "msa_fed.runtime"),
        ("msa_fed.privacy", "msa_fed.control"),
        ("msa_fed.site", "msa_fed.control"),
        ("msa_fed.site", "msa_fed.runtime"),
        ("msa_fed.boundary", "msa_fed.site"),
        ("msa_fed.boundary", "msa_fed.control"),
        # the registry and its client need neither operations nor the server side
        ("msa_fed.control.registry", "msa_fed.control.ops"),
        ("msa_fed.control.registry", "msa_fed.control.server"),
        ("msa_fed.control.transport", "msa_fed.control.registry"),
    ],
)
def test_named_rules_follow_from_the_order(lower, upper):
    """The rules that docs/DESIGN.md states in words hold by the declared order."""
    assert layer_of(lower) < layer_of(upper)


def reached_from(start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others (imports inside functions too)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph().get(name, ()))
    return seen


def test_the_site_process_reaches_only_the_registry_client_side_of_control():
    """A site (``site serve``, msa_fed.federation.agent) talks to the registry as a client: it
    never loads the registry's service, its store, the interceptors, the relay or operations."""
    reached = {name for name in reached_from("msa_fed.federation.agent") if name.startswith("msa_fed.control.")}
    client_side = {
        "msa_fed.control.transport.address",
        "msa_fed.control.transport.connection",
        "msa_fed.control.registry.client",
        "msa_fed.control.registry.convert",
        "msa_fed.control.registry.public",
        "msa_fed.control.registry.records",
        "msa_fed.control.registry.tokens",
    }
    assert "msa_fed.control.registry.client" in reached
    assert sorted(reached - client_side) == []
