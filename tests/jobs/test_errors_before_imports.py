"""A mistake in the command line or the job file is one error line from a process that has not
imported torch, Ray or scikit-learn (they cost seconds; the answer should come at once).  Real
processes: what the test checks is what a fresh ``msa-fed`` imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "sklearn", "onnxruntime", "scipy")
# msa-fed, then the heavy modules this process imported (as JSON on the last line of stderr)
DRIVER = (
    "import json, sys\n"
    "from msa_fed.cli import main\n"
    "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as exc:\n    rc = exc.code\n"
    f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def job_file(tmp: Path, top: str = "", tables: str = "") -> Path:
    token = tmp / "admin_token"
    token.write_text("mft1.admin.admin.x\n")
    path = tmp / "job.toml"
    path.write_text(
        f'{top}[registry]\naddress = "127.0.0.1:1"\ninsecure = true\nadmin_token_file = "{token}"\n{tables}'
    )
    return path


def occupied(tmp: Path) -> Path:
    (tmp / "result").mkdir()
    (tmp / "result" / "manifest.json").write_text("{}")
    return tmp / "result"


#: (argv given the test's folder, the text of the one error line)
CASES = {
    "unknown command": (lambda tmp: ["runn"], "invalid choice: 'runn'"),
    "unknown experiment": (lambda tmp: ["experiment", "synthtic"], "invalid choice: 'synthtic'"),
    "unknown job file key": (
        lambda tmp: ["run", "--job", job_file(tmp, tables='[run]\ntopologyy = "cluster"\n')],
        "unknown key(s) ['topologyy'] in [run]",
    ),
    "misspelt topology": (
        lambda tmp: ["run", "--job", job_file(tmp, tables='[run]\ntopology = "clustre"\n')],
        "topology",
    ),
    "federated job name that is no relay job id": (
        lambda tmp: ["run", "--job", job_file(tmp, top='name = "two words"\n')],
        "job name 'two words' is the job's id at the registry's relay",
    ),
    "unsealed federated job": (
        lambda tmp: ["run", "--job", job_file(tmp)],
        "job 'msa' is not sealed, and sites serve sealed jobs only",
    ),
    "sealed and unsealed at once": (
        lambda tmp: [
            "run",
            "--job",
            job_file(tmp, tables="[sealing]\nallow_unsealed = true\n"),
            "--job-key",
            tmp / "admin_token",
        ],
        "sends it unsealed: give one",
    ),
    "occupied output folder": (
        lambda tmp: ["run", "--job", job_file(tmp, tables='[run]\ntopology = "cluster"\n'), "--output", occupied(tmp)],
        "already exists and is not an empty directory",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_error_comes_before_any_heavy_import(case, tmp_path):
    argv, expected = CASES[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), RAY_ADDRESS="")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, argv(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    *lines, imported = proc.stderr.strip().splitlines()
    assert proc.returncode in (1, 2), proc.stderr
    assert json.loads(imported) == [], f"imported before the error: {imported}"
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
