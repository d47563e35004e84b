"""Stage functions and pipeline builders shared by the end-to-end tests.

Workers import stage functions by module and name, so they live at the top
level of this importable module; each builder wires them into a Pipeline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import hetflow as hf


def make_rows(ctx):
    n = int(ctx.params.get("rows_per_rank", 1000))
    start = ctx.rank * n
    return {"numbers": pa.table({"x": np.arange(start, start + n, dtype=np.int64),
                                 "rank": np.full(n, ctx.rank, dtype=np.int32)})}


def describe_rank(ctx, numbers):
    """One row per rank: what this rank saw and where it ran."""
    time.sleep(float(ctx.params.get("sleep", 0)))
    return {ctx.stage + "_out": pa.table({
        "rank": [ctx.rank], "size": [ctx.size], "comm_size": [ctx.comm.Get_size()],
        "rows": [numbers.num_rows], "sum": [int(np.asarray(numbers["x"]).sum()) if numbers.num_rows else 0],
        "first": [int(numbers["x"][0].as_py()) if numbers.num_rows else -1],
        "affinity": [sorted(os.sched_getaffinity(0))],
        "cuda": [os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")],
        "rocr": [os.environ.get("ROCR_VISIBLE_DEVICES", "<unset>")],
        "hip": [os.environ.get("HIP_VISIBLE_DEVICES", "<unset>")],
        "pid": [os.getpid()],
    })}


def passthrough(ctx, numbers):
    return {ctx.stage + "_out": numbers}


def fail_on_rank_one(ctx, numbers):
    if ctx.rank == 1:
        raise ValueError(f"boom on rank {ctx.rank} with {numbers.num_rows} rows")
    ctx.comm.barrier()  # rank 0 would wait here forever without the abort
    return {"never": numbers}


def sleepy(ctx, numbers):
    time.sleep(float(ctx.params.get("sleep", 60)))
    return {"late": numbers}


def pipeline(name: str, *, pilot: "str | hf.PilotDescription" = "local", workdir: Path | None = None) -> hf.Pipeline:
    return hf.Pipeline(name, pilot=pilot, workdir=workdir)


def two_branches(workdir: Path, *, sleep: float = 1.0) -> hf.Pipeline:
    """make_rows (2 ranks) feeding two independent 1-rank stages that can run at once."""
    pipe = pipeline("branches", workdir=workdir)
    pipe.stage(ranks=2, outputs=["numbers"], params={"rows_per_rank": 500})(make_rows)
    pipe.stage(name="left", ranks=1, inputs=["numbers"], outputs=["left_out"], params={"sleep": sleep})(describe_rank)
    pipe.stage(name="right", ranks=1, inputs=["numbers"], outputs=["right_out"], params={"sleep": sleep})(describe_rank)
    return pipe


def tiny(ctx):
    return {ctx.stage: pa.table({"stage": [ctx.stage], "rank": [ctx.rank]})}


def wide(workdir: Path, stages: int, pilot: "hf.PilotDescription") -> hf.Pipeline:
    """``stages`` independent one-rank stages: they all finish within moments of each other."""
    pipe = pipeline("wide", pilot=pilot, workdir=workdir)
    for i in range(stages):
        pipe.stage(name=f"t{i:03d}", ranks=1, outputs=[f"t{i:03d}"])(tiny)
    return pipe
