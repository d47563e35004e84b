"""Numpy kernels for one integer-like key column without nulls (layer 1, no communicator).

The order of ``n`` rows by an integer key whose range fits in ``64 - ceil(log2 n)``
bits is one ``np.sort`` of packed ``(key - min) << bits | row`` words: numpy's
vectorised (AVX-512/AVX2) sort, stable because the row number breaks ties, and
it yields the sorted keys as well as the permutation.  Measured on this
machine (one core, 10M rows, keys uniform on [0, 9e7)): packed sort 0.12 s CPU
against 0.41 s for polars ``arg_sort``, 0.64 s for ``np.argsort`` and 2.0 s
for ``pyarrow.compute.sort_indices``.

Group-by of integer values (count/sum/mean/min/max) then reduces contiguous
runs with ``np.add.reduceat`` & co.: 0.31 s CPU on the same 10M rows against
0.95 s for DuckDB, 1.4 s for polars and 1.7 s for pyarrow (all one thread).

Every function returns ``None`` when its fast path does not apply; callers
fall back to the general kernels, which give the same rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

#: aggregations the sort-based group-by computes (on integer columns without nulls)
SORTED_AGGS = frozenset({"count", "sum", "mean", "min", "max"})


def key_values(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """The integer values of an integer/temporal column without nulls (``None`` otherwise)."""
    t = col.type
    if col.null_count:
        return None
    if pa.types.is_integer(t):
        storage = col
    elif pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_date64(t) or pa.types.is_time64(t):
        storage = col.view(pa.int64()) if isinstance(col, pa.Array) else pa.chunked_array([c.view(pa.int64()) for c in col.chunks], pa.int64())
    elif pa.types.is_date32(t) or pa.types.is_time32(t):
        storage = col.view(pa.int32()) if isinstance(col, pa.Array) else pa.chunked_array([c.view(pa.int32()) for c in col.chunks], pa.int32())
    else:
        return None
    if isinstance(storage, pa.ChunkedArray):
        storage = storage.combine_chunks() if storage.num_chunks != 1 else storage.chunk(0)
    return np.asarray(storage.to_numpy(zero_copy_only=False))


def packed_order(values: np.ndarray, descending: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(stable permutation, keys in that order) of integer ``values``, or ``None`` when the
    key range and the row count do not fit in one 64-bit word together."""
    n = int(values.size)
    if n == 0:
        return np.empty(0, dtype=np.int64), values[:0]
    lo, hi = int(values.min()), int(values.max())
    bits = max(1, (n - 1).bit_length())
    if hi - lo >= 1 << (64 - bits):
        return None
    if values.dtype.kind == "u" and values.dtype.itemsize == 8:
        packed = values - np.uint64(lo)
    else:
        with np.errstate(over="ignore"):
            packed = values.astype(np.int64).view(np.uint64) - np.uint64(lo & (2**64 - 1))
    if descending:
        np.subtract(np.uint64(hi - lo), packed, out=packed)
    packed <<= np.uint64(bits)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & np.uint64((1 << bits) - 1)).view(np.int64)
    packed >>= np.uint64(bits)
    if descending:
        np.subtract(np.uint64(hi - lo), packed, out=packed)
    with np.errstate(over="ignore"):
        packed += np.uint64(lo & (2**64 - 1))
    keys = packed.view(np.int64).astype(values.dtype, copy=False) if values.dtype.kind != "u" or values.dtype.itemsize != 8 else packed
    return order, keys


def _as_arrow(values: np.ndarray, t: pa.DataType) -> pa.Array:
    arr = pa.array(values)
    return arr if arr.type == t else arr.view(t)


def sort_table(table: pa.Table, key: str, descending: bool) -> pa.Table | None:
    """``table`` stably sorted by one integer-like key without nulls, or ``None``."""
    values = key_values(table.column(key))
    if values is None:
        return None
    res = packed_order(values, descending)
    if res is None:
        return None
    order, keys = res
    rest = table.drop_columns([key])
    out = rest.take(pa.array(order)) if rest.num_columns else pa.table({})
    i = table.schema.get_field_index(key)
    return out.add_column(i, table.schema.field(key), _as_arrow(keys, table.schema.field(key).type)) if out.num_columns else \
        pa.table([_as_arrow(keys, table.schema.field(key).type)], schema=pa.schema([table.schema.field(key)]))


def _int_values(col: pa.ChunkedArray) -> np.ndarray | None:
    if col.null_count or not pa.types.is_integer(col.type):
        return None
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def group_aggregate(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], schema: pa.Schema) -> pa.Table | None:
    """Sort-based group-by of integer values by one integer-like key (no nulls anywhere),
    groups in key order; ``None`` when the fast path does not apply or a sum could overflow."""
    if len(keys) != 1 or not aggs or any(agg not in SORTED_AGGS for _, agg in aggs):
        return None
    cols: dict[str, np.ndarray] = {}
    for col, agg in aggs:
        if table.column(col).null_count:
            return None
        if agg == "count":  # the group size: any null-free column
            continue
        v = cols.get(col)
        if v is None:
            v = _int_values(table.column(col))
            if v is None:
                return None
            cols[col] = v
    n = table.num_rows
    key_np = key_values(table.column(keys[0]))
    if key_np is None:
        return None
    res = packed_order(key_np, False)
    if res is None:
        return None
    order, sorted_keys = res
    del key_np
    if n:
        starts = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
        starts = np.concatenate([np.zeros(1, dtype=starts.dtype), starts])
    else:
        starts = np.empty(0, dtype=np.int64)
    sizes = np.diff(np.append(starts, n)).astype(np.int64)
    largest = int(sizes.max()) if sizes.size else 0
    for col, agg in aggs:  # exact sums only: no group's sum may leave int64 (uint64)
        v = cols.get(col)
        if agg in ("sum", "mean") and v is not None and v.size:
            limit = 1 << (64 if v.dtype.kind == "u" else 63)
            if max(abs(int(v.min())), abs(int(v.max()))) * largest >= limit:
                return None
    # free each intermediate as soon as possible: the peak stays near input + 2 columns
    out: list[pa.Array] = [_as_arrow(sorted_keys[starts], schema.field(0).type)]
    del res, sorted_keys
    gathered = {col: v[order] for col, v in cols.items()}
    del order, cols
    for i, (col, agg) in enumerate(aggs):
        t = schema.field(i + 1).type
        if agg == "count":
            out.append(pa.array(sizes, pa.int64()))
            continue
        v = gathered[col]
        if agg in ("sum", "mean"):
            wide = v.astype(np.uint64 if v.dtype.kind == "u" else np.int64, copy=False)
            s = np.add.reduceat(wide, starts) if n else wide[:0]
            out.append(pa.array(s / sizes if agg == "mean" else s).cast(t))
        else:
            red = np.minimum if agg == "min" else np.maximum
            out.append(pa.array(red.reduceat(v, starts) if n else v[:0]).cast(t))
    return pa.table(out, schema=schema)
