"""The embedded local backend: every task is one ``mpiexec`` on this machine.

Each task runs in its own session (process group), so a timeout or a cancel
kills every rank and Hydra's proxies with one signal, and nothing outlives
:meth:`LocalBackend.shutdown`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from ..errors import HetflowError
from ..launchers.mpiexec import Mpiexec
from .base import Backend, LaunchSpec, TaskOutcome

log = logging.getLogger(__name__)

KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when a task is stopped."""


MPIEXEC_ENV = "HETFLOW_MPIEXEC"
"""Names the ``mpiexec`` to use (a site's MPI module) instead of the one beside this Python."""


def find_mpiexec() -> str:
    """``$HETFLOW_MPIEXEC``, else the ``mpiexec`` beside this Python (the ``mpich`` wheel's), else the first on PATH."""
    chosen = os.environ.get(MPIEXEC_ENV)
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise HetflowError(f"{MPIEXEC_ENV}={chosen!r} is not an executable mpiexec (not found, or not "
                               "executable); unset it to use the one installed with hetflow[mpich]")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise HetflowError("no mpiexec found beside this Python or on PATH; install one with "
                           "pip install 'hetflow[mpich]' or load your site's MPI module")
    return found


def _private_log(path: Path) -> "int":
    """An append-only log file readable by this user only (whatever the umask)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, pilot, run_dir):  # type: ignore[no-untyped-def]
        super().__init__(pilot, run_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._launcher: Mpiexec | None = None

    def start(self) -> None:
        self._launcher = Mpiexec(find_mpiexec())

    def launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        if self._launcher is None:
            raise HetflowError("LocalBackend.launch() called before start()")
        argv = self._launcher.argv(spec.argv, spec.slots, self.node_names())
        env = dict(os.environ)
        env.update(spec.env)
        future: Future[TaskOutcome] = Future()
        future.set_running_or_notify_cancel()
        stdout = _private_log(spec.stdout) if spec.stdout else subprocess.DEVNULL
        stderr = _private_log(spec.stderr) if spec.stderr else subprocess.DEVNULL
        started = time.time()
        try:
            proc = subprocess.Popen(argv, cwd=spec.cwd, env=env, stdout=stdout, stderr=stderr,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            for fh in (stdout, stderr):
                if fh != subprocess.DEVNULL:
                    os.close(fh)
        with self._lock:
            self._procs[spec.task_id] = proc
        log.debug("started %s: pid %d: %s", spec.task_id, proc.pid, argv)
        thread = threading.Thread(target=self._wait, args=(spec, proc, started, future),
                                  name=f"hetflow-wait-{spec.task_id}", daemon=True)
        thread.start()
        return future

    def _wait(self, spec: LaunchSpec, proc: "subprocess.Popen[bytes]", started: float,
              future: "Future[TaskOutcome]") -> None:
        timed_out = False
        try:
            proc.wait(timeout=spec.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            log.warning("task %s exceeded its timeout of %ss; killing its process group", spec.task_id, spec.timeout)
            self._kill_group(proc)
        with self._lock:
            self._procs.pop(spec.task_id, None)
            cancelled = spec.task_id in self._cancelled
        code = proc.returncode
        future.set_result(TaskOutcome(
            task_id=spec.task_id, returncode=code, timed_out=timed_out, cancelled=cancelled,
            signal=-code if code is not None and code < 0 else None, started=started, ended=time.time(),
            detail=f"timed out after {spec.timeout}s" if timed_out else ""))

    @staticmethod
    def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                # the leader is gone; make sure no rank of its group survives it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
            return

    def cancel(self, task_id: str) -> None:
        with self._lock:
            proc = self._procs.get(task_id)
            if proc is None:
                return
            self._cancelled.add(task_id)
        self._kill_group(proc)

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._procs)
        for task_id in running:
            self.cancel(task_id)
