"""``DTable`` operators over ``settings.memory_budget`` run out of core (``operators/overbudget.py``) at any
rank count: the same rows as in memory, the plan says so and names the spill directory, which is gone
afterwards; under the budget, or with none, nothing changes.  The stage wiring is tested end to end
in ``tests/test_stage_spill.py``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hetflow.operators import DTable, UnsupportedAggregationError, settings

pytestmark = pytest.mark.mpi

BUDGET = 128 << 10  # bytes; each rank's input below is 4x it


def _table(rank: int) -> pa.Table:
    n = 0 if rank == 1 else 4 * BUDGET // 24  # rank 1 (when there is one) holds nothing
    rng = np.random.default_rng([11, rank])
    keys = [f"k{x}" for x in rng.integers(0, 3000, n)]
    return pa.table({"k": pa.array(keys, pa.string_view()), "v": rng.random(n), "w": rng.integers(0, 9, n)})


def _rows(comm: Any, dt: DTable) -> pa.Table | None:
    """The whole table on rank 0 in one canonical order (None elsewhere)."""
    table = dt.gather()
    return None if table is None else table.cast(pa.schema([pa.field(f.name, pa.string() if f.type == pa.string_view()
                                                                      else f.type) for f in table.schema])
                                                 ).sort_by([(c, "ascending") for c in table.column_names])


def test_over_the_budget_join_sort_and_group_by_spill_and_match_in_memory(comm: Any) -> None:
    base = comm.bcast(tempfile.mkdtemp(prefix="hetflow-spilling-test-") if comm.Get_rank() == 0 else None, root=0)
    left = DTable(comm, _table(comm.Get_rank()))
    right = DTable(comm, _table(comm.Get_rank()).slice(0, 500).select(["k", "w"]))
    aggs = [("v", "sum"), ("w", "max"), ("v", "count")]
    in_memory = [left.join(right, "k", how="full"), left.sort_by([("k", "descending"), ("v", "ascending")]),
                 left.group_by("k").aggregate(aggs)]
    with settings.override(memory_budget=BUDGET, spill_dir=base):
        spilled = [left.join(right, "k", how="full"), left.sort_by([("k", "descending"), ("v", "ascending")]),
                   left.group_by("k").aggregate(aggs)]
        tiny = right.head(3).join(right.head(3), "k")  # under the budget: in memory
        with pytest.raises(UnsupportedAggregationError, match="over the memory budget of 131072 B per rank"):
            left.group_by("k").aggregate([("v", "first")])
    comm.Barrier()
    assert os.listdir(base) == [], "the spill directories must be gone"
    for memory_dt, spill_dt in zip(in_memory, spilled):
        plan = spill_dt.explain()
        assert "algorithm=out-of-core" in plan and "spilled " in plan and base in plan, plan
        assert "out-of-core" not in memory_dt.explain()
        assert spill_dt.schema == memory_dt.schema  # string_view stays one
        want, got = _rows(comm, memory_dt), _rows(comm, spill_dt)
        if comm.Get_rank() == 0:
            assert want is not None and got is not None and got.num_rows == want.num_rows > 0
            if "v_sum" in got.column_names:  # float sums in another order
                np.testing.assert_allclose(got["v_sum"].to_numpy(), want["v_sum"].to_numpy(), rtol=1e-12)
                got, want = got.drop_columns(["v_sum"]), want.drop_columns(["v_sum"])
            assert got.equals(want)
    assert "out-of-core" not in tiny.explain()
    # the sort's partitions in rank order are one sorted table (ties in no particular order)
    keys = spilled[1].gather()
    if keys is not None:
        column = keys["k"].cast(pa.string()).to_pylist()
        assert column == sorted(column, reverse=True)
    comm.Barrier()
    if comm.Get_rank() == 0:
        os.rmdir(base)
