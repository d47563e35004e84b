"""The Parsl backend: one Parsl ``MPIExecutor`` block holds the pilot's nodes.

A task becomes a Parsl python app with ``parsl_resource_specification``
(``num_nodes``, ``num_ranks``, ``ranks_per_node``).  Parsl's MPI worker pool
gives the app a node list (``PARSL_MPI_NODELIST``); the app maps the task's
slots onto those nodes and starts the ranks with the pilot's launcher
(``mpiexec``/``srun``/``jsrun``, an argv list) through :func:`run_ranks`.

What this module handles for users:

* outside a batch job Parsl's MPI pool refuses to start without a node file,
  so on a ``local`` scheduler the backend writes one (``PBS_NODEFILE``) into its
  run directory.  Parsl's MPI tasks claim whole node-file entries, so the file
  lists this host once per usable core: as many tasks can run at once as the
  hetflow scheduler may place;
* Parsl's workers are found by command name: the venv's ``bin`` is put first
  on ``PATH`` of this process before the executor starts;
* with a batch scheduler (``slurm``: Parsl's ``SlurmProvider``) the block is one
  job of ``nodes`` whole nodes; Parsl gives an MPI task whole nodes of it, and
  the ranks start as one job step (``srun``, as the ``slurm`` backend starts
  them, :func:`~hetflow.tasks.backends.ranks.launch_argv`), so at most ``nodes``
  tasks run at once;
* :meth:`ParslBackend.start` returns once the worker pool has connected (the
  block's job started), so start-up is paid there and a job that never starts
  is an error after ``start_timeout`` rather than a run waiting forever;
* an unclean exit leaves Parsl's interchange and worker pool running: the
  backend records every process Parsl starts and kills what
  ``DataFlowKernel.cleanup()`` left (also at interpreter exit).

Options (``pilot.options.parsl``): ``scheduler`` (``local``/``slurm``/``lsf``/``pbs``;
default from the launcher: ``srun`` → slurm, ``jsrun`` → lsf, else local),
``worker_init`` (shell lines run before the worker pool, e.g. ``module load``),
``scheduler_options`` (extra ``#SBATCH``/``#BSUB``/``#PBS`` lines),
``start_timeout`` (seconds the worker pool may take to connect: default 120 for
a local pool, 600 for a batch job, which may wait in the queue).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shlex
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..pilot import PilotDescription
from .base import Backend, LaunchSpec, TaskOutcome
from ..paths import private_dir
from .ranks import RankRun, options_for, outcome_fields, run_ranks, safe_name, stop_and_wait

log = logging.getLogger(__name__)

OPTIONS = ("scheduler", "worker_init", "scheduler_options", "start_timeout")
SCHEDULERS = ("local", "slurm", "lsf", "pbs")
LABEL = "hetflow"


def scheduler_of(pilot: PilotDescription) -> str:
    """The batch system a Parsl pilot goes through (``options.scheduler`` or from the launcher)."""
    default = {"srun": "slurm", "jsrun": "lsf"}.get(pilot.launcher, "local")
    scheduler = str(options_for(pilot, "parsl", OPTIONS).get("scheduler", default))
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"pilot {pilot.name!r}: bad value for 'options.parsl.scheduler': {scheduler!r} "
                          f"(expected one of {list(SCHEDULERS)})")
    return scheduler


def _walltime(pilot: PilotDescription) -> str:
    seconds = int(pilot.walltime or 3600)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def parsl_config(pilot: PilotDescription, run_dir: Path) -> Any:
    """The :class:`parsl.config.Config` this backend loads for ``pilot`` (also used by ``pilot render``)."""
    from parsl.config import Config
    from parsl.executors import MPIExecutor
    from parsl.launchers import SimpleLauncher
    from parsl.providers import LocalProvider, LSFProvider, PBSProProvider, SlurmProvider

    scheduler = scheduler_of(pilot)
    options = options_for(pilot, "parsl", OPTIONS)
    worker_init = str(options.get("worker_init", ""))
    scheduler_options = str(options.get("scheduler_options", ""))
    workers = pilot.nodes
    provider: Any
    if scheduler == "local":
        nodefile = run_dir / "parsl" / "nodefile"
        worker_init = "\n".join(filter(None, [f"export PBS_NODEFILE={shlex.quote(str(nodefile))}", worker_init]))
        workers = len(nodefile_hosts(pilot))
        provider = LocalProvider(nodes_per_block=1, init_blocks=1, min_blocks=1, max_blocks=1,  # type: ignore[no-untyped-call]
                                 worker_init=worker_init, launcher=SimpleLauncher())
    elif scheduler == "slurm":
        provider = SlurmProvider(partition=pilot.queue, account=pilot.account, nodes_per_block=pilot.nodes,
                                 init_blocks=1, min_blocks=1, max_blocks=1, walltime=_walltime(pilot),
                                 scheduler_options=scheduler_options, worker_init=worker_init, exclusive=True,
                                 launcher=SimpleLauncher())
    elif scheduler == "lsf":
        provider = LSFProvider(  # type: ignore[no-untyped-call]
            project=pilot.account, queue=pilot.queue, nodes_per_block=pilot.nodes,
            init_blocks=1, min_blocks=1, max_blocks=1, walltime=_walltime(pilot),
            scheduler_options=scheduler_options, worker_init=worker_init,
            bsub_redirection=True, launcher=SimpleLauncher())
    else:
        provider = PBSProProvider(  # type: ignore[no-untyped-call]
            account=pilot.account, queue=pilot.queue, nodes_per_block=pilot.nodes,
            cpus_per_node=pilot.cores_per_node or 1, init_blocks=1, min_blocks=1,
            max_blocks=1, walltime=_walltime(pilot), scheduler_options=scheduler_options,
            worker_init=worker_init, launcher=SimpleLauncher())
    executor = MPIExecutor(label=LABEL, provider=provider, max_workers_per_block=workers,
                           mpi_launcher="srun" if pilot.launcher == "srun" else "mpiexec",
                           working_dir=str(run_dir / "parsl" / "work"),
                           worker_logdir_root=str(run_dir / "parsl" / "logs"),
                           address="127.0.0.1" if scheduler == "local" else None,
                           heartbeat_period=5, heartbeat_threshold=30, poll_period=10)
    return Config(executors=[executor], run_dir=str(run_dir / "parsl" / "runinfo"), strategy="none",
                  usage_tracking=0, retries=0, exit_mode="cleanup", initialize_logging=False)


def nodefile_hosts(pilot: PilotDescription) -> list[str]:
    """Node-file entries for a local Parsl pilot: this host once per usable core of each pilot node."""
    return ["localhost"] * (pilot.nodes * len(pilot.usable_cores()))


def _run_in_parsl(run: RankRun, parsl_resource_specification: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The app body, on a Parsl worker: map the slots onto Parsl's nodes and start the ranks.

    ``parsl_resource_specification`` is consumed by Parsl (it picks the nodes).
    """
    nodes = [h for h in os.environ.get("PARSL_MPI_NODELIST", "localhost").split(",") if h]
    order = sorted({slot.node for slot in run.slots})
    if len(nodes) < len(order):
        raise RuntimeError(f"Parsl gave {len(nodes)} node(s) {nodes}, the task needs {len(order)}")
    index = {node: i for i, node in enumerate(order)}
    slots = tuple(dataclasses.replace(slot, node=index[slot.node]) for slot in run.slots)
    return run_ranks(dataclasses.replace(run, slots=slots), hosts=nodes[: len(order)])


CLEANUP_TIMEOUT = 60.0


class ParslBackend(Backend):
    """Launch tasks as Parsl MPI apps in one block that spans the pilot."""

    name = "parsl"

    def __init__(self, pilot: PilotDescription, run_dir: Path) -> None:
        super().__init__(pilot, run_dir)
        self.scheduler = scheduler_of(pilot)
        self._dfk: Any = None
        self._app: Any = None
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Future[TaskOutcome], Path]] = {}
        self._pids: set[int] = set()
        self._foreign: set[int] = set()
        self._base = run_dir / "parsl"
        self._cancel_dir = self._base / "cancel"

    def start(self) -> None:
        from parsl.app.app import python_app
        from parsl.dataflow.dflow import DataFlowKernel

        private_dir(self._cancel_dir)
        if self.scheduler == "local":
            (self._base / "nodefile").write_text("\n".join(nodefile_hosts(self.pilot)) + "\n")
        venv_bin = str(Path(sys.executable).parent)
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            log.info("putting %s first on PATH so Parsl finds its worker pool", venv_bin)
            os.environ["PATH"] = os.pathsep.join([venv_bin, os.environ.get("PATH", "")])
        atexit.register(self._at_exit)
        import psutil

        # Parsl processes that already exist belong to another backend in this process
        # (e.g. a second pilot): never claim, let alone kill, those.
        self._foreign = {p.pid for p in psutil.Process().children(recursive=True)}
        self._dfk = DataFlowKernel(parsl_config(self.pilot, self.run_dir))
        self._app = python_app(_run_in_parsl, data_flow_kernel=self._dfk, executors=[LABEL])
        self._remember_children()
        default = 120 if self.scheduler == "local" else 600
        self._wait_for_pool(float(options_for(self.pilot, "parsl", OPTIONS).get("start_timeout", default)))

    def _wait_for_pool(self, timeout: float) -> None:
        """Block until the worker pool has registered, so start-up cost is paid in :meth:`start`."""
        executor = self._dfk.executors[LABEL]
        deadline = time.monotonic() + timeout
        while not executor.connected_managers():
            if time.monotonic() > deadline:
                self.shutdown()
                queued = "" if self.scheduler == "local" else f" (its {self.scheduler} job did not start or failed)"
                raise RuntimeError(f"Parsl's worker pool did not connect within {timeout:g} s{queued}; "
                                   f"see {self._base / 'runinfo'} and {self._base / 'logs'}")
            time.sleep(0.1)
        self._remember_children()

    def _remember_children(self) -> None:
        """Record the Parsl processes of this backend (and their children): what :meth:`_reap` may kill.

        Those are this process's descendants that run Parsl code (the interchange)
        and any process of this user whose command line names this backend's run
        directory (the block script and worker pool, which the local provider
        detaches from this process).
        """
        import psutil

        base = str(self._base)
        descendants = {p.pid for p in psutil.Process().children(recursive=True)}
        for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
            try:
                cmdline = proc.info["cmdline"] or []
                ours = proc.pid in descendants and proc.pid not in self._foreign and \
                    any("parsl" in part for part in cmdline)
                if ours or (proc.info["uids"] and proc.info["uids"].real == os.getuid()
                            and any(base in part for part in cmdline)):
                    self._pids.add(proc.pid)
                    self._pids.update(p.pid for p in proc.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue

    def pids(self) -> list[int]:
        """PIDs of the Parsl processes (interchange, worker pool, ...) this backend saw start."""
        self._remember_children()
        return sorted(self._pids)

    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        if self._app is None:
            raise RuntimeError("parsl backend not started; call start() first")
        cancel_file = self._cancel_dir / safe_name(spec.task_id)
        cancel_file.unlink(missing_ok=True)
        run = RankRun.of(spec, self.pilot.launcher, cancel_file)
        per_node = Counter(slot.node for slot in spec.slots)
        resources: Mapping[str, Any] = {"num_nodes": len(per_node), "num_ranks": spec.ranks,
                                        "ranks_per_node": max(per_node.values())}
        outcome: Future[TaskOutcome] = Future()
        outcome.set_running_or_notify_cancel()
        with self._lock:
            self._running[spec.task_id] = (outcome, cancel_file)
        try:
            remote = self._app(run, parsl_resource_specification=dict(resources))
        except BaseException:
            with self._lock:
                self._running.pop(spec.task_id, None)
            raise
        remote.add_done_callback(lambda f, task_id=spec.task_id: self._done(task_id, f))
        self._remember_children()
        return outcome

    def _done(self, task_id: str, remote: Any) -> None:
        with self._lock:
            entry = self._running.pop(task_id, None)
        if entry is None:
            return
        try:
            entry[0].set_result(TaskOutcome(**outcome_fields(remote.result())))
        except Exception as exc:  # noqa: BLE001 - the engine failed the task: report, don't raise in a callback
            entry[0].set_result(TaskOutcome(task_id, None, detail=f"parsl app failed: {exc!r}"))

    def _at_exit(self) -> None:
        """Interpreter exit without :meth:`shutdown` (Ctrl-C): stop running tasks, then the engine."""
        with self._lock:
            entries = list(self._running.values())
        stop_and_wait(entries)
        self._reap()

    def cancel(self, task_id: str) -> None:
        with self._lock:
            entry = self._running.get(task_id)
        if entry is not None:
            entry[1].touch()  # the app kills its process group when it sees this file

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._running.items())
        for task_id, _ in running:
            self.cancel(task_id)
        for _, (outcome, _) in running:
            try:
                outcome.result(timeout=30)
            except Exception:  # noqa: BLE001 - shutting down; the outcome was reported already
                pass
        if self._dfk is not None:
            self._remember_children()
            dfk, self._dfk, self._app = self._dfk, None, None
            # DataFlowKernel.cleanup() talks to the interchange without a timeout: if the
            # interchange is already gone it never returns.  Bound it; _reap ends the rest.

            def cleanup() -> None:
                try:
                    dfk.cleanup()
                except Exception:  # noqa: BLE001 - shutting down: say it, then reap below
                    log.exception("Parsl's cleanup failed")

            done = threading.Thread(target=cleanup, name="parsl-cleanup", daemon=True)
            done.start()
            done.join(CLEANUP_TIMEOUT)
            if done.is_alive():
                log.warning("Parsl's cleanup did not finish within %s s; killing its processes", CLEANUP_TIMEOUT)
        self._reap()

    def _reap(self) -> None:
        """Kill every Parsl process this backend saw that is still alive (interchange, pool)."""
        import psutil

        self._remember_children()
        procs = []
        for pid in sorted(self._pids):
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            log.warning("parsl process %d did not stop on SIGTERM; killing it", proc.pid)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
