"""Auxiliary partitioning (layer 1½): deterministic hash partition, split by ids, rebalance plans.

The hash must be the same on every rank and in every process (never Python's
salted ``hash()``): a single integer-like key column uses a SplitMix64 finaliser
in numpy; any other key set uses polars' seeded ``hash_rows`` (stable within
one polars version, which all ranks share) after ``canonical_floats``.  ``string``/``large_string`` and
``binary``/``large_binary`` hash alike, so both sides of a join agree.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import arrowtypes, memory

_INTLIKE = (pa.types.is_integer, pa.types.is_date, pa.types.is_timestamp, pa.types.is_duration, pa.types.is_boolean)


def _fibonacci(x: np.ndarray) -> np.ndarray:
    """Multiplicative (Fibonacci) hashing: a bijection whose high bits are well mixed."""
    with np.errstate(over="ignore"):
        return x.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def _as_int64_numpy(col: pa.ChunkedArray) -> np.ndarray:
    t = col.type
    if pa.types.is_boolean(t):
        col = pc.cast(col, pa.int8())
    elif not pa.types.is_integer(t):
        col = col.cast(pa.int64()) if not pa.types.is_date32(t) else col.cast(pa.int32())
    if col.null_count:
        col = pc.fill_null(col, 0)
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def canonical_floats(table: pa.Table, names: Sequence[str]) -> pa.Table:
    """Floating-point ``names`` with -0.0 as 0.0 and every NaN as the one quiet NaN, so that
    values SQL calls equal (DuckDB: -0.0 = 0.0, NaN = NaN) hash and group alike."""
    for name in names:
        col = table.column(name)
        if pa.types.is_float16(col.type):  # no arithmetic kernels for halffloat: as float, exactly
            col = col.cast(pa.float32())
            table = table.set_column(table.schema.get_field_index(name), pa.field(name, col.type), col)
        if pa.types.is_floating(col.type) and col.num_chunks:
            fixed = pc.if_else(pc.is_nan(col), pa.scalar(float("nan"), col.type), pc.add(col, pa.scalar(0.0, col.type)))
            table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), fixed)
    return table


def hash_keys(table: pa.Table, keys: Sequence[str]) -> np.ndarray:
    """A deterministic uint64 hash per row of the ``keys`` columns (nulls hash alike).

    The high bits are the well-mixed ones (``ids_from_hash`` uses them)."""
    if table.num_rows == 0:
        return np.empty(0, dtype=np.uint64)
    table = arrowtypes.encode_keys(arrowtypes.to_kernel(table.select(list(keys))), keys)
    if len(keys) == 1 and any(pred(table.schema.field(keys[0]).type) for pred in _INTLIKE):
        return _fibonacci(_as_int64_numpy(table.column(keys[0])).astype(np.int64, copy=False))
    import polars as pl

    sub = canonical_floats(table.select(list(keys)), keys)
    sub = sub.rename_columns([f"c{i}" for i in range(len(keys))])
    df = pl.from_arrow(sub, rechunk=False)
    assert isinstance(df, pl.DataFrame)
    hashed = df.hash_rows(seed=0x5EED)
    return _splitmix64(hashed.to_numpy())


def partition_ids(table: pa.Table, keys: Sequence[str], n: int) -> np.ndarray:
    """Target partition (0..n-1) of every row, by hash of ``keys``."""
    return ids_from_hash(hash_keys(table, keys), n)


def ids_from_hash(h: np.ndarray, n: int) -> np.ndarray:
    """Partition 0..n-1 from the high 32 bits of the hash (multiply-shift, no division)."""
    dtype = np.uint8 if n <= 256 else np.uint16 if n <= 65536 else np.uint32
    if n == 1:
        return np.zeros(h.size, dtype=dtype)
    if n & (n - 1) == 0:  # the same ids with one shift (n = 2^b: ((h >> 32) * n) >> 32 == h >> (64 - b))
        return (h >> np.uint64(64 - (n.bit_length() - 1))).astype(dtype)
    top = h >> np.uint64(32)
    top *= np.uint64(n)
    top >>= np.uint64(32)
    return top.astype(dtype)


def split_indices(ids: np.ndarray, n: int) -> list[np.ndarray]:
    """Row indices (ascending) of every id 0..n-1."""
    if n == 1:
        return [np.arange(ids.size, dtype=np.int64)]
    if n <= 16:  # a few linear scans beat a sort (docs/benchmarks.md, "Group-by estimate and splitters")
        return memory.indices_by_id(ids, n)
    counts = np.bincount(ids, minlength=n)
    order = np.argsort(ids, kind="stable")  # radix sort on small ints
    return list(np.split(order, np.cumsum(counts)[:-1]))


def split_by_ids(table: pa.Table, ids: np.ndarray, n: int) -> list[pa.Table]:
    """Split ``table`` into ``n`` tables by the per-row id (row order kept within a part)."""
    if n == 1:
        return [table]
    counts = np.bincount(ids, minlength=n)
    nonzero = np.flatnonzero(counts)
    if len(nonzero) == 1:  # everything goes to one part: no copy
        return [table if j == nonzero[0] else table.slice(0, 0) for j in range(n)]
    # one take per part: each part owns its buffers, so sent parts can be freed independently
    return [arrowtypes.take(table, pa.array(g)) if g.size else table.slice(0, 0) for g in split_indices(ids, n)]


def hash_partition(table: pa.Table, keys: Sequence[str], n: int) -> list[pa.Table]:
    if n == 1:
        return [table]
    return split_by_ids(table, partition_ids(table, keys, n), n)


def range_slices(counts: Sequence[int], rank: int, targets: Sequence[int]) -> list[tuple[int, int]]:
    """Given every rank's row count (in global order) and the target count per rank,
    return, for this ``rank``, the (offset, length) slice of its rows destined to each target."""
    start = int(sum(counts[:rank]))
    end = start + int(counts[rank])
    out: list[tuple[int, int]] = []
    t_start = 0
    for t in targets:
        lo, hi = max(start, t_start), min(end, t_start + int(t))
        out.append((lo - start, max(0, hi - lo)))
        t_start += int(t)
    return out


def balanced_counts(total: int, n: int, parts: int | None = None) -> list[int]:
    """``total`` rows over ``n`` ranks as evenly as possible; with ``parts`` < n only the first ``parts`` ranks get rows."""
    k = n if parts is None else parts
    base, extra = divmod(total, k)
    return [base + (1 if i < extra else 0) if i < k else 0 for i in range(n)]
