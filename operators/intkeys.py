"""Numpy kernels for one integer-like key column without nulls (layer 1, no communicator).

The order of ``n`` rows by an integer key whose range fits in ``64 - ceil(log2 n)``
bits is one ``np.sort`` of packed ``(key - min) << bits | row`` words: numpy's
vectorised (AVX-512/AVX2) sort, stable because the row number breaks ties, and
it yields the sorted keys as well as the permutation.  It is the fastest of
the sorts tried (polars ``arg_sort``, ``np.argsort``, ``pyarrow.compute.sort_indices``).

Group-by of integer values (count/sum/mean/min/max) then reduces contiguous
runs with ``np.add.reduceat`` & co., faster than DuckDB, polars and pyarrow on
one thread.  Figures: docs/benchmarks.md, "Integer keys".

Every function returns ``None`` when its fast path does not apply; callers
fall back to the general kernels, which give the same rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from . import memory

#: aggregations the sort-based group-by computes (on integer columns without nulls)
SORTED_AGGS = frozenset({"count", "sum", "mean", "min", "max"})
#: rows per block of the blockwise loops: a block's temporaries (one reusable scratch array each,
#: never a fresh allocation: numpy maps and unmaps every large temporary) stay in the 512 KiB L2 cache
_BLOCK = 1 << 15


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


def packed_sort(values: np.ndarray, descending: bool = False, *,
                consume: bool = False) -> tuple[np.ndarray, int, int, int] | None:
    """``(words, bits, lo, hi)``: the sorted packed words ``(key - lo) << bits | row`` (``hi - key``
    when descending), or ``None`` when key range and row count do not fit one 64-bit word.

    The words are built block by block (copy, subtract, shift and row numbers while a block is
    in cache: one pass over memory instead of four).  With ``consume`` a writable 64-bit
    ``values`` becomes the words itself (the caller gives the array up): no n-sized allocation."""
    n = int(values.size)
    lo, hi = (int(values.min()), int(values.max())) if n else (0, 0)
    bits = max(1, (n - 1).bit_length())
    if hi - lo >= 1 << (64 - bits):
        return None
    wide = values.dtype.itemsize == 8
    packed = values.view(np.uint64) if consume and wide and values.flags.writeable else memory.empty(n, np.uint64)
    lo_word, span, shift = np.uint64(lo & (2**64 - 1)), np.uint64(hi - lo), np.uint64(bits)
    rows = np.arange(min(n, _BLOCK), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, n, _BLOCK):
            stop = min(n, start + _BLOCK)
            block = packed[start:stop]
            src = values[start:stop]
            if wide:  # modulo 2**64: hi - lo fits, so the difference is exact
                np.subtract(src.view(np.uint64), lo_word, out=block)
            else:
                np.subtract(src.astype(np.int64).view(np.uint64), lo_word, out=block)
            if descending:
                np.subtract(span, block, out=block)
            block <<= shift
            block |= rows[: stop - start]
            block += np.uint64(start)  # the row number start + i: no carry, it fits the low bits
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
    out = memory.empty_like(values)
    mask = np.uint64((1 << bits) - 1)
    rows = np.empty(min(_BLOCK, values.shape[0]), dtype=np.uint64)
    for start in range(0, values.shape[0], _BLOCK):
        stop = min(values.shape[0], start + _BLOCK)
        idx = np.bitwise_and(packed[start:stop], mask, out=rows[: stop - start]).view(np.int64)
        np.take(values, idx, axis=0, out=out[start:stop], mode="clip")
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


def _sorted_words(col: pa.ChunkedArray, descending: bool,
                  consume: bool = False) -> tuple[np.ndarray, int, int, int, np.dtype] | None:
    """The packed, sorted (key, row) words of an integer-like key column and how to unpack
    them, or ``None`` when the fast path does not apply.  The key values are not kept; with
    ``consume`` a one-chunk 64-bit column's own buffer becomes the words (see ``packed_sort``)."""
    values = key_values(col)
    if values is None:
        return None
    if consume and values.dtype.itemsize == 8:
        raw = _fixed_values(col)
        if raw is not None and raw.flags.writeable:
            values = raw.view(values.dtype)
    res = packed_sort(values, descending, consume=consume)
    if res is None:
        return None
    packed, bits, lo, hi = res
    return packed, bits, lo, hi, values.dtype


def sort_table(table: pa.Table, key: str, descending: bool, *, consume: bool = False) -> pa.Table | None:
    """``table`` stably sorted by one integer-like key without nulls, or ``None``.

    Fixed-width null-free columns are gathered block by block from the packed words; the
    others with one Arrow ``take`` (then the permutation is materialised once).  ``consume``:
    the caller gives ``table`` up (it owns its buffers alone, e.g. a shuffle's result), so the
    key column's buffer is packed, sorted and unpacked in place; ``table`` is garbage afterwards."""
    found = _sorted_words(table.column(key), descending, consume)
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


def group_aggregate(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], schema: pa.Schema, *,
                    consume: bool = False) -> pa.Table | None:
    """Sort-based group-by of integer values by one integer-like key (no nulls anywhere),
    groups in key order; ``None`` when the fast path does not apply or a sum could overflow.
    ``consume`` as in ``sort_table`` (the key column is overwritten unless it is also aggregated)."""
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
    key_col_in = table.column(keys[0])
    found = _sorted_words(key_col_in, False, consume and keys[0] not in cols)
    if found is None:
        return None
    packed, bits, lo, hi, key_dtype = found
    # group starts from the words' key bits, block by block (no n-sized temporaries), so that the
    # overflow check comes before anything else is overwritten
    first = memory.empty(n, np.bool_)
    first[:1] = True
    shift = np.uint64(bits)
    block_keys = np.empty(min(n, _BLOCK + 1), dtype=np.uint64)
    for a in range(1, n, _BLOCK):
        b = min(n, a + _BLOCK)
        ks = np.right_shift(packed[a - 1 : b], shift, out=block_keys[: b - a + 1])
        np.not_equal(ks[1:], ks[:-1], out=first[a:b])
    starts = memory.flatnonzero(first)
    del first
    m = starts.size
    largest = max((int(np.diff(starts[a : a + _BLOCK + 1]).max(initial=0)) for a in range(0, m, _BLOCK)), default=0)
    if m:
        largest = max(largest, n - int(starts[-1]))
    for col, agg in aggs:  # exact sums only: no group's sum may leave int64 (uint64)
        v = cols.get(col)
        if agg in ("sum", "mean") and v is not None and v.size:
            limit = 1 << (64 if v.dtype.kind == "u" else 63)
            if max(abs(int(v.min())), abs(int(v.max()))) * largest >= limit:
                _restore_keys(packed, bits, lo, key_col_in)
                return None
    # memory: input + packed words + one gathered column + the run starts (+ sizes for count/mean);
    # keys and sums are compacted in place into the buffers they are computed from
    gathered = {col: gather_sorted(v, packed, bits) for col, v in cols.items()}
    del cols
    sorted_keys = _unpack_keys(packed, bits, lo, hi, False, np.dtype(np.int64))
    key_col = _as_arrow(_compact(sorted_keys, starts, lambda block, s, out: np.take(block, s, out=out, mode="clip")).astype(key_dtype, copy=False),
                        schema.field(0).type)
    del sorted_keys, packed
    sizes = None
    if any(agg in ("count", "mean") for _, agg in aggs):
        sizes = memory.empty(m, np.int64)
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
            red = _compact(v, starts, lambda block, s, out: ufunc.reduceat(block, s, out=out))
            del gathered[col]
        else:
            red = ufunc.reduceat(v, starts) if n else v[:0]
        if agg == "mean":
            assert sizes is not None
            red = red / sizes
        out.append(pa.array(red).cast(t))
    return pa.table(out, schema=schema)


def _restore_keys(packed: np.ndarray, bits: int, lo: int, col: pa.ChunkedArray) -> None:
    """Undo ``consume``: when the sorted words live in ``col``'s own buffer, put every key back
    at its row (a group-by that falls back to another kernel needs its input intact)."""
    raw = _fixed_values(col)
    if raw is None or not np.may_share_memory(raw, packed):
        return
    rows = (packed & np.uint64((1 << bits) - 1)).view(np.int64)
    keys = (packed >> np.uint64(bits)) + np.uint64(lo & (2**64 - 1))
    raw[rows] = keys.view(raw.dtype)


def _compact(values: np.ndarray, starts: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """``reduce(block, run starts in the block, out)`` over the runs that begin at ``starts``, written
    in place into ``values[:len(starts)]``.

    Runs are handled in blocks; a block's result only overwrites positions before its own first
    input row (``starts[i] >= i``), which earlier blocks have consumed already.  The block's
    results go through a scratch array (an output overlapping its input would make numpy copy)."""
    m = starts.size
    local = np.empty(min(m, _BLOCK), dtype=starts.dtype)
    result = np.empty(min(m, _BLOCK), dtype=values.dtype)
    for a in range(0, m, _BLOCK):
        b = min(m, a + _BLOCK)
        lo = int(starts[a])
        hi = int(starts[b]) if b < m else values.shape[0]
        s = np.subtract(starts[a:b], lo, out=local[: b - a])
        values[a:b] = reduce(values[lo:hi], s, result[: b - a])
    return values[:m]
