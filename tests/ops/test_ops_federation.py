"""The single-machine walkthroughs run end to end: ``make federation`` (deploy/federated.sh, the
federated topology) and ``make federation-cluster`` (deploy/federation.sh, the cluster topology)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ops_helpers import REPO, env, free_recipe_ports

RAY_DEFAULT_PORTS = {6379, 8265, 10001}


def _run_recipe(script: str, first_port: int) -> tuple[int, str, str, str]:
    """Run deploy/<script> on a free block of ports from ``first_port``; returns the base port,
    its stdout, stdout and stderr together, and the working folder it announced."""
    base = free_recipe_ports(first_port)
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / script)],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**env(), "PY": sys.executable, "BASE_PORT": str(base)},
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    work = next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("working folder: "))
    return base, proc.stdout, out, work


def _leftovers(work: str) -> list[str]:
    """The command lines of the processes still running that name the working folder ``work``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if work in cmdline:
                out.append(cmdline.replace("\0", " ")[:200])
    return out


@pytest.mark.slow
def test_make_federation_walkthrough():
    base, stdout, out, work = _run_recipe("federation.sh", 27200)
    lines = stdout.splitlines()
    assert f"registry listening on 127.0.0.1:{base}" in out
    model_row = lines[lines.index("== the stored model") + 2].split()
    assert model_row[:2] == ["1", "*"] and model_row[-1] == "north,east,west"
    assert any("walkthrough  succeeded" in line for line in lines)
    assert "loaded with msa_fed.load_model: dmsa over north, east, west" in out
    for site in ("north", "east", "west"):
        assert f"site {site}: tls data channel open" in out
    assert "federation walkthrough finished" in out
    assert not Path(work).exists()  # cleaned up
    # nothing it started keeps running (registry, Ray head and its processes)
    assert _leftovers(work) == []
    assert not RAY_DEFAULT_PORTS & {base, base + 1, base + 2}


@pytest.mark.slow
def test_make_federation_runs_the_federated_topology():
    base, _, out, work = _run_recipe("federated.sh", 27500)
    assert f"registry listening on 127.0.0.1:{base}" in out
    for site in ("north", "east", "west"):
        assert f"site {site}: answers from its own process through the registry's relay" in out
        assert f"site {site}: joined job walkthrough (opened by admin" in out
        assert re.search(rf"^site {site}: job walkthrough ended; answered .*dc_evaluate x\d+", out, re.M), out[-3000:]
        assert re.search(rf"^site {site} \(accepting jobs: admin\)$", out, re.M)
    # sealed end to end, as by default: the job signed with the job key, each site's key pinned
    assert re.search(r"^  sealed end to end: job key [0-9a-f]{16}\.\.\., content digest [0-9a-f]{64}$", out, re.M), out
    assert "stored combined model version 1" in out
    assert "loaded with msa_fed.load_model: dmsa over east, north, west" in out
    assert "federation walkthrough finished" in out
    # an operator's output: no Ray warnings, no reprs, no raw gRPC status
    for line in out.splitlines():
        assert not re.search(r"\bWARNING\b|^\[20\d\d-|\['|StatusCode\.", line), line
    assert not Path(work).exists() and _leftovers(work) == []
