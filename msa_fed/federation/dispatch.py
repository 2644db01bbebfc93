"""The site process's dispatcher: jobs served concurrently (bounded), each job's requests in order.

One job's requests run one after another, in the order they arrived (a job's state at the site,
its :class:`~msa_fed.site.worker.SiteWorker`, is not shared between threads); different jobs
run on a bounded pool of threads, so a job whose request is slow (a peer's predictor running up
to its time limit, a large evaluation) leaves the other jobs' requests answered meanwhile.  At
most ``max_jobs`` jobs run at once; further jobs' requests wait their turn.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

#: jobs a site process serves at once (each holds one thread while it has requests queued)
MAX_JOBS = 4


class JobDispatcher:
    """``submit(job_id, task)`` runs ``task()`` after the job's earlier tasks, on a bounded pool."""

    def __init__(self, max_jobs: int = MAX_JOBS):
        if isinstance(max_jobs, bool) or not isinstance(max_jobs, int) or max_jobs < 1:
            raise ValueError(f"max_jobs must be a positive integer; got {max_jobs!r}")
        self._pool = ThreadPoolExecutor(max_workers=max_jobs, thread_name_prefix="site-job")
        self._queues: dict[str, deque] = {}
        self._lock = threading.Lock()

    def submit(self, job_id: str, task: Callable[[], None]) -> None:
        with self._lock:
            queue = self._queues.get(job_id)
            if queue is not None:  # a runner is draining this job's queue: it will get to it
                queue.append(task)
                return
            self._queues[job_id] = deque([task])
        self._pool.submit(self._drain, job_id)

    def _drain(self, job_id: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[job_id]
                if not queue:
                    del self._queues[job_id]
                    return
                task = queue.popleft()
            try:
                task()
            except Exception:  # noqa: BLE001 - a task answers its own errors; this is a bug's last stop
                log.exception("site request of job %s failed outside its handler", job_id)

    def close(self) -> None:
        """Stop taking work; the running tasks finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)
