"""The Dask backend: stages run on the workers of a ``dask.distributed`` cluster.

Each pilot node is one Dask worker (sorted by name, then address).  Tasks are
Dask tasks pinned to the worker of their node (``workers=[...]``,
``allow_other_workers=False``) and annotated with the cores and GPUs they
hold (``resources={"cores": ..., "gpus": ...}`` when the workers declare
them).  A multi-rank task gets its communicator in one of two ways
(``options.dask.communicator``):

* ``mpi``: ONE Dask task starts all ranks with the pilot's launcher
  (``mpiexec``) on its worker's host, so they form a real MPI world, exactly
  as with the local backend.  Needs every rank on one host (or workers that
  are MPI ranks, via dask-mpi under the radical or parsl backend).
* ``tcp``: every rank is its own Dask task, pinned to the worker of its
  node, which runs the rank's command (the worker entry point) as a
  subprocess with ``HETFLOW_COMM=tcp``: the ranks build the TCP communicator
  of :mod:`hetflow.operators.tcpcomm`, which implements the same table
  collectives, over any number of hosts.  Rendezvous: for each launch the
  backend makes a private directory ``<run>/dask/comm/<task>-<id>/`` (on
  the file system every worker sees, like the datasets and cancel files)
  holding a fresh random secret (mode 0600; it never crosses the Dask
  wire); rank 0 listens on a kernel-chosen port of its worker's address
  and publishes ``host:port`` in that directory; the other ranks connect
  and authenticate with the secret.  A rank that fails creates the launch's
  abort file, and every other rank of the task is stopped (its process
  group killed) within a poll interval, even before the rendezvous is
  complete; the rank's own ``Abort`` has already ended the others when they
  were connected.  The directory is removed when the task ends.
* ``auto`` (default): ``mpi`` when all the task's ranks are on one worker
  host, ``tcp`` otherwise.

Ranks of one task must be able to run at the same time: the Dask workers
need a thread per rank they host (the local cluster gives each worker one
thread per core), else the ranks that started wait at the rendezvous until
its timeout (``HETFLOW_COMM_CONNECT_TIMEOUT``, 120 s) names the missing ones.

Options (``pilot.options.dask``):

* ``address``: scheduler address of an existing cluster.  Without it (and
  without ``jobqueue``) the backend starts a scheduler and one worker process
  per pilot node on this host (no dashboard, loopback only) and stops them on
  :meth:`shutdown`.
* ``jobqueue``: ``slurm``: the workers are batch jobs of dask-jobqueue's
  ``SLURMCluster``, one per pilot node (:mod:`hetflow.tasks.backends.jobqueue`,
  which also reads ``worker_init``, ``scheduler_options`` and ``start_timeout``).
  Nodes are then told apart by the workers' hostnames, which are the node names.
* ``communicator``: ``auto`` | ``mpi`` | ``tcp`` (above).
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
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, UnsatisfiableRequest
from ..gpu import GpuVendor, visible_devices_env
from ..scheduler import RankSlot
from .base import Backend, LaunchSpec, TaskOutcome
from ..paths import private_dir
from .ranks import (RankRun, options_for, outcome_fields, run_rank, run_ranks, safe_name,
                    stop_and_wait)

log = logging.getLogger(__name__)

OPTIONS = ("address", "communicator", "jobqueue", "worker_init", "scheduler_options", "start_timeout")
COMMUNICATORS = ("auto", "mpi", "tcp")


def check_options(pilot: Any) -> Mapping[str, Any]:
    """``pilot.options.dask`` with its keys, ``communicator`` and ``jobqueue`` checked (:class:`ConfigError`)."""
    from .jobqueue import JOBQUEUES

    options = options_for(pilot, "dask", OPTIONS)
    communicator = options.get("communicator", "auto")
    if communicator not in COMMUNICATORS:
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.communicator is {communicator!r} "
                          f"(allowed: {list(COMMUNICATORS)})")
    jobqueue = options.get("jobqueue")
    if jobqueue is not None and jobqueue not in JOBQUEUES:
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.jobqueue is {jobqueue!r} "
                          f"(allowed: {list(JOBQUEUES)}, or left out)")
    if jobqueue is not None and options.get("address"):
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.address and options.dask.jobqueue exclude each "
                          "other (address: an existing cluster; jobqueue: one the backend submits)")
    batch_only = sorted(k for k in ("worker_init", "scheduler_options") if k in options)
    if jobqueue is None and batch_only:
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.{batch_only[0]} needs options.dask.jobqueue "
                          f"(allowed: {list(JOBQUEUES)})")
    return options


@dataclass
class _Launch:
    """A launched task: its Dask futures (one, or one per rank) and what they reported so far."""

    task_id: str
    remotes: list[Any]
    outcome: "Future[TaskOutcome]"
    cancel_file: Path
    comm_dir: Path | None = None
    results: dict[int, Mapping[str, Any] | BaseException] = field(default_factory=dict)


def choose_communicator(option: str, rank_hosts: "list[str]") -> str:
    """``mpi`` or ``tcp`` for a task whose ranks run on ``rank_hosts`` (``option``: auto, mpi or tcp)."""
    if option != "auto":
        return option
    return "tcp" if len(set(rank_hosts)) > 1 else "mpi"


def combine_ranks(task_id: str, results: list[Mapping[str, Any] | BaseException]) -> TaskOutcome:
    """One outcome for a task whose ranks ran as separate engine tasks (in rank order).

    The first rank that failed by itself (not stopped because another failed)
    gives the return code and signal; the details of every failed rank are kept.
    """
    fields: list[Mapping[str, Any]] = [
        r if isinstance(r, Mapping) else {"returncode": None, "detail": f"dask task failed: {r!r}"} for r in results]
    started = [f["started"] for f in fields if f.get("started") is not None]
    ended = [f["ended"] for f in fields if f.get("ended") is not None]
    cancelled = any(f.get("cancelled") for f in fields)
    timed_out = any(f.get("timed_out") for f in fields)
    failed = [(rank, f) for rank, f in enumerate(fields) if f.get("returncode") != 0]
    own = [(rank, f) for rank, f in failed if not f.get("aborted")] or failed
    code: int | None = 0
    signal_: int | None = None
    if own:
        code, signal_ = own[0][1].get("returncode"), own[0][1].get("signal")
    detail = "; ".join(f"rank {rank}: {f.get('detail') or 'exited with ' + str(f.get('returncode'))}"
                       for rank, f in failed)
    return TaskOutcome(task_id, code, timed_out=timed_out, cancelled=cancelled, signal=signal_,
                       started=min(started) if started else None, ended=max(ended) if ended else None,
                       detail=detail)


def tcp_rank_env(base: Mapping[str, str], rank: int, size: int, comm_dir: Path, host: str, vendor: GpuVendor,
                 gpus: tuple[int, ...]) -> dict[str, str]:
    """The environment of one rank started alone by a Dask task: its TCP communicator and its GPUs."""
    env = dict(base)
    env.update({"HETFLOW_COMM": "tcp", "HETFLOW_COMM_RANK": str(rank), "HETFLOW_COMM_SIZE": str(size),
                "HETFLOW_COMM_RENDEZVOUS": str(comm_dir / "address"),
                "HETFLOW_COMM_SECRET_FILE": str(comm_dir / "secret"), "HETFLOW_COMM_HOST": host})
    env.update(visible_devices_env(vendor, gpus))
    return env


class DaskBackend(Backend):
    """Launch tasks as Dask tasks that start the ranks with the pilot's launcher."""

    name = "dask"

    def __init__(self, pilot: Any, run_dir: Path) -> None:
        super().__init__(pilot, run_dir)
        self.options = check_options(pilot)
        self._client: Any = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._workers: list[str] = []
        self._hosts: list[str] = []
        self._names: list[str] = []  # node names: the hosts, or the workers' hostnames on a jobqueue cluster
        self._cluster: Any = None  # the dask-jobqueue cluster, when options.dask.jobqueue
        self._resources = False
        self._lock = threading.Lock()
        self._running: dict[str, _Launch] = {}
        self._cancel_dir = run_dir / "dask" / "cancel"
        self._comm_root = run_dir / "dask" / "comm"
        self.communicator = str(self.options.get("communicator", "auto"))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        from distributed import Client

        private_dir(self._cancel_dir)
        private_dir(self._comm_root)
        address = self.options.get("address")
        jobqueue = self.options.get("jobqueue")
        timeout = 120.0
        if jobqueue:
            from .jobqueue import start_cluster

            atexit.register(self._close_cluster)
            self._cluster = start_cluster(str(jobqueue), self.pilot, self.run_dir, self.options)
            address = self._cluster.scheduler_address
            timeout = float(self.options.get("start_timeout", 600))
        elif not address:
            address = self._start_local_cluster()
        try:
            self._client = Client(address, set_as_default=False, timeout=60)  # type: ignore[no-untyped-call]
            self._wait_for_workers(str(address), timeout)
            info = self._client.scheduler_info(n_workers=-1)["workers"]
            self._workers = sorted(info, key=lambda w: (str(info[w].get("name")), w))[: self.pilot.nodes]
            if len(self._workers) < self.pilot.nodes:
                raise ConfigError(f"{self.pilot.shape()} needs {self.pilot.nodes} Dask workers, "
                                  f"the cluster at {address} has {len(info)}")
            self._hosts = [info[w].get("host", "localhost") for w in self._workers]
            self._names = list(self._hosts)
            if jobqueue:
                # one job per node: the workers share an address on a one-host lab cluster, never a hostname
                hostnames = self._client.run(socket.gethostname, workers=self._workers)
                self._names = [str(hostnames[w]) for w in self._workers]
            self._resources = all("cores" in (info[w].get("resources") or {}) for w in self._workers)
        except BaseException:
            self.shutdown()
            raise
        log.info("dask backend on %d worker(s): %s (nodes %s)", len(self._workers), self._workers, self._names)

    def _wait_for_workers(self, address: str, timeout: float) -> None:
        """Until the pilot's workers connected; on a jobqueue cluster, fail as soon as a job ended without one."""
        from .jobqueue import ended_jobs, job_error

        deadline = time.monotonic() + timeout
        while True:
            try:
                self._client.wait_for_workers(self.pilot.nodes, timeout=min(2.0, timeout))
                return
            except TimeoutError:
                pass
            ended = ended_jobs(self._cluster) if self._cluster is not None else []
            if ended:
                logs = self.run_dir / "dask" / "logs"
                raise ConfigError(f"{self.pilot.shape()}: dask-jobqueue job {ended[0]} ended before its Dask "
                                  f"worker connected: {job_error(logs, ended[0])}")
            if time.monotonic() > deadline:
                where = f"; see the job logs in {self.run_dir / 'dask' / 'logs'}" if self._cluster is not None else ""
                raise ConfigError(f"{self.pilot.shape()}: {self.pilot.nodes} Dask worker(s) did not connect to "
                                  f"{address} within {timeout:g} s{where}")

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
        return list(self._names) if self._names else super().node_names()

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._running)
        for task_id in running:
            self.cancel(task_id)
        for launch in list(self._running.values()):
            try:
                launch.outcome.result(timeout=30)
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
        self._close_cluster()
        self._stop_local_cluster()

    def _close_cluster(self) -> None:
        """Close the dask-jobqueue cluster, which cancels its batch jobs (also at interpreter exit)."""
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            try:
                cluster.close()
            except Exception:  # shutting down: say it; the jobs end at their walltime
                log.exception("closing the dask-jobqueue cluster failed; its jobs may still be queued")

    # ------------------------------------------------------------------- tasks
    def uses_tcp(self, slots: "tuple[RankSlot, ...]") -> bool:
        """Whether a task on ``slots`` gets the TCP communicator (else one ``mpiexec``)."""
        return choose_communicator(self.communicator, [self._names[slot.node] for slot in slots]) == "tcp"

    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        if self._client is None:
            raise RuntimeError("dask backend not started; call start() first")
        cancel_file = self._cancel_dir / safe_name(spec.task_id)
        cancel_file.unlink(missing_ok=True)
        run = RankRun.of(spec, self.pilot.launcher, cancel_file)
        outcome: Future[TaskOutcome] = Future()
        outcome.set_running_or_notify_cancel()
        launch = _Launch(spec.task_id, [], outcome, cancel_file)
        if self.uses_tcp(spec.slots):
            launch.comm_dir = private_dir(self._comm_root / f"{safe_name(spec.task_id)}-{uuid.uuid4().hex[:8]}")
            remotes = self._submit_tcp(run, launch.comm_dir)
        else:
            remotes = [self._submit_mpi(run)]
        launch.remotes = remotes
        with self._lock:
            self._running[spec.task_id] = launch
        for rank, remote in enumerate(remotes):
            remote.add_done_callback(lambda f, task_id=spec.task_id, rank=rank: self._done(task_id, rank, f))
        return outcome

    def _submit_kwargs(self, run: RankRun, node: int, slots: "list[RankSlot]", label: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"workers": [self._workers[node]], "allow_other_workers": False, "pure": False,
                                  "key": f"hetflow-{safe_name(run.task_id)}{label}-{uuid.uuid4().hex[:8]}"}
        if self._resources:
            kwargs["resources"] = {"cores": sum(len(s.cores) for s in slots)}
            gpus = sum(len(s.gpus) for s in slots)
            if gpus:
                kwargs["resources"]["gpus"] = gpus
        return kwargs

    def _submit_mpi(self, run: RankRun) -> Any:
        """All ranks with one ``mpiexec`` from the worker of the first node (they share its host)."""
        nodes = sorted({slot.node for slot in run.slots})
        if len({self._names[n] for n in nodes}) > 1:
            raise UnsatisfiableRequest(
                f"task {run.task_id!r}: its {len(run.slots)} ranks span Dask workers on hosts "
                f"{sorted({self._names[n] for n in nodes})}, which one mpiexec cannot reach; "
                "set options.dask.communicator to 'auto' or 'tcp'")
        # Every slot of the task is on one host: show the launcher a single local node.
        local_run = dataclasses.replace(run, slots=tuple(dataclasses.replace(s, node=0) for s in run.slots))
        # On a host with several pilot nodes (workers), the slots on the other nodes are that
        # host's too, and the hetflow scheduler already holds them: annotate what this worker gives.
        here = [s for s in run.slots if s.node == nodes[0]]
        return self._client.submit(run_ranks, local_run, **self._submit_kwargs(run, nodes[0], here, ""))

    def _submit_tcp(self, run: RankRun, comm_dir: Path) -> list[Any]:
        """One Dask task per rank on its node's worker; they meet through ``comm_dir`` (module docstring)."""
        from hetflow.operators import tcpcomm

        tcpcomm.write_secret(comm_dir / "secret")
        remotes = []
        for rank, slot in enumerate(run.slots):
            env = tcp_rank_env(run.env, rank, len(run.slots), comm_dir, self._hosts[slot.node], self.pilot.vendor,
                               slot.gpus)
            one = dataclasses.replace(run, env=env, abort_file=str(comm_dir / "abort"))
            remotes.append(self._client.submit(run_rank, one,
                                               **self._submit_kwargs(run, slot.node, [slot], f"-r{rank}")))
        return remotes

    def _done(self, task_id: str, rank: int, remote: Any) -> None:
        try:
            result: Mapping[str, Any] | BaseException = remote.result()
        except BaseException as exc:  # noqa: BLE001 - the engine failed the task: report, don't raise in a callback
            result = exc
        with self._lock:
            launch = self._running.get(task_id)
            if launch is None:
                return
            launch.results[rank] = result
            failed = not isinstance(result, Mapping) or result.get("returncode") != 0
            if failed and launch.comm_dir is not None:
                (launch.comm_dir / "abort").touch()  # e.g. its Dask worker died: stop the other ranks
            if len(launch.results) < len(launch.remotes):
                return
            del self._running[task_id]
        if launch.comm_dir is not None:
            shutil.rmtree(launch.comm_dir, ignore_errors=True)
            outcome = combine_ranks(task_id, [launch.results[r] for r in range(len(launch.remotes))])
        elif isinstance(result, Mapping):
            outcome = TaskOutcome(**outcome_fields(result))
        else:
            outcome = TaskOutcome(task_id, None, detail=f"dask task failed: {result!r}")
        launch.outcome.set_result(outcome)

    def _at_exit(self) -> None:
        """Interpreter exit without :meth:`shutdown` (Ctrl-C): stop running tasks, then the engine."""
        with self._lock:
            entries = [(launch.outcome, launch.cancel_file) for launch in self._running.values()]
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
        entry.cancel_file.touch()
