"""The Dask backend: stages run on the workers of a ``dask.distributed`` cluster.

Each pilot node is one Dask worker (sorted by address).  A task becomes ONE
Dask task pinned to the worker of its node, annotated with the cores and GPUs
it holds (``resources={"cores": ..., "gpus": ...}`` when the workers declare
them), which starts the task's ranks with the pilot's launcher (``mpiexec``)
on that worker's host: the ranks form a real MPI world, exactly as with the
local backend.  A task whose ranks span workers on different hosts would need
a cross-host rendezvous that this backend does not provide; it is rejected
with :class:`UnsatisfiableRequest` (use dask-mpi workers under the radical or
parsl backend for multi-node stages).

Options (``pilot.options.dask``):

* ``address``: scheduler address of an existing cluster.  Without it the
  backend starts a scheduler and one worker process per pilot node on this
  host (no dashboard, loopback only) and stops them on :meth:`shutdown`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnsatisfiableRequest
from .base import Backend, LaunchSpec, TaskOutcome
from .ranks import RankRun, options_for, outcome_fields, private_dir, run_ranks, safe_name, stop_and_wait

log = logging.getLogger(__name__)

OPTIONS = ("address",)


class DaskBackend(Backend):
    """Launch tasks as Dask tasks that start the ranks with the pilot's launcher."""

    name = "dask"

    def __init__(self, pilot: Any, run_dir: Path) -> None:
        super().__init__(pilot, run_dir)
        self.options = options_for(pilot, "dask", OPTIONS)
        self._client: Any = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._workers: list[str] = []
        self._hosts: list[str] = []
        self._resources = False
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Any, Future[TaskOutcome], Path]] = {}
        self._cancel_dir = run_dir / "dask" / "cancel"

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        from distributed import Client

        private_dir(self._cancel_dir)
        address = self.options.get("address")
        if not address:
            address = self._start_local_cluster()
        self._client = Client(address, set_as_default=False, timeout=60)  # type: ignore[no-untyped-call]
        self._client.wait_for_workers(self.pilot.nodes, timeout=120)
        info = self._client.scheduler_info(n_workers=-1)["workers"]
        self._workers = sorted(info, key=lambda w: (str(info[w].get("name")), w))[: self.pilot.nodes]
        if len(self._workers) < self.pilot.nodes:
            raise ConfigError(f"{self.pilot.shape()} needs {self.pilot.nodes} Dask workers, "
                              f"the cluster at {address} has {len(info)}")
        self._hosts = [info[w].get("host", "localhost") for w in self._workers]
        self._resources = all("cores" in (info[w].get("resources") or {}) for w in self._workers)
        log.info("dask backend on %d worker(s): %s", len(self._workers), self._workers)

    def _start_local_cluster(self) -> str:
        """A scheduler and one worker per pilot node, as separate processes on this host.

        Processes started with ``python -m distributed.cli...`` rather than a
        ``LocalCluster``: its worker processes would re-import the user's script
        (multiprocessing spawn), which runs the pipeline again.
        """
        base = private_dir(self.run_dir / "dask")
        atexit.register(self._at_exit)  # after Ctrl-C too: they run in their own sessions
        scheduler_file = base / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)
        logs = private_dir(base / "logs")
        common = {"stdin": subprocess.DEVNULL, "start_new_session": True}
        with open(logs / "scheduler.log", "ab") as out:
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                 "--no-dashboard", "--scheduler-file", str(scheduler_file)],
                stdout=out, stderr=subprocess.STDOUT, **common))  # type: ignore[call-overload]
        cores = len(self.pilot.usable_cores())
        for node in range(self.pilot.nodes):
            with open(logs / f"worker-{node}.log", "ab") as out:
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                     "--host", "127.0.0.1", "--no-nanny", "--no-dashboard", "--nthreads", str(cores),
                     "--name", f"node{node:05d}", "--local-directory", str(private_dir(base / f"worker-{node}")),
                     "--resources", f"cores={cores} gpus={self.pilot.gpus_per_node or 0}"],
                    stdout=out, stderr=subprocess.STDOUT, **common))  # type: ignore[call-overload]
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.stat().st_size:
            if time.monotonic() > deadline or self._procs[0].poll() is not None:
                self._stop_local_cluster()
                raise RuntimeError(f"the local Dask scheduler did not start; see {logs / 'scheduler.log'}")
            time.sleep(0.05)
        time.sleep(0.05)  # the file is written in one go, but give the writer a moment
        return str(json.loads(scheduler_file.read_text())["address"])

    def _stop_local_cluster(self) -> None:
        """Stop the processes of our own cluster: workers first, then the scheduler.

        One at a time: a worker sent SIGTERM while its scheduler is closing can
        hang in Dask's close path; a process that does not stop is killed.
        """
        deadline = time.monotonic() + 5  # after client.shutdown() they are on their way out
        for proc in reversed(self._procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in reversed(self._procs):
            if proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                log.warning("dask process %d did not stop on SIGTERM; killing it", proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()

    def pids(self) -> list[int]:
        """PIDs of the scheduler and worker processes this backend started (for leak checks)."""
        return [proc.pid for proc in self._procs]

    def node_names(self) -> list[str]:
        return list(self._hosts) if self._hosts else super().node_names()

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._running)
        for task_id in running:
            self.cancel(task_id)
        for _, future, _ in list(self._running.values()):
            try:
                future.result(timeout=30)
            except Exception:  # noqa: BLE001 - shutting down; the outcome was reported already
                pass
        if self._client is not None:
            if self._procs:
                # Our own cluster: let the scheduler close its workers, then itself.
                try:
                    self._client.shutdown()
                except Exception as exc:  # noqa: BLE001 - the processes are stopped below anyway
                    log.info("dask client.shutdown() failed (%r); stopping the processes", exc)
            else:
                self._client.close()
            self._client = None
        self._stop_local_cluster()

    # ------------------------------------------------------------------- tasks
    def launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        if self._client is None:
            raise RuntimeError("dask backend not started; call start() first")
        nodes = sorted({slot.node for slot in spec.slots})
        if len({self._hosts[n] for n in nodes}) > 1:
            raise UnsatisfiableRequest(
                f"task {spec.task_id!r}: its {spec.ranks} ranks span Dask workers on hosts "
                f"{sorted({self._hosts[n] for n in nodes})}; the dask backend starts a task's ranks on one host "
                f"(use the radical or parsl backend for multi-node MPI stages)")
        cancel_file = self._cancel_dir / safe_name(spec.task_id)
        cancel_file.unlink(missing_ok=True)
        run = RankRun(task_id=spec.task_id, command=tuple(spec.argv), slots=spec.slots,
                      launcher=self.pilot.launcher, cwd=str(spec.cwd), cancel_file=str(cancel_file),
                      env=dict(spec.env), timeout=spec.timeout,
                      stdout=None if spec.stdout is None else str(spec.stdout),
                      stderr=None if spec.stderr is None else str(spec.stderr))
        # Every slot of the task is on one host: show the launcher a single local node.
        local_run = dataclasses.replace(run, slots=tuple(dataclasses.replace(s, node=0) for s in spec.slots))
        kwargs: dict[str, Any] = {"workers": [self._workers[nodes[0]]], "allow_other_workers": False,
                                  "pure": False, "key": f"hetflow-{safe_name(spec.task_id)}-{uuid.uuid4().hex[:8]}"}
        if self._resources:
            # The task runs on the worker of its first node; on a host with several pilot
            # nodes (workers), the slots on the other nodes are that host's too, and the
            # hetflow scheduler already holds them: annotate what this worker gives.
            here = [s for s in spec.slots if s.node == nodes[0]]
            kwargs["resources"] = {"cores": sum(len(s.cores) for s in here)}
            gpus = sum(len(s.gpus) for s in here)
            if gpus:
                kwargs["resources"]["gpus"] = gpus
        outcome: Future[TaskOutcome] = Future()
        outcome.set_running_or_notify_cancel()
        remote = self._client.submit(run_ranks, local_run, **kwargs)
        with self._lock:
            self._running[spec.task_id] = (remote, outcome, cancel_file)
        remote.add_done_callback(lambda f, task_id=spec.task_id: self._done(task_id, f))
        return outcome

    def _done(self, task_id: str, remote: Any) -> None:
        with self._lock:
            entry = self._running.pop(task_id, None)
        if entry is None:
            return
        _, outcome, _ = entry
        try:
            outcome.set_result(TaskOutcome(**outcome_fields(remote.result())))
        except Exception as exc:  # noqa: BLE001 - the engine failed the task: report, don't raise in a callback
            outcome.set_result(TaskOutcome(task_id, None, detail=f"dask task failed: {exc!r}"))

    def _at_exit(self) -> None:
        """Interpreter exit without :meth:`shutdown` (Ctrl-C): stop running tasks, then the engine."""
        with self._lock:
            entries = list(self._running.values())
        stop_and_wait(entries)
        self._stop_local_cluster()

    def cancel(self, task_id: str) -> None:
        with self._lock:
            entry = self._running.get(task_id)
        if entry is None:
            return
        # Not ``remote.cancel()``: Dask would forget a running task without stopping its
        # processes.  The task sees the file (before starting or while running) and kills
        # its process group, then its future resolves as cancelled.
        entry[2].touch()
