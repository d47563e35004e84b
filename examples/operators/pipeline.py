"""Distributed dataframe operators inside pipeline stages: join + group-by + sort.

``generate`` makes, on 2 ranks, detector hits and a table of calibration runs;
``summarize`` (2 ranks) wraps its partitions as DTables, joins hits to runs
(hash-shuffle or broadcast, chosen by the cost model), keeps good runs, sums
energy per (run, detector), and sorts globally by total energy.  The chosen
algorithms and their Hockney estimates go to the stage log.

    .venv/bin/hetflow run examples/operators/pipeline.py
    .venv/bin/python examples/operators/pipeline.py
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import hetflow as hf

pipe = hf.Pipeline("ops-demo", pilot="local")


@pipe.stage(ranks=2, outputs=["hits", "runs"], params={"hits_per_rank": 200_000, "runs": 500, "seed": 11})
def generate(ctx):
    """Each rank makes its share of the hits and of the run table."""
    n, n_runs = int(ctx.params["hits_per_rank"]), int(ctx.params["runs"])
    rng = np.random.default_rng([int(ctx.params["seed"]), ctx.rank])
    hits = pa.table({
        "run_id": rng.integers(0, n_runs, n),
        "detector": rng.integers(0, 16, n, dtype=np.int32),
        "energy": rng.gamma(2.0, 3.0, n),
    })
    mine = np.arange(ctx.rank, n_runs, ctx.size)
    runs = pa.table({"run_id": mine, "quality": rng.random(mine.size), "beam": np.where(mine % 3 == 0, "proton", "ion")})
    return {"hits": hits, "runs": runs}


@pipe.stage(ranks=2, inputs=["hits", "runs"], outputs=["summary"])
def summarize(ctx, hits, runs):
    """join → filter → group-by → global sort, all distributed over the stage's ranks."""
    good_runs = ctx.dtable(runs).filter(pc.field("quality") > 0.2)
    joined = ctx.dtable(hits).join(good_runs, "run_id", how="inner")
    per_run = joined.group_by(["run_id", "beam"]).aggregate([("energy", "sum"), ("energy", "mean"), ("detector", "count_distinct")])
    ordered = per_run.sort_by([("energy_sum", "descending"), ("run_id", "ascending")])
    if ctx.rank == 0:
        ctx.log.info("plan:\n%s", ordered.explain())
    total = ordered.num_rows
    top = ordered.head(5).gather()
    if ctx.rank == 0:
        ctx.log.info("%d good runs; top 5 by energy:\n%s", total, top.to_pandas().to_string(index=False))
    return {"summary": ordered.to_arrow()}


if __name__ == "__main__":
    run = pipe.run()
    print(f"run {run.id}: {run.state}")
    if run.ok:
        summary = run.dataset("summary").to_table()
        print(f"{summary.num_rows} runs; highest total energy first:")
        print(summary.slice(0, 5).to_pandas().to_string(index=False))
