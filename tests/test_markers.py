"""The markers of tests/conftest.py: what `make test-fast` leaves out, and no test that starts Ray or
reads the data sets slips into the fast tier."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# tests/conftest.py by its path (several conftest modules share that name)
_spec = importlib.util.spec_from_file_location("_suite_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
TESTS, markers_for = _conftest.TESTS, _conftest.markers_for

#: source text that starts or attaches to a Ray cluster, or reads the shared data sets (a test
#: that works on its own directory, tmp_path or the data_root fixture, does not)
STARTS_RAY = re.compile(r"ray\.init\(|Cluster\(|runtime=\"ray\"|RaySites\(|\"--runtime\", \"ray\"|\"demo\"\]")
READS_DATA = re.compile(r"\bload_(adult|sentiment|digits_domains)\(\)")
OWN_DIRECTORY = re.compile(r"\b(tmp_path|data_root)\b")


def test_markers_by_path_and_fixture():
    assert markers_for("cluster/test_cluster_job.py", "test_x", set()) == {"cluster", "ray", "slow"}
    assert markers_for("runtime/test_ray_runtime.py", "test_x[lbfgs]", set()) == {"ray"}
    assert markers_for("experiments/test_data.py", "test_adult_row_counts_and_domains", set()) == {"data"}
    assert markers_for("experiments/test_data.py", "test_data_dir_resolution", set()) == set()
    assert markers_for("core/test_core_api.py", "test_x", {"local_ray"}) == {"ray"}
    assert markers_for("core/test_core_api.py", "test_x", {"tmp_path"}) == set()


def _test_modules() -> list[tuple[str, str]]:
    """(path relative to tests/, source) of every test module but this one."""
    return [
        (f.relative_to(TESTS).as_posix(), f.read_text())
        for f in sorted(TESTS.rglob("test_*.py"))
        if f.name != Path(__file__).name
    ]


def test_every_module_that_starts_ray_is_marked_ray():
    unmarked = [
        rel for rel, src in _test_modules() if STARTS_RAY.search(src) and "ray" not in markers_for(rel, "", set())
    ]
    assert unmarked == []


def test_every_test_that_reads_the_data_sets_is_marked_data():
    unmarked = []
    for rel, src in _test_modules():
        # each test function's source: from its def to the next top-level def
        for m in re.finditer(r"^def (test_\w+)\(.*?(?=^def |\Z)", src, re.S | re.M):
            body = m.group(0)
            if (
                READS_DATA.search(body)
                and not OWN_DIRECTORY.search(body)
                and "data" not in markers_for(rel, m.group(1), set())
            ):
                unmarked.append(f"{rel}::{m.group(1)}")
    assert unmarked == []
