"""Suite-wide fixtures, the test markers and the loopback-only local Ray."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

# A local Ray started by a test (``ray.init(address="local")``, ``ray.cluster_utils.Cluster``,
# ``fit_dmsa(runtime="ray")``, a job driver in a subprocess) binds 127.0.0.1 only.  Ray turns
# an explicit ``_node_ip_address="127.0.0.1"`` into the machine's external address; this switch
# (read when ``ray`` is first imported, so set before any test module imports it, and inherited
# by subprocesses) makes it use loopback for the node address and every server it starts.
# `ray start` refuses worker nodes under it: tests/cluster removes it for its own processes.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
os.environ.setdefault(RAY_LOOPBACK_ENV, "0")
# Ray waits 30 s for a new head's GCS to write its port file; a loaded two-core machine (the
# suite's own processes beside it) can take longer (a CI run failed on it): wait 60 s.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "60")
# load_model keeps a per-user record of verified predictors (msa_fed.artifacts.verified_cache):
# the suite keeps its own, in a temporary directory (inherited by its subprocesses), so that no
# run finds the verdicts of an earlier one and nothing is written to the user's cache.
VERIFIED_CACHE_ENV = "MSA_FED_VERIFIED_CACHE"
if VERIFIED_CACHE_ENV not in os.environ:
    os.environ[VERIFIED_CACHE_ENV] = tempfile.mkdtemp(prefix="msa_fed_verified_")
    atexit.register(shutil.rmtree, os.environ[VERIFIED_CACHE_ENV], True)
# Every process the suite starts (site processes, CLI commands, registries, Ray workers, the
# deploy recipes) imports the project's modules: where PYTHONDONTWRITEBYTECODE is set (container
# images set it), none keeps the bytecode it compiled, and each compiles them all again (measured:
# about 0.2 s of CPU for each `msa-fed` command, and the suite starts hundreds).  The suite's
# processes keep it (__pycache__ folders, ignored by git).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

TESTS = Path(__file__).resolve().parent

#: markers by path under tests/ (a directory ends with "/"): ray starts or uses a local Ray,
#: cluster runs several Ray nodes, data reads the data sets under shared/data, slow is a long
#: end-to-end run.  `make test-fast` deselects all four.
MARKERS_BY_PATH: dict[str, tuple[str, ...]] = {
    "cluster/": ("cluster", "ray", "slow"),
    "runtime/test_ray_multinode.py": ("cluster", "ray"),
    "runtime/test_ray_runtime.py": ("ray",),
    "experiments/test_experiments_ray.py": ("ray", "data", "slow"),
    "experiments/test_experiments_quick.py": ("data", "slow"),
    "test_demo.py": ("slow",),  # the demo's job is small: its coordinator trains, no Ray
    "experiments/test_cnn.py": ("slow",),  # trains small CNNs
    "control/test_control_load.py": ("slow",),  # 200 concurrent clients
    # the federated topology: a registry with its relay, `msa-fed site serve` subprocesses, local Ray
    "federation/test_federated_job.py": ("ray", "slow"),
    "federation/test_federation_security.py": ("ray", "slow"),
    "federation/test_cluster_liveness.py": ("ray", "slow"),
    "federation/test_sealed_relay.py": ("ray", "slow"),
    # the same without Ray: their jobs' samples are small (the coordinator trains the classifier)
    "federation/test_federation_network.py": ("slow",),
    "federation/test_hostile_sites.py": ("slow",),
    "experiments/test_influence_paper.py": ("data", "slow"),
    "experiments/test_target_adult.py": ("data",),
    "federation/test_site_serve_ops.py": ("slow",),  # small jobs: no Ray either
    # every `site serve` of a sealed job under the import blocker (tests/slim.py), twice
    "federation/test_slim_federation.py": ("slow",),
    # builds a venv with `pip install .` alone (PyPI), minutes
    "site/test_slim_install.py": ("slow",),
    # the recipe's real Ray head on 127.0.0.1, then `deploy/ray-up-local.sh down`
    "ops/test_ray_up_local_down.py": ("ray", "slow"),
}
#: single tests that read the data sets (the rest of their module uses temporary files)
DATA_TESTS = {
    "experiments/test_data.py::test_adult_row_counts_and_domains",
    "experiments/test_data.py::test_sentiment_reviews_and_ratings",
    "experiments/test_data.py::test_digits_domains_shapes_and_counts",
    "experiments/test_data_checksums.py::test_the_shared_sums_list_every_file_the_loaders_read",
}
#: fixtures that start a local Ray
RAY_FIXTURES = {"local_ray"}
#: `make test-quick`, the inner loop's tier (marker "quick"): every test outside the four markers
#: above except these, which take seconds each (a watchdog's timeout, a registry or job process,
#: a browser): they run in `make test-fast` and `make test`
NOT_QUICK = (
    # the heaviest CPU of the inner loop, measured per file (in make test-fast and make test):
    "privacy/test_verify_intercepts.py",
    "core/test_core_dc_solver.py",
    "test_deploy_configs.py",
    "privacy/test_verify.py",
    "privacy/test_runtime_privacy.py",  # DP fits of the local runtime, dp-accounting composition
    "artifacts/test_hostile_models.py",
    "federation/test_boundary_schema.py",
    "core/test_core_density.py",
    "control/test_control_uploads.py",
    "runtime/test_hostile_peers.py",
    "privacy/test_dp_honest.py",
    "ops/test_ops_messages.py",
    "control/test_control_tls.py",
    "artifacts/test_batch_probe.py",  # sandboxed children run into their CPU and memory limits
    "artifacts/test_verified_cache.py",  # a sandboxed load_model in every test, one in a fresh interpreter
    "artifacts/test_isolated_predictors.py",  # predictor workers forked and killed at their limits
    "ops/test_ops_restart.py",  # registry processes stopped and started again
    "ops/test_ops_export.py",  # a registry process and models of every experiment's configuration
    "artifacts/test_onnx_export.py",  # exported graphs of every feature map and task against the model
    "core/test_core_dc_rounds.py",  # full solves of every start against the bounded rounds
    "experiments/test_verdicts_honest.py",  # eight honest fits with the influence report
    "runtime/test_site_verdicts.py",  # attacked and honest fits with the influence report, DP
    "runtime/test_own_loss_guarantee.py",  # four fits with the own-loss guarantee, one with DP
    "core/test_core_guarantee.py",  # a grid of 7000 mixtures and constrained solves
    "core/test_core_influence_lockstep.py",  # min-max solves and their p re-solves
    "privacy/test_coordinator_reads.py",  # decoding attacks over whole honest transcripts
    "privacy/test_request_path.py",  # a site process killed with SIGKILL mid-job
    "federation/test_site_startup.py",  # waits out a registry that is not up yet
    "artifacts/test_isolated_batching.py",  # peers' predictors in forked worker processes, slow ones timed out
    "ops/test_ops_ray_own.py",  # Ray-like process trees started and stopped
    "control/test_control_attacks.py",  # floods that wait for the server's idle/read timeouts
    "control/test_control_restart.py",  # SIGKILL and restart of a registry process
    "control/test_control_cli.py::test_registry_serve",  # `registry serve` processes until SIGTERM
    "ops/test_ops_cli.py",  # a registry process and a module of fitted models
    "ops/test_ops_job.py",  # a registry process, three sites, the job driver
    "ops/test_ops_tls_errors.py",  # a `site serve` and a CLI process per TLS mistake
    "federation/test_site_audit_writer.py",  # a registry process and `site serve` processes
    "ops/test_ops_report.py",  # a fitted model's report, rendered by a headless browser
    "federation/test_relay_limits.py::test_stream_heartbeats",  # waits out heartbeat intervals
    "jobs/test_errors_before_imports.py",  # a fresh interpreter per case (what it imports is the point)
    "site/test_slim_site.py",  # a site process per case under the import blocker, a job fitted for each replay
    "test_artifacts.py::test_a_graph_that_never_ends_is_stopped",  # runs into the sandbox's CPU and clock limits
    "privacy/test_attacks.py::test_point_isolation_1d_policy_aware",  # 30 jobs against one site's ledger
    "privacy/test_attacks.py::test_differencing_2d_policy_aware",  # the same
    # hostile models that run into the sandbox's memory limit, or parse for seconds
    "artifacts/test_hostile_models.py::test_a_memory_bomb_is_stopped_by_the_sandbox_limit",
    "artifacts/test_hostile_models.py::test_a_parser_amplification_bomb_is_parsed_only_in_the_sandbox",
    "artifacts/test_hostile_models.py::test_a_huge_declared_width_costs_this_process_nothing",
    "control/test_control_fuzz.py::test_corrupted_predictors_are_refused_or_still_valid",  # a sandbox per example
    "artifacts/test_target_check.py",  # fitted and saved demo models, target checks with bootstraps
    "jobs/test_target_cli.py",  # the CLI on a saved model (sandboxed load) and an HTML report with plots
    "experiments/test_target_truth.py",  # a fit of the paper's synthetic domains and 10 bootstrapped checks
    # single tests of a few seconds of CPU each, measured in the quick tier (it was 88 s of CPU with them)
    "control/test_connection_flags.py",  # the help of every command that dials the registry
    "test_artifacts.py::test_every_truncation_is_refused",
    "test_artifacts.py::test_probabilities_are_checked_on_a_probe_batch",
    "test_artifacts.py::test_random_bytes_raise_only_artifact_error",
    "test_artifacts.py::test_to_onnx_dispatch",
    "core/test_core_domain_classifier.py::test_stacked_exact_fit_reaches_the_former_optimum",
    "core/test_core_domain_classifier.py::test_sgd_gets_close_to_the_optimum",
    "core/test_core_api.py::test_save_load_round_trip",
    "test_docs_paths.py::test_every_path_a_code_comment_names_exists",
    "federation/test_relay_limits.py::test_the_stores_say_which_sites_may_still_be_served",
    "privacy/test_privacy_experiment.py::test_synthetic_seed_dp_off_equals_the_plain_fit_and_dp_on_stays_sane",
    "control/test_control_cli.py::test_input_errors_are_one_clear_line",
    "ops/test_ops_models.py::test_round_trip_opens_with_load_model",
    "ops/test_ops_models.py::test_total_size_and_member_count_are_bounded",
    "core/test_core_target.py::test_knn_distance_at_the_fit_reference_size_matches_brute_force",
    "core/test_core_target.py::test_the_bootstrap_interval_holds_the_estimate_and_covers_the_truth",
    "privacy/test_noisy_solver.py::test_small_noise_finds_the_minmax_point",
    "runtime/test_runtime_local.py::test_workers_per_site_equals_single_process",
    "runtime/test_runtime_local.py::test_the_sites_check_the_handed_answers_together_with_the_same_numbers",
    "runtime/test_runtime_local.py::test_binary_logistic_models_are_evaluated_as_their_predict_proba_does",
    "runtime/test_runtime_local.py::test_a_model_that_is_not_a_plain_binary_logistic_regression_is_called",
    "privacy/test_attacks.py::test_point_isolation_1d_without_the_rules_recovers_every_label",
    "privacy/test_attacks.py::test_multi_column_attack_is_stopped_by_dp",
    "control/test_control_fuzz.py::test_malformed_",
    "experiments/test_synthetic_sites.py",  # 50 site sets of the synthetic experiment
    "control/test_connection.py::test_a_shared_client_",  # two servers, a wait on gRPC's reconnect backoff
    "test_markers.py::test_the_scheduler_spreads_a_split_file_over_the_workers",  # an xdist run of two workers
    "test_markers.py::test_a_test_blocked_in_native_code_",  # a pytest run into its hang backstop
    "test_markers.py::test_the_module_fixtures_put_back_",  # a pytest run of two modules
)
#: the quick tier's budget, read when `make test-quick` sets these variables: the tier fails when
#: its CPU time (this process and the processes it waited for) passes MSA_FED_QUICK_CPU_S, or its
#: wall time passes MSA_FED_QUICK_WALL_S times the machine's load per core (a loaded machine
#: stretches wall time, not CPU time; sleeps show in wall time only)
QUICK_CPU_ENV, QUICK_WALL_ENV = "MSA_FED_QUICK_CPU_S", "MSA_FED_QUICK_WALL_S"
_STARTED = time.monotonic()
#: pytest-timeout limit of a slow test (the default, 300 s in pyproject.toml, is for the rest): an
#: end-to-end run on a loaded two-core machine can take several times its idle duration
SLOW_TIMEOUT_S = 900


def markers_for(rel: str, name: str, fixtures: set[str]) -> set[str]:
    """The markers of the test ``name`` in the file ``rel`` (relative to tests/, "/"-separated)."""
    found: set[str] = set()
    for prefix, marks in MARKERS_BY_PATH.items():
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            found.update(marks)
    if f"{rel}::{name.split('[')[0]}" in DATA_TESTS:
        found.add("data")
    if fixtures & RAY_FIXTURES:
        found.add("ray")
    return found


def is_quick(rel: str, name: str, marks: set[str]) -> bool:
    """Whether the test ``name`` in ``rel`` (with the markers ``marks``) is in the quick tier."""
    test_id = f"{rel}::{name}"
    return not marks & {"slow", "ray", "cluster", "data"} and not any(test_id.startswith(p) for p in NOT_QUICK)


def pytest_ignore_collect(collection_path, config):
    """Under ``-m quick``, the files that hold no quick test are not even imported (several import
    Ray or start helpers at import time: seconds of the tier's budget)."""
    if config.getoption("markexpr", "") != "quick":
        return None
    try:
        rel = Path(str(collection_path)).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None
    whole = [*MARKERS_BY_PATH, *(p for p in NOT_QUICK if "::" not in p)]
    if any(rel == p or (p.endswith("/") and (rel + "/").startswith(p)) for p in whole):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue
        marks = markers_for(rel, item.name, set(getattr(item, "fixturenames", ())))
        for mark in sorted(marks):
            item.add_marker(mark)
        if is_quick(rel, item.name, {m.name for m in item.iter_markers()}):
            item.add_marker("quick")
        slow = "slow" in marks or "cluster" in marks or item.get_closest_marker("slow") is not None
        if slow and item.get_closest_marker("timeout") is None:  # a decorated slow test too
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    heavy_first(items)


#: the files that take a worker longest in `make test`, with the seconds of their longest work
#: unit (the file, or its longest test in SPLIT_FILES): a full `make test` run (three workers on
#: the otherwise idle two-core machine; JUnit times, fixtures included).
#: `make test` starts them first, the longest first, so that the short files fill the end rather
#: than one long unit running alone (replayed on those runs' times, this order and the former one
#: end the three workers within a few seconds of each other: the suite's time is its sum / 3)
HEAVY_FILES: dict[str, float] = {
    "runtime/test_ray_runtime.py": 132,
    "cluster/test_cluster_job.py": 104,  # a two-node Ray and `ray job submit`
    "experiments/test_experiments_ray.py": 102,  # two experiments on both runtimes, a Ray started by fit_dmsa
    "federation/test_federated_job.py": 97,
    "federation/test_cluster_liveness.py": 88,  # waits out a start time-out and two site time-outs
    "ops/test_ops_federation.py": 86,  # its longest test: make federation-cluster
    "federation/test_federation_security.py": 82,
    "runtime/test_ray_multinode.py": 71,
    "ops/test_ops_walkthrough.py": 70,  # the operations walkthrough
    "control/test_control_load.py": 62,  # one test: 200 concurrent clients
    "artifacts/test_batch_probe.py": 55,
    "ops/test_ops_job.py": 52,
    "site/test_slim_install.py": 37,  # a fresh venv, `pip install .`
    "test_demo.py": 32,  # one `msa-fed demo`
    "federation/test_hostile_sites.py": 28,
    "ops/test_ops_consortium.py": 27,  # the kit flow: three jobs on a mutual-TLS federation
    "experiments/test_experiments_quick.py": 21,
}
#: files whose tests share no module fixture (each starts its own processes or works alone):
#: `make test`'s workers take them a test at a time rather than a file at a time, so that their
#: long tests run side by side on several workers
SPLIT_FILES = frozenset(
    {
        "ops/test_ops_consortium.py",
        "federation/test_federation_network.py",
        "ops/test_ops_federation.py",
        "ops/test_ops_walkthrough.py",
        "ops/test_ops_job.py",
        "experiments/test_experiments_quick.py",
        "privacy/test_verify_intercepts.py",
    }
)


def heavy_first(items) -> None:
    """The files of HEAVY_FILES first, the heaviest first, then the files with slow or cluster
    tests, then those with Ray tests, then the rest, each file's tests together and in their order.
    `make test`'s workers take a file at a time (a test at a time in SPLIT_FILES) in this order."""
    rel = {item.path: _relative(item.path) for item in items}
    tier: dict = {}  # a file's tier: 0 slow or cluster tests, 1 Ray tests, 2 the rest
    for item in items:
        own = 0 if item.get_closest_marker("slow") or item.get_closest_marker("cluster") else 2
        own = 1 if own == 2 and item.get_closest_marker("ray") else own
        tier[item.path] = min(tier.get(item.path, 2), own)
    first_seen = {path: k for k, path in reversed(list(enumerate(item.path for item in items)))}

    def key(item):
        weight = HEAVY_FILES.get(rel[item.path] or "")
        if weight is not None:
            return (0, -weight, first_seen[item.path])
        return (1 + tier[item.path], 0, first_seen[item.path])

    items.sort(key=key)


def _relative(path) -> str | None:
    try:
        return Path(str(path)).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


def work_unit(nodeid: str) -> str:
    """What `make test` (``--dist loadfile``) hands a worker at a time for the test ``nodeid``
    (relative to the repository): its file, or the test itself in a file of SPLIT_FILES."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path.removeprefix("tests/") in SPLIT_FILES else path


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` as `make test` wants it: the work units of :func:`work_unit`, handed
    out in the collection's order (heavy_first), the next one to a worker when it is on its
    last test.  xdist's own loadfile would sort the files by their number of tests, which put
    the longest files (a few long tests each) last."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyFirstScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _reschedule(self, node) -> None:
            # xdist tops a worker up while it has two tests or fewer left, so a worker could
            # hold two long one-test units queued behind the one it runs while another worker
            # idles.  Here a worker gets its next unit when it is on its last test (a worker
            # needs the next test before it starts one, to know which fixtures to tear down).
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return HeavyFirstScheduling(config, log)


#: the module that ran last in this process (its file, relative to tests/): named by the checks
#: of :func:`_ray_does_not_leak_between_modules`
_PREVIOUS_MODULE: list[str] = []
#: seconds a Ray process of this process's own local Ray gets to exit after ``ray.shutdown()``
RAY_EXIT_GRACE_S = 15.0


def _ray_variable(name: str) -> bool:
    """An environment variable ``ray.init`` sets in its driver's process."""
    return name.startswith("RAY_") or name == "PYTHONBREAKPOINT"


@pytest.fixture(autouse=True, scope="module")
def _ray_does_not_leak_between_modules(request, _global_state_is_left_as_found):
    """A module that used Ray (``fit_dmsa(runtime="ray")`` starts one and keeps it) must not
    hand it to the next module, which may want its own cluster (multi-node tests), or leave a
    process of its Ray running: a later module's driver could attach to it, or a module's Ray
    stay attached to a cluster since stopped.  So, in this order:

    - at the module's start, Ray is not initialised (else something of the previous module in
      this process, a thread that outlived it, started Ray after its end: an error naming it);
    - at its end, after the module's own fixtures, a Ray still initialised is shut down;
    - then no process of a local Ray this process started runs on (an error naming the module,
      the processes stopped; ``msa_fed.runtime.ray_actors.ray_children``).

    What ``ray.init`` leaves in the environment (its RAY_* variables, RAY_AUTH_MODE among them,
    and PYTHONBREAKPOINT) stays: Ray's core in this process keeps the settings it started with
    after ``ray.shutdown()``, and a cluster a later module starts from this process must get
    them too (measured: with RAY_AUTH_MODE removed, the multi-node module's cluster, started
    after a module that ran a local Ray, destroyed every actor the driver created: "all
    references to the actor were removed").  Its SIGTERM handler is put back
    (:func:`_global_state_is_left_as_found`, whose end comes after this one's).
    """

    here = _relative(request.path) or str(request.path)
    previous = _PREVIOUS_MODULE[-1] if _PREVIOUS_MODULE else "none"
    _PREVIOUS_MODULE[:] = [here]
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(
            f"Ray was initialised when {here} started, after the end of the module before it in this "
            f"process ({previous}): something of that module (a thread?) started it once the module had ended"
        )
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if ray is None:
        return
    from msa_fed.runtime.ray_actors import ray_children, stop_processes

    deadline = time.monotonic() + RAY_EXIT_GRACE_S
    left = ray_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_children()
    if left:
        stop_processes(left, grace_s=0)
        pytest.fail(
            f"{here} left {len(left)} Ray process(es) of this process running (killed now): "
            + "; ".join(f"{pid} {cmd}" for pid, cmd in left.items())
        )


class StateLeftWarning(UserWarning):
    """A test module changed the process's global state for the modules after it (a warning: the
    run's summary names the module and what it changed)."""


#: variables a session-scoped fixture sets for every module after it, on purpose (PYTHONPATH:
#: tests/federation/conftest.py puts the checkout first for the site processes)
SESSION_ENV = frozenset({"PYTHONPATH"})


def global_state() -> dict[str, object]:
    """What a module may leave behind for the next one in this process: the environment (bar
    pytest's own variables, SESSION_ENV and Ray's variables, which stay with Ray's core in the
    process: :func:`_ray_does_not_leak_between_modules`) and torch's thread pools (once torch is
    imported)."""
    state: dict[str, object] = {
        f"${k}": v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST_") and k not in SESSION_ENV and not _ray_variable(k)
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch.get_num_threads()"] = torch.get_num_threads()
        state["torch.get_num_interop_threads()"] = torch.get_num_interop_threads()
    return state


def state_changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The entries of :func:`global_state` that differ, in words (an environment value is not
    shown; torch's thread counts appear when a module first imports torch: not a change)."""
    out = []
    for key in sorted(set(before) | set(after)):
        if key in before and key in after and before[key] is after[key]:
            continue
        if not key.startswith("$") and (key not in before or key not in after):
            continue
        if key not in after:
            out.append(f"{key} removed")
        elif key not in before:
            out.append(f"{key} set")
        elif before[key] != after[key]:
            out.append(f"{key} changed" if key.startswith("$") else f"{key} {before[key]!r} -> {after[key]!r}")
    return out


@pytest.fixture(autouse=True, scope="module")
def _global_state_is_left_as_found(request):
    """Puts back the SIGTERM and SIGINT handlers a module found (``ray.init`` installs its own, an
    in-process job its JobInterrupted one: a later SIGTERM would end another module's test with
    them), and warns (StateLeftWarning) when a module leaves the environment or torch's thread
    pools changed for the modules after it in this process (what an order-dependent failure
    would come from), naming the module and what changed."""
    import signal
    import warnings

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    before = global_state()
    yield
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    changes = state_changes(before, global_state())
    if changes:
        here = _relative(request.path) or str(request.path)
        warnings.warn(StateLeftWarning(f"{here} left for the next module: " + "; ".join(changes)), stacklevel=1)


#: seconds past a test's time limit (pytest-timeout's: its ``timeout`` marker, else --timeout,
#: else ``timeout`` in pyproject.toml) after which its process prints the stack of every thread
#: and exits (faulthandler; MSA_FED_TEST_HANG_BACKSTOP_S overrides).  pytest-timeout's signal
#: cannot stop a test whose main thread is blocked in native code (a futex wait that never ends:
#: a run once stalled in one for good): without this the whole suite waits for ever; with it that
#: worker ends, its stacks on stderr, and xdist reports the test and goes on with a new worker.
HANG_BACKSTOP_S = 120.0
HANG_BACKSTOP_ENV = "MSA_FED_TEST_HANG_BACKSTOP_S"


def time_limit(item) -> float:
    """The time limit pytest-timeout sets the test ``item`` (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
    elif item.config.getoption("timeout", None) is not None:
        value = item.config.getoption("timeout")
    else:
        try:
            value = item.config.getini("timeout")
        except ValueError:  # no pytest-timeout
            return 0.0
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = time_limit(item)
    if limit <= 0:
        return (yield)
    import faulthandler

    try:  # the copy of stderr pytest's faulthandler plugin keeps (the test's own stderr is captured)
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        out = item.config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        out = sys.__stderr__.fileno()
    backstop = float(os.environ.get(HANG_BACKSTOP_ENV) or HANG_BACKSTOP_S)
    faulthandler.dump_traceback_later(limit + backstop, file=out, exit=True)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


def quick_budget_exceeded(cpu_s: float, wall_s: float, load_per_core: float, env=os.environ) -> str | None:
    """Why the quick tier is over its budget (None when it is not, or when no budget is set)."""
    problems = []
    if env.get(QUICK_CPU_ENV) and cpu_s > float(env[QUICK_CPU_ENV]):
        problems.append(f"{cpu_s:.1f} s of CPU time, budget {QUICK_CPU_ENV}={env[QUICK_CPU_ENV]} s")
    if env.get(QUICK_WALL_ENV):
        allowed = float(env[QUICK_WALL_ENV]) * max(1.0, load_per_core)
        if wall_s > allowed:
            problems.append(
                f"{wall_s:.1f} s of wall time, budget {QUICK_WALL_ENV}={env[QUICK_WALL_ENV]} s "
                f"x load per core {load_per_core:.2f} = {allowed:.0f} s"
            )
    if not problems:
        return None
    return (
        "the quick tier is over its budget: "
        + "; ".join(problems)
        + (". Move the slow tests out (NOT_QUICK in tests/conftest.py) or make them faster.")
    )


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != 0 or not (os.environ.get(QUICK_CPU_ENV) or os.environ.get(QUICK_WALL_ENV)):
        return
    zygote = sys.modules.get("msa_fed.artifacts.zygote")
    if zygote is not None:  # the sandbox's fork helper: its CPU time (and its children's) counts once waited for
        zygote.shutdown()
    t = os.times()
    cpu_s = t.user + t.system + t.children_user + t.children_system
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    reason = quick_budget_exceeded(cpu_s, time.monotonic() - _STARTED, load)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reason is None:
        if reporter is not None:
            reporter.line("")  # after the progress line
            reporter.write_sep(
                "-",
                f"quick tier: {cpu_s:.1f} s CPU, {time.monotonic() - _STARTED:.1f} s wall, load per core {load:.2f}",
            )
        return
    if reporter is not None:
        reporter.line("")  # after the progress line
        reporter.write_line(reason, red=True, bold=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def demo_federation():
    """The demo's three sites, small (150 labelled, 200 unlabelled points each), with their
    predictors: ``(sites, fed)`` where ``fed`` is make_federation's dict (test sets included).
    Shared by every test that needs a realistic fitted model; nothing may change them."""
    from demo_sites import demo_sites

    return demo_sites(1)


@pytest.fixture(scope="session")
def demo_model_dir(demo_federation, tmp_path_factory):
    """``fit_dmsa`` on :func:`demo_federation`, saved once: ``(path, X_test of site north)``."""
    import msa_fed

    sites, fed = demo_federation
    model = msa_fed.fit_dmsa(sites, task="classification")
    return model.save(tmp_path_factory.mktemp("demo_model") / "model"), fed["north"]["X_test"]
