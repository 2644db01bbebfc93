"""The documented wheel build (cluster/README.md) works offline: no index, no build isolation."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from ops_helpers import REPO


@pytest.mark.slow
def test_wheel_builds_offline_from_a_clean_checkout(tmp_path):
    src = tmp_path / "src"
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    documented = "python -m pip wheel --no-build-isolation --no-deps -w dist ."
    assert documented in (REPO / "cluster" / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", "dist", "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (src / "dist").glob("msa_fed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "msa_fed/boundary/proto/operations_pb2.py",
        "msa_fed/control/ops/cli.py",
        "msa_fed/jobs/report.py",
        "msa_fed/runtime/progress.py",
    ):
        assert module in names
