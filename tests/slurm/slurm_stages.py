"""Stage functions for the slurm tests (imported by the workers by module and name).

Deterministic for a given rank count, so the slurm and local backends must commit
byte-identical datasets.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def generate(ctx):
    """Rows with a shuffled integer key, seeded per rank."""
    n = int(ctx.params.get("rows_per_rank", 200))
    rng = np.random.default_rng([7, ctx.rank])
    keys = rng.permutation(n).astype(np.int64) * ctx.size + ctx.rank
    return {"rows": pa.table({"key": keys, "x": rng.normal(size=n)})}


def sort_rows(ctx, rows):
    """A hetflow operator across the stage's ranks (one communicator, whatever the nodes)."""
    from hetflow.operators.sorting import sample_sort

    ordered = sample_sort(ctx.comm, rows, [("key", "ascending")], "at_end")
    assert ctx.comm.allreduce(ordered.num_rows) == ctx.comm.allreduce(rows.num_rows)
    return {"sorted": ordered}


def noop(ctx):
    """A trivial one-rank stage: what the per-task overhead is measured with."""
    return {}


def fail_on_last_rank(ctx):
    """The last rank raises; the others wait in a barrier that only the abort ends."""
    if ctx.rank == ctx.size - 1:
        raise ValueError(f"boom on rank {ctx.rank} of {ctx.size}")
    ctx.comm.barrier()
    return {}


def exit_on_last_rank(ctx):
    """The last rank leaves without a result (exit code 15, what MPICH's MPI_ERR_OTHER gives)."""
    import os

    if ctx.rank == ctx.size - 1:
        os._exit(15)
    ctx.comm.barrier()
    return {}


def sleep_long(ctx):
    """Outlives its stage's timeout on every rank."""
    import time

    time.sleep(300)
    return {}


def hold_node(ctx):
    """One rank on every CPU of its node for a moment: a neighbour the locality test places around."""
    import time

    time.sleep(float(ctx.params.get("hold_seconds", 1.0)))
    return {}


def produce(ctx):
    """A small table: its partition's recorded node is what the consumer is placed by."""
    return {"made": pa.table({"x": np.arange(10, dtype=np.int64) + ctx.rank})}


def consume(ctx, made):
    return {"used": made}


def wait_for_node_loss(ctx):
    """The first attempt: say where each rank runs (a file per rank in ``params['ready_dir']``), then
    wait for the test to take a node away.  A retry returns at once."""
    import pathlib
    import socket
    import time

    if ctx.attempt == 1:
        ready = pathlib.Path(ctx.params["ready_dir"])
        (ready / f"rank-{ctx.rank}.tmp").write_text(socket.gethostname())
        (ready / f"rank-{ctx.rank}.tmp").rename(ready / f"rank-{ctx.rank}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            # MPI progress: a rank that only sleeps can hold up the other's start (its last
            # message of MPI_Init may wait in this rank's queue until it calls into MPI)
            ctx.comm.Iprobe()
            time.sleep(0.05)
    return {}


def who(ctx):
    """Where and how this rank was started, in ``params['record_dir']/<stage>-<rank>.json``: its host, pid,
    session, and its parent's command line and start time (a rank forked by its node's agent has the fork
    server as parent, one started by a job step its witness or slurmstepd)."""
    import json
    import os
    import pathlib
    import socket
    import time

    parent = pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    # the parent's start (clock ticks after boot, /proc/PID/stat field 22) as a time.time()
    ticks = int(pathlib.Path(f"/proc/{os.getppid()}/stat").read_text().rpartition(")")[2].split()[19])
    booted = time.time() - float(pathlib.Path("/proc/uptime").read_text().split()[0])
    record = {"host": socket.gethostname(), "pid": os.getpid(), "leads_session": os.getsid(0) == os.getpid(),
              "parent": parent, "parent_started": booted + ticks / os.sysconf("SC_CLK_TCK"), "size": ctx.size}
    path = pathlib.Path(ctx.params["record_dir"]) / f"{ctx.stage}-{ctx.rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)
    return {}


def sleep_flagged(ctx):
    """Say its pid (``params['record_dir']/<stage>.pid``), then outlive any timeout or cancel."""
    import os
    import pathlib
    import time

    flag = pathlib.Path(ctx.params["record_dir"]) / f"{ctx.stage}.pid"
    flag.with_suffix(".tmp").write_text(str(os.getpid()))
    flag.with_suffix(".tmp").rename(flag)
    time.sleep(300)
    return {}


def wait_for_agent_kill(ctx):
    """The first attempt: say its pid, its parent's pid and its host (``params['record_dir']/first.json``),
    then wait for the test to kill its parent.  A retry says its parent's command line and returns."""
    import json
    import os
    import pathlib
    import socket
    import time

    record_dir = pathlib.Path(ctx.params["record_dir"])
    if ctx.attempt == 1:
        record = {"pid": os.getpid(), "parent": os.getppid(), "host": socket.gethostname()}
        (record_dir / "first.tmp").write_text(json.dumps(record))
        (record_dir / "first.tmp").rename(record_dir / "first.json")
        time.sleep(120)
    parent = pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    (record_dir / "retry.json").write_text(json.dumps({"parent": parent, "host": socket.gethostname()}))
    return {}
