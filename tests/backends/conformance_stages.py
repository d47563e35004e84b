"""Stage functions for the backend conformance suite (imported by workers by module and name).

Everything here is deterministic for a given rank count, so every backend must
commit byte-identical datasets.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

FEATURES = ["f0", "f1", "f2", "f3"]


def generate(ctx):
    """Rows with a shuffled integer key and a linear target, seeded per rank."""
    n = int(ctx.params.get("rows_per_rank", 400))
    rng = np.random.default_rng([11, ctx.rank])
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
    keys = rng.permutation(n).astype(np.int64) * ctx.size + ctx.rank
    columns = {"key": keys, **{name: x[:, i] for i, name in enumerate(FEATURES)}, "y": y}
    return {"rows": pa.table(columns)}


def sort_rows(ctx, rows):
    """A hetflow operator: distributed sample sort of every rank's rows by key."""
    from hetflow.operators.sorting import sample_sort

    ordered = sample_sort(ctx.comm, rows, [("key", "ascending")], "at_end")
    assert ctx.comm.allreduce(ordered.num_rows) == ctx.comm.allreduce(rows.num_rows)
    return {"sorted": ordered}


def train(ctx, rows):
    """Data-parallel training of a small MLP (torch.distributed Gloo over the stage's ranks)."""
    import torch

    import hetflow.ml as ml

    torch.manual_seed(0)
    result = ml.fit(ctx, rows, model=ml.MLP(4, hidden=[8]), features=FEATURES, label="y",
                    loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                    epochs=2, batch_size=64, seed=3)
    return {"model": result.model_table, "metrics": result.metrics}


def fail_on_rank_one(ctx, rows):
    if ctx.rank == 1:
        raise ValueError(f"boom on rank {ctx.rank} with {rows.num_rows} rows")
    ctx.comm.barrier()  # rank 0 would wait forever without the abort
    return {"never": rows}


def join_and_group(ctx, rows):
    """hetflow operators over the stage's ranks: a self-join on a derived key, then a group-by."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ctx.dtable(rows.select(["key", "y"]))
    bucket = table.with_columns(b=lambda t: pc.bit_wise_and(t.column("key"), pa.scalar(7, pa.int64())))
    pairs = bucket.join(bucket.select(["key", "b"]), "b", suffix="_other")
    groups = pairs.group_by("b").aggregate([("key_other", "count"), ("y", "sum")])
    return {"joined": groups.sort_by("b").to_arrow()}
