"""A stage's ``memory_per_rank`` and the pilot's ``node_local_dir`` reach the operators: a real
``pipe.run()`` (2 ranks under mpiexec) whose join, sort and group-by inputs are 4x the stage's
memory budget runs them out of core, spilling under ``node_local_dir``, with results equal to
DuckDB's and nothing left on disk afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import hetflow as hf
import numpy as np
import pyarrow as pa

BUDGET = 256 << 10  #: the stage's memory_per_rank, bytes
ROWS = 4 * BUDGET // 16  #: left rows per rank: two 8-byte columns, 4x the budget


def make(ctx):
    rng = np.random.default_rng([7, ctx.rank])
    keys = ROWS // 2
    return {"left": pa.table({"k": rng.integers(0, keys, ROWS), "v": rng.random(ROWS)}),
            "right": pa.table({"k": rng.integers(0, keys, ROWS // 2), "w": rng.integers(0, 1000, ROWS // 2)}),
            "small": pa.table({"k": np.arange(ctx.rank, 40, 2), "x": np.arange(20)})}


def crunch(ctx, left, right, small):
    lt, rt, st = ctx.dtable(left), ctx.dtable(right), ctx.dtable(small)
    joined = lt.join(rt, "k")
    ordered = lt.sort_by("k")
    grouped = lt.group_by("k").aggregate([("v", "sum"), ("v", "count")])
    tiny = st.join(st, "k", suffix="_2")  # well under the budget: in memory
    plans = pa.table({"rank": [ctx.rank] * 4, "op": ["join", "sort", "group", "tiny"],
                      "plan": [t.explain() for t in (joined, ordered, grouped, tiny)]})
    return {"joined": joined.to_arrow(), "sorted": ordered.to_arrow(), "grouped": grouped.to_arrow(), "plans": plans}


def test_a_stage_over_its_memory_budget_spills_to_the_node_local_dir(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    pilot = hf.PilotDescription(name="two-cores-nvme", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34,
                                node_local_dir=str(nvme))
    pipe = hf.Pipeline("spill", workdir=tmp_path / "work")
    pipe.stage(ranks=2, outputs=["left", "right", "small"])(make)
    pipe.stage(ranks=2, memory_per_rank=BUDGET, inputs=["left", "right", "small"],
               outputs=["joined", "sorted", "grouped", "plans"])(crunch)
    run = pipe.run(pilot=pilot)
    assert run.ok, run

    assert os.listdir(nvme) == [], "spill directories must be removed"
    plans = run.dataset("plans").to_table().to_pylist()
    assert sorted(p["rank"] for p in plans) == [0, 0, 0, 0, 1, 1, 1, 1]
    for p in plans:
        if p["op"] == "tiny":
            assert "out of core" not in p["plan"], p["plan"]
            continue
        assert "algorithm=out-of-core" in p["plan"] and f"budget of {BUDGET} B per rank" in p["plan"], p["plan"]
        spilled, where = p["plan"].split("; spilled ")[1].split(" B to ")
        assert int(spilled) > 4 * BUDGET // 2, p["plan"]  # at least this rank's share of the input went to disk
        assert Path(where.split()[0]).parent == nvme, p["plan"]

    con = duckdb.connect()
    con.register("l", run.dataset("left").to_table())
    con.register("r", run.dataset("right").to_table())
    want = con.sql("SELECT k, v, w FROM l JOIN r USING (k) ORDER BY k, v, w").to_arrow_table()
    got = run.dataset("joined").to_table().sort_by([("k", "ascending"), ("v", "ascending"), ("w", "ascending")])
    assert got.num_rows == want.num_rows > 0
    assert got.select(["k", "v", "w"]).equals(want)

    ordered = run.dataset("sorted").to_table()  # partitions in rank order: one sorted table
    assert np.all(np.diff(ordered["k"].to_numpy()) >= 0)
    assert ordered.sort_by([("k", "ascending"), ("v", "ascending")]).equals(
        con.sql("SELECT k, v FROM l ORDER BY k, v").to_arrow_table())

    want_groups = con.sql("SELECT k, sum(v) AS s, count(v) AS c FROM l GROUP BY k ORDER BY k").to_arrow_table()
    groups = run.dataset("grouped").to_table().sort_by("k")
    assert groups["k"].equals(want_groups["k"]) and groups["v_count"].equals(want_groups["c"])
    np.testing.assert_allclose(groups["v_sum"].to_numpy(), want_groups["s"].to_numpy(), rtol=1e-12)
