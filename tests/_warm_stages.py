"""Stage functions for the warm-start tests (importable by workers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa


def lineage(ctx):
    """Who started this rank: the command lines of its witness's parent, and its communicator."""
    from mpi4py import MPI

    witness = psutil.Process(os.getppid())
    starter = witness.parent()
    gathered = ctx.comm.allgather(ctx.rank)
    return {"lineage": pa.table({
        "rank": [ctx.rank], "starter": [" ".join(starter.cmdline()) if starter else ""],
        "session_leader": [os.getsid(0) == witness.pid], "mpi_comm": [isinstance(ctx.comm, MPI.Comm)],
        "size": [ctx.comm.Get_size()], "gathered": [gathered], "blas_threads": [os.environ.get("OMP_NUM_THREADS")],
        "cwd": [os.getcwd()], "stdin_null": [os.path.realpath("/proc/self/fd/0") == "/dev/null"]})}


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
