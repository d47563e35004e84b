"""Bucketed hash join (layer 2½): join one key-hash bucket at a time.

Every rank's share of the key space is cut into ``B`` buckets by the same hash
that picks the rank: a row goes to partition ``rank * B + bucket`` of the
multiply-shift ``ids_from_hash(h, ranks * B)``, whose ``// B`` is exactly the
rank the unbucketed shuffle would pick (``floor(x * P * B) // B = floor(x * P)``),
so the rows of a key still meet on one rank and in one bucket there.  A
blockwise counting sort lays the row indices out by partition, so each
destination's rows are one contiguous run already grouped by bucket.

Exchange: when every rank's tables are fixed-width without nulls, each column is
copied once into partition order by a blockwise counting sort (``permuted_columns``:
the column is read and written once, where gathering each partition through an
index array reads the whole column once per partition), and each bucket is then one
``Alltoallv`` per column sent straight from the contiguous runs, with this rank's
own run used in place (no copy).  Other tables are shuffled bucket by bucket
through ``comm.shuffle`` (Arrow IPC when needed).  Either way DuckDB builds a hash
table of ``1/B`` of the rows and drops it before the next bucket.  Every join type
is exact per bucket because a key's rows on both sides are in the same bucket; rows
with a null key that cannot appear in the result are left out of the indices (no
filtered copy).

Decisions, from the measurements in docs/benchmarks.md ("Bucketed hash join"):
copying each column once into partition order beats gathering through index
arrays; one bucket per exchange (``settings.join_exchange_buckets = 1``) keeps peak memory
down at no clear cost in time; the bucket count barely matters; DuckDB stays the
per-bucket kernel (faster than polars and a numpy sort-merge).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .communicator import Communicator
from . import collectives as tc
from . import arrowtypes, kernels, partition, settings

log = logging.getLogger(__name__)

#: rows per bucket (of the larger side, per rank) the bucket count aims at;
#: ``settings.current().join_bucket_rows`` overrides it (a huge value turns bucketing off)
BUCKET_ROWS = 1 << 20
#: upper bound on buckets per rank (ids stay small integers)
MAX_BUCKETS = 64
_BLOCK = 1 << 20
#: rows per block of the permuting counting sort (a block of a column stays in cache)
_PERMUTE_BLOCK = 1 << 16


def bucket_count(rows_per_rank: int, *, shuffled: bool = True) -> int:
    """Buckets for a join whose larger side has ``rows_per_rank`` rows per rank (same value on every rank).

    A join that needs no shuffle (one rank) is bucketed only when ``settings.current().join_bucket_rows``
    is set: there each bucket costs a ``take`` the plain join does not need (slower, for less
    peak memory: docs/benchmarks.md, "Bucketed hash join")."""
    chosen = settings.current().join_bucket_rows
    if chosen is None and not shuffled:
        return 1
    target = chosen if chosen is not None else BUCKET_ROWS
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
    ids = _partition_ids(table, keys, parts)  # its dtype also holds ``parts``, which marks a null key
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


def _bucket(comm: Communicator, table: pa.Table, groups: list[np.ndarray], columns: Any, bucket: int, buckets: int) -> pa.Table:
    """This rank's rows of ``bucket`` (after the shuffle when there are several ranks)."""
    p = comm.Get_size()
    if p == 1:
        if buckets == 1:
            return table
        return arrowtypes.take(table, pa.array(groups[bucket]))
    mine = [groups[r * buckets + bucket] for r in range(p)]
    return tc.shuffle(comm, table, None, mine, columns=columns)


def _partition_ids(table: pa.Table, keys: Sequence[str], parts: int) -> np.ndarray:
    """Partition ``0..parts-1`` of every row, hashed block by block (no n-sized hash temporaries)."""
    n = table.num_rows
    ids = np.empty(n, dtype=np.min_scalar_type(parts))
    for start in range(0, n, _BLOCK):
        block = table.slice(start, min(_BLOCK, n - start))
        ids[start : start + block.num_rows] = partition.ids_from_hash(partition.hash_keys(block, keys), parts)
    return ids


def permuted_columns(table: pa.Table, keys: Sequence[str], ranks: int, buckets: int,
                     raw: list[tuple[np.ndarray, int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """``(columns, bounds)``: every column of ``raw`` (``comm.raw_columns(table)``) copied into partition
    order, rows of partition ``j = rank * buckets + bucket`` at ``bounds[j]:bounds[j + 1]`` (ascending
    row order within a partition; the same partitions as ``bucket_order``).

    A counting sort done block by block: each block's rows are gathered (from a block small enough
    to stay in cache) into every partition's run, so each column is read and written once.  A
    gather through ``bucket_order``'s indices instead reads the whole column once per partition."""
    parts = ranks * buckets
    n = table.num_rows
    ids = _partition_ids(table, keys, parts)
    counts = np.bincount(ids, minlength=parts)
    bounds = np.zeros(parts + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    columns = [np.empty_like(values) for values, _ in raw]
    fill = bounds[:-1].tolist()
    for start in range(0, n, _PERMUTE_BLOCK):
        block = ids[start : start + _PERMUTE_BLOCK]
        local = np.argsort(block, kind="stable")
        local_counts = np.bincount(block, minlength=parts).tolist()
        views = [values[start : start + block.size] for values, _ in raw]
        pos = 0
        for j, c in enumerate(local_counts):
            if not c:
                continue
            rows = local[pos : pos + c]
            f = fill[j]
            for view, out in zip(views, columns):
                np.take(view, rows, axis=0, out=out[f : f + c], mode="clip")
            fill[j] = f + c
            pos += c
    return columns, bounds


def _permute(comm: Communicator, table: pa.Table, keys: Sequence[str], buckets: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray] | None:
    """Fixed-width null-free tables (on every rank): each column copied once into partition order
    (``permuted_columns``), so every (rank, bucket) run is a contiguous slice: sends need no gather
    and this rank's own rows no copy.  Returns ``(columns, sent, got)`` with ``sent[r, b]`` rows of
    bucket ``b`` for rank ``r`` (starting at ``sent``'s flat prefix sum) and ``got[s, b]`` rows of
    bucket ``b`` from rank ``s``; ``None`` (on every rank) when some rank's table is not raw or a
    column is too large for byte displacements."""
    p = comm.Get_size()
    raw = tc.raw_columns(table)
    fits = raw is not None and table.nbytes < tc._MAX_CHUNK
    if comm.allreduce(0 if fits else 1) != 0:
        return None
    assert raw is not None
    columns, bounds = permuted_columns(table, keys, p, buckets, raw)
    sent = np.diff(bounds).reshape(p, buckets)
    got = np.empty_like(sent)
    comm.Alltoall(sent, got)
    return columns, sent, got


def _exchange_buckets(comm: Communicator, schema: pa.Schema, columns: list[np.ndarray], sent: np.ndarray,
                      got: np.ndarray, first: int, stop: int) -> list[pa.Table]:
    """This rank's rows of buckets ``first..stop-1`` from the permuted ``columns`` (``_permute``): one
    ``Alltoallv`` per column straight from the contiguous runs (a destination's buckets are adjacent),
    received into one buffer (source-major, then bucket); own rows stay zero-copy slices.  Rows of a
    bucket are in source-rank order (one chunk per non-empty source)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    buckets = sent.shape[1]
    starts = np.zeros(sent.size + 1, dtype=np.int64)
    np.cumsum(sent.reshape(-1), out=starts[1:])
    sdispl = starts[np.arange(p) * buckets + first]
    scount = sent[:, first:stop].sum(axis=1)
    scount[rank] = 0
    rows_in = got[:, first:stop].copy()
    rows_in[rank] = 0
    rcount = rows_in.sum(axis=1)
    rstart = np.zeros(rows_in.size + 1, dtype=np.int64)  # where (source, bucket) starts in the receive buffer
    np.cumsum(rows_in.reshape(-1), out=rstart[1:])
    rdispl = rstart[np.arange(p) * (stop - first)]
    total = int(rcount.sum())
    chunks: list[list[list[pa.Array]]] = [[[] for _ in columns] for _ in range(first, stop)]
    for i, (values, field) in enumerate(zip(columns, schema)):
        w = values.itemsize * (values.shape[1] if values.ndim > 1 else 1)
        recv = np.empty((total,) + values.shape[1:], dtype=values.dtype)
        tc._exchange(comm, values.reshape(-1).view(np.uint8), scount * w, recv.reshape(-1).view(np.uint8),
                     rcount * w, rdispl=rdispl * w, sdispl=sdispl * w)
        for b in range(first, stop):
            for src in range(p):
                if src == rank:
                    at = int(starts[rank * buckets + b])
                    part = values[at : at + int(sent[rank, b])]
                else:
                    at = int(rstart[src * (stop - first) + b - first])
                    part = recv[at : at + int(rows_in[src, b - first])]
                if part.shape[0]:
                    chunks[b - first][i].append(pa.Array.from_buffers(field.type, part.shape[0], [None, pa.py_buffer(part)]))
    return [pa.Table.from_arrays([pa.chunked_array(c, f.type) for c, f in zip(cols, schema)], schema=schema)
            for cols in chunks]


def hash_join(comm: Communicator, left: pa.Table, right: pa.Table, keys: Sequence[str], right_keys: Sequence[str],
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
    if p > 1:
        lp = _permute(comm, left, keys, buckets)
        rp = _permute(comm, right, right_keys, buckets) if lp is not None else None
        if lp is not None and rp is not None:
            # buckets per exchange: 1 keeps one bucket's received rows at a time, MAX_BUCKETS moves all at once
            step = max(1, min(buckets, settings.current().join_exchange_buckets))
            for first in range(0, buckets, step):
                stop = min(buckets, first + step)
                lts = _exchange_buckets(comm, left.schema, *lp, first, stop)
                rts = _exchange_buckets(comm, right.schema, *rp, first, stop)
                for j in range(stop - first):
                    out = kernels.join(lts[j], rts[j], keys, right_keys, how, suffix)
                    lts[j] = rts[j] = left.schema.empty_table()
                    if out.num_rows or not outs:
                        outs.append(out)
                del lts, rts
            del lp, rp
            log.debug("bucketed hash join (permuted columns): %d bucket(s), %d rank(s)", buckets, p)
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
