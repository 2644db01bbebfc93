"""Every repository path that the docs and the code's comments name exists, and no doc points
outside the repository."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "BENCHMARKS.md",
    "CHANGELOG.md",
    "cluster/README.md",
    "deploy/README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]
CODE_DIRS = ["msa_fed", "tests", "benchmarks", "protos", "cluster"]
#: the repository's top-level folders and files: a path is checked when it starts with one
TOP = ("msa_fed/", "tests/", "docs/", "benchmarks/", "cluster/", "deploy/", "protos/", ".ci/")
TOP_FILES = ("README.md", "BENCHMARKS.md", "CHANGELOG.md", "LICENSE", "Makefile", "pyproject.toml")
#: paths that name what a command writes, not a file of the repository: prefix -> the folder
#: that must exist (benchmark results; TLS material made by deploy/secrets/README.md's commands;
#: protoc's output names before protos/generate.py moves the modules)
GENERATED = {
    "benchmarks/results/": "benchmarks/results",
    "deploy/secrets/": "deploy/secrets",
    "msa_fed/v1/": "protos/msa_fed/v1",
}

PATH_RE = re.compile(r"(?<![\w./:-])((?:\.\./)*(?:[\w.-]+/)*[\w.-]+(?:/|\.[A-Za-z]+))(?![\w/-])")


def candidate_paths(text: str) -> list[str]:
    """Tokens of ``text`` that look like relative paths of this repository."""
    found = []
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".")
        if path.startswith("../"):
            found.append(path)
        elif path.startswith(TOP) or path in TOP_FILES or (path.endswith(".md") and "/" not in path):
            found.append(path)
    return found


def exists(path: str, base: Path) -> bool:
    """``path`` exists relative to the repository root, to ``base`` (the naming file's folder)
    or, for a bare ``NAME.md``, in docs/; ``a/b/*.c`` globs count when they match; a path under
    a GENERATED prefix counts when its folder exists."""
    for prefix, folder in GENERATED.items():
        if path.startswith(prefix):
            return (ROOT / folder).is_dir()
    roots = [ROOT, base] + ([ROOT / "docs"] if "/" not in path else [])
    for root in roots:
        if "*" in path:
            if any(root.glob(path)):
                return True
        elif (root / path).exists():
            return True
    return False


def comments_and_docstrings(source: str) -> str:
    """The comments and string literals of a Python file (docstrings included)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string)
    return "\n".join(out)


def code_files() -> list[Path]:
    files = []
    for d in CODE_DIRS:
        files += [p for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name and p != Path(__file__).resolve()]
    return sorted(files)


def test_the_extractor_finds_paths_and_ignores_the_rest():
    text = (
        "see `msa_fed/core/dc_solver.py`, docs/DESIGN.md section 3, ../shared/DESIGN.md, "
        "https://example.org/docs/x.md, /etc/msa-fed/site.toml, README.md and 3.5 or e.g. x/y"
    )
    assert candidate_paths(text) == ["msa_fed/core/dc_solver.py", "docs/DESIGN.md", "../shared/DESIGN.md", "README.md"]
    assert not exists("tests/control/test_store.py", ROOT)
    assert exists("tests/control/test_control_store.py", ROOT)
    assert exists("DESIGN.md", ROOT / "msa_fed" / "core") and not exists("NO_SUCH.md", ROOT)
    assert exists("benchmarks/results/bench_x.json", ROOT) and exists("tests/*/conftest.py", ROOT)


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
    text = (ROOT / doc).read_text()
    base = (ROOT / doc).parent
    outside = [p for p in candidate_paths(text) if p.startswith("../")]
    assert not outside, f"{doc} points outside the repository: {outside}"
    missing = sorted({p for p in candidate_paths(text) if not exists(p, base)})
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_every_path_a_code_comment_names_exists():
    missing = []
    for f in code_files():
        for p in candidate_paths(comments_and_docstrings(f.read_text())):
            if p.startswith("../") or not exists(p, f.parent):
                missing.append(f"{f.relative_to(ROOT)}: {p}")
    assert not missing, "comments name paths that do not exist:\n" + "\n".join(missing)


def test_the_readme_layout_has_one_row_per_package():
    """README.md's layout table gives every package of msa_fed/ a row of its own, and names none
    that is gone."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :]
    table = table[: table.index("\n## ")]
    rows = [m.group(1) for m in re.finditer(r"^\| `msa_fed/(\w+)` \|", table, re.M)]
    packages = sorted(p.parent.name for p in (ROOT / "msa_fed").glob("*/__init__.py"))
    assert sorted(rows) == packages
