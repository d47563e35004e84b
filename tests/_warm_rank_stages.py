"""Stage functions for the warm multi-rank tests (importable by workers)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pyarrow as pa


def _note_starter(ctx) -> str:
    """Write, and return, the command line of this rank's parent (the fork server for a warm rank, a witness
    started by ``mpiexec`` for a cold one) to ``starter-<rank>.txt``."""
    line = " ".join(psutil.Process(os.getppid()).cmdline())
    (Path(ctx.workdir) / f"starter-{ctx.rank}.txt").write_text(line)
    return line


def allreduces(ctx):
    """Who started this rank, its world, an allreduce over it, and where it runs."""
    starter = _note_starter(ctx)
    print(f"rank {ctx.rank} says hello", flush=True)
    return {"reduced": pa.table({
        "rank": [ctx.rank], "size": [ctx.comm.Get_size()], "total": [ctx.comm.allreduce(ctx.rank + 1)],
        "starter": [starter], "session_leader": [os.getsid(0) == os.getpid()],
        "cpus": [sorted(os.sched_getaffinity(0))], "cores": [list(ctx.cores)],
        "pmi_rank": [os.environ.get("PMI_RANK")], "cwd": [os.getcwd()]})}


def one_raises(ctx):
    """Rank 1 raises; rank 0 waits for it in a collective (it would wait forever if nobody ended it)."""
    _note_starter(ctx)
    if ctx.rank == 1:
        while not (Path(ctx.workdir) / "starter-0.txt").exists():
            time.sleep(0.01)
        raise ValueError("rank one gives up")
    ctx.comm.barrier()


def one_is_killed(ctx):
    """Rank 1 dies by SIGKILL; rank 0 waits for it in a collective."""
    _note_starter(ctx)
    if ctx.rank == 1:
        while not (Path(ctx.workdir) / "starter-0.txt").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.barrier()


def both_hang(ctx):
    _note_starter(ctx)
    while True:
        time.sleep(0.1)


def reduces_into(ctx):
    """The sum of the ranks' numbers over their world, into the output ``params["out"]``."""
    starter = _note_starter(ctx)
    return {ctx.params["out"]: pa.table({"rank": [ctx.rank], "total": [ctx.comm.allreduce(ctx.rank + 1)],
                                         "starter": [starter]})}
