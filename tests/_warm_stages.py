"""Stage functions for the warm-start tests (importable by workers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa


def starter(pid: int | None = None) -> psutil.Process | None:
    """What started rank ``pid`` (this one): a warm rank leads its own session, and its parent, the fork
    server, is its witness; any other rank's parent is a witness, whose parent started it."""
    rank = psutil.Process(pid)
    parent = rank.parent()
    return parent if os.getsid(rank.pid) == rank.pid or parent is None else parent.parent()


def lineage(ctx):
    """Who started this rank: the command line of its starter (:func:`starter`), whether that is its own
    parent (one fork: no witness between them), and its communicator."""
    from mpi4py import MPI

    parent = psutil.Process(os.getppid())
    started_by = starter()
    gathered = ctx.comm.allgather(ctx.rank)
    return {"lineage": pa.table({
        "rank": [ctx.rank], "starter": [" ".join(started_by.cmdline()) if started_by else ""],
        "starter_is_parent": [started_by is not None and started_by.pid == parent.pid],
        "session_leader": [os.getsid(0) in (os.getpid(), parent.pid)], "mpi_comm": [isinstance(ctx.comm, MPI.Comm)],
        "size": [ctx.comm.Get_size()], "gathered": [gathered], "blas_threads": [os.environ.get("OMP_NUM_THREADS")],
        "cwd": [os.getcwd()], "stdin_null": [os.path.realpath("/proc/self/fd/0") == "/dev/null"],
        "fi_provider_path": [os.environ.get("FI_PROVIDER_PATH")]})}


def prints(ctx):
    print(f"hello from {ctx.stage}", flush=True)
    print(f"warning from {ctx.stage}", file=sys.stderr, flush=True)


def hangs(ctx):
    (Path(ctx.workdir) / "hanging").touch()
    if ctx.params.get("how") == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(0.1)


def kills_itself(ctx):
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(ctx):
    """Sleeps on its first attempt (until the test ends its fork server), returns on the next."""
    if ctx.attempt == 1:
        (Path(ctx.workdir) / "sleeping").touch()
        time.sleep(60)
    return {"slept": pa.table({"attempt": [ctx.attempt]})}


def lineage2(ctx):
    return {"lineage2": lineage(ctx)["lineage"]}


def lineage_after(ctx, table):
    return lineage(ctx)


def daemon_then_killed(ctx):
    """Leaves a daemon (``setsid`` and a double fork) and then dies by SIGKILL, so it cannot end the daemon."""
    import _fault_stages as F

    F._leave_child(ctx, "daemon")
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps_beside(ctx):
    """Runs while the other stage dies, and returns: its end is not its neighbour's."""
    time.sleep(3.0)
    return {"beside": pa.table({"pid": [os.getpid()]})}


def _mpi():
    """mpi4py's MPI module, as the rank loaded it, found without naming the package: a stage whose code names
    mpi4py has MPI started before it runs (``WorkerSpec.mpi_named``)."""
    return sys.modules["mpi4py.MPI"]


def mpi_started(ctx):
    """Whether MPI runs before the stage reads ``ctx.comm``, after ``ctx.rank``/``ctx.size``, and after it does."""
    MPI = _mpi()
    before = MPI.Is_initialized()
    rank, size = ctx.rank, ctx.size
    after_rank = MPI.Is_initialized()
    comm = ctx.comm
    return {"mpi_started": pa.table({
        "before": [before], "after_rank": [after_rank], "rank": [rank], "size": [size],
        "after_comm": [MPI.Is_initialized()], "mpi_comm": [isinstance(comm, MPI.Comm)],
        "same": [comm is ctx.comm], "comm_size": [comm.Get_size()], "gathered": [comm.allgather(7)]})}


def mpi_unused(ctx):
    return {"mpi_unused": pa.table({"started": [_mpi().Is_initialized()], "rank": [ctx.rank], "size": [ctx.size]})}


def mpi_direct(ctx):
    """Uses mpi4py without reading ``ctx.comm``, as code written for mpiexec does."""
    from mpi4py import MPI

    return {"mpi_direct": pa.table({"gathered": [MPI.COMM_WORLD.allgather(5)], "size": [MPI.COMM_WORLD.Get_size()]})}


def _openblas_threads() -> int | None:
    """Threads numpy's OpenBLAS uses now (None when numpy's OpenBLAS is not loaded)."""
    import ctypes

    with open("/proc/self/maps") as fh:
        paths = [line.split()[-1] for line in fh if "openblas" in line.lower()]
    for path in paths:
        if "openblas" in os.path.basename(path).lower():
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                         "openblas_get_num_threads"):
                if hasattr(lib, name):
                    return int(getattr(lib, name)())
    return None


def environment(ctx):
    """What this rank was given: its environment, CPU affinity, BLAS and torch thread counts, who started it."""
    import json

    import numpy as np

    started = time.time()
    time.sleep(float(ctx.params.get("sleep", 0)))
    np.ones((64, 64)) @ np.ones((64, 64))  # the BLAS in use
    torch = sys.modules.get("torch")
    started_by = starter()
    return {ctx.stage + "_env": pa.table({
        "env": [json.dumps(dict(os.environ), sort_keys=True)],
        "affinity": [sorted(os.sched_getaffinity(0))],
        "openblas_threads": [_openblas_threads()],
        "torch_threads": [torch.get_num_threads() if torch is not None else -1],
        "torch_interop_threads": [torch.get_num_interop_threads() if torch is not None else -1],
        "warm": [started_by is not None and "hetflow.tasks.forkserver" in " ".join(started_by.cmdline())
                 and started_by.pid == os.getppid()],
        "pid": [os.getpid()], "ppid": [os.getppid()],
        "cuda": [os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")], "started": [started],
        "ended": [time.time()]})}
