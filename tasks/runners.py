"""Threads that watch tasks, kept and reused: one per running task, none started per task.

A backend watches each task it launches in a thread of its own (book its cores, start it, wait for it,
report its outcome).  Starting a thread per task made the orchestrator wait, at every launch, for the new
thread to be scheduled (``Thread.start`` blocks until the thread runs), which the run's other threads
competing for the interpreter made the largest single cost of a launch (docs/benchmarks.md, issue 26).
:class:`Runners` hands a job to a thread that has finished its last one, and starts a thread only when
every thread is busy; a thread idle for :data:`IDLE_SECONDS` ends.  The threads are daemons, as the
per-task threads were: a process that ends does not wait for a task it was watching.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

IDLE_SECONDS = 30.0
"""How long a thread waits for another job before it ends."""


class Runners:
    """A growing set of daemon threads, each running one job at a time (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no submitted job has claimed yet
        self._started = 0

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        """Run ``job(*args)`` in a thread now: an idle one, or a new one when none is idle."""
        with self._lock:
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
            else:
                self._started += 1
                number = self._started
        self._jobs.put((job, args))
        if not claimed:
            threading.Thread(target=self._serve, name=f"{self.name}-{number}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job, args = self._jobs.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job claimed this thread: it ends
                        self._idle -= 1
                        return
                continue  # a job was submitted for it just now: it is in the queue
            try:
                job(*args)
            except BaseException:  # noqa: BLE001 - a job reports its own outcome; this thread serves the next
                log.exception("%s: a job raised", self.name)
            with self._lock:
                self._idle += 1
