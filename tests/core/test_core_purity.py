"""msa_fed/core is pure math: no module there imports ray or grpc (DESIGN.md section 5)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import msa_fed.core

FORBIDDEN = ("ray", "grpc")
CORE = Path(msa_fed.core.__file__).parent


def imported_modules(source: str) -> list[str]:
    """Every module named by an import statement or a literal importlib/__import__ call."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names.append(str(node.args[0].value))
    return names


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") or name.startswith(f + "_") for f in FORBIDDEN)


def test_scanner_sees_every_import_form():
    src = (
        "import ray\nfrom grpc import aio\nimport importlib\nimportlib.import_module('ray.util')\n__import__('grpc')\n"
    )
    assert [n for n in imported_modules(src) if forbidden(n)] == ["ray", "grpc", "ray.util", "grpc"]
    assert not forbidden("rayleigh") and not forbidden("numpy")


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_neither_ray_nor_grpc(path):
    bad = [n for n in imported_modules(path.read_text()) if forbidden(n)]
    assert not bad, f"{path.name} imports {bad}"


def test_core_has_modules():
    assert len(list(CORE.glob("*.py"))) >= 8


def test_library_errors_survive_pickling():
    """Ray ships exceptions raised in site actors back to the coordinator by pickling them."""
    import pickle

    from msa_fed.errors import RegistryError, SiteError

    e = pickle.loads(pickle.dumps(SiteError("a", "down")))
    assert isinstance(e, SiteError) and e.site == "a" and str(e) == "site 'a': down"
    r = pickle.loads(pickle.dumps(RegistryError("NOT_FOUND", "x")))
    assert isinstance(r, RegistryError) and r.code == "NOT_FOUND" and str(r) == "NOT_FOUND: x"
