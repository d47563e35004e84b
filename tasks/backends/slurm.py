"""The ``slurm`` backend: hetflow's own pilot inside a Slurm allocation, one job step per task.

Run inside ``salloc``/``sbatch``: the pilot has the allocation's shape
(:mod:`hetflow.tasks.slurm_allocation`), hetflow's scheduler places the ranks,
and each task is one ``srun`` job step with exactly those ranks per node
(:class:`~hetflow.tasks.launchers.srun.SrunStep`); many steps run at once.
The step's ranks are one MPI world (PMI-2), so a stage across nodes has one
communicator.  Outside an allocation :meth:`SlurmBackend.start` refuses with a
message saying how to get one.

A step that fails is checked against Slurm's view of its nodes
(:func:`~hetflow.tasks.slurm_allocation.lost_nodes`): a node that is down,
failed, not responding or gone from the job is reported in the outcome's
``lost_nodes`` and named in its error, and the pilot places nothing there again.
The job must survive losing a node (``--no-kill``; ``hetflow submit`` asks for
it), or Slurm ends the whole allocation with it.

``srun`` runs in its own session; a timeout, cancel or shutdown sends it
SIGTERM (srun passes it to every rank of the step), then SIGKILL to the
group; a step that is still listed after that (found by its name,
``hetflow-<task>``) is ended with ``scancel``.

A task that the local backend would start warm (one worker rank on one core,
no GPUs: :func:`~hetflow.tasks.backends.local._warm_command`) costs no job
step: :meth:`SlurmBackend.start` starts one *agent* per node of the pilot, a
long-lived step running the fork server (:mod:`hetflow.tasks.forkserver`,
``srun --overlap``: it shares the node's CPUs and memory with every other step
and blocks none of them), and the task's rank is forked by its node's agent,
its requests and replies through srun's stdin and stdout.  The agent is the
rank's witness, as the local fork server is.  A timeout or cancel asks the
agent to signal the rank's process group (SIGTERM, then SIGKILL); the rank's
logs are appended to by the rank itself, on its node, at the paths a job step
writes them to (the run directory is on a file system every node sees).  An
agent whose step ends (its node lost, the agent killed) fails the tasks it ran,
with the node's loss in their error as for a step, and the node's later tasks
are job steps again.  Every other task (several ranks, several cores, GPUs) is
a job step.  ``options.slurm.warm_start: false`` in the pilot config starts
no agents.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from ..errors import ConfigError, HetflowError
from ..forkserver import (
    ForkedTask,
    ForkServer,
    ForkServerGone,
    adopt_early,
    start_early,
)
from ..launchers.srun import SrunStep, failure_report, step_env
from ..protocol import tail
from ..slurm_allocation import Allocation, current_allocation, lost_nodes
from .base import Backend, LaunchSpec, TaskOutcome
from .local import _warm_command, warm_start
from .ranks import safe_name

log = logging.getLogger(__name__)

KILL_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL of a step's ``srun``."""

POLL = 0.2
"""Seconds between checks of a running step's deadline and cancellation."""


class SlurmBackend(Backend):
    name = "slurm"

    def __init__(self, pilot, run_dir):  # type: ignore[no-untyped-def]
        super().__init__(pilot, run_dir)
        self._allocation: Allocation | None = None
        self._launcher: SrunStep | None = None
        self._srun = "srun"
        self._procs: dict[str, subprocess.Popen[bytes] | ForkedTask] = {}
        self._warm = warm_start(pilot, "slurm")
        self._agents: dict[str, ForkServer] = {}
        self._cancelled: set[str] = set()
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        alloc = current_allocation()
        srun = shutil.which("srun")
        if srun is None:
            raise HetflowError(f"Slurm job {alloc.job_id}: srun is not on PATH; load your site's Slurm module")
        pilot = self.pilot
        cores, gpus = min(alloc.cpus_per_node), min(alloc.gpus_per_node)
        if pilot.nodes > len(alloc.nodes) or (pilot.cores_per_node or 0) > cores or (pilot.gpus_per_node or 0) > gpus:
            raise ConfigError(f"{pilot.shape()} does not fit Slurm job {alloc.job_id}: {len(alloc.nodes)} node(s) "
                              f"({', '.join(alloc.nodes)}) x {cores} CPUs x {gpus} GPUs; give the run a pilot "
                              "config with `backend: slurm` so the pilot takes the allocation's shape")
        if pilot.nodes < len(alloc.nodes) or (pilot.cores_per_node or 0) < cores:
            log.warning("%s uses part of Slurm job %s (%d node(s) x %d CPUs); a pilot config with "
                        "`backend: slurm` takes the whole allocation", pilot.shape(), alloc.job_id,
                        len(alloc.nodes), cores)
        self._allocation = alloc
        self._srun = srun
        self._launcher = SrunStep(srun)
        log.info("slurm backend in job %s: nodes %s", alloc.job_id, ", ".join(alloc.nodes[:pilot.nodes]))
        for node in self.node_names():  # their imports are done while the run looks up its cache
            self._agent(node)

    def _agent(self, node: str) -> ForkServer | None:
        """The agent on ``node``, started by :meth:`start` (or on first use); ``None`` once it has ended, or with
        warm start off."""
        with self._lock:
            if not self._warm:
                return None
            agent = self._agents.get(node)
            if agent is None:
                log_path = self.run_dir / f"agent-{safe_name(node)}.log" if self.run_dir is not None else None
                early = adopt_early(log_path, early_key(node)) if log_path is not None else None  # pipe.run()'s
                agent = self._agents[node] = early if early is not None else ForkServer(
                    log_path, launcher=agent_argv(self._srun, node), env=step_env(os.environ, {}))
            return agent if agent.alive else None

    def node_names(self) -> list[str]:
        """The allocation's hostnames (``scontrol show hostnames``), the first ``pilot.nodes`` of them."""
        if self._allocation is None:
            return super().node_names()
        return list(self._allocation.nodes[: self.pilot.nodes])

    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        if self._launcher is None:
            raise HetflowError("SlurmBackend.launch() called before start()")
        step = SrunStep(self._srun, job_name=step_name(spec.task_id))
        argv = step.argv(spec.argv, spec.slots, self.node_names())
        future: Future[TaskOutcome] = Future()
        future.set_running_or_notify_cancel()
        thread = threading.Thread(target=self._run, args=(spec, argv, future), name=f"hetflow-step-{spec.task_id}",
                                  daemon=True)
        with self._lock:
            self._threads[spec.task_id] = thread
        thread.start()
        return future

    def _run(self, spec: LaunchSpec, argv: list[str], future: "Future[TaskOutcome]") -> None:
        started = time.time()
        try:
            outcome = self._step(spec, argv, started)
        except Exception as exc:  # noqa: BLE001 - the orchestrator waits on this future: it must resolve
            log.error("task %s: could not start its job step: %s: %s", spec.task_id, type(exc).__name__, exc)
            outcome = TaskOutcome(task_id=spec.task_id, returncode=None, started=started, ended=time.time(),
                                  detail=f"could not start srun: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._procs.pop(spec.task_id, None)
                self._threads.pop(spec.task_id, None)
        future.set_result(outcome)

    def _step(self, spec: LaunchSpec, argv: list[str], started: float) -> TaskOutcome:
        env = step_env(os.environ, spec.env)
        node = self.node_names()[spec.slots[0].node]
        proc: subprocess.Popen[bytes] | ForkedTask | None = self._start_warm(spec, env, node)
        if proc is None:
            out = _log(spec.stdout)
            err = _log(spec.stderr)
            try:
                proc = subprocess.Popen(argv, cwd=spec.cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)
            finally:
                for fd in (out, err):
                    if fd != subprocess.DEVNULL:
                        os.close(fd)
        with self._lock:
            self._procs[spec.task_id] = proc
            cancelled = spec.task_id in self._cancelled
        if isinstance(proc, ForkedTask):
            log.debug("task %s: started by the agent on %s: pid %d there", spec.task_id, node, proc.pid)
        else:
            log.debug("task %s: job step %s", spec.task_id, argv)
        if cancelled:
            _stop(proc)
        timed_out = False
        # counted from the request: a warm start's imports in the fork server are in the timeout, as a cold
        # rank's imports are
        deadline = (None if spec.timeout is None
                    else time.monotonic() + spec.timeout - max(0.0, time.time() - started))
        while True:
            try:
                proc.wait(POLL)
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                log.warning("task %s exceeded its timeout of %ss; ending its job step", spec.task_id, spec.timeout)
                _stop(proc)
                break
        with self._lock:
            cancelled = spec.task_id in self._cancelled
        warm = isinstance(proc, ForkedTask)
        if (timed_out or cancelled) and self._allocation is not None and not warm:
            _end_step(self._allocation.job_id, step_name(spec.task_id))
        code = proc.returncode
        detail = ""
        lost: dict[str, str] = {}
        agent = self._agents.get(node) if warm else None
        if timed_out:
            detail = f"timed out after {spec.timeout}s"
        elif warm and code and not cancelled and agent is not None and not agent.alive:
            detail = f"the hetflow agent on {node} ended while the task ran (see agent-{safe_name(node)}.log)"
            if self._allocation is not None:
                lost = lost_nodes(self._allocation.job_id, [node])
            if lost:
                log.error("task %s: %s", spec.task_id, "; ".join(lost.values()))
                detail = "; ".join(lost.values()) + "; " + detail
        elif code and not cancelled and not warm:
            detail = failure_report(code, None if spec.stderr is None else tail(spec.stderr, 20000))
            if self._allocation is not None:  # a failed step may mean a lost node: ask Slurm about its nodes
                names = self.node_names()
                lost = lost_nodes(self._allocation.job_id, [names[s.node] for s in spec.slots])
            if lost:
                log.error("task %s: %s", spec.task_id, "; ".join(lost.values()))
                detail = "; ".join(lost.values()) + "; " + detail
        return TaskOutcome(task_id=spec.task_id, returncode=code, timed_out=timed_out, cancelled=cancelled,
                           signal=-code if code is not None and code < 0 else None, started=started,
                           ended=time.time(), detail=detail, lost_nodes=lost)

    def _start_warm(self, spec: LaunchSpec, env: dict[str, str], node: str) -> ForkedTask | None:
        """Start ``spec`` by ``node``'s agent, if it can take it; ``None``: start it as a job step."""
        command = _warm_command(spec)
        agent = self._agent(node) if command is not None else None
        if agent is None or command is None:
            return None
        try:
            return agent.start_task(command, spec.cwd, env, spec.stdout, spec.stderr,
                                    timeout=spec.timeout)
        except ForkServerGone as exc:
            log.warning("task %s: started as a job step: the agent on %s: %s", spec.task_id, node, exc)
            return None

    def cancel(self, task_id: str) -> None:
        with self._lock:
            if task_id not in self._threads:
                return
            self._cancelled.add(task_id)
            proc = self._procs.get(task_id)
        if proc is not None:
            _stop(proc)

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._threads.items())
        for task_id, _ in running:
            self.cancel(task_id)
        for _, thread in running:
            thread.join(timeout=2 * KILL_GRACE + 5)
        with self._lock:
            agents, self._agents, self._warm = list(self._agents.values()), {}, False
        for agent in agents:  # stdin closed: each agent ends, and its step with it
            agent.close()


def step_name(task_id: str) -> str:
    """The job step's name: finds a step whose ``srun`` is gone."""
    return f"hetflow-{safe_name(task_id)}"


AGENT_NAME = "hetflow-agent"
"""The job name of the agents' steps."""


def agent_argv(srun: str, node: str) -> list[str]:
    """The ``srun`` that runs ``node``'s agent (the fork server's command follows): one task on that node,
    ``--overlap`` so that it shares the CPUs and memory the job has there with the other steps and blocks
    none of them (it asks for no GPU: the ranks it starts have none), unbound (``--cpu-bind=none``: its children may run on any of the
    node's CPUs), no PMI (its ranks are MPI singletons), stdin to the one task."""
    return [srun, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--cpu-bind=none", "--mem=0",
            "--mpi=none", "--input=all", f"--job-name={AGENT_NAME}"]


def early_key(node: str) -> str:
    """The key of ``node``'s agent among the fork servers started early (:func:`start_agents_early`)."""
    return f"slurm:{node}"


def start_agents_early(pilot: object) -> None:
    """Start the agents of ``pilot``'s nodes now, for the run's backend to adopt (:func:`start_early`).

    Decision: a blocking ``pipe.run()`` calls this before it imports the orchestrator and opens the store,
    so each agent's ``srun`` and imports (pyarrow, pandas, MPI's library, then the script's installed
    imports on its first task) go on while this process imports, as the local backend's fork server does.
    Nothing is started where :meth:`SlurmBackend.start` would refuse (outside an allocation, no ``srun``,
    a pilot that does not fit): it says why, after."""
    srun = shutil.which("srun")
    nodes = getattr(pilot, "nodes", 0) or 0
    if srun is None or not warm_start(pilot, "slurm"):
        return
    try:
        alloc = current_allocation()
    except HetflowError:
        return
    if nodes > len(alloc.nodes):
        return
    env = step_env(os.environ, {})
    for node in alloc.nodes[:nodes]:
        start_early(early_key(node), agent_argv(srun, node), env)


def _end_step(job_id: str, name: str) -> None:
    """``scancel`` the steps of job ``job_id`` named ``name`` that are still listed."""
    try:
        listed = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not list the steps of job %s to end %s: %s", job_id, name, exc)
        return
    steps = [line.split()[0] for line in listed.stdout.splitlines() if line.split()[1:] == [name]]
    if steps:
        log.warning("job steps %s (%s) outlived their srun; scancel", steps, name)
        try:
            subprocess.run(["scancel", "--quiet", *steps], timeout=30, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("could not scancel %s: %s", steps, exc)


def _log(path: Path | None) -> int:
    if path is None:
        return subprocess.DEVNULL
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def _stop(proc: "subprocess.Popen[bytes] | ForkedTask") -> None:
    """SIGTERM to srun's session (srun forwards it to the step's ranks), SIGKILL after a grace; for a rank an
    agent started, the same to the rank's process group, through the agent."""
    from .ranks import _kill_group

    if not isinstance(proc, ForkedTask):
        _kill_group(proc, KILL_GRACE)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc.signal_group(sig)
        try:
            proc.wait(KILL_GRACE)
            return
        except subprocess.TimeoutExpired:
            continue
