"""The operator's walkthrough of docs/OPERATIONS.md, run as written: three sites (one in approve
mode), the job, a registry restart and a site killed and restarted in the middle of it, then
`site status`, `job list`, `model show` and `model report`, every command a real process.  No
line any of them prints is a raw gRPC status, a Python repr or a Ray warning.  The job survives
the registry's restart (SIGTERM mid-job, back on its port): the relay's job is opened again and
the sites reconnect."""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest
from ops_helpers import REPO, cli
from proc_federation import ProcFederation, demo_sites

#: what no operator-facing line may look like
BAD = [
    (re.compile(r"^(error: )?[A-Z][A-Z_]{4,}: "), "a raw gRPC status"),
    (re.compile(r"StatusCode\.|_InactiveRpcError|Traceback"), "a gRPC exception or a traceback"),
    (re.compile(r"\['|\[\"|\{'|\bdict_keys\("), "a Python repr"),
    (re.compile(r"\d\d:\d\d:\d\d,\d+\s+(WARNING|ERROR) \S+\.py:\d+ --"), "a Ray log line"),
    (re.compile(r"^\[20\d\d-\d\d-\d\d [\d:,.]+ [WE] \d+"), "a Ray (C++) log line"),
    (re.compile(r"^\((raylet|pid=\d+)"), "a Ray worker's line"),
]


def _check_lines(where: str, text: str) -> None:
    for line in text.splitlines():
        for pattern, what in BAD:
            assert not pattern.search(line), f"{where}: {what}: {line}"


def _doc_commands() -> list[str]:
    """The `msa-fed` commands of the walkthrough in docs/OPERATIONS.md, as "group command"."""
    doc = (REPO / "docs" / "OPERATIONS.md").read_text()
    block = doc.split("<!-- walkthrough -->", 1)[1].split("<!-- /walkthrough -->", 1)[0]
    out = []
    for line in block.splitlines():
        words = line.strip().split()
        if words[:1] == ["msa-fed"]:
            out.append(" ".join(words[1:3]) if words[1] != "run" else "run")
    return out


def _dedup(commands: list[str]) -> list[str]:
    return [c for i, c in enumerate(commands) if i == 0 or commands[i - 1] != c]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_operations_walkthrough(tmp_path):
    ran: list[str] = []
    sites = demo_sites(("north", "east", "west"))
    with ProcFederation(tmp_path / "fed", sites, accept_jobs={"west": "approve"}) as fed:

        def admin(*args):
            ran.append(" ".join(args[:2]))
            rc, out, err = fed.admin(*args)
            assert rc == 0, (args, out, err)
            _check_lines(" ".join(args[:2]), out + err)
            return out

        def site(*args):
            ran.append(" ".join(args[:2]))
            rc, out, err = cli(*args)
            assert rc == 0, (args, out, err)
            _check_lines(" ".join(args[:2]), out + err)
            return out

        # done by ProcFederation.start, as documented: the job key, then each site's key, record, files
        ran += ["job keygen", "site keygen", "site register", "site publish"]
        for name in fed.sites:
            ran.append("site serve")
            fed.serve(name).wait_for("connected to the registry", timeout=300)
        admin("admin", "site-status")

        # every start of 40 run to the end: the solve is still asking the sites when the
        # registry and east's process restart below (the default stops after the first start)
        job = fed.write_job("ward-study", "approval_wait_s = 600\n\n[solver]\nall_starts = true\nn_restarts = 40\n")
        ran.append("run")
        proc, out = fed.start_job(job)
        try:
            # west is in approve mode: its operator runs the command its process printed
            line = fed.out["west"].wait_for("job ward-study waits for approval; to admit it run: ", timeout=600)
            command = shlex.split(line.split("to admit it run: ", 1)[1])
            site(*command[1:])
            out.wait_for("DC solver: iteration 1,", timeout=900)
            # mid-job: the registry restarts and east's process is killed and started again
            fed.registry.stop()
            old_east = fed.procs["east"].pid
            fed.kill("east")
            time.sleep(3)
            fed.registry.start()
            ran.append("site serve")
            fed.serve("east").wait_for("connected to the registry", timeout=300)
            assert proc.wait(timeout=900) == 0, out.text()
        finally:
            proc.kill()
        text = out.text()
        _check_lines("msa-fed run", text)
        assert "stored combined model version 1" in text
        # the job went on through the registry's restart: the relay forgot the job and the job
        # opened it again (no call found it closed)
        assert "FAILED_PRECONDITION" not in text and "no open job" not in text, text
        assert "site west: waits for its operator to approve job ward-study" in text
        methods = [json.loads(x)["method"] for x in open(fed.root / "audit.jsonl")]
        assert methods.count("/msa_fed.v1.Relay/OpenJob") >= 2  # reopened after the restart

        east = site("site", "status", "--config", fed.config("east"))
        assert f"serving, pid {fed.procs['east'].pid}, " in east and old_east != fed.procs["east"].pid
        assert re.search(r"domain models: \d+ of 10 used in the rolling day, \d+ left; \d+ come back at 20", east)
        assert re.search(r"job ward-study: (ended|served), last seen", east), east
        west = site("site", "status", "--config", fed.config("west"))
        assert "(waited for approval)" in west, west
        jobs = admin("job", "list")
        assert re.search(r"ward-study\s+succeeded", jobs), jobs
        shown = admin("model", "show", "latest")
        assert "ward-study" in shown
        admin("model", "report", "latest", "--out", tmp_path / "report.html")
        assert (tmp_path / "report.html").stat().st_size > 10_000
        for name in fed.sites:
            log = fed.out[name].text()
            _check_lines(f"site serve ({name})", log)
            assert "joined job ward-study" in log

    # the documented walkthrough is what ran here, command for command (a command repeated for
    # each site is written once)
    assert _dedup(_doc_commands()) == _dedup(ran), (_doc_commands(), ran)


def test_the_walkthrough_block_is_in_the_doc():
    commands = _doc_commands()
    assert (
        commands[0] == "job keygen"
        and "site keygen" in commands
        and "run" in commands
        and commands[-1] == "model report"
    )
