"""Bucketed hash join (layer 2½): join one key-hash bucket at a time.

Every rank's share of the key space is cut into ``B`` buckets by the same hash
that picks the rank: a row goes to partition ``rank * B + bucket`` of the
multiply-shift ``ids_from_hash(h, ranks * B)``, whose ``// B`` is exactly the
rank the unbucketed shuffle would pick (``floor(x * P * B) // B = floor(x * P)``),
so the rows of a key still meet on one rank and in one bucket there.  A
blockwise counting sort lays the row indices out by partition, so each
destination's rows are one contiguous run already grouped by bucket.

Two exchange modes (``ONE_SHUFFLE``): one shuffle per table whose received
rows are grouped by bucket (every bucket is zero-copy slices of the received
columns), or one shuffle per bucket (only one bucket's shuffled copies exist
at a time).  Either way DuckDB builds a hash table of ``1/B`` of the rows and
drops it before the next bucket.  Every join type is exact per bucket because
a key's rows on both sides are in the same bucket; rows with a null key that
cannot appear in the result are left out of the indices (no filtered copy).

Measured (2 ranks, 20M rows per table, one DuckDB thread per rank, wall /
peak RSS growth over both input partitions, this 2-core VM at load 1.1-1.7):
unbucketed 1.6-2.6 s / 2.96-3.21x; one shuffle, B=10: 1.23-1.37 s / 1.3x
when repeated in one process, 1.50-1.75 s / 1.47x (median of 3) in a fresh
one; one shuffle per bucket, B=10: 1.27-1.41 s / 0.43-0.66x repeated,
1.33-1.54 s / 0.85x fresh (the default); B=5 and B=20 were not faster.  Kernels on one real bucket (1M + 1M rows, CPU): DuckDB 0.064-0.074 s,
polars 0.078-0.086 s, numpy packed-sort + searchsorted merge 0.079-0.083 s
(10M + 10M: DuckDB 0.62-0.72, numpy 0.82-0.87, polars 1.7-1.9 s), so DuckDB
stays the kernel; bucketing does not make DuckDB's CPU smaller (10 x 0.07 s =
the whole join), the gain is memory and fewer freshly faulted pages (a new
page costs ~0.8 ms/MB on this VM).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import comm as tc
from . import kernels, partition

log = logging.getLogger(__name__)

#: rows per bucket (of the larger side, per rank) the bucket count aims at;
#: ``HETFLOW_JOIN_BUCKET_ROWS`` overrides it (a huge value turns bucketing off)
BUCKET_ROWS = 1 << 20
#: upper bound on buckets per rank (ids stay small integers)
MAX_BUCKETS = 64
_BLOCK = 1 << 20
#: shuffle each table once, grouped by bucket (True), or shuffle bucket by bucket (False, the default:
#: as fast or faster in fresh processes and half the peak memory; ``HETFLOW_JOIN_ONE_SHUFFLE=1``)
ONE_SHUFFLE = os.environ.get("HETFLOW_JOIN_ONE_SHUFFLE", "0") == "1"


def bucket_count(rows_per_rank: int, *, shuffled: bool = True) -> int:
    """Buckets for a join whose larger side has ``rows_per_rank`` rows per rank (same value on every rank).

    A join that needs no shuffle (one rank) is bucketed only when ``HETFLOW_JOIN_BUCKET_ROWS``
    is set: there each bucket costs a ``take`` the plain join does not need (20M + 20M rows:
    2.1-2.4 s bucketed against 1.5-1.7 s plain, peak growth 0.62x against 1.89x)."""
    env = os.environ.get("HETFLOW_JOIN_BUCKET_ROWS")
    if not env and not shuffled:
        return 1
    target = max(1, int(env)) if env else BUCKET_ROWS
    return max(1, min(MAX_BUCKETS, math.ceil(rows_per_rank / target)))


def bucket_groups(table: pa.Table, keys: Sequence[str], ranks: int, buckets: int, *,
                  drop_null_keys: bool = False) -> list[np.ndarray]:
    """Row indices (ascending) of every partition ``rank * buckets + bucket`` (see ``bucket_order``)."""
    order, bounds = bucket_order(table, keys, ranks, buckets, drop_null_keys=drop_null_keys)
    return [order[bounds[j] : bounds[j + 1]] for j in range(ranks * buckets)]


def bucket_order(table: pa.Table, keys: Sequence[str], ranks: int, buckets: int, *,
                 drop_null_keys: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(order, bounds)``: ``order[bounds[j]:bounds[j + 1]]`` are the row indices (ascending) of
    partition ``j = rank * buckets + bucket``, so a rank's rows are contiguous and grouped by bucket; with
    ``drop_null_keys`` the rows with a null key are in none (they could match nothing),
    which spares the caller a filtered copy of the table.

    Indices are int32 when the table allows (half the memory of int64 for the whole loop)."""
    parts = ranks * buckets
    n = table.num_rows
    valid = _valid_keys(table, keys) if drop_null_keys else None
    if parts == 1 and valid is None:
        return np.arange(n, dtype=np.int32 if n < 2**31 else np.int64), np.array([0, n], dtype=np.int64)
    ids = np.empty(n, dtype=np.min_scalar_type(parts))  # ``parts`` itself marks a null key
    for start in range(0, n, _BLOCK):  # block by block: the hash words stay in cache, no n-sized temporaries
        block = table.slice(start, min(_BLOCK, n - start))
        ids[start : start + block.num_rows] = partition.ids_from_hash(partition.hash_keys(block, keys), parts)
    if valid is not None:
        ids[~valid] = parts
    counts = np.bincount(ids, minlength=parts + 1)
    bounds = np.zeros(parts + 2, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    # a counting sort done block by block: a stable radix argsort of each block's ids, scattered
    # into every part's slice, so the only n-sized array written is the index array itself
    order = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
    fill = bounds[:-1].copy()
    for start in range(0, n, _BLOCK):
        block = ids[start : start + _BLOCK]
        local = np.argsort(block, kind="stable")
        local_counts = np.bincount(block, minlength=parts + 1)
        pos = 0
        for j in np.flatnonzero(local_counts[:parts]):
            c = int(local_counts[j])
            np.add(local[pos : pos + c], start, out=order[fill[j] : fill[j] + c], casting="unsafe")
            fill[j] += c
            pos += c
        # ids == parts (null keys) sort last in the block and are dropped
    del ids
    return order, bounds[: parts + 1]


def _valid_keys(table: pa.Table, keys: Sequence[str]) -> np.ndarray | None:
    """Rows whose keys are all non-null, or ``None`` when no key column has a null."""
    valid = None
    for k in keys:
        col = table.column(k)
        if col.null_count:
            m = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False))
            valid = m if valid is None else valid & m
    return valid


def _bucket(comm: Any, table: pa.Table, groups: list[np.ndarray], columns: Any, bucket: int, buckets: int) -> pa.Table:
    """This rank's rows of ``bucket`` (after the shuffle when there are several ranks)."""
    p = comm.Get_size()
    if p == 1:
        if buckets == 1:
            return table
        return table.take(pa.array(groups[bucket]))
    mine = [groups[r * buckets + bucket] for r in range(p)]
    return tc.shuffle(comm, table, None, mine, columns=columns)


def _shuffle_by_bucket(comm: Any, table: pa.Table, keys: Sequence[str], buckets: int, drop_null_keys: bool) -> list[pa.Table]:
    """One shuffle of the whole table whose sent rows are grouped by bucket (the destinations'
    index lists are the contiguous runs of ``bucket_order``), then every bucket as zero-copy
    slices of the received table, one per source rank."""
    p = comm.Get_size()
    order, bounds = bucket_order(table, keys, p, buckets, drop_null_keys=drop_null_keys)
    sent = np.diff(bounds).reshape(p, buckets)
    got = np.empty_like(sent)
    comm.Alltoall(sent, got)
    dest = [order[bounds[r * buckets] : bounds[(r + 1) * buckets]] for r in range(p)]
    received = tc.shuffle(comm, table, None, dest)
    del dest, order
    starts = np.zeros(got.size + 1, dtype=np.int64)
    np.cumsum(got.reshape(-1), out=starts[1:])  # source-major, then bucket
    out = []
    for b in range(buckets):
        parts = [received.slice(int(starts[s * buckets + b]), int(got[s, b])) for s in range(p) if got[s, b]]
        out.append(pa.concat_tables(parts) if parts else received.schema.empty_table())
    return out


def hash_join(comm: Any, left: pa.Table, right: pa.Table, keys: Sequence[str], right_keys: Sequence[str],
              how: str, suffix: str, buckets: int) -> pa.Table:
    """Hash-shuffle join of this rank's partitions, ``buckets`` buckets at a time (collective).

    Rows with a null key are left home when they cannot appear in the result (both sides of
    inner/semi, the right side of left/anti, the left side of right)."""
    p = comm.Get_size()
    if p == 1 and buckets == 1:
        return kernels.join(left, right, keys, right_keys, how, suffix)
    drop_left = how in ("inner", "semi", "right")
    drop_right = how in ("inner", "semi", "left", "anti")
    outs: list[pa.Table] = []
    if p > 1 and ONE_SHUFFLE:
        lbs = _shuffle_by_bucket(comm, left, keys, buckets, drop_left)
        rbs = _shuffle_by_bucket(comm, right, right_keys, buckets, drop_right)
        for b in range(buckets):
            out = kernels.join(lbs[b], rbs[b], keys, right_keys, how, suffix)
            lbs[b] = rbs[b] = left.schema.empty_table()  # the slices go; the received buffers go after the loop
            if out.num_rows or not outs:
                outs.append(out)
        del lbs, rbs
        return outs[0] if len(outs) == 1 else pa.concat_tables(outs)
    gl = bucket_groups(left, keys, p, buckets, drop_null_keys=drop_left)
    gr = bucket_groups(right, right_keys, p, buckets, drop_null_keys=drop_right)
    cl = tc.raw_columns(left) if p > 1 else None
    cr = tc.raw_columns(right) if p > 1 else None
    for b in range(buckets):
        lt = _bucket(comm, left, gl, cl, b, buckets)
        rt = _bucket(comm, right, gr, cr, b, buckets)
        out = kernels.join(lt, rt, keys, right_keys, how, suffix)
        del lt, rt
        if out.num_rows or not outs:
            outs.append(out)
    log.debug("bucketed hash join: %d bucket(s), %d rank(s)", buckets, p)
    return outs[0] if len(outs) == 1 else pa.concat_tables(outs)
