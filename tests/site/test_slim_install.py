"""`pip install .` alone installs a working site, and none of the coordinator's packages.

A fresh venv (in a temporary folder) gets this checkout with ``pip install`` and no extra, from
the package index pip is configured with (PyPI on a fresh machine; the test is skipped, saying
so, only when that index cannot be reached).  Then: torch, Ray, scikit-learn, skl2onnx and tqdm
are not installed there; ``msa-fed`` starts and a coordinator's command is one line naming the
extra; and the venv's Python answers every request a site process answers in a recorded job
(tests/site/slim_replay.py, the peers' predictors in the sandbox) as the in-process site did.
Minutes: the download and install of the site's packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slim import ROOT
from test_slim_site import _record, check_replayed, replay

from msa_fed.errors import COORDINATOR_INSTALL

#: what the site's install must not bring (distribution names)
NOT_AT_A_SITE = {"torch", "ray", "scikit-learn", "skl2onnx", "tqdm"}


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)


def _pip(venv: Path) -> list:
    """pip (this interpreter's) acting on the venv ``venv``: it runs under the venv's Python."""
    return [sys.executable, "-m", "pip", "--python", venv / "bin" / "python"]


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("slim_install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "msa_fed", src / "msa_fed", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp / "venv"
    # no pip of its own (the venv's ensurepip was most of a minute on a loaded machine): this
    # interpreter's pip installs into it, running under the venv's Python (pip --python)
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = _pip(venv)
    probe = _run([*pip, "download", "--no-deps", "--dest", tmp / "probe", "absl-py"], env=env, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"the package index is unreachable from here: {last[:300]}")
    # --no-compile: the bytecode is written on first import instead (the install's minutes are
    # the download; compiling scipy's and numpy's modules adds tens of seconds)
    installed = _run([*pip, "install", "--quiet", "--no-compile", src], env=env, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def test_the_site_install_holds_none_of_the_coordinator_packages(slim_venv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = _run([*_pip(slim_venv), "list", "--format=json"], env=env, timeout=120)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not names & NOT_AT_A_SITE, names & NOT_AT_A_SITE
    assert {"msa-fed", "onnxruntime", "grpcio", "cryptography", "dp-accounting"} <= {n.replace("_", "-") for n in names}


def test_msa_fed_starts_and_a_coordinator_command_names_the_extra(slim_venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cli = slim_venv / "bin" / "msa-fed"
    assert _run([cli, "--help"], env=env, cwd=tmp_path, timeout=120).returncode == 0
    assert _run([cli, "site", "keygen", "--out", "site.key"], env=env, cwd=tmp_path, timeout=120).returncode == 0
    done = _run([cli, "experiment", "synthetic"], env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: msa-fed experiment needs the coordinator extra (sklearn is not installed): {COORDINATOR_INSTALL}"
    ]


def test_the_site_install_answers_a_jobs_requests_as_the_in_process_site(slim_venv, tmp_path):
    methods, expected = _record(tmp_path / "job", "dmsa", "classification")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = replay(tmp_path / "job", str(slim_venv / "bin" / "python"), env)
    check_replayed(tmp_path / "job", methods, expected, got)
