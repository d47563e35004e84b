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
