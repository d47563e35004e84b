"""Distributed group-by aggregate and whole-table column aggregates.

Group-by has two algorithms (Cylon / Dask ``split_out`` style):

* **shuffle-compute** – hash-shuffle the key and value columns, aggregate once;
  moves every row, best when most keys are distinct;
* **combine-shuffle-reduce** – aggregate locally to partial states, shuffle the
  partials, merge them; moves one row per (rank, group), best with few groups.
  Only for decomposable aggregations (count, sum, mean, min, max, stddev,
  variance on numbers).
* **range-shuffle-compute** – shuffle-compute with ranges of the key instead of
  its hash (the sample sort's splitters; all rows of a key value go to one
  rank); only for one integer-like key without nulls on any rank.  It needs no
  hash of the key: the splitters cost one comparison per row, and the group
  count is estimated from every 8th key (``SAMPLE_STRIDE``) instead of a
  HyperLogLog sketch of every key's hash, which is cheaper (figures:
  docs/benchmarks.md, "Group-by estimate and splitters").

``auto`` estimates the number of groups per row and takes combine-shuffle-reduce
when it is at most ``COMBINE_MAX_GROUP_RATIO``, else range-shuffle-compute when
the key allows it, else shuffle-compute.  The Hockney cost of each exchange is
reported in ``explain()``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .communicator import Communicator
from . import collectives as tc
from . import arrowtypes, kernels, partition, sorting
from .costmodel import Plan, group_by_costs, hockney
from .errors import AggregateOverflowError, InvalidOptionError, UnsupportedAggregationError
from .optiontypes import DECOMPOSABLE_AGGS, GroupByAlgorithm

log = logging.getLogger(__name__)

COMBINE_MAX_GROUP_RATIO = 0.5
#: the range path estimates the group count from every ``SAMPLE_STRIDE``-th key
SAMPLE_STRIDE = 8
#: ... when a rank has more rows than this (below it every key is counted)
SAMPLE_MIN_ROWS = 1 << 16


def _decomposable(schema: pa.Schema, aggs: Sequence[tuple[str, str]], keys: Sequence[str] = ()) -> bool:
    for k in keys:  # the partial states are grouped by pyarrow on the keys as they are
        t = schema.field(k).type
        if arrowtypes.key_encoding(t) is not None or t.num_fields:
            return False
    for col, agg in aggs:
        if agg not in DECOMPOSABLE_AGGS:
            return False
        t = schema.field(col).type
        if agg != "count" and not kernels.native_aggregate_type(t):  # partial states need pyarrow's own kernels
            return False
        if agg in ("sum", "mean", "stddev", "variance") and not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            return False
    return True


def _partial_state_bytes(table: pa.Table, aggs: Sequence[tuple[str, str]]) -> float:
    """Bytes of one group's partial states as ``kernels.partial_aggregate`` makes them: count int64,
    integer sums decimal128, float sums float64, min/max the input's width (variable width: this
    rank's mean), mean a sum and a count, stddev/variance a count, a mean and a sum of squares."""
    states: dict[tuple[str, str], float] = {}
    for col, agg in aggs:
        t = table.schema.field(col).type
        sum_width = 16.0 if pa.types.is_integer(t) else 8.0
        if agg in ("min", "max"):
            fixed = tc.raw_width(t)
            states[(col, agg)] = float(fixed) if fixed else table.column(col).nbytes / max(1, table.num_rows)
        elif agg in ("count", "sum"):
            states[(col, agg)] = 8.0 if agg == "count" else sum_width
        elif agg == "mean":
            states.update({(col, "sum"): sum_width, (col, "count"): 8.0})
        else:
            states.update({(col, "count"): 8.0, (col, "mean"): 8.0, (col, "m2"): 8.0})
    return sum(states.values())


def _estimate_groups(hashes: np.ndarray) -> int:
    """Distinct key hashes (HyperLogLog sketch)."""
    if hashes.size == 0:
        return 0
    pl = kernels._polars()
    return int(pl.Series(hashes).approx_n_unique())


def _range_key(comm: Communicator, table: pa.Table, keys: Sequence[str]) -> np.ndarray | None:
    """The integer values of the one integer-like key when no rank's key has a null, else ``None`` (collective)."""
    values = None
    if len(keys) == 1 and table.column(keys[0]).null_count == 0:
        values = sorting._numeric_key(table, keys[0])
    return values if tc.allreduce_sum(comm, 0 if values is not None else 1) == 0 else None


def _groups_from_sample(values: np.ndarray) -> int:
    """Groups among ``values`` estimated from every ``SAMPLE_STRIDE``-th value: ``d`` distinct values in
    ``s`` samples are inverted through ``d = G (1 - exp(-s / G))`` (keys of ``G`` groups drawn alike),
    so a sample that is nearly all distinct means as many groups as rows."""
    n = int(values.size)
    if n == 0:
        return 0
    sample = values[::SAMPLE_STRIDE] if n > SAMPLE_MIN_ROWS else values
    s = int(sample.size)
    d = int(kernels._polars().Series(sample).approx_n_unique())
    if s == n:
        return min(d, n)
    if d >= s * (1 - 1e-6):
        return n
    lo, hi = float(d), float(n) * 1e6  # f(G) = G (1 - exp(-s/G)) grows with G from ~d towards s
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid * -math.expm1(-s / mid) < d:
            lo = mid
        else:
            hi = mid
    return min(n, int(round(hi)))


def group_aggregate(comm: Communicator, table: pa.Table, keys: list[str], aggs: list[tuple[str, str]],
                    algorithm: GroupByAlgorithm) -> tuple[pa.Table, Plan]:
    """One row per distinct key of the distributed table whose partition here is ``table`` (collective);
    the result partition (in the input's types) and the plan chosen.  Columns are checked by the caller."""
    schema = kernels.aggregate_schema(table.schema, keys, aggs)  # validates names and types
    needed = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
    out, plan = _group_aggregate(comm, arrowtypes.to_kernel(table.select(needed)), keys, aggs, algorithm, schema)
    return arrowtypes.restore(out, schema), plan


def _group_aggregate(comm: Communicator, table: pa.Table, keys: list[str], aggs: list[tuple[str, str]],
                     algorithm: GroupByAlgorithm, schema: pa.Schema) -> tuple[pa.Table, Plan]:
    table = partition.canonical_floats(table, keys)  # -0.0 and 0.0 (and all NaNs) are one group
    p = comm.Get_size()
    needed = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
    if p == 1:
        local = group_by_costs(hockney(comm), [table.select(needed).nbytes], None, None)["shuffle"]
        return kernels.group_aggregate(table, keys, aggs, schema=schema), Plan("group_by", "local aggregate (1 rank)", local)
    decomposable = _decomposable(table.schema, aggs, keys)
    if algorithm == "combine" and not decomposable:
        raise UnsupportedAggregationError(
            f"combine-shuffle-reduce needs decomposable numeric aggregations {sorted(DECOMPOSABLE_AGGS)}; got {aggs}")
    model = hockney(comm)
    proj = table.select(needed)
    rkey = _range_key(comm, proj, keys) if algorithm in ("auto", "range") else None
    if algorithm == "range" and rkey is None:
        raise InvalidOptionError("group_by algorithm for these keys", algorithm,
                                 ["auto", "combine", "shuffle", "range (one integer-like key without nulls)"])
    hashes: np.ndarray | None = None
    if rkey is not None:
        groups_local = _groups_from_sample(rkey) if decomposable else proj.num_rows
    else:
        hashes = partition.hash_keys(proj, keys)  # once: for the estimate and for the shuffle
        groups_local = _estimate_groups(hashes) if decomposable else proj.num_rows
    key_bytes = sum(proj.column(k).nbytes for k in keys)
    stats = np.array(comm.allgather((proj.num_rows, groups_local, int(proj.nbytes), int(key_bytes))), dtype=np.float64)
    rows = stats[:, 0].sum()
    ratio = float(stats[:, 1].sum() / rows) if rows else 1.0
    row_bytes = stats[:, 2].sum() / rows if rows else 0.0
    partial = None
    if decomposable:  # the keys (at their mean width) and the partial states of one group
        partial_row_bytes = (stats[:, 3].sum() / rows if rows else 0.0) + _partial_state_bytes(proj, aggs)
        partial = (stats[:, 1] * partial_row_bytes).tolist()
    samples = None
    if rkey is not None:  # range_ids' (key, rank-and-position) pairs
        want = sorting.range_sample_rows(int(rows), p)
        samples = [(rkey.itemsize + 8.0) * want * n / rows for n in stats[:, 0]]
    costs = group_by_costs(model, stats[:, 2].tolist(), partial, samples)
    if algorithm == "auto":
        choice = "combine" if decomposable and ratio <= COMBINE_MAX_GROUP_RATIO else "range" if rkey is not None else "shuffle"
    else:
        choice = algorithm
    how = f"every {SAMPLE_STRIDE}th key" if rkey is not None else "HyperLogLog"
    if decomposable:
        detail = f"estimated groups/rows {ratio:.2f} ({how}), {row_bytes:.0f} B/row"
    else:
        detail = f"non-decomposable aggregation: no combine step, {row_bytes:.0f} B/row"
    if choice in ("shuffle", "range"):
        if choice == "range":
            assert rkey is not None
            ids = sorting.range_ids(comm, rkey, split_ties=False)
        else:
            ids = partition.ids_from_hash(hashes if hashes is not None else partition.hash_keys(proj, keys), p)
        del hashes, rkey
        shuffled = tc.shuffle(comm, proj, ids)
        del ids, proj
        out = _collectively(comm, lambda: kernels.group_aggregate(shuffled, keys, aggs, consume=True, schema=schema))
        name = "range-shuffle-compute" if choice == "range" else "shuffle-compute"
    else:
        partial = kernels.partial_aggregate(proj, keys, aggs)
        shuffled = tc.shuffle(comm, partial, partition.partition_ids(partial, keys, p))
        out = _collectively(comm, lambda: kernels.combine_aggregate(shuffled, keys, aggs, arrowtypes.plain_schema(schema)))
        name = "combine-shuffle-reduce"
    return out, Plan("group_by", name, costs[choice], {k: c.seconds for k, c in costs.items()}, detail)


def column_aggregates(comm: Communicator, table: pa.Table, aggs: list[tuple[str, str]]) -> dict[str, Any]:
    """Replicated whole-table aggregates as Python values keyed ``<col>_<agg>`` (collective; columns are
    checked by the caller)."""
    schema = kernels.aggregate_schema(table.schema, [], aggs)
    table = arrowtypes.to_kernel(table.select(list(dict.fromkeys(c for c, _ in aggs))))
    out: dict[str, Any] = {}
    dec = [a for a in aggs if _decomposable(table.schema, [a])]
    root = comm.Get_rank() == 0  # results are computed on rank 0 and broadcast: bit-identical replicas
    error = None
    if dec:
        partial = kernels.partial_aggregate(table, [], dec)
        parts = tc.gather_table(comm, partial, root=0)
        if parts is not None:
            try:
                res = kernels.combine_aggregate(pa.concat_tables(parts), [], dec, kernels.aggregate_schema(table.schema, [], dec))
                for name in res.schema.names:
                    out[name] = _py(res.column(name), schema.field(name).type)
            except AggregateOverflowError as exc:
                error = str(exc)
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
            mine = None if n == 0 else _py(column.column(col).slice(0 if agg == "first" else n - 1, 1), schema.field(name).type)
            every = comm.allgather((n > 0, mine))
            vals = [v for has, v in every if has]
            out[name] = None if not vals else (vals[0] if agg == "first" else vals[-1])
        else:  # list and the aggregations of non-numeric types: on the gathered column
            parts = tc.gather_table(comm, column, root=0)
            if parts is not None:
                try:
                    res = kernels.group_aggregate(pa.concat_tables(parts), [], [(col, agg)])
                    out[name] = _py(res.column(0), schema.field(name).type)
                except AggregateOverflowError as exc:
                    error = str(exc)
    final = {name: out[name] for name in schema.names} if root and error is None else None
    error, final = comm.bcast((error, final), root=0)
    if error is not None:  # raised on every rank, not only where it happened
        raise AggregateOverflowError(error)
    return final  # type: ignore[no-any-return]


def _collectively(comm: Communicator, kernel: Callable[[], pa.Table]) -> pa.Table:
    """``kernel()`` on every rank; an ``AggregateOverflowError`` on one rank is raised on all of them
    (the others would otherwise wait in the next collective)."""
    out, error = None, None
    try:
        out = kernel()
    except AggregateOverflowError as exc:
        error = str(exc)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        raise AggregateOverflowError(errors[0])
    return out


def _py(col: pa.ChunkedArray | pa.Array, t: pa.DataType) -> Any:
    """The first value of a kernel's result column as a Python value of the user's type ``t``."""
    return arrowtypes.restore_column(col.slice(0, 1), t)[0].as_py()
