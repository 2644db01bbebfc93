"""`make demo` end to end, as a user runs it: `msa-fed demo` in a fresh process (a registry on
loopback gRPC with its relay, three `msa-fed site serve` processes that dial out to it, the
federated job, whose coordinator trains the domain classifier itself on samples this small: no
Ray), checked on what it prints.  The module runs it once, with ``--keep`` (the only difference:
the folder it works in is kept, and its last line says so), and both tests assert on that run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXE = Path(sys.executable).parent / "msa-fed"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One `msa-fed demo --keep FOLDER` for the module (the demo is the module's minute): its
    completed process, its wall time and its working folder.
    ``--keep`` changes only where the demo works (a given folder, not a temporary one) and its
    last line; both tests assert on this one run."""
    tmp = tmp_path_factory.mktemp("demo")
    keep = tmp / "kept"
    started = time.monotonic()
    out = subprocess.run(
        [str(EXE), "demo", "--keep", keep],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    return out, time.monotonic() - started, keep


def test_msa_fed_demo_runs_end_to_end(demo_run):
    out, wall, keep = demo_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "Traceback" not in out.stderr
    # nothing the user cannot act on: no Ray warnings or errors, no reprs, no pointer into the
    # demo's folders (removed when it ends, unless kept) but the line that says what was kept
    for line in (text + out.stderr).splitlines():
        assert not re.search(r"\b(WARNING|ERROR)\b|^\[20\d\d-|\['", line), line
    assert "job show" not in text and "saved to" not in text
    pointers = [line for line in (text + out.stderr).splitlines() if str(keep) in line]
    assert len(pointers) == 1 and pointers[0].startswith("demo finished in "), pointers
    took = float(re.search(r"^demo finished in ([0-9.]+) s", text, re.M).group(1))
    assert 0 < took <= wall, (took, wall)  # the time it reports lies within the process's life
    # the solver's lines count iterations from 1 (a restart, when a start does not converge, is
    # "DC solver (run 2)"), and the end says what was minimised
    err = out.stderr
    assert "DC solver: iteration 1," in err, err[-3000:]
    assert re.search(r"^DC solver \(slsqp-minmax\): minimised max_k L_k\(z\), the worst site's loss", err, re.M)
    assert re.search(r"^Gamma\(z\)\s+= \S+: how far the worst site's loss lies above", text, re.M), text
    for expected in (
        "registered over gRPC",
        "run 'msa-fed site serve' and are connected",
        "(pinned by the job)",  # each site's sealing key: the demo's job is sealed end to end
        "  sealed end to end: job key ",
        "stored combined model version 1",
        "downloaded combined model version 1",
        "demo finished in",
    ):
        assert expected in text, expected
    for site in ("north", "east", "west"):  # each site's own account: its policy, its audit log, its decisions
        assert re.search(
            rf"^  {site}: policy policy.toml: min_points 20, max_point_share 0.25, eta_min 0.001, "
            r"2000 DC evaluations per job, DP off$",
            text,
            re.M,
        ), text[-3000:]
        assert re.search(
            rf"^  {site}: answered dc_evaluate x\d+, harm x1, join_job x1, set_domain_model x1, set_qhat x1; "
            r"refused nothing; \d+ audit records, hash chain intact, length matches the ledger$",
            text,
            re.M,
        ), text[-3000:]
        assert re.search(rf"^  {site}: decisions on set_domain_model: .*qhat_share \S+", text, re.M), text[-3000:]
    rows = {
        m.group(1): [float(x) for x in m.group(2).split()]
        for m in re.finditer(r"^(DMSA|GMSA|unif|h_\w+)\s+((?:[01]\.\d{3}\s*){4})$", text, re.M)
    }
    assert set(rows) == {"DMSA", "GMSA", "unif", "h_north", "h_east", "h_west"}, text[-2000:]
    dmsa, unif = rows["DMSA"], rows["unif"]
    assert dmsa[3] > unif[3] + 0.2  # the uniform mixture
    assert min(dmsa[:3]) > 0.9  # every target domain
    z = dict(re.findall(r"(\w+)=([0-9.]+)", re.search(r"^z\s+=(.*)$", text, re.M).group(1)))
    assert abs(sum(float(v) for v in z.values()) - 1.0) < 2e-4 and set(z) == {"north", "east", "west"}


def test_demo_keep_leaves_the_model_and_says_where(demo_run, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    out = subprocess.run([str(EXE), "demo", "--keep", tmp_path / "used"], capture_output=True, text=True, env=_env())
    assert (
        out.returncode == 1 and out.stderr.strip().startswith("error: --keep ") and "not an empty folder" in out.stderr
    )
    out, _, keep = demo_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"kept in {keep}: the combined model (msa_fed.load_model('{keep / 'job-output'}'))" in out.stdout
    assert "(z: each site's weight in the combined model" in out.stdout
    import msa_fed

    model = msa_fed.load_model(keep / "job-output")
    assert set(model.site_names) == {"north", "east", "west"}
    assert (keep / "registry.db").is_file() and (keep / "north" / "site.toml").is_file()
