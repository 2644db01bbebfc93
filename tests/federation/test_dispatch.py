"""The site process's dispatcher: a slow request of one job leaves another job's answered at once;
each job's requests run in order; at most max_jobs jobs run at once."""

from __future__ import annotations

import threading
import time

from msa_fed.federation.dispatch import JobDispatcher


def test_a_slow_job_does_not_delay_another():
    d = JobDispatcher(max_jobs=2)
    release, other_ran = threading.Event(), threading.Event()
    seen = {}
    d.submit("slow", lambda: release.wait(60))
    d.submit("other", lambda: (seen.setdefault("slow_released", release.is_set()), other_ran.set()))
    answered = other_ran.wait(30)  # the slow job holds its thread until released below
    release.set()
    d.close()
    assert answered and seen == {"slow_released": False}  # answered while the slow job still ran


def test_a_jobs_requests_run_in_order_one_at_a_time():
    d = JobDispatcher(max_jobs=4)
    seen, running = [], []
    lock = threading.Lock()

    def task(i):
        with lock:
            running.append(i)
            assert len(running) == 1
        time.sleep(0.002)
        seen.append(i)
        with lock:
            running.remove(i)

    for i in range(30):
        d.submit("job", lambda i=i: task(i))
    for _ in range(500):
        if len(seen) == 30:
            break
        time.sleep(0.01)
    d.close()
    assert seen == list(range(30))


def test_at_most_max_jobs_at_once():
    d = JobDispatcher(max_jobs=2)
    active, peak = [0], [0]
    lock = threading.Lock()
    finished = threading.Semaphore(0)

    def task():
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        finished.release()

    for j in range(5):
        d.submit(f"job{j}", task)
    for _ in range(5):
        assert finished.acquire(timeout=10)
    d.close()
    assert peak[0] == 2
