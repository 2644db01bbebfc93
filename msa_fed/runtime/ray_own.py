"""Stop the Ray that msa_fed's cluster configs started, and no other.

    python -m msa_fed.runtime.ray_own stop --temp-dir /tmp/msa-fed-ray

``ray stop`` stops every Ray process of the user on the machine, whoever started it (another
team's cluster on a shared host, a notebook's local Ray).  msa_fed's cluster configs start their
Ray with ``--temp-dir`` set to a folder of their own, and every process of that Ray (GCS,
raylet, dashboard, agents, workers) names that folder on its command line, except the Ray
client server, which names the GCS's port; this stops exactly the processes of this user whose
command line names it (and that Ray's client server, and their children): SIGTERM, then SIGKILL for those still
there after ``--grace`` seconds.  The GCS server is signalled last, once the others are gone:
signalled with them (while its raylet shuts down) it waits out the whole grace period.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def _own_command_lines() -> dict[int, list[str]]:
    """{pid: command line words} of this user's processes (this one left out)."""
    uid, me = os.getuid(), os.getpid()
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out[int(entry.name)] = [a.decode("utf-8", "replace") for a in args if a]
    return out


def own_ray_processes(temp_dir: str) -> list[int]:
    """PIDs of this user's Ray processes (a program or script under a ``ray/`` folder) whose
    command line names ``temp_dir`` (as --temp-dir, or a path under it: the session folder, its
    sockets and logs), and the Ray client server of that Ray (``python -m
    ray.util.client.server``, started by ``ray start --head``: its command line names only the
    GCS's address, ``--address=HOST:PORT``, with the port the GCS of ``temp_dir`` listens on)."""
    root = os.path.abspath(temp_dir).rstrip("/")
    marks = (root + "/", "=" + root)
    procs = _own_command_lines()
    out: list[int] = []
    gcs_ports: set[str] = set()
    for pid, words in procs.items():
        is_ray = any("/ray/" in w for w in words[:3])  # Ray's binaries and scripts, not an editor on a log
        if is_ray and any(w == root or w.endswith(marks[1]) or marks[0] in w for w in words):
            out.append(pid)
            gcs_ports.update(w.split("=", 1)[1] for w in words if w.startswith("--gcs_server_port="))
    for pid, words in procs.items():
        if pid in out or "ray.util.client.server" not in words[1:3]:
            continue
        if any(w.startswith("--address=") and w.rsplit(":", 1)[-1] in gcs_ports for w in words):
            out.append(pid)
    # and their children (the raylet's agents and workers rename themselves, "ray::IDLE")
    parents = {pid: _parent(pid) for pid in procs}
    found = set(out)
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found and pid not in found}
        found |= more
        grew = bool(more)
    return sorted(found)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_gcs(pid: int) -> bool:
    """Whether ``pid`` runs Ray's GCS server (its program is ``.../gcs_server``)."""
    try:
        program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return program.rsplit(b"/", 1)[-1] == b"gcs_server"


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended: reaped here when it is this process's child, else not alive."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # not this process's child (or reaped already)
        return not process_alive(pid)


def _terminate(pids, deadline: float) -> list[int]:
    """SIGTERM to each of ``pids``, then wait until each has ended or ``deadline`` passed;
    returns those still running."""
    left = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            left.append(pid)
        except ProcessLookupError:
            pass
    while left:
        left = [p for p in left if not _gone(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return left


def _kill(pids) -> None:
    """SIGKILL to each of ``pids`` (this process's children among them reaped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def stop_processes(pids, grace_s: float = 5.0) -> None:
    """SIGTERM to each of ``pids``, SIGKILL to one still running ``grace_s`` later; this
    process's children among them are reaped."""
    _kill(_terminate(list(pids), time.monotonic() + grace_s))


def stop(temp_dir: str, grace: float = 15.0) -> int:
    """Stop the Ray of ``temp_dir``; returns how many processes were signalled.  The GCS server
    goes last (after the others, within the same ``grace``)."""
    pids = own_ray_processes(temp_dir)
    gcs = [p for p in pids if _is_gcs(p)]
    deadline = time.monotonic() + grace
    left = _terminate([p for p in pids if p not in gcs], deadline)
    left += _terminate(gcs, deadline)
    _kill(left)
    return len(pids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msa_fed.runtime.ray_own", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stop", help="stop the Ray started with --temp-dir DIR (only that one)")
    p.add_argument("--temp-dir", required=True, help="the --temp-dir its `ray start` was given")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL (default 15)")
    args = ap.parse_args(argv)
    n = stop(args.temp_dir, args.grace)
    print(f"stopped {n} process(es) of the Ray in {args.temp_dir}" if n else f"no Ray of {args.temp_dir} was running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
