"""Low-latency stages for the radical backend: RP Raptor MPI workers.

With ``options.radical.raptor: true`` the radical backend starts, once per
pilot node, an RP Raptor master and one RP MPI worker (``radical.pilot.raptor.
MPIWorker``) with one rank per usable core of that node.  The workers stay up
for the whole pilot.  An eligible stage (see :func:`ineligible`) then runs as an
RP *function task* with ``ranks=N`` instead of a fresh ``mpiexec``: RP's worker
picks N free ranks, builds their private communicator with ``Create_group``
and calls :meth:`HetflowWorker.hetflow_stage` on each of them, which runs
:func:`run_stage` — the same steps as ``python -m hetflow.tasks.worker``
(pin to the slot's cores, open the inputs, call the stage function, write the
partitions and a ``rank-<r>.json`` record), so the orchestrator sees no
difference except the start-up time.

Nothing is deserialised: a function task names the worker method
(``hetflow_stage``) and carries the spec path; :class:`HetflowWorker` refuses
every other task mode and function name, so RP's pickled-``PythonTask`` path is
never reached.  The stage function itself is found by module and name, as by the
normal worker.

Failure and recovery: a failing rank of a one-rank stage only fails its task
(the pool lives on).  In a multi-rank stage the other ranks may be blocked in a
collective that will never complete, so the failing rank records its error and
calls ``Abort`` on the stage's communicator, which ends the whole MPI worker
(MPICH aborts the job).  Killing a running function is likewise impossible
inside a worker, so a timeout or a cancel of a running Raptor stage stops the
pool too.  Either way the backend stops that node's master and worker and starts
a new pair (after three generations in a row that die before running anything,
the node's stages fall back to normal RP tasks).  The stage that brought the
pool down fails with its recorded error class, as with ``mpiexec``; a stage
that merely shared the pool (no rank recorded an error) runs once more in the
new pool, so other stages see no difference either.  A timeout counts from the
first launch.

This module is imported by the client (descriptions, eligibility) and loaded by
RP's ``radical-pilot-raptor-worker`` from its file path (``raptor_file``); RP's
classes are imported only when the worker class is asked for.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hetflow.tasks.errors import HetflowError

if TYPE_CHECKING:
    from hetflow.tasks.protocol import RankResult, WorkerSpec

WORKER_CLASS = "HetflowWorker"
STAGE_FUNCTION = "hetflow_stage"
PING_FUNCTION = "hetflow_ping"
WORKER_MODULE = "hetflow.tasks.worker"

_WORKER: dict[str, str] = {}  # inside a Raptor worker: its RP uid (RP_TASK_ID names the task during a call)


class StageFailed(HetflowError, RuntimeError):
    """A stage rank failed inside a Raptor worker (its ``rank-<r>.json`` holds the error)."""


# ----------------------------------------------------------------- client side
def spec_path_of(argv: Sequence[str]) -> str | None:
    """The spec path if ``argv`` is ``PYTHON -m hetflow.tasks.worker SPEC``, else ``None``."""
    if len(argv) == 4 and tuple(argv[1:3]) == ("-m", WORKER_MODULE):
        return str(argv[3])
    return None


def ineligible(argv: Sequence[str], slots: Sequence[Any], pool_cores: Sequence[int]) -> str | None:
    """Why a launch cannot run in a Raptor pool (``None``: it can).

    Eligible: the hetflow worker entry point (not an arbitrary program), no GPUs
    (RP 1.103's MPI worker assigns no GPUs to its ranks), every rank on one node
    (one pool per node), and no more ranks than that pool has.
    """
    if spec_path_of(argv) is None:
        return f"not a hetflow stage ({argv[0] if argv else 'empty argv'!r} ...)"
    if any(s.gpus for s in slots):
        return "it uses GPUs (RP's MPI worker gives its ranks no GPUs)"
    nodes = {s.node for s in slots}
    if len(nodes) != 1:
        return f"its ranks span {len(nodes)} nodes (a Raptor pool serves one node)"
    if len(slots) > len(pool_cores):
        return f"it has {len(slots)} ranks and the node's pool has {len(pool_cores)}"
    return None


def _slot(node: int, host: str, cores: Sequence[int]) -> dict[str, Any]:
    return {"node_index": node, "node_name": host, "cores": list(cores), "gpus": [], "lfs": 0, "mem": 0}


def master_description(uid: str, node: int, host: str, core: int, sandbox: Path) -> dict[str, Any]:
    """The RP ``TaskDescription`` fields of a node's Raptor master (pre-placed on one core).

    The master mostly sleeps; it shares its core with the stages hetflow places there.
    """
    return {"uid": uid, "mode": "raptor.master", "ranks": 1, "cores_per_rank": 1, "sandbox": str(sandbox),
            "slots": [_slot(node, host, [core])]}


def worker_description(uid: str, master: str, node: int, host: str, cores: Sequence[int],
                       sandbox: Path) -> dict[str, Any]:
    """The RP ``TaskDescription`` fields of a node's MPI worker: one rank on each usable core.

    The ranks are idle hosts for stage functions; each stage rank pins itself to
    the cores hetflow's scheduler chose, as in a fresh ``mpiexec``.
    """
    return {"uid": uid, "mode": "raptor.worker", "raptor_id": master, "raptor_class": WORKER_CLASS,
            "raptor_file": str(Path(__file__).resolve()), "ranks": len(cores), "cores_per_rank": 1,
            "use_mpi": True, "sandbox": str(sandbox), "environment": {"PYTHONUNBUFFERED": "1"},
            "slots": [_slot(node, host, [c]) for c in cores]}


def function_description(uid: str, master: str, spec_path: str, ranks: int, cores_per_rank: int,
                         env: dict[str, str], stdout: Path | None, stderr: Path | None,
                         sandbox: Path) -> dict[str, Any]:
    """The RP ``TaskDescription`` fields of one stage as a Raptor function task."""
    return {"uid": uid, "mode": "task.function", "raptor_id": master, "function": STAGE_FUNCTION,
            "args": [spec_path, str(stdout) if stdout else "", str(stderr) if stderr else ""],
            "kwargs": {}, "ranks": ranks, "cores_per_rank": cores_per_rank, "environment": dict(env),
            "sandbox": str(sandbox)}


def ping_description(uid: str, master: str, ranks: int, sandbox: Path) -> dict[str, Any]:
    """A function task over every rank of a pool: proves the worker is up (used at start)."""
    return {"uid": uid, "mode": "task.function", "raptor_id": master, "function": PING_FUNCTION,
            "args": [], "kwargs": {}, "ranks": ranks, "sandbox": str(sandbox)}


class Pool:
    """The client's view of one node's Raptor master and MPI worker (one generation of them).

    A plain class, not a dataclass: RP's worker launcher loads this file outside
    ``sys.modules``, where ``@dataclass`` cannot resolve the module.
    """

    MAX_BAD_STARTS = 3
    """Generations in a row that end before running anything: then the node gets no more pools."""

    def __init__(self, node: int, host: str, cores: Sequence[int], base: Path, generation: int = 0,
                 bad_starts: int = 0) -> None:
        self.node, self.host, self.cores, self.base, self.generation = node, host, tuple(cores), base, generation
        self.tasks: set[str] = set()  # uids of function tasks sent to this generation
        self.lost = False
        self.worked = False  # a function task of this generation finished (pool proven alive)
        self.bad_starts = bad_starts

    def __repr__(self) -> str:
        return f"Pool(node={self.node}, host={self.host!r}, cores={self.cores}, generation={self.generation})"

    @property
    def master(self) -> str:
        return f"hetflow-raptor.n{self.node:04d}.g{self.generation:03d}"

    @property
    def worker(self) -> str:
        return f"{self.master}.worker"

    @property
    def sandbox(self) -> Path:
        return self.base / self.master

    def descriptions(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(master, worker) RP ``TaskDescription`` fields of this generation."""
        return (master_description(self.master, self.node, self.host, self.cores[0], self.sandbox),
                worker_description(self.worker, self.master, self.node, self.host, self.cores, self.sandbox))

    def next_generation(self) -> "Pool | None":
        """The replacement after a loss, or ``None`` after :attr:`MAX_BAD_STARTS` failed starts in a row."""
        bad = 0 if self.worked else self.bad_starts + 1
        if bad >= self.MAX_BAD_STARTS:
            return None
        return Pool(self.node, self.host, self.cores, self.base, self.generation + 1, bad)


# ----------------------------------------------------------------- worker side
def run_stage(spec_path: str, comm: Any, stdout: str = "", stderr: str = "") -> dict[str, Any]:
    """Run one rank of a stage on ``comm`` (exactly the stage's ranks); returns its record.

    The steps and the ``rank-<r>.json`` record are those of ``python -m
    hetflow.tasks.worker`` (whose helpers this calls).  Differences that come from
    living in a persistent worker: the process's cwd, CPU affinity and logging are
    restored afterwards, stage output goes to the rank's ``rank-<r>.log`` in the
    attempt directory by redirection of ``sys.stdout``/``sys.stderr`` (not of the file descriptors, which the
    worker shares), and a failure raises :class:`StageFailed`
    (after ``Abort`` of ``comm`` when other ranks may be waiting in a collective).
    """
    affinity = os.sched_getaffinity(0)
    cwd = os.getcwd()
    from hetflow.tasks.protocol import WorkerSpec

    spec = WorkerSpec.read(Path(spec_path))
    with contextlib.ExitStack() as stack:
        if stdout or stderr:  # the rank's own log, as a rank started by a launcher has (the worker's own_output)
            from hetflow.tasks.protocol import AttemptFiles

            rank_log = AttemptFiles(spec.attempt_dir).rank_log(comm.Get_rank())
            out = err = stack.enter_context(open(os.open(rank_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                                                 "a", buffering=1))
        else:
            out, err = sys.stdout, sys.stderr
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            os.chdir(spec.attempt_dir)
            record = _run_rank(spec, comm, err)
        finally:
            os.chdir(cwd)
            os.sched_setaffinity(0, affinity)
            out.flush()
            err.flush()
    if record.error is not None:
        if comm.Get_size() > 1:
            comm.Abort(1)  # the other ranks may wait in a collective forever otherwise
        raise StageFailed(f"stage {spec.stage!r} rank {record.rank}: {record.error.type}: {record.error.message}")
    return {"rank": record.rank, "size": record.size, "status": record.status}


def _run_rank(spec: "WorkerSpec", comm: Any, err: Any) -> "RankResult":
    from mpi4py import MPI

    from hetflow.tasks.worker import run_rank

    # A pilot that declares more cores than this machine has (a demo or test pilot): a fresh
    # mpiexec folds the ids onto real CPUs, but two busy-polling ranks of a shared pool folded
    # onto one CPU starve each other (a 3-rank sort on 2 CPUs took 50 s instead of 0.3 s), so
    # here such a rank is left unpinned.
    raptor = {"worker": _WORKER.get("uid"), "pool_rank": MPI.COMM_WORLD.Get_rank(),
              "pool_size": MPI.COMM_WORLD.Get_size()}
    record, _ = run_rank(spec, comm.Get_rank(), comm.Get_size(), lambda: comm, stream=err, fold_cores=False,
                         raptor=raptor)
    return record


def _worker_class() -> type:
    """Build :class:`HetflowWorker` (RP's classes are imported only here)."""
    from radical.pilot.raptor import MPIWorker
    from radical.pilot.task_description import TASK_FUNC

    class HetflowWorker(MPIWorker):  # type: ignore[misc]  # untyped RP base
        """RP's MPI worker, restricted to hetflow's own two functions."""

        def __init__(self, raptor_id: str) -> None:
            super().__init__(raptor_id)
            _WORKER["uid"] = self._uid
            # only named function tasks: eval/exec/proc/shell modes are not offered
            self._modes = {TASK_FUNC: self._dispatch_func}

        async def _dispatch_func(self, task: dict[str, Any]) -> Any:
            name = task["description"].get("function")
            if name not in (STAGE_FUNCTION, PING_FUNCTION):
                # never fall through to RP's deserialisation of a PythonTask
                message = f"hetflow's Raptor worker runs only {[STAGE_FUNCTION, PING_FUNCTION]}, not {str(name)[:80]!r}"
                return None, message, 1, None, (repr(ValueError(message)), message)
            return await super()._dispatch_func(task)

        def hetflow_stage(self, *args: Any) -> dict[str, Any]:
            """``(comm, spec, stdout, stderr)``: RP prepends ``comm`` only for more than one rank."""
            if len(args) == 4:
                return run_stage(args[1], args[0], args[2], args[3])
            from mpi4py import MPI

            comm = MPI.COMM_SELF.Dup()
            try:
                return run_stage(args[0], comm, args[1], args[2])
            finally:
                comm.Free()

        def hetflow_ping(self, *args: Any) -> dict[str, Any]:
            from mpi4py import MPI

            size = args[0].Get_size() if args else 1
            return {"pid": os.getpid(), "pool_rank": MPI.COMM_WORLD.Get_rank(), "size": size}

    return HetflowWorker


_classes: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # RP's worker launcher loads this file and asks for ``HetflowWorker`` by name
    if name == WORKER_CLASS:
        if name not in _classes:
            _classes[name] = _worker_class()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
