"""A run going on in the background: what ``pipe.run(wait=False)`` returns.

Decisions:

- The run executes in a thread of the process that started it (a notebook's
  kernel), as a Dask or Ray future's work goes on while the kernel runs other
  cells.  A thread shares the stages as they were pickled when the run started,
  needs no second interpreter, and is stopped with the process: a process of its
  own would outlive a restarted kernel, holding the run and its ranks with
  nobody left to wait for them or cancel them.  The ranks themselves are
  processes, as in every run; the thread only orchestrates.
- The kernel's interrupt reaches the main thread only: it stops the cell that
  runs (``handle.wait()`` included), not the run.  ``handle.cancel()`` stops the
  run: its tasks are cancelled as by ``hetflow cancel``, and it is recorded
  CANCELLED, resumable with ``pipe.run(run_id=...)`` (or ``hetflow resume``).
- When the process exits with runs still going on (the kernel shut down or
  restarted), each is stopped and recorded INTERRUPTED before it exits, so that it
  does not show RUNNING until its lease lapses.
- Two runs of one process record into the store as two processes' runs would;
  one run cannot be executed twice at once (:class:`~hetflow.RunLocked`).
- ``status()`` and ``dataset()`` read the state store, as ``hetflow status`` and
  ``hetflow datasets`` do: a stage's output can be read as soon as the stage has
  committed it, while later stages run.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
import weakref
from typing import TYPE_CHECKING, Any

from hetflow.operators.dataset import Dataset

from .states import State

if TYPE_CHECKING:
    from .pipeline import _Started
    from .status import RunStatus

EXIT_WAIT = 30.0
"""Seconds the process's exit waits for each background run it stops (its tasks get the orchestrator's
own stop grace within it)."""

_handles: "weakref.WeakSet[RunHandle]" = weakref.WeakSet()
_handles_lock = threading.Lock()


class RunHandle:
    """A run started with ``pipe.run(wait=False)``, executing in a thread of this process.

    ``run_id`` names it (``hetflow status RUN`` from a shell shows it too); :meth:`status`,
    :meth:`done`, :meth:`wait`, :meth:`cancel`, :meth:`dataset`.  Displayed in a notebook, it
    renders as a table of its stages (:mod:`hetflow.display`).
    """

    def __init__(self, started: "_Started") -> None:
        self.run_id = started.run_id
        self.pipeline = started.pipeline
        self._orchestrator = started.orchestrator
        self._store_url = str(started.store.url)
        self._workdir = started.orchestrator.run_dir.parent.parent
        self._reader: Any = None
        self._future: concurrent.futures.Future[RunStatus] = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()
        self._thread = threading.Thread(target=self._execute, args=(started,), name=f"hetflow run {self.run_id}",
                                        daemon=True)  # the process's exit stops it first (_stop_at_exit)
        with _handles_lock:
            _handles.add(self)
        self._thread.start()

    def _execute(self, started: "_Started") -> None:
        try:
            self._future.set_result(started.execute())
        except BaseException as exc:  # noqa: BLE001 - wait() raises what run() would have
            self._future.set_exception(exc)

    # ------------------------------------------------------------ asking
    def done(self) -> bool:
        """Whether the run has ended (however it ended)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> "RunStatus":
        """The run's status once it has ended, as ``pipe.run()`` returns it; raises what ``pipe.run()``
        raises (:class:`~hetflow.RunFailed` for a run that did not end DONE, unless the run was started
        with ``check=False``).  ``TimeoutError`` when it is still running after ``timeout`` seconds (the run
        goes on).  Interrupting the wait (the kernel's stop button) stops the waiting, not the run."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"run {self.run_id} is still running after {timeout:g} s; wait() again, or stop "
                               "it with cancel()") from None

    def cancel(self, timeout: float | None = EXIT_WAIT) -> bool:
        """Stop the run: its running tasks are cancelled, nothing more starts, and it is recorded
        CANCELLED, resumable (``pipe.run(run_id=handle.run_id)``).  Waits up to ``timeout`` seconds
        for the stop to be recorded; True if this call stopped it, False if it had ended already."""
        if self.done():
            return False
        self._orchestrator.ask_stop(State.CANCELLED, "cancelled from Python (RunHandle.cancel())")
        concurrent.futures.wait([self._future], timeout)
        if not self.done():
            return True  # asked; the loop records it within its stop grace
        return self.status().state == State.CANCELLED

    def status(self) -> "RunStatus":
        """The run as recorded now: what ``hetflow status RUN`` shows (stages, states, cache decisions)."""
        from .status import run_status
        from .store import Store

        if self._reader is None:
            self._reader = Store(self._store_url)
        return run_status(self._reader, self.run_id)

    def dataset(self, name: str) -> Dataset:
        """Output ``name`` once its stage has committed it, while the run goes on; ``KeyError`` naming the
        stage that makes it and that stage's state when it has not (yet)."""
        status = self.status()
        if name in status.datasets:
            return Dataset(status.datasets[name])
        makers = [stage for stage in status.stages if name in stage.outputs]
        if not makers:
            outputs = sorted({out for stage in status.stages for out in stage.outputs})
            raise KeyError(f"run {self.run_id}: no stage outputs a dataset {name!r} (outputs: {outputs})")
        stage = makers[0]
        then = "wait() for the run, or ask again later" if status.state == State.RUNNING else "the run has ended"
        raise KeyError(f"run {self.run_id}: dataset {name!r} is not committed: its stage {stage.name!r} is "
                       f"{stage.state} ({then})")

    # ------------------------------------------------------------ display
    def __repr__(self) -> str:
        from .display import run_text

        try:
            return run_text(self.status(), handle=True)
        except Exception as exc:  # noqa: BLE001 - a repr never raises: the store may be gone
            return f"<RunHandle {self.run_id}: status unreadable ({type(exc).__name__}: {exc})>"

    def _repr_html_(self) -> str:
        from .display import run_html, serve_link

        status = self.status()
        return run_html(status, link=serve_link(self._workdir, self._store_url, self.run_id))


@atexit.register
def _stop_at_exit() -> None:
    """Stop the runs still going on when the process exits (a kernel shut down or restarted): recorded
    INTERRUPTED, resumable, their tasks stopped, instead of RUNNING until their lease lapses."""
    with _handles_lock:
        running = [handle for handle in _handles if not handle.done()]
    for handle in running:
        handle._orchestrator.ask_stop(State.INTERRUPTED, "interrupted (the Python process that started it in the "
                                                     "background exited)")
    for handle in running:
        concurrent.futures.wait([handle._future], EXIT_WAIT)
