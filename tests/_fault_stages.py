"""Stage functions for the fault-injection tests (importable by workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa


def numbers(ctx):
    n = int(ctx.params.get("rows_per_rank", 2000))
    start = ctx.rank * n
    return {"numbers": pa.table({"x": np.arange(start, start + n, dtype=np.int64),
                                 "rank": np.full(n, ctx.rank, dtype=np.int32)})}


def shuffle_loop(ctx, table):
    """An all-to-all exchange repeated long enough for a test to kill a rank inside it."""
    rounds = int(ctx.params.get("rounds", 40))
    (Path(ctx.workdir) / f"in-shuffle-{ctx.rank}").touch()
    x = np.asarray(table["x"])
    for _ in range(rounds):
        parts = [x[x % ctx.size == r] for r in range(ctx.size)]
        received = ctx.comm.alltoall(parts)
        x = np.concatenate(received) if received else x
        time.sleep(0.05)
    return {"shuffled": pa.table({"x": np.sort(x)})}


def slow_writer(ctx, table):
    """Streams its output slowly, so a test can kill a rank while the partition is being written."""
    schema = pa.schema([("x", pa.int64())])

    def batches():
        (Path(ctx.workdir) / f"writing-{ctx.rank}").touch()
        for start in range(0, table.num_rows, 100):
            time.sleep(0.05)
            yield pa.record_batch([table["x"].slice(start, 100).combine_chunks()], schema=schema)

    return {"written": pa.RecordBatchReader.from_batches(schema, batches())}


def dies_alone(ctx, table):
    """Rank 1 ends by itself mid-stage (``how``: SIGKILL, as the OOM killer does, or ``os._exit(3)``).

    Every rank first notes the MPICH shared-memory files it maps (``shm-seen-<rank>.txt``)."""
    with open("/proc/self/maps") as maps:
        seen = sorted({line.split()[-1] for line in maps if "/dev/shm/mpich_" in line and "(deleted)" not in line})
    (ctx.workdir / f"shm-seen-{ctx.rank}.txt").write_text("".join(f"{p}\n" for p in seen))
    if ctx.rank == 1:
        time.sleep(0.2)
        if ctx.params["how"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    ctx.comm.barrier()  # the others wait in a collective until mpiexec kills them
    return {"survivors": table}


def missed_death(ctx, table):
    """Rank 1 leaves the record its witness writes when a rank dies by itself, but stays alive:
    what a launcher that missed the death leaves behind (Hydra's racy check, mpich#4862; srun
    without --kill-on-bad-exit)."""
    if ctx.rank == 1:
        record = {"pid": os.getpid(), "status": int(signal.SIGKILL), "ended": time.time()}
        (Path(ctx.workdir) / f"ended-{os.getpid()}.json").write_text(json.dumps(record))
        while True:
            time.sleep(0.1)
    ctx.comm.barrier()
    return {"survivors": table}


def hang(ctx, table):
    if ctx.rank == 1:
        if ctx.params.get("how") == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:
            time.sleep(0.1)
    ctx.comm.barrier()
    return {"hung": table}


def flaky(ctx, table):
    """Fails on its first attempt only (a transient fault).

    Decided by the attempt number, not by per-rank marker files: the first rank to
    raise aborts the others, which may not have reached their marker yet.
    """
    if ctx.attempt == 1:
        raise ConnectionError("transient: the file system blinked")
    return {"steady": table}


def unknown_column(ctx, table):
    return {"picked": table.select(["no_such_column"])}


def passthrough(ctx, table):
    return {ctx.stage + "_out": table}


def big_output(ctx, table):
    return {"big": pa.table({"x": np.arange(2_000_000, dtype=np.int64)})}


def sleeper(ctx, table):
    (Path(ctx.workdir) / f"sleeping-{ctx.rank}").touch()
    time.sleep(float(ctx.params.get("sleep", 30)))
    return {"slept": table}


DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


def _leave_child(ctx, how: str) -> Path:
    """Start a process that outlives this rank; returns the file with its pid.

    ``how``: ``stdout`` (a child keeping the rank's stdout), ``group`` (a child in the rank's
    process group, stdout elsewhere), ``daemon`` (``setsid`` and a double fork, stdout kept).
    """
    pid_file = Path(ctx.workdir) / f"child-{ctx.rank}.pid"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if how == "daemon":
        subprocess.run([sys.executable, "-c", DAEMON, str(pid_file)], stdin=subprocess.DEVNULL, check=True)
        while not pid_file.exists():
            time.sleep(0.01)
    else:
        child = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, **({} if how == "stdout" else quiet))
        pid_file.write_text(str(child.pid))
    return pid_file


def leaves_children(ctx):
    """Every rank returns at once, leaving a child behind (``how``, see :func:`_leave_child`)."""
    _leave_child(ctx, ctx.params["how"])


def dies_beside_a_daemon(ctx):
    """Rank 0 starts a daemon and waits in a collective; rank 1 then ends by itself, so the launcher
    SIGKILLs rank 0 together with its witness."""
    if ctx.rank == 0:
        _leave_child(ctx, "daemon")
    else:
        while not (Path(ctx.workdir) / "child-0.pid").exists():
            time.sleep(0.01)
        time.sleep(1.0)  # the backend has looked at the tree since
        os._exit(3)
    ctx.comm.barrier()


def books_cores(ctx):
    """Records this rank's CPUs and lifetime in ``params["record"]``.

    With ``until`` (the other run's log): stays until that log says the other run waits for
    cores, or the other run's stage has started, whichever comes first (at most 30 s).
    """
    record = Path(ctx.params["record"])
    started = time.time()
    until = ctx.params.get("until")
    (record / f"started-{'first' if until else 'second'}-{ctx.rank}").touch()
    if until:
        deadline = time.time() + 30
        while time.time() < deadline and not list(record.glob("started-second-*")):
            if Path(until).exists() and "waiting for cores" in Path(until).read_text(errors="replace"):
                break
            time.sleep(0.02)
    (record / f"{ctx.run_id}-{ctx.rank}.json").write_text(json.dumps(
        {"cpus": sorted(os.sched_getaffinity(0)), "started": started, "ended": time.time()}))


def aborts_on_its_way_out(ctx, table):
    """Rank 1 returns its result, then aborts in the interpreter's teardown (as a native library can)."""
    if ctx.rank == 1:
        import atexit

        atexit.register(os.abort)
    return {"copied": table}
