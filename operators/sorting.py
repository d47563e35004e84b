"""Sample sort with regular sampling (PSRS) and range partitioning.

1. every rank sorts its partition (kernel);
2. it takes regularly spaced samples, as many as its share of the rows;
3. the samples are allgathered and sorted, ``p-1`` splitters picked at regular positions;
4. each rank binary-searches the splitters in its sorted rows and sends contiguous slices;
5. the received sorted runs (in source-rank order) are merged by a stable sort.

Ties are broken by (source rank, original position), so the result is the
stable global order and even a table of identical keys ends up balanced.  For
co-partitioning joins (``tie_break=False``) equal keys always land together.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from .communicator import Communicator
from . import collectives as tc
from . import arrowtypes, kernels, memory

SAMPLES_PER_RANK = 32
#: at least this many samples in all for the integer-key splitters (``range_ids``): the share of a
#: rank is off by about ``0.5 / sqrt(samples)``, so 32768 keeps ranks within about 0.3% of an equal share
#: for a negligible gather and sort (docs/benchmarks.md, "Group-by estimate and splitters")
RANGE_SAMPLES = 1 << 15


def _value(col: pa.ChunkedArray, i: int) -> Any:
    s = col[i]
    if not s.is_valid:
        return None
    t = s.type
    if pa.types.is_temporal(t):
        narrow = pa.types.is_date32(t) or pa.types.is_time32(t)  # 32-bit storage casts only to int32
        return s.cast(pa.int32() if narrow else pa.int64()).as_py()
    return s.as_py()


def _cmp_one(a: Any, b: Any, descending: bool, nulls_last: bool) -> int:
    if a is None or b is None:
        if a is None and b is None:
            return 0
        return (1 if nulls_last else -1) * (1 if a is None else -1)
    a_nan = isinstance(a, float) and math.isnan(a)
    b_nan = isinstance(b, float) and math.isnan(b)
    if a_nan or b_nan:  # NaN sorts above every number
        c = 0 if a_nan and b_nan else (1 if a_nan else -1)
    else:
        c = 0 if a == b else (1 if a > b else -1)
    return -c if descending else c


def compare(a: Sequence[Any], b: Sequence[Any], by: Sequence[tuple[str, str]], nulls: str) -> int:
    for x, y, (_, order) in zip(a, b, by):
        c = _cmp_one(x, y, order == "descending", nulls == "at_end")
        if c:
            return c
    return 0


def _row(table: pa.Table, names: Sequence[str], i: int) -> list[Any]:
    return [_value(table.column(n), i) for n in names]


def lower_bound(sorted_table: pa.Table, by: Sequence[tuple[str, str]], nulls: str, key: Sequence[Any],
                tie: tuple[int, int] | None, rank: int, positions: np.ndarray | None) -> int:
    """Number of rows of ``sorted_table`` ordered before the splitter ``(key, tie)``."""
    names = [c for c, _ in by]
    lo, hi = 0, sorted_table.num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        c = compare(_row(sorted_table, names, mid), key, by, nulls)
        if c == 0 and tie is not None:
            assert positions is not None
            mine = (rank, int(positions[mid]))
            c = (mine > tie) - (mine < tie)
        if c < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


def splitters(comm: Communicator, sorted_table: pa.Table, by: Sequence[tuple[str, str]], nulls: str,
              positions: np.ndarray, n_parts: int) -> list[tuple[list[Any], tuple[int, int]]]:
    """``n_parts - 1`` splitters (key values, (rank, position)) from regular samples of every rank."""
    rank, p = comm.Get_rank(), comm.Get_size()
    n_local = sorted_table.num_rows
    total = tc.allreduce_sum(comm, n_local)
    want = SAMPLES_PER_RANK * p
    k = 0 if total == 0 else min(n_local, max(1 if n_local else 0, round(want * n_local / total)))
    idx = (np.arange(k, dtype=np.int64) * n_local) // max(k, 1)
    names = [c for c, _ in by]
    sample = sorted_table.select(names).take(pa.array(idx))
    sample = sample.append_column("__rank", pa.array(np.full(k, rank, dtype=np.int64)))
    sample = sample.append_column("__pos", pa.array(positions[idx] if k else np.empty(0, np.int64), pa.int64()))
    everyone = pa.concat_tables(tc.allgather_table(comm, sample))
    if everyone.num_rows == 0:
        return []
    ordered = kernels.sort(everyone, list(by) + [("__rank", "ascending"), ("__pos", "ascending")], nulls)
    m = ordered.num_rows
    out = []
    for j in range(1, n_parts):
        i = min(m - 1, (j * m) // n_parts)
        out.append((_row(ordered, names, i), (int(ordered.column("__rank")[i].as_py()), int(ordered.column("__pos")[i].as_py()))))
    return out


def _numeric_key(table: pa.Table, name: str) -> np.ndarray | None:
    t = table.schema.field(name).type
    col = table.column(name)
    if pa.types.is_integer(t):
        pass
    elif pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_duration(t):
        col = col.cast(pa.int64())
    elif pa.types.is_date32(t):
        col = col.cast(pa.int32())
    else:
        return None
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def range_sample_rows(total: int, p: int) -> int:
    """Rows that all ranks sample together for the integer-key splitters (``range_ids``)."""
    return min(total, max(2 * SAMPLES_PER_RANK * p, RANGE_SAMPLES))


def range_ids(comm: Communicator, keys: np.ndarray, *, split_ties: bool) -> np.ndarray:
    """Destination rank of every row by ranges of integer ``keys`` (collective): ``p - 1`` splitters at
    regular positions of a regular sample of every rank.  With ``split_ties`` the rows equal to a
    splitter are split by (rank, position), so even a table of one key value ends up balanced (the
    stable sort); without it all rows of one key value go to one rank (a group-by or join)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    n = keys.size
    total = tc.allreduce_sum(comm, n)
    want = range_sample_rows(total, p)
    k = 0 if total == 0 else min(n, max(1 if n else 0, round(want * n / total)))
    pos = (np.arange(k, dtype=np.int64) * n) // max(k, 1)
    sample = (keys[pos], np.full(k, rank, dtype=np.int64) << np.int64(40) | pos)
    gathered = comm.allgather(sample)
    s_keys = np.concatenate([g[0] for g in gathered])
    s_ties = np.concatenate([g[1] for g in gathered])
    dtype = np.uint8 if p <= 256 else np.uint32
    if s_keys.size == 0:
        return np.zeros(n, dtype=dtype)
    order = np.lexsort((s_ties, s_keys))  # regular positions of the sorted sample
    m = order.size
    chosen = order[[min(m - 1, (j * m) // p) for j in range(1, p)]]
    spl_keys, spl_ties = s_keys[chosen], s_ties[chosen]
    ids: np.ndarray
    if p <= 16:  # a few comparisons per row, block by block into a pool array (no n-sized temporaries)
        ids = memory.empty(n, np.uint8)
        above = np.empty(min(n, memory.BLOCK), dtype=bool)
        for a in range(0, n, memory.BLOCK):
            kb = keys[a : a + memory.BLOCK]
            ib = ids[a : a + kb.size]
            np.greater(kb, spl_keys[0], out=ib.view(np.bool_))
            for value in spl_keys[1:]:
                np.add(ib, np.greater(kb, value, out=above[: kb.size]), out=ib)
    else:
        ids = np.searchsorted(spl_keys, keys, side="left")
    if split_ties:
        for value in np.unique(spl_keys):  # rows equal to a splitter key: split by (rank, position)
            eq = _positions_equal(keys, value)
            if eq.size:
                first = int(np.searchsorted(spl_keys, value, side="left"))
                ties = spl_ties[spl_keys == value]
                mine = (np.int64(rank) << np.int64(40)) | eq.astype(np.int64)
                ids[eq] = first + np.searchsorted(ties, mine, side="left")
    return ids.astype(dtype, copy=False)


def _positions_equal(keys: np.ndarray, value: Any) -> np.ndarray:
    """Positions of ``keys == value``, block by block (cache-sized temporaries)."""
    eq = np.empty(min(keys.size, memory.BLOCK), dtype=bool)
    found = []
    for a in range(0, keys.size, memory.BLOCK):
        kb = keys[a : a + memory.BLOCK]
        hits = np.flatnonzero(np.equal(kb, value, out=eq[: kb.size]))
        if hits.size:
            found.append(hits + a)
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _partition_first_sort(comm: Communicator, table: pa.Table, name: str, keys: np.ndarray) -> pa.Table:
    """Single ascending integer-like key without nulls: range-partition the unsorted rows with
    sampled splitters (ties split by (rank, position)), exchange, then sort once."""
    ids = range_ids(comm, keys, split_ties=True)
    received = tc.shuffle(comm, table, ids)
    del ids
    return kernels.sort(received, [(name, "ascending")], "at_end", consume=True)  # the shuffle's own buffers


def sample_sort(comm: Communicator, table: pa.Table, by: Sequence[tuple[str, str]], nulls: str) -> pa.Table:
    """This rank's slice of the globally sorted table (stable across ranks)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    if p > 1 and len(by) == 1 and by[0][1] == "ascending":
        name = by[0][0]
        keys = _numeric_key(table, name)
        if tc.allreduce_sum(comm, 0 if keys is not None and table.column(name).null_count == 0 else 1) == 0:
            assert keys is not None
            return _partition_first_sort(comm, table, name, keys)
    if p == 1:
        return kernels.sort(table, by, nulls)
    if table.num_rows > 1:
        perm = kernels.sort_indices(table, by, nulls)
        local = arrowtypes.take(table, pa.array(perm))
    else:
        perm = np.arange(table.num_rows, dtype=np.int64)
        local = table
    spl = splitters(comm, local, by, nulls, perm, p)
    if not spl:
        return local
    bounds = [0] + [lower_bound(local, by, nulls, key, tie, rank, perm) for key, tie in spl] + [local.num_rows]
    bounds = list(np.maximum.accumulate(bounds))
    parts = [local.slice(bounds[j], bounds[j + 1] - bounds[j]) for j in range(p)]
    del local
    runs = tc.alltoall_tables(comm, parts)
    merged = pa.concat_tables(runs)
    nonempty = sum(1 for r in runs if r.num_rows)
    return merged if nonempty <= 1 else kernels.sort(merged, by, nulls)


def range_partition(comm: Communicator, tables: Sequence[pa.Table], keysets: Sequence[Sequence[str]]) -> list[pa.Table]:
    """Co-partition several tables by ranges of their (ascending) keys; equal keys go to one rank.

    Returns this rank's locally sorted share of each table (the sort-merge join's input).
    """
    p = comm.Get_size()
    by_sets = [[(k, "ascending") for k in keys] for keys in keysets]
    sorted_tables = [kernels.sort(t, by, "at_end") for t, by in zip(tables, by_sets)]
    # samples from every table, renamed to the first table's key names
    first = keysets[0]
    samples = []
    for t, keys in zip(sorted_tables, keysets):
        n = t.num_rows
        k = min(n, SAMPLES_PER_RANK)
        idx = (np.arange(k, dtype=np.int64) * n) // max(k, 1)
        samples.append(arrowtypes.take(t.select(list(keys)), pa.array(idx)).rename_columns(list(first)).cast(tables[0].select(list(first)).schema))
    sample = pa.concat_tables(samples)
    everyone = pa.concat_tables(tc.allgather_table(comm, sample))
    out = []
    if everyone.num_rows == 0 or p == 1:
        return sorted_tables
    ordered = kernels.sort(everyone, by_sets[0], "at_end")
    m = ordered.num_rows
    spl = [_row(ordered, first, min(m - 1, (j * m) // p)) for j in range(1, p)]
    for t, by in zip(sorted_tables, by_sets):
        bounds = [0] + [lower_bound(t, by, "at_end", key, None, 0, None) for key in spl] + [t.num_rows]
        bounds = list(np.maximum.accumulate(bounds))
        runs = tc.alltoall_tables(comm, [t.slice(bounds[j], bounds[j + 1] - bounds[j]) for j in range(p)])
        out.append(kernels.sort(pa.concat_tables(runs), by, "at_end"))
    return out
