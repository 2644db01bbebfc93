"""The job file: every table and key checked before any network work, each mistake one
``error:`` line naming the table and the key (through the real ``msa-fed run`` process, with no
registry listening), and every option reaching the fit's configuration tree."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import cli_runner
import pytest

from msa_fed.core.dc_solver import SolverConfig
from msa_fed.errors import ConfigError
from msa_fed.jobs.config import JobConfig, read_token_file
from msa_fed.runtime.config import FitConfig

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
name = "t"
[registry]
address = "127.0.0.1:{port}"
insecure = true
[model]
task = "classification"
mu = 0.01
objective = "gamma"
[privacy]
min_points = 5
[run]
sites = ["a", "b"]
site_data = "{{site}}.npz"
topology = "cluster"
ray_address = "127.0.0.1:6380"
data_channel = "off"
[classifier]
optimizer = "sgd"
epochs = 3
lr = 0.1
[solver]
method = "dca"
max_iter = 50
"""


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_table_reaches_the_config_tree(tmp_path):
    job = JobConfig.from_toml(write(tmp_path, GOOD.format(port=50051)))
    fit = job.fit
    assert isinstance(fit, FitConfig)
    assert job.name == "t" and job.registry == "127.0.0.1:50051" and job.insecure is True
    assert job.sites == ("a", "b") and job.site_data == "{site}.npz"
    assert fit.classifier.mu == 0.01 and fit.classifier.optimizer == "sgd" and fit.classifier.epochs == 3
    assert fit.classifier.lr == 0.1
    assert fit.solver == SolverConfig(objective="gamma", method="dca", max_iter=50)
    assert fit.min_points == 5 and fit.topology == "cluster"
    assert fit.ray.address == "127.0.0.1:6380" and fit.ray.data_channel == "off"


def test_defaults(tmp_path):
    job = JobConfig.from_toml(write(tmp_path, '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n'))
    assert job.fit.topology == "federated" and job.fit.site_timeout_s == 60.0
    assert job.fit.solver.objective == "minmax" and job.fit.solver.method is None
    assert job.fit.classifier.mu == 1e-3 and job.fit.min_points == 20 and job.sites == ()
    federated = JobConfig.from_toml(
        write(
            tmp_path,
            '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n[run]\nsite_timeout_s = 12.5\n',
            "federated.toml",
        )
    )
    assert federated.fit.topology == "federated" and federated.fit.site_timeout_s == 12.5


BAD = [
    ('[model]\nmu = "x"', r"\[model\] mu must be a number > 0; got \'x\'"),
    ("[model]\nmu = 0.0", r"\[model\] mu must be a number > 0; got 0.0"),
    ('[run]\nsites = "cleveland"', r"\[run\] sites must be a list of non-empty strings; got 'cleveland'"),
    ('[run]\nsites = ["a", 3]', r"\[run\] sites must be a list of non-empty strings"),
    ('[run]\nsites = ["a", "a"]', r"\[run\] sites names a site twice"),
    ('[run]\nsite_data = "x.npz"', r"\[run\] site_data must be a string containing '\{site\}'"),
    ('[run]\ntopology = "mesh"', r"\[run\] topology must be one of 'federated', 'cluster'; got 'mesh'"),
    ("[run]\nsite_timeout_s = 0", r"\[run\] site_timeout_s must be a number > 0; got 0"),
    ('[run]\ndata_channel = "udp"', r"\[run\] data_channel must be one of 'tls', 'plain', 'off'"),
    ("[run]\nray_address = 5", r"\[run\] ray_address must be a non-empty string"),
    (
        '[run]\ntopology = "cluster"\nsite_timeout_s = 5',
        r"\[run\] site_timeout_s applies only to topology = "
        r"'federated'",
    ),
    ("[model]\neta = -1.0", r"\[model\] eta must be a number >= 0; got -1.0"),
    ('[model]\nrandom_state = "x"', r"\[model\] random_state must be an integer >= 0; got 'x'"),
    ('[model]\ntask = "ranking"', r"\[model\] task must be one of 'classification', 'regression'"),
    ('[model]\nobjective = "mean"', r"\[model\] objective must be one of 'minmax', 'gamma'"),
    ('[model]\nfeatures = "none"', r"\[model\] features must be set for method 'dmsa'"),
    ("[privacy]\nmin_points = 0", r"\[privacy\] min_points must be an integer >= 1; got 0"),
    ('[privacy]\nmin_points = "20"', r"\[privacy\] min_points must be an integer >= 1; got '20'"),
    ("[classifier]\nepochs = -1", r"\[classifier\] epochs must be an integer >= 1; got -1"),
    ("[classifier]\nlr = nan", r"\[classifier\] lr must be a number > 0; got nan"),
    ("[classifier]\nmu = 0.1", r"unknown key\(s\) \['mu'\] in \[classifier\] \(mu is set in \[model\]\)"),
    ("[classifier]\nspeed = 1", r"unknown key\(s\) \['speed'\] in \[classifier\]"),
    ('[solver]\nmethod = "dca"', r"\[solver\] method='dca' applies only to objective='gamma'"),
    ('[solver]\nobjective = "gamma"', r"unknown key\(s\) \['objective'\] in \[solver\] \(objective is set in"),
    ("[solver]\nmax_iter = 0", r"\[solver\] max_iter must be an integer >= 1; got 0"),
    ('[solver]\nall_starts = "yes"', r"\[solver\] all_starts must be true or false; got 'yes'"),
    ("[model]\nspeed = 1", r"unknown key\(s\) \['speed'\] in \[model\]"),
    ('[run]\ninfluence = "sometimes"', r"\[run\] influence must be true, false or 'when-harmed'; got 'sometimes'"),
    ("[run]\ninfluence = 1", r"\[run\] influence must be true, false or 'when-harmed'; got 1"),
    ("[extra]\nx = 1", r"unknown table\(s\) or key\(s\) \['extra'\]"),
    ("model = 3", r"\[model\] must be a table; got 3"),
    ("name = 3", r"name must be a non-empty string; got 3"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[b[0].replace("\n", " ") for b in BAD])
def test_bad_job_files_name_the_table_and_key(tmp_path, text, message):
    registry = '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n'
    # a top-level key goes before the first table (after it, it would belong to that table)
    path = write(tmp_path, registry + text + "\n" if text.startswith("[") else text + "\n" + registry)
    with pytest.raises(ConfigError, match=message) as info:
        JobConfig.from_toml(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_checkpoint_dir_naming_a_file(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("x")
    path = write(tmp_path, f'[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n[run]\ncheckpoint_dir = "{f}"\n')
    with pytest.raises(ConfigError, match=r"\[run\] checkpoint_dir must be a directory path .*not a directory"):
        JobConfig.from_toml(path)


def test_registry_table_messages_name_the_file_not_the_flags(tmp_path):
    """insecure = true in the file is reported as the file's key; the flags as the flags."""
    remote = write(tmp_path, '[registry]\naddress = "registry.example.org:50051"\ninsecure = true\n')
    with pytest.raises(
        ConfigError,
        match=r"\[registry\] insecure = true would send the admin token in plaintext "
        r"to 'registry.example.org'",
    ) as info:
        JobConfig.from_toml(remote)
    assert "--insecure" not in str(info.value)
    tls = write(tmp_path, '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\ntls_ca = "/x/ca.pem"\n', "tls.toml")
    with pytest.raises(ConfigError, match=r"\[registry\] insecure = true and \[registry\] tls_ca are mutually"):
        JobConfig.from_toml(tls)
    plain = write(tmp_path, '[registry]\naddress = "registry.example.org:50051"\n', "plain.toml")
    with pytest.raises(ConfigError, match=r"--insecure would send the admin token in plaintext"):
        JobConfig.from_toml(plain, insecure=True)
    with pytest.raises(ConfigError, match=r"--registry must be HOST:PORT; got 'nowhere'"):
        JobConfig.from_toml(plain, registry="nowhere")
    with pytest.raises(ConfigError, match=r"\[registry\] address must be HOST:PORT"):
        JobConfig.from_toml(write(tmp_path, '[registry]\naddress = "nowhere"\n', "addr.toml"))
    with pytest.raises(ConfigError, match=r"\[registry\] tls_ca '/x/ca.pem' is not a readable file"):
        JobConfig.from_toml(write(tmp_path, '[registry]\naddress = "h:1"\ntls_ca = "/x/ca.pem"\n', "ca.toml"))
    with pytest.raises(ConfigError, match="no registry address"):
        JobConfig.from_toml(write(tmp_path, "[model]\nmu = 0.1\n", "noreg.toml"))


def test_job_file_path_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        JobConfig.from_toml(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        JobConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        JobConfig.from_toml(write(tmp_path, "[model\n"))


def test_token_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        read_token_file(str(tmp_path))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token_file(str(tmp_path / "empty"))


def run_cli(*args) -> subprocess.CompletedProcess:
    """``msa-fed ARGS`` in this process (tests/cli_runner.py); what a fresh process imports before
    such an error is tests/jobs/test_errors_before_imports.py's concern."""
    rc, out, err = cli_runner.run_cli(*args, cwd=ROOT)
    return subprocess.CompletedProcess(["msa-fed", *args], rc, out, err)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[model]\nmu = "x"', "[model] mu must be a number > 0; got 'x'"),
        ('[run]\nsites = "cleveland"', "[run] sites must be a list of non-empty strings; got 'cleveland'"),
        ('[solver]\nmethod = "dca"', "[solver] method='dca' applies only to objective='gamma'"),
    ],
)
def test_msa_fed_run_prints_one_error_line_before_any_network_work(tmp_path, text, message):
    """Nothing listens on the registry's port: the job file's mistake is found first."""
    token = tmp_path / "admin_token"
    token.write_text("admin.operator.secret")
    job = write(
        tmp_path,
        f'[registry]\naddress = "127.0.0.1:{closed_port()}"\ninsecure = true\nadmin_token_file = "{token}"\n{text}\n',
    )
    out = run_cli("run", "--job", str(job))
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: job file") and message in lines[0], out.stderr
    assert out.stdout == ""


def test_a_federated_job_name_that_is_no_relay_job_id_is_one_error_line(tmp_path):
    """A federated job's name is its id at the registry's relay (sites approve jobs by it): a name
    that cannot be one stops the job before the registry is contacted (nothing listens there)."""
    token = tmp_path / "admin_token"
    token.write_text("admin.operator.secret")
    job = write(
        tmp_path,
        f'name = "two words"\n[registry]\naddress = "127.0.0.1:{closed_port()}"\ninsecure = true\n'
        f'admin_token_file = "{token}"\n',
    )
    out = run_cli("run", "--job", str(job))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "job name 'two words' is the job's id at the registry's relay" in lines[0], out.stderr


def test_ray_options_apply_to_both_topologies(tmp_path):
    """The federated topology's stand-in actors run on Ray too: ray_address and data_channel are
    valid under either topology."""
    for topology in ("federated", "cluster"):
        job = JobConfig.from_toml(
            write(
                tmp_path,
                f'[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n[run]\ntopology = "{topology}"\n'
                'ray_address = "h:1"\ndata_channel = "plain"\n',
            )
        )
        assert job.fit.ray.address == "h:1" and job.fit.ray.data_channel == "plain" and job.topology == topology


@pytest.mark.parametrize("path", ["cluster/jobs/example_job.toml", "deploy/compose_job.toml"])
def test_example_job_files_are_valid_and_use_explicit_addresses(path):
    import tomllib

    doc = tomllib.loads((ROOT / path).read_text())
    assert doc["run"]["ray_address"] not in ("auto", "")
    from msa_fed.jobs.config import from_document

    # the CA file of a deployment is not on this machine: check everything else
    doc["registry"].pop("tls_ca", None)
    job = from_document(doc)
    assert job.fit.topology == "cluster" and job.fit.ray.address == doc["run"]["ray_address"]


def test_the_federated_example_job_file_is_valid(tmp_path):
    import tomllib

    from msa_fed.crypto.sealing import JobKey
    from msa_fed.jobs.config import from_document

    doc = tomllib.loads((ROOT / "cluster/jobs/federated_job.toml").read_text())
    doc["registry"].pop("tls_ca", None)
    # the deployment's job key is not on this machine either: one of the same kind stands in
    assert doc["sealing"]["job_key"] == "/etc/msa-fed/job.key"
    doc["sealing"]["job_key"] = str(JobKey.generate().save(tmp_path / "job.key"))
    job = from_document(doc)
    assert job.fit.topology == "federated" and job.fit.site_timeout_s == 60.0 and job.name == "federated-example"
    job.check_sealed()  # sealed: the job key and every site's pin
    assert sorted(job.seal_pins) == ["site-a", "site-b"]


def test_a_federated_job_is_sealed_unless_its_file_opts_out(tmp_path):
    """The federated topology seals by default: a job without a job key is one error line naming
    the keys to set; [sealing] allow_unsealed = true is the explicit opt-out (exclusive with a
    job key); the cluster topology has no relay and needs neither."""
    from msa_fed.crypto.sealing import JobKey

    base = '[registry]\naddress = "127.0.0.1:50051"\ninsecure = true\n'
    bare = JobConfig.from_toml(write(tmp_path, base))
    with pytest.raises(ConfigError) as info:
        bare.check_sealed()
    text = str(info.value)
    assert "\n" not in text and "is not sealed" in text, text
    for key in ("[sealing] job_key", "--job-key", "[sealing] sites", "[sealing] allow_unsealed = true"):
        assert key in text, (key, text)
    JobConfig.from_toml(write(tmp_path, base + "[sealing]\nallow_unsealed = true\n")).check_sealed()
    JobConfig.from_toml(write(tmp_path, base + '[run]\ntopology = "cluster"\n')).check_sealed()
    key = JobKey.generate().save(tmp_path / "job.key")
    with pytest.raises(ConfigError, match="allow_unsealed = true sends it unsealed: give one"):
        JobConfig.from_toml(write(tmp_path, base + f'[sealing]\njob_key = "{key}"\nallow_unsealed = true\n'))
    JobConfig.from_toml(write(tmp_path, base + f'[sealing]\njob_key = "{key}"\n')).check_sealed()


def test_a_site_token_given_as_the_admin_token_is_named(tmp_path):
    from msa_fed.control.registry.tokens import new_token

    site_token, _ = new_token("site", "east", 0.0)
    admin_token, _ = new_token("admin", "operator", 0.0)
    f = tmp_path / "token"
    f.write_text(site_token + "\n")
    with pytest.raises(ConfigError, match=r"--admin-token-file holds a token of site 'east', not an admin token"):
        read_token_file(str(f))
    f.write_text(admin_token)
    assert read_token_file(str(f)) == admin_token
    job = write(tmp_path, f'[registry]\naddress = "127.0.0.1:{closed_port()}"\ninsecure = true\n')
    out = run_cli("run", "--job", str(job), "--admin-token", site_token)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "error: --admin-token holds a token of site 'east', not an admin token; the job "
        "needs the registry's admin token (msa-fed admin issue-token --admin)"
    )


def test_a_job_config_is_validated_once_and_never_changed_in_place(tmp_path):
    """from_toml returns a validated config; validating it again returns it unchanged (run_job
    does); validating an unchecked config leaves it as it was and returns a checked copy."""
    config = JobConfig.from_toml(write(tmp_path, GOOD.format(port=closed_port())))
    assert config.validated and config.validate() is config
    raw = JobConfig(name="t", registry="127.0.0.1:1", insecure=True, sites=["a", "b"])
    checked = raw.validate()
    assert not raw.validated and raw.sites == ["a", "b"]  # the caller's object is untouched
    assert checked.validated and checked is not raw and checked.sites == ("a", "b")
    changed = replace(checked, name="two words")  # a new config: checked anew
    assert not changed.validated
    with pytest.raises(ConfigError, match="job name 'two words' is the job's id at the registry's relay"):
        changed.validate()


def test_the_fit_is_checked_with_the_job_and_never_again(tmp_path, monkeypatch):
    """The job file's fit tree is checked once, with the job (the influence report folded in);
    the coordinator and the Ray sites take the checked values without checking them again; a
    copy made with ``replace`` is checked anew."""
    from msa_fed.core import config as core_config
    from msa_fed.core.options import is_checked
    from msa_fed.runtime import config as runtime_config
    from msa_fed.runtime.coordinator import Coordinator

    config = JobConfig.from_toml(write(tmp_path, GOOD.format(port=closed_port())))
    fit = config.fit
    assert all(is_checked(part) for part in (fit, fit.classifier, fit.solver, fit.ray))
    # the report once a site is harmed by default; always where a margin refuses models on it
    assert config.influence == fit.influence == "when-harmed"
    assert replace(config, influence_margin=0.2).validate().fit.influence is True
    assert replace(config, influence=False).validate().fit.influence is False

    def checked_again(obj, where=""):
        raise AssertionError(f"{type(obj).__name__} checked again")

    for module in (core_config, runtime_config):
        monkeypatch.setattr(module, "normalise", checked_again)
    assert Coordinator(None, [], fit, verbose=False).config is fit
    assert fit.ray.validate() is fit.ray and fit.solver.validate() is fit.solver  # what the Ray sites call
    with pytest.raises(AssertionError, match="FitConfig checked again"):
        Coordinator(None, [], replace(fit, verbose=True))


def test_all_starts_reaches_the_solver(tmp_path):
    registry = '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n'
    job = JobConfig.from_toml(write(tmp_path, registry + "[solver]\nall_starts = true\nn_restarts = 2\n"))
    assert job.fit.solver == SolverConfig(all_starts=True, n_restarts=2)
    assert JobConfig.from_toml(write(tmp_path, registry, "plain.toml")).fit.solver.all_starts is False
