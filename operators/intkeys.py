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

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

#: aggregations the sort-based group-by computes (on integer columns without nulls)
SORTED_AGGS = frozenset({"count", "sum", "mean", "min", "max"})
_BLOCK = 1 << 20


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


def packed_sort(values: np.ndarray, descending: bool = False) -> tuple[np.ndarray, int, int, int] | None:
    """``(words, bits, lo, hi)``: the sorted packed words ``(key - lo) << bits | row`` (``hi - key``
    when descending), or ``None`` when key range and row count do not fit one 64-bit word."""
    n = int(values.size)
    lo, hi = (int(values.min()), int(values.max())) if n else (0, 0)
    bits = max(1, (n - 1).bit_length())
    if hi - lo >= 1 << (64 - bits):
        return None
    with np.errstate(over="ignore"):
        packed = values.astype(np.uint64 if values.dtype.kind == "u" else np.int64).view(np.uint64)  # the one copy
        packed -= np.uint64(lo & (2**64 - 1))
    if descending:
        np.subtract(np.uint64(hi - lo), packed, out=packed)
    packed <<= np.uint64(bits)
    for start in range(0, n, _BLOCK):  # row numbers in blocks: no second n-sized temporary
        stop = min(n, start + _BLOCK)
        packed[start:stop] |= np.arange(start, stop, dtype=np.uint64)
    packed.sort()
    return packed, bits, lo, hi


def _unpack_keys(packed: np.ndarray, bits: int, lo: int, hi: int, descending: bool, dtype: np.dtype) -> np.ndarray:
    """The sorted keys, computed in place in ``packed`` (whose row numbers are lost)."""
    packed >>= np.uint64(bits)
    if descending:
        np.subtract(np.uint64(hi - lo), packed, out=packed)
    with np.errstate(over="ignore"):
        packed += np.uint64(lo & (2**64 - 1))
    if dtype.kind == "u" and dtype.itemsize == 8:
        return packed
    return packed.view(np.int64).astype(dtype, copy=False)


def gather_sorted(values: np.ndarray, packed: np.ndarray, bits: int) -> np.ndarray:
    """``values`` in the order of the sorted ``packed`` words, without an n-sized permutation array."""
    out = np.empty_like(values)
    mask = np.uint64((1 << bits) - 1)
    for start in range(0, values.shape[0], _BLOCK):
        stop = min(values.shape[0], start + _BLOCK)
        np.take(values, (packed[start:stop] & mask).view(np.int64), axis=0, out=out[start:stop], mode="clip")
    return out


def packed_order(values: np.ndarray, descending: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(stable permutation, keys in that order) of integer ``values``, or ``None`` when the
    key range and the row count do not fit in one 64-bit word together."""
    res = packed_sort(values, descending)
    if res is None:
        return None
    packed, bits, lo, hi = res
    order = (packed & np.uint64((1 << bits) - 1)).view(np.int64)
    return order, _unpack_keys(packed, bits, lo, hi, descending, values.dtype)


def _as_arrow(values: np.ndarray, t: pa.DataType) -> pa.Array:
    arr = pa.array(values)
    return arr if arr.type == t else arr.view(t)


def _fixed_values(col: pa.ChunkedArray) -> np.ndarray | None:
    """Zero-copy numpy values of a one-chunk, null-free, byte-aligned fixed-width column."""
    t = col.type
    if col.null_count or col.num_chunks != 1 or isinstance(t, (pa.DictionaryType, pa.ExtensionType)) \
            or t.num_fields or t.num_buffers != 2 or pa.types.is_boolean(t):
        return None
    try:
        width = t.bit_width // 8
    except ValueError:
        return None
    if width not in (1, 2, 4, 8):
        return None
    arr = col.chunk(0)
    if len(arr) == 0:
        return None
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[arr.offset * width : (arr.offset + len(arr)) * width]
    return raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])


def _sorted_words(col: pa.ChunkedArray, descending: bool) -> tuple[np.ndarray, int, int, int, np.dtype] | None:
    """The packed, sorted (key, row) words of an integer-like key column and how to unpack
    them, or ``None`` when the fast path does not apply.  The key values are not kept."""
    values = key_values(col)
    if values is None:
        return None
    res = packed_sort(values, descending)
    if res is None:
        return None
    packed, bits, lo, hi = res
    return packed, bits, lo, hi, values.dtype


def sort_table(table: pa.Table, key: str, descending: bool) -> pa.Table | None:
    """``table`` stably sorted by one integer-like key without nulls, or ``None``.

    Fixed-width null-free columns are gathered block by block from the packed words; the
    others with one Arrow ``take`` (then the permutation is materialised once)."""
    found = _sorted_words(table.column(key), descending)
    if found is None:
        return None
    packed, bits, lo, hi, key_dtype = found
    columns: list[pa.Array | pa.ChunkedArray] = []
    order: pa.Array | None = None
    for name, col in zip(table.schema.names, table.columns):
        if name == key:
            columns.append(col)  # placeholder, filled below
            continue
        fixed = _fixed_values(col)
        if fixed is not None:
            columns.append(pa.Array.from_buffers(col.type, len(fixed), [None, pa.py_buffer(gather_sorted(fixed, packed, bits))]))
        else:
            if order is None:
                order = pa.array((packed & np.uint64((1 << bits) - 1)).view(np.int64))
            columns.append(col.take(order))
    del order
    keys = _unpack_keys(packed, bits, lo, hi, descending, key_dtype)
    i = table.schema.get_field_index(key)
    columns[i] = _as_arrow(keys, table.schema.field(key).type)
    return pa.Table.from_arrays(columns, schema=table.schema)


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
    found = _sorted_words(table.column(keys[0]), False)
    if found is None:
        return None
    packed, bits, lo, hi, key_dtype = found
    # memory: input + packed words + one gathered column + the run starts (+ sizes for count/mean);
    # keys and sums are compacted in place into the buffers they are computed from
    gathered = {col: gather_sorted(v, packed, bits) for col, v in cols.items()}
    del cols
    sorted_keys = _unpack_keys(packed, bits, lo, hi, False, np.dtype(np.int64))
    first = np.empty(n, dtype=bool)
    first[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    m = starts.size
    key_col = _as_arrow(_compact(sorted_keys, starts, lambda block, s: block[s]).astype(key_dtype, copy=False),
                        schema.field(0).type)
    del sorted_keys, packed
    largest = max((int(np.diff(starts[a : a + _BLOCK + 1]).max(initial=0)) for a in range(0, m, _BLOCK)), default=0)
    if m:
        largest = max(largest, n - int(starts[-1]))
    for col, agg in aggs:  # exact sums only: no group's sum may leave int64 (uint64)
        v = gathered.get(col)
        if agg in ("sum", "mean") and v is not None and v.size:
            limit = 1 << (64 if v.dtype.kind == "u" else 63)
            if max(abs(int(v.min())), abs(int(v.max()))) * largest >= limit:
                return None
    sizes = None
    if any(agg in ("count", "mean") for _, agg in aggs):
        sizes = np.empty(m, dtype=np.int64)
        np.subtract(starts[1:], starts[:-1], out=sizes[:-1])
        if m:
            sizes[-1] = n - starts[-1]
    last_use = {col: i for i, (col, agg) in enumerate(aggs) if agg != "count"}
    out: list[pa.Array] = [key_col]
    for i, (col, agg) in enumerate(aggs):
        t = schema.field(i + 1).type
        if agg == "count":
            assert sizes is not None
            out.append(pa.array(sizes, pa.int64()))
            continue
        v = gathered[col]
        ufunc: np.ufunc = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}[agg]
        if agg in ("sum", "mean"):
            v = v.astype(np.uint64 if v.dtype.kind == "u" else np.int64, copy=False)
        if last_use[col] == i:  # in place: the column is not needed afterwards
            red = _compact(v, starts, lambda block, s: ufunc.reduceat(block, s))
            del gathered[col]
        else:
            red = ufunc.reduceat(v, starts) if n else v[:0]
        if agg == "mean":
            assert sizes is not None
            red = red / sizes
        out.append(pa.array(red).cast(t))
    return pa.table(out, schema=schema)


def _compact(values: np.ndarray, starts: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """``reduce`` over the runs that begin at ``starts``, written in place into ``values[:len(starts)]``.

    Runs are handled in blocks; a block's result only overwrites positions before its own first
    input row (``starts[i] >= i``), which earlier blocks have consumed already."""
    m = starts.size
    for a in range(0, m, _BLOCK):
        b = min(m, a + _BLOCK)
        lo = int(starts[a])
        hi = int(starts[b]) if b < m else values.shape[0]
        values[a:b] = reduce(values[lo:hi], starts[a:b] - lo)
    return values[:m]
