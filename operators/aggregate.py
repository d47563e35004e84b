"""Distributed group-by aggregate and whole-table column aggregates.

Group-by has two algorithms (Cylon / Dask ``split_out`` style):

* **shuffle-compute** – hash-shuffle the key and value columns, aggregate once;
  moves every row, best when most keys are distinct;
* **combine-shuffle-reduce** – aggregate locally to partial states, shuffle the
  partials, merge them; moves one row per (rank, group), best with few groups.
  Only for decomposable aggregations (count, sum, mean, min, max, stddev,
  variance on numbers).

``auto`` estimates the number of groups with a HyperLogLog sketch of the key
hashes and compares the Hockney cost of both exchanges.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import comm as tc
from . import kernels, partition
from .costmodel import Plan, hockney
from .errors import UnsupportedAggregationError
from .typing import DECOMPOSABLE_AGGS

if TYPE_CHECKING:
    from .dtable import DTable

log = logging.getLogger(__name__)

COMBINE_MAX_GROUP_RATIO = 0.5


def _decomposable(schema: pa.Schema, aggs: Sequence[tuple[str, str]]) -> bool:
    for col, agg in aggs:
        if agg not in DECOMPOSABLE_AGGS:
            return False
        t = schema.field(col).type
        if agg in ("sum", "mean", "stddev", "variance") and not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            return False
    return True


def _estimate_groups(hashes: np.ndarray) -> int:
    """Distinct key hashes (HyperLogLog sketch)."""
    if hashes.size == 0:
        return 0
    pl = kernels._polars()
    return int(pl.Series(hashes).approx_n_unique())


def group_aggregate(dt: "DTable", keys: list[str], aggs: list[tuple[str, str]], algorithm: str) -> "DTable":
    table = dt.to_arrow()
    dt._check_columns([c for c, _ in aggs], "aggregate")
    schema = kernels.aggregate_schema(table.schema, keys, aggs)  # validates names and types
    table = partition.canonical_floats(table, keys)  # -0.0 and 0.0 (and all NaNs) are one group
    comm = dt.comm
    p = comm.Get_size()
    needed = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
    if p == 1:
        return dt._derive(kernels.group_aggregate(table, keys, aggs), Plan("group_by", "local aggregate (1 rank)", 0.0))
    decomposable = _decomposable(table.schema, aggs)
    if algorithm == "combine" and not decomposable:
        raise UnsupportedAggregationError(
            f"combine-shuffle-reduce needs decomposable numeric aggregations {sorted(DECOMPOSABLE_AGGS)}; got {aggs}")
    model = hockney(comm)
    proj = table.select(needed)
    hashes = partition.hash_keys(proj, keys)  # once: for the estimate and for the shuffle
    groups_local = _estimate_groups(hashes) if decomposable else proj.num_rows
    stats = np.array(comm.allgather((proj.num_rows, groups_local, int(proj.nbytes))), dtype=np.float64)
    rows = stats[:, 0].sum()
    ratio = float(stats[:, 1].sum() / rows) if rows else 1.0
    row_bytes = stats[:, 2].sum() / rows if rows else 0.0
    partial_row_bytes = 8.0 * (len(keys) + 2 * len(aggs))
    costs = {"shuffle": model.shuffle(p, float(stats[:, 2].max()))}
    if decomposable:
        costs["combine"] = model.shuffle(p, float((stats[:, 1] * partial_row_bytes).max()))
    if algorithm == "auto":
        choice = "combine" if decomposable and ratio <= COMBINE_MAX_GROUP_RATIO else "shuffle"
    else:
        choice = algorithm
    if decomposable:
        detail = f"estimated groups/rows {ratio:.2f} (HyperLogLog), {row_bytes:.0f} B/row"
    else:
        detail = f"non-decomposable aggregation: shuffle-compute only, {row_bytes:.0f} B/row"
    if choice == "shuffle":
        ids = partition.ids_from_hash(hashes, p)
        del hashes
        shuffled = tc.shuffle(comm, proj, ids)
        del ids, proj
        out = kernels.group_aggregate(shuffled, keys, aggs)
        name = "shuffle-compute"
    else:
        partial = kernels.partial_aggregate(proj, keys, aggs)
        shuffled = tc.shuffle(comm, partial, partition.partition_ids(partial, keys, p))
        out = kernels.combine_aggregate(shuffled, keys, aggs, schema)
        name = "combine-shuffle-reduce"
    return dt._derive(out, Plan("group_by", name, costs[choice], costs, detail))


def column_aggregates(dt: "DTable", aggs: list[tuple[str, str]]) -> dict[str, Any]:
    """Replicated whole-table aggregates as Python values keyed ``<col>_<agg>``."""
    table = dt.to_arrow()
    dt._check_columns([c for c, _ in aggs], "aggregate")
    schema = kernels.aggregate_schema(table.schema, [], aggs)
    comm = dt.comm
    out: dict[str, Any] = {}
    dec = [a for a in aggs if _decomposable(table.schema, [a])]
    root = comm.Get_rank() == 0  # results are computed on rank 0 and broadcast: bit-identical replicas
    if dec:
        partial = kernels.partial_aggregate(table, [], dec)
        parts = tc.gather_table(comm, partial, root=0)
        if parts is not None:
            res = kernels.combine_aggregate(pa.concat_tables(parts), [], dec, kernels.aggregate_schema(table.schema, [], dec))
            for name in res.schema.names:
                out[name] = res.column(name)[0].as_py()
    for col, agg in aggs:
        name = kernels.agg_name(col, agg)
        if (col, agg) in dec:
            continue
        column = table.select([col])
        if agg == "count_distinct":
            shuffled = pa.concat_tables(tc.alltoall_tables(comm, partition.hash_partition(column, [col], comm.Get_size())))
            local = pc.count_distinct(shuffled.column(col), mode="only_valid").as_py() if shuffled.num_rows else 0
            out[name] = tc.allreduce_sum(comm, local)
        elif agg in ("first", "last"):
            n = column.num_rows
            mine = None if n == 0 else column.column(col)[0 if agg == "first" else n - 1].as_py()
            every = comm.allgather((n > 0, mine))
            vals = [v for has, v in every if has]
            out[name] = None if not vals else (vals[0] if agg == "first" else vals[-1])
        else:  # list and the aggregations of non-numeric types: on the gathered column
            parts = tc.gather_table(comm, column, root=0)
            if parts is not None:
                res = kernels.group_aggregate(pa.concat_tables(parts), [], [(col, agg)])
                out[name] = res.column(0)[0].as_py()
    final = {name: out[name] for name in schema.names} if root else None
    return comm.bcast(final, root=0)  # type: ignore[no-any-return]
