"""Four stages in a row, each ~15 s of work estimated at 25 s: in a one-minute job, two start.

Each stage appends "<stage> <Slurm job id>" to the file ``--param marks=PATH``.
"""

from __future__ import annotations

import os
import time

import hetflow as hf
import pyarrow as pa

pipe = hf.Pipeline("chain", pilot="local")


def _work(ctx, name):  # type: ignore[no-untyped-def]
    time.sleep(15)
    with open(ctx.params["marks"], "a") as marks:
        marks.write(f"{name} {os.environ.get('SLURM_JOB_ID', '-')}\n")
    return pa.table({"stage": [name]})


@pipe.stage(ranks=1, duration=25, outputs=["a"], params={"marks": ""})
def first(ctx):  # type: ignore[no-untyped-def]
    return {"a": _work(ctx, "first")}


@pipe.stage(ranks=1, duration=25, inputs=["a"], outputs=["b"])
def second(ctx, a):  # type: ignore[no-untyped-def]
    return {"b": _work(ctx, "second")}


@pipe.stage(ranks=1, duration=25, inputs=["b"], outputs=["c"])
def third(ctx, b):  # type: ignore[no-untyped-def]
    return {"c": _work(ctx, "third")}


@pipe.stage(ranks=1, duration=25, inputs=["c"], outputs=["d"])
def fourth(ctx, c):  # type: ignore[no-untyped-def]
    return {"d": _work(ctx, "fourth")}
