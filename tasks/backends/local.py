"""The embedded local backend: every task is one ``mpiexec`` on this machine.

Each task runs in its own session (process group); a timeout or a cancel
signals that group, and Hydra passes the signal to its proxies and ranks.
Each rank's witness ends what the rank started; the backend also watches the
tree below ``mpiexec`` while the task runs and, when the task has ended, ends
whatever it saw there that outlived it (a witness killed by SIGKILL cannot do
its part: :mod:`hetflow.tasks.proctree`).  Nothing outlives
:meth:`LocalBackend.shutdown`.

A one-rank task is started warm, by a fork server that has the worker's
imports done (:mod:`hetflow.tasks.forkserver`): the same worker in a child
that leads its own session, so timeouts, cancels and the tree watch work on it
as on ``mpiexec`` (the server is its witness).  Whatever its cores: the rank
pins itself to them and sets its thread counts, as a cold rank does.  With
GPUs only on an NVIDIA pilot, and only while the server has not loaded the
CUDA driver (it refuses the fork otherwise, and the task starts cold): forking
after the driver is initialised breaks the child.  AMD GPUs stay cold (HIP's
libraries are loaded by ``import torch``; no sound "not initialised yet" test
is made).  A pilot turns warm starts off with ``options.local.warm_start:
false``; a fork server that has ended leaves the tasks after it to ``mpiexec``.
A task of several ranks on one node, one core each and no GPUs, keeps
``mpiexec`` as its launcher but has its ranks forked by that server too
(:mod:`hetflow.tasks.warmranks`): ``mpiexec`` starts a stub per rank that hands
its PMI connection to the server.

A one-node pilot keeps MPI on loopback: the ranks' own listening sockets
(UCX's TCP transport of MPICH's ch4:ucx, or libfabric's tcp/sockets providers
under ch4:ofi) are put on ``lo`` by :data:`LOOPBACK_ENV`, where the user's
environment does not choose an interface itself.  Hydra's own control port
(``mpiexec`` and its proxy) is bound to every address by MPICH 5's hydra, which
has no setting to change that; docs/runs.md says so.

Before it starts, a task books its CPUs in the machine-wide, per-user
:class:`~hetflow.tasks.ledger.CoreLedger`, so two runs on this machine never
use the same core at once: the second waits, and says so in its log.
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
from typing import Protocol

from ..errors import ConfigError, HetflowError
from ..forkserver import ColdStart, ForkServer, ForkServerGone, adopt_early
from ..launchers.mpiexec import Mpiexec
from ..ledger import CoreLedger, real_cpus
from ..proctree import TreeWatch
from ..runners import Runners
from .base import Backend, LaunchSpec, TaskOutcome
from .ranks import options_for

log = logging.getLogger(__name__)

KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when a task is stopped."""

WATCH = 0.5
"""Seconds between looks at the tree below a running task's ``mpiexec``."""

ESCAPES_END = sys.platform.startswith("linux")
"""Whether a process that left the tree alive is ended at once: only where the witness is a subreaper,
so that leaving means its witness was killed (elsewhere a rank's daemon leaves it by design)."""


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


LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo"}
"""Environment that keeps the ranks of a one-node run on the loopback interface (each only where the
environment does not set it): MPICH's UCX netmod (the ``mpich`` wheel's default) and libfabric's TCP
providers (``MPIR_CVAR_CH4_NETMOD=ofi``).  Also given to warm (fork-server) tasks, whose MPI starts as a
singleton.  Multi-node backends (``slurm``) keep their own settings."""

OPTIONS = ("warm_start",)
"""Keys of ``pilot.options.local`` (and of ``pilot.options.slurm``)."""


class _Process(Protocol):
    """What the backend needs of a started task: a ``subprocess.Popen`` or a fork server's child."""

    pid: int
    returncode: int | None

    def wait(self, timeout: float | None = None) -> int: ...


def warm_start(pilot: object, backend: str = "local") -> bool:
    """``options.<backend>.warm_start`` of ``pilot`` (default true), checked: ``local`` (a fork server here)
    and ``slurm`` (a fork server per node, :mod:`hetflow.tasks.backends.slurm`) read it."""
    value = options_for(pilot, backend, OPTIONS).get("warm_start", True)
    if not isinstance(value, bool):
        raise ConfigError(f"pilot {getattr(pilot, 'name', '?')!r}: options.{backend}.warm_start must be true or "
                          f"false, got {value!r}")
    return value


WARM_GPU_VENDORS = ("nvidia",)
"""Vendors whose GPU ranks the local fork server may start: those with a sound test that the server has not
initialised the GPU runtime (NVIDIA: the driver library is not loaded, :func:`hetflow.tasks.forkserver.gpu_unsafe`)."""


def _warm_command(spec: LaunchSpec, *, cores: bool = False, gpus: bool = False) -> str | None:
    """The spec path when ``spec`` is one worker rank the fork server can start; ``cores``: on any number of
    cores (else one), ``gpus``: with GPUs too (else none)."""
    argv = spec.argv
    if len(spec.slots) != 1:
        return None
    if (len(spec.slots[0].cores) > 1 and not cores) or (spec.slots[0].gpus and not gpus):
        return None
    if len(argv) != 4 or tuple(argv[:3]) != (sys.executable, "-m", "hetflow.tasks.worker"):
        return None
    return argv[3]


def _warm_ranks_command(spec: LaunchSpec) -> str | None:
    """The spec path when ``spec`` is a worker of several ranks on one node, one core each and no GPUs,
    whose ranks the fork server can start under ``mpiexec`` (:mod:`hetflow.tasks.warmranks`)."""
    slots = spec.slots
    if len(slots) < 2 or len({slot.node for slot in slots}) != 1:
        return None
    if any(len(slot.cores) > 1 or slot.gpus for slot in slots):
        return None
    argv = spec.argv
    if len(argv) != 4 or tuple(argv[:3]) != (sys.executable, "-m", "hetflow.tasks.worker"):
        return None
    return argv[3]


def _private_log(path: Path) -> "int":
    """An append-only log file readable by this user only (whatever the umask)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


class _CancelledBeforeStart(Exception):
    """The task was cancelled before it had a process: none is started (a cold start after the fork server
    ended at shutdown would outlive the run, the orchestrator gone before it could end it)."""


class LocalBackend(Backend):
    name = "local"

    def __init__(self, pilot, run_dir):  # type: ignore[no-untyped-def]
        super().__init__(pilot, run_dir)
        self._procs: dict[str, tuple[_Process, TreeWatch]] = {}
        self._booking: set[str] = set()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._runners = Runners("hetflow-task")  # the thread that books, starts and waits for each task
        self._launcher: Mpiexec | None = None
        self._ledger: CoreLedger | None = None
        self._warm = warm_start(pilot)
        self._server: ForkServer | None = None
        self._tokens: dict[str, tuple[ForkServer, str]] = {}
        """Warm multi-rank tasks' registrations with the fork server, by task id."""
        self._warm_gpus = getattr(pilot, "vendor", None) in WARM_GPU_VENDORS

    def start(self) -> None:
        self._launcher = Mpiexec(find_mpiexec())
        self._ledger = CoreLedger()
        self._fork_server()  # its imports are done while the run looks up its cache

    def _fork_server(self) -> ForkServer | None:
        """The run's fork server, started on first use; ``None`` once it has ended."""
        with self._lock:
            if self._server is None and self._warm:
                log_path = self.run_dir / "forkserver.log" if self.run_dir is not None else None
                early = adopt_early(log_path) if log_path is not None else None  # started by pipe.run()
                self._server = early if early is not None else ForkServer(log_path)
            return self._server if self._server is not None and self._server.alive else None

    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        """Book the task's CPUs in the machine's :class:`CoreLedger` (waiting, in the task's thread,
        while another run holds them), then start it; the CPUs are given back when it has ended."""
        if self._launcher is None or self._ledger is None:
            raise HetflowError("LocalBackend.launch() called before start()")
        argv = self._launcher.argv(spec.argv, spec.slots, self.node_names())
        cpus = real_cpus([c for slot in spec.slots for c in slot.cores], sorted(os.sched_getaffinity(0)))
        future: Future[TaskOutcome] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            self._booking.add(spec.task_id)
        self._runners.submit(self._run, spec, argv, cpus, self._ledger, future)
        return future

    def _run(self, spec: LaunchSpec, argv: list[str], cpus: list[int], ledger: CoreLedger,
             future: "Future[TaskOutcome]") -> None:
        booked = False
        try:
            booked = ledger.book(cpus, spec.task_id, stop=lambda: spec.task_id in self._cancelled)
            if not booked:
                future.set_result(TaskOutcome(task_id=spec.task_id, returncode=None, cancelled=True,
                                              detail="cancelled while waiting for cores"))
                return
            try:
                proc, tree, started = self._start(spec, argv)
            except _CancelledBeforeStart:
                future.set_result(TaskOutcome(task_id=spec.task_id, returncode=None, cancelled=True,
                                              detail="cancelled while it was being started"))
                return
            self._wait(spec, proc, tree, started, future)
        except Exception as exc:  # noqa: BLE001 - the orchestrator waits on this future: it must resolve
            log.error("task %s could not be started: %s: %s", spec.task_id, type(exc).__name__, exc)
            if spec.stderr is not None:
                with open(_private_log(spec.stderr), "a") as fh:
                    print(f"hetflow: could not start {argv[0]}: {type(exc).__name__}: {exc}", file=fh)
            if not future.done():
                future.set_result(TaskOutcome(task_id=spec.task_id, returncode=None,
                                              detail=f"could not start: {type(exc).__name__}: {exc}"))
        finally:
            self._forget_ranks(spec)
            if booked:
                ledger.release(cpus)
            with self._lock:
                self._booking.discard(spec.task_id)

    def _start(self, spec: LaunchSpec, argv: list[str]) -> "tuple[_Process, TreeWatch, float]":
        env = dict(os.environ)
        env.update(spec.env)
        if self.node_names() == ["localhost"]:  # one node: no rank needs to be reached from elsewhere
            env.update({k: v for k, v in LOOPBACK_ENV.items() if k not in env})
        started = time.time()
        proc = self._start_warm(spec, env)
        if proc is None:
            argv = self._warm_ranks(spec, argv, env)
            with self._lock:
                if spec.task_id in self._cancelled:  # while the fork server was asked (and ended by shutdown)
                    raise _CancelledBeforeStart(spec.task_id)
            stdout = _private_log(spec.stdout) if spec.stdout else subprocess.DEVNULL
            stderr = _private_log(spec.stderr) if spec.stderr else subprocess.DEVNULL
            try:
                proc = subprocess.Popen(argv, cwd=spec.cwd, env=env, stdout=stdout, stderr=stderr,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                for fh in (stdout, stderr):
                    if fh != subprocess.DEVNULL:
                        os.close(fh)
        tree = TreeWatch(proc.pid)
        with self._lock:
            self._procs[spec.task_id] = (proc, tree)
            cancelled = spec.task_id in self._cancelled  # while it was being started
        log.debug("started %s: pid %d: %s", spec.task_id, proc.pid, argv)
        if cancelled:
            self._kill_group(proc, tree)
        return proc, tree, started

    def _start_warm(self, spec: LaunchSpec, env: dict[str, str]) -> _Process | None:
        """Start ``spec`` by the fork server, if it can take it; ``None``: start it with ``mpiexec``."""
        command = _warm_command(spec, cores=True, gpus=self._warm_gpus)
        server = self._fork_server() if command is not None else None
        if server is None or command is None:
            return None
        try:
            return server.start_task(command, spec.cwd, env, spec.stdout, spec.stderr,
                                     timeout=spec.timeout, threads=max(1, len(spec.slots[0].cores)),
                                     gpus=bool(spec.slots[0].gpus))
        except ColdStart as exc:
            log.info("task %s: started with mpiexec: %s", spec.task_id, exc)
            return None
        except ForkServerGone as exc:
            log.warning("task %s: started with mpiexec: %s", spec.task_id, exc)
            return None

    def _warm_ranks(self, spec: LaunchSpec, argv: list[str], env: dict[str, str]) -> list[str]:
        """``argv``, or, for a task of several ranks the fork server can start (:func:`_warm_ranks_command`,
        this machine's ``mpiexec`` from the ``mpich`` wheel, MPI as the communicator), ``mpiexec`` running a
        stub per rank that has the fork server fork it (:mod:`hetflow.tasks.warmranks`); ``env`` then
        gets the server's socket and the task's token."""
        command = _warm_ranks_command(spec)
        if command is None or self._launcher is None or self.node_names() != ["localhost"]:
            return argv
        if os.environ.get(MPIEXEC_ENV) or self._launcher.executable != str(Path(sys.executable).parent / "mpiexec"):
            return argv  # a site's MPI: its PMI may not be the one the preloaded library speaks
        if env.get("HETFLOW_COMM", "mpi") != "mpi":
            return argv
        server = self._fork_server()
        if server is None:
            return argv
        from ..rankstub import SOCKET_ENV, TOKEN_ENV
        from ..warmranks import stub_argv

        try:
            path, token = server.register_ranks(command, spec.cwd, len(spec.slots), timeout=spec.timeout)
        except ForkServerGone as exc:
            log.warning("task %s: its ranks started cold: %s", spec.task_id, exc)
            return argv
        with self._lock:
            self._tokens[spec.task_id] = (server, token)
        env.update({SOCKET_ENV: path, TOKEN_ENV: token})
        return self._launcher.argv(stub_argv(command), spec.slots, self.node_names())

    def _forget_ranks(self, spec: LaunchSpec) -> None:
        with self._lock:
            registered = self._tokens.pop(spec.task_id, None)
        if registered is not None and not registered[0].forget_ranks(registered[1]):
            log.warning("task %s: the fork server did not confirm that its ranks had ended", spec.task_id)

    def _wait(self, spec: LaunchSpec, proc: _Process, tree: TreeWatch, started: float,
              future: "Future[TaskOutcome]") -> None:
        timed_out = False
        # counted from the request: a warm start's imports in the fork server are in the timeout, as a cold
        # rank's imports are
        deadline = (None if spec.timeout is None
                    else time.monotonic() + spec.timeout - max(0.0, time.time() - started))
        while True:
            self._end_escaped(spec, tree)
            left = WATCH if deadline is None else min(WATCH, deadline - time.monotonic())
            try:
                proc.wait(timeout=max(left, 0.0))
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                log.warning("task %s exceeded its timeout of %ss; killing its process group",
                            spec.task_id, spec.timeout)
                self._kill_group(proc, tree)
                break
        self._forget_ranks(spec)  # a warm task's ranks are the fork server's: gone, with what they left, first
        outlived = tree.end()
        if outlived:
            log.warning("task %s: ended %d processes that outlived it: pids %s", spec.task_id, len(outlived), outlived)
        with self._lock:
            self._procs.pop(spec.task_id, None)
            cancelled = spec.task_id in self._cancelled
        code = proc.returncode
        future.set_result(TaskOutcome(
            task_id=spec.task_id, returncode=code, timed_out=timed_out, cancelled=cancelled,
            signal=-code if code is not None and code < 0 else None, started=started, ended=time.time(),
            detail=f"timed out after {spec.timeout}s" if timed_out else ""))

    @staticmethod
    def _end_escaped(spec: LaunchSpec, tree: TreeWatch) -> None:
        escaped = tree.look()
        if escaped and ESCAPES_END:
            ended = tree.end(escaped)
            log.warning("task %s: ended %d processes orphaned by a killed rank: pids %s", spec.task_id,
                        len(ended), ended)

    @staticmethod
    def _kill_group(proc: _Process, tree: TreeWatch) -> None:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 10.0)):
            tree.look()  # what is below it now, before a SIGKILL orphans it
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
            running = self._procs.get(task_id)
            if running is None and task_id not in self._booking:
                return
            self._cancelled.add(task_id)  # one still waiting for cores gives up
        if running is not None:
            self._kill_group(*running)

    def shutdown(self) -> None:
        with self._lock:
            running = list(self._procs) + list(self._booking)
        for task_id in running:
            self.cancel(task_id)
        with self._lock:
            server, self._server, self._warm = self._server, None, False
        if server is not None:
            server.close()
