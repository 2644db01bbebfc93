"""The markers of tests/conftest.py: what `make test-fast` leaves out, and no test that starts Ray or
reads the data sets slips into the fast tier."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# tests/conftest.py by its path (several conftest modules share that name)
_spec = importlib.util.spec_from_file_location("_suite_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
TESTS, markers_for, is_quick = _conftest.TESTS, _conftest.markers_for, _conftest.is_quick

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


def test_the_quick_tier_is_what_no_marker_and_no_exclusion_leaves():
    assert is_quick("core/test_core_api.py", "test_x", set())
    assert not is_quick("core/test_core_api.py", "test_x", {"ray"})
    assert not is_quick("ops/test_ops_job.py", "test_x", {"slow"})
    assert not is_quick("control/test_control_attacks.py", "test_x", set())  # a whole file
    assert not is_quick("test_artifacts.py", "test_a_graph_that_never_ends_is_stopped[spawn]", set())  # one test
    assert is_quick("test_artifacts.py", "test_torch_round_trip", set())


def test_the_quick_budget_counts_cpu_time_and_scales_wall_time_by_the_load():
    over = _conftest.quick_budget_exceeded
    env = {_conftest.QUICK_CPU_ENV: "50", _conftest.QUICK_WALL_ENV: "60"}
    assert over(40.0, 55.0, 0.5, env) is None
    assert "51.0 s of CPU time" in over(51.0, 10.0, 0.5, env)
    assert over(40.0, 100.0, 2.0, env) is None  # a loaded machine: 120 s allowed
    assert "100.0 s of wall time" in over(40.0, 100.0, 1.0, env)
    assert over(1e6, 1e6, 1.0, {}) is None  # no budget set: any other run of the suite


def test_a_run_over_its_budget_fails_even_when_its_tests_pass():
    env = dict(os.environ, **{_conftest.QUICK_CPU_ENV: "0.001"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_markers_by_path_and_fixture",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS.parent,
        timeout=120,
    )
    assert proc.returncode == 1 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "the quick tier is over its budget" in proc.stdout and "MSA_FED_QUICK_CPU_S=0.001" in proc.stdout


def test_make_test_hands_out_a_split_file_a_test_at_a_time():
    split = "tests/ops/test_ops_federation.py::test_make_federation_walkthrough"
    assert _conftest.work_unit(split) == split
    assert _conftest.work_unit("tests/core/test_core_api.py::test_x[1]") == "tests/core/test_core_api.py"
    for rel in [*_conftest.SPLIT_FILES, *_conftest.HEAVY_FILES]:
        assert (TESTS / rel).is_file(), rel


def test_a_split_file_shares_no_module_fixture():
    """A file taken a test at a time runs its module fixtures once per worker: the files of
    SPLIT_FILES have none (nor the suite's module-scoped local Ray)."""
    for rel in _conftest.SPLIT_FILES:
        src = (TESTS / rel).read_text()
        assert not re.search(r"scope=\"(module|package|session|class)\"|\blocal_ray\b", src), rel


def test_the_scheduler_spreads_a_split_file_over_the_workers():
    """`make test`'s scheduling in a real xdist run: the two tests of a split file (the heaviest
    files come first) start on two workers, while xdist's own loadfile gives a file to one."""
    cheap = [
        "ops/test_ops_consortium.py::test_the_kit_walkthrough_in_the_doc_is_what_the_flow_test_runs",
        "ops/test_ops_consortium.py::test_init_refuses_a_used_folder_and_bad_names",
        "test_layers.py",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
        + [f"tests/{c}" for c in cheap],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},  # not this run's worker
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = {m.group(2): m.group(1) for m in re.finditer(r"\[(gw\d)\] \[[ \d%]+\] PASSED (\S+)", proc.stdout)}
    kit = {worker for test, worker in workers.items() if "test_ops_consortium" in test}
    assert len(workers) >= 3 and len(kit) == 2, proc.stdout


def _child_pytest(tmp_path, modules: dict[str, str], env: dict[str, str] | None = None):
    """(process, its output): a pytest of ``modules`` ({file name: source}) in ``tmp_path`` with
    the suite's conftest, in one process, under this environment (pytest's own variables and
    LEFT_BY_THE_MODULE left out) plus ``env``."""
    import shutil

    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    keep = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "LEFT_BY_THE_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0", "."],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**keep, **(env or {})},
        timeout=120,
    )
    return proc, proc.stdout + proc.stderr


def test_a_test_blocked_in_native_code_ends_its_process_with_every_stack(tmp_path):
    """A test whose main thread waits in native code for ever (here: a pthread mutex it already
    holds) is out of reach of pytest-timeout's signal; the suite's backstop (conftest
    HANG_BACKSTOP_S past the test's limit) prints every thread's stack and ends the process
    rather than leaving the run waiting."""
    stuck = (
        "import ctypes\nimport pytest\n\n\n"
        "@pytest.mark.timeout(1)\n"
        "def test_stuck_in_native_code():\n"
        "    mutex = ctypes.create_string_buffer(64)  # zeroed: a default pthread mutex\n"
        "    libc = ctypes.CDLL(None)\n"
        "    libc.pthread_mutex_lock(mutex)\n"
        "    libc.pthread_mutex_lock(mutex)  # the second lock of a default mutex never returns\n"
    )
    proc, out = _child_pytest(tmp_path, {"test_stuck.py": stuck}, {_conftest.HANG_BACKSTOP_ENV: "1"})
    assert proc.returncode == 1, out  # faulthandler's exit, not pytest's report of a test
    assert "Timeout (0:00:02)!" in out and "most recent call first" in out, out
    assert "line 10 in test_stuck_in_native_code" in out, out
    assert "passed" not in out and "failed" not in out, out


def test_the_state_a_module_leaves_is_named():
    """What the suite's module-end check (conftest.state_changes) reports: an environment variable
    set, changed or removed (by name, never its value), a thread count changed; nothing when the
    state is the same, nor for torch's counts appearing when a module first imports torch."""
    before = {"$A": "1", "$B": "x", "torch.get_num_threads()": 1, "torch.get_num_interop_threads()": 2}
    same = dict(before)
    assert _conftest.state_changes(before, same) == []
    after = {"$A": "2", "$C": "secret", "torch.get_num_threads()": 2, "torch.get_num_interop_threads()": 2}
    changes = _conftest.state_changes(before, after)
    assert changes == ["$A changed", "$B removed", "$C set", "torch.get_num_threads() 1 -> 2"]
    assert not any("secret" in c for c in changes)
    first = {"$A": "1"}  # torch imported by the module: its first counts are no change
    assert _conftest.state_changes(first, dict(first, **{"torch.get_num_threads()": 2})) == []
    assert "torch.get_num_threads()" in _conftest.global_state() or "torch" not in sys.modules


def test_the_module_fixtures_put_back_handlers_and_keep_ray_variables(tmp_path):
    """What a module changes is put back before the next module in the process: its SIGTERM
    handler (an in-process job's, Ray's); the RAY_* variables ``ray.init`` sets stay (Ray's core
    in the process keeps them: a later cluster must get them) and are no warning; a variable it
    leaves otherwise is named in a StateLeftWarning (a child pytest of two modules)."""
    first = (
        "import os, signal, sys, types\n\n\n"
        "def test_changes_all_three():\n"
        "    # stands in for Ray: imported, not initialised (the module-end check asks it)\n"
        "    sys.modules.setdefault('ray', types.SimpleNamespace(is_initialized=lambda: False))\n"
        "    signal.signal(signal.SIGTERM, lambda *_: None)\n"
        "    os.environ['RAY_SET_BY_INIT'] = '1'\n"
        "    os.environ['LEFT_BY_THE_MODULE'] = 'x'\n"
    )
    second = (
        "import os, signal\n\n\n"
        "def test_finds_them_put_back_but_one():\n"
        "    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "    assert os.environ['RAY_SET_BY_INIT'] == '1'\n"
        "    assert os.environ['LEFT_BY_THE_MODULE'] == 'x'\n"
    )
    proc, out = _child_pytest(tmp_path, {"test_a_first.py": first, "test_b_second.py": second})
    assert proc.returncode == 0 and "2 passed" in out, out
    assert "StateLeftWarning: test_a_first.py left for the next module: $LEFT_BY_THE_MODULE set" in out, out
    assert "RAY_SET_BY_INIT" not in out and "SIGTERM" not in out, out
