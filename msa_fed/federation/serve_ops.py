"""What ``msa-fed site serve`` does around the agent for its operator: one process per site (a
lock on the site's state files) and one line per job joined, ended and refused.

**One process per site.**  Two ``site serve`` of one site would share its audit log, ledger and
job book and take the relay connection from each other.  :class:`SiteLock` takes an exclusive
``fcntl.flock`` on ``<state file>.lock`` next to each of the site's state files (audit log,
ledger, job book; usually one folder) and writes its pid and start time in it; the kernel drops
the lock when the process ends, however it ends, so a killed process never leaves a stale lock.
A second process is refused with the first one's pid.

**Job lines.**  :class:`JobLines` prints, at the default log level, one line when the site joins
a job, one when a job ends (with what was answered and refused), and one per refusal.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from msa_fed.errors import ConfigError
from msa_fed.site.methods import JobCounts


class SiteLock:
    """Exclusive locks on a site's state files; ``acquire()`` raises :class:`ConfigError` naming
    the process that holds one.  Released by ``release()`` or when the process ends."""

    def __init__(self, site: str, state_files):
        self.site = site
        self.paths = sorted({Path(str(p) + ".lock").resolve() for p in state_files})
        self._fds: list[int] = []

    def acquire(self) -> SiteLock:
        try:
            for path in self.paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 200).decode("utf-8", "replace").strip()
                    os.close(fd)
                    raise ConfigError(
                        f"site {self.site} is already served by another process ({holder or 'pid unknown'}), "
                        f"which holds {path}; one 'msa-fed site serve' per site: stop that one first"
                    ) from None
                self._fds.append(fd)
                os.ftruncate(fd, 0)
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                os.write(fd, f"pid {os.getpid()}, started {stamp}\n".encode())
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # drops the flock; the file stays (its content is only informative)
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self) -> SiteLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def state_files(config, policy) -> list[Path]:
    """The files a site's process writes: audit log, ledger, job book (``policy``: the site's
    policy as :func:`msa_fed.federation.agent.load_site_policy` reads it)."""
    return [Path(policy.audit_log), Path(policy.ledger), Path(config.jobs_path)]


class JobLines:
    """One line per job joined, per job ended (with its counts, :class:`msa_fed.site.methods.JobCounts`)
    and per refusal (thread-safe)."""

    def __init__(self, site: str, echo: Callable[[str], None], config_path: str = "site.toml"):
        self.site, self.echo, self.config_path = site, echo, config_path
        self._pending: set[str] = set()
        self._joined: set[str] = set()
        self._counts: dict[str, JobCounts] = {}  # the audit records' counts (JobCounts: one definition)
        self._lock = threading.Lock()

    def joined(self, job: str, admin: str, sites, charged: dict | None = None) -> None:
        with self._lock:
            again = job in self._joined  # joined again (the site restarted, or the job resumed)
            self._joined.add(job)
            self._counts.setdefault(job, JobCounts()).add("join_job", "answered", charged=charged)
            self._pending.discard(job)
        if not again:
            self.echo(f"site {self.site}: joined job {job} (opened by {admin or '-'}; sites {', '.join(sites)})")

    def answered(self, job: str, request: str, charged: dict | None = None) -> None:
        with self._lock:
            self._counts.setdefault(job, JobCounts()).add(request, "answered", charged=charged)

    def refused(self, job: str, request: str, rule: str, detail: str, charged: dict | None = None) -> None:
        with self._lock:
            self._counts.setdefault(job, JobCounts()).add(request, "refused", rule=rule, charged=charged)
        if rule == "accept_jobs":  # approve mode: the operator's next step, once per job
            with self._lock:
                first = job not in self._pending
                self._pending.add(job)
            if first:
                self.echo(
                    f"site {self.site}: job {job} waits for approval; to admit it run: "
                    f"msa-fed site approve {job} --config {self.config_path}"
                )
            return
        detail = " ".join(str(detail).split())[:300]
        self.echo(f"site {self.site}: refused {request} for job {job or '-'} ({rule}): {detail}")

    def ended(self, job: str) -> None:
        with self._lock:
            counts = self._counts.pop(job, None) or JobCounts()
            self._joined.discard(job)
        self.echo(f"site {self.site}: job {job} ended; {counts.summary()}")
