"""tasks/runners.py: the threads that watch tasks, reused instead of one started per task."""

from __future__ import annotations

import threading
import time

import pytest

from hetflow.tasks import runners
from hetflow.tasks.runners import Runners


def _wait_for(check, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_a_thread_that_finished_its_job_runs_the_next_one():
    pool = Runners("t")
    seen: list[int] = []
    for _ in range(20):
        done = threading.Event()
        pool.submit(lambda d=done: (seen.append(threading.get_ident()), d.set()))
        assert done.wait(10)
        _wait_for(lambda: pool._idle == 1)  # it counts itself idle after the job
    assert len(set(seen)) == 1, "a new thread for each job"


def test_jobs_that_run_at_once_each_get_a_thread():
    """Watching a task blocks its thread for the task's life: ten tasks at once need ten threads."""
    pool = Runners("t")
    release = threading.Event()
    running = []
    lock = threading.Lock()

    def job() -> None:
        with lock:
            running.append(threading.get_ident())
        release.wait(10)

    for _ in range(10):
        pool.submit(job)
    _wait_for(lambda: len(running) == 10)
    assert len(set(running)) == 10
    release.set()
    _wait_for(lambda: pool._idle == 10)
    assert pool._started == 10


def test_an_idle_thread_ends_and_a_job_after_it_still_runs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(runners, "IDLE_SECONDS", 0.05)
    pool = Runners("idle-test")
    first = threading.Event()
    pool.submit(first.set)
    assert first.wait(10)
    _wait_for(lambda: pool._idle == 0 and not any(t.name == "idle-test-1" for t in threading.enumerate()))
    second = threading.Event()
    pool.submit(second.set)
    assert second.wait(10)
    assert pool._started == 2


def test_a_job_that_raises_leaves_its_thread_serving(caplog: pytest.LogCaptureFixture):
    pool = Runners("t")
    pool.submit(lambda: 1 / 0)
    _wait_for(lambda: pool._idle == 1)
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(10)
    assert pool._started == 1
    assert "a job raised" in caplog.text
