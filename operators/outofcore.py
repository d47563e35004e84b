"""Out-of-core join, sort and group-by under a per-rank memory budget (layer 3).

Input is a ``shares.Share`` (Arrow IPC files read a chunk at a time); output is
written a batch at a time, so neither side has to fit in memory: a hetflow
dataset (one partition per rank, manifest last; ``Scan``'s methods return a
``Scan`` of it) or, with ``local=True``, only this rank's partition file in a
directory private to the rank (the node-local spill directory of a ``DTable``
operator over its budget, see ``overbudget``).  Every function is collective and
returns what it did (buckets, runs, bytes spilled, the spill directory).

* **join, group-by: grace hash.**  Each chunk is hashed on its keys into
  ``ranks x B`` partitions (the multiply-shift ``ids_from_hash(h, P * B)``,
  whose ``// B`` is the rank), shuffled, and every received row appended to
  its bucket's spill file.  ``B`` is chosen from the global input bytes so
  that one bucket (both sides of a join) is a fixed fraction of the budget;
  then each bucket is read back and joined (DuckDB) or aggregated on its own.
  A key's rows are all in one bucket, so every join type and aggregation is
  exact per bucket.  A single key whose rows exceed the budget still has to
  fit (splitting it further cannot help a hash partition).
* **sort: sample, range shuffle, runs, k-way merge.**  Key samples from
  every chunk give ``P - 1`` splitters; each chunk is sorted, cut at the
  splitters and exchanged; what a rank receives is collected into sorted runs
  of a fixed fraction of the budget, written as IPC files; the runs are then
  merged a window at a time: the window ends at the smallest last key among
  the runs' current slices, so everything up to it can be emitted.  Equal keys
  go to one rank (no tie splitting); ties keep no particular order.

Memory: a chunk read is ``CHUNK_FRACTION`` of the budget; buckets,
runs and the merge window are the other fractions below; what the budget
bounds is the operator's working memory above the process's baseline
(interpreter, pyarrow, DuckDB loaded).  Spill files live in a private
directory under ``spill_dir`` (the node-local directory) removed on return,
failure or interrupt (``spilldir.SpillDir``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import arrowtypes, kernels, partition, sorting, spilldir
from . import collectives as tc
from . import dataset as ds
from .communicator import Communicator
from .errors import (
    ColumnNotFoundError,
    InvalidOptionError,
    KeyTypeMismatchError,
    OperatorError,
    UnsupportedAggregationError,
)
from .optioncheck import check_orderable, join_key_type, key_list, sort_keys
from .shares import Share, Slice
from .optiontypes import JOIN_HOWS, NULL_PLACEMENTS, JoinHow, Keys, NullPlacement, SortKey

log = logging.getLogger(__name__)

#: share of the budget read (and shuffled) per round
CHUNK_FRACTION = 1 / 16
#: share of the budget one join bucket (both sides) may hold: DuckDB's join takes a multiple of the bucket
#: on top (docs/benchmarks.md, "Out-of-core operators")
JOIN_BUCKET_FRACTION = 1 / 16
#: share of the budget one group-by bucket may hold
GROUP_BUCKET_FRACTION = 1 / 8
#: share of the budget one sorted run holds before it is written (it is sorted in memory once)
RUN_FRACTION = 1 / 8
#: share of the budget the merge holds (one batch of every run of the expected number, plus the emitted window)
MERGE_FRACTION = 1 / 16
#: aggregations whose result depends on row order, which the bucketed path does not keep
ORDER_DEPENDENT = frozenset({"first", "last", "list"})


class SpillError(OperatorError, RuntimeError):
    """An out-of-core operator failed on another rank (this rank's part was fine)."""


def _budget(memory_budget: int) -> int:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise InvalidOptionError("memory_budget", memory_budget, ["a positive number of bytes"])
    return memory_budget


def _max(comm: Communicator, value: int) -> int:
    return int(max(comm.allgather(int(value))))


def bucket_count(bytes_per_rank: float, bucket_bytes: float) -> int:
    """Buckets so that each holds at most ``bucket_bytes`` of a rank's ``bytes_per_rank`` (evenly hashed)."""
    return max(1, math.ceil(bytes_per_rank / max(1.0, bucket_bytes)))


def _chunk_rows(scan: Share, budget: int) -> int:
    return max(1024, int(budget * CHUNK_FRACTION / scan.row_bytes))


@contextlib.contextmanager
def _duckdb_flush_threshold(nbytes: int) -> Iterator[None]:
    """DuckDB (the join and group-by kernel) hands freed memory back above ``nbytes`` instead of its
    default 128 MiB, for the duration of an out-of-core operator: its cache would count against a
    budget of that order."""
    con = kernels._duck()
    old = con.execute("SELECT current_setting('allocator_flush_threshold')").fetchone()[0]
    con.execute(f"SET allocator_flush_threshold = '{int(nbytes)}B'")
    try:
        yield
    finally:
        con.execute(f"SET allocator_flush_threshold = '{old}'")


# --------------------------------------------------------------------------- grace hash partitioning
def _partition(scan: Share, keys: Sequence[str], buckets: int, directory: Path, name: str, budget: int,
               prepare: Callable[[pa.Table], pa.Table]) -> spilldir.Buckets:
    """Hash-shuffle ``scan`` a chunk at a time and append every row to its bucket's spill file (collective)."""
    comm = scan.comm
    p = comm.Get_size()
    schema = prepare(scan.schema.empty_table()).schema
    out = spilldir.Buckets(directory, name, schema, buckets)
    chunks = scan.chunks(_chunk_rows(scan, budget))
    try:
        for i in range(_max(comm, len(chunks))):
            table = prepare(scan.read(chunks[i]) if i < len(chunks) else scan.schema.empty_table())
            ids = partition.ids_from_hash(partition.hash_keys(table, keys), p * buckets).astype(np.int32)
            if p > 1:
                table = table.append_column("__bucket", pa.array((ids % buckets).astype(np.uint16)))
                table = tc.shuffle(comm, table, ids // buckets)
                ids = table.column("__bucket").to_numpy().astype(np.int32)
                table = table.drop_columns(["__bucket"])
            for bucket, piece in enumerate(partition.split_by_ids(table, ids, buckets)):
                out.write(bucket, piece)
            del table, ids
            spilldir.release()
    finally:
        out.close()
    return out


# --------------------------------------------------------------------------- output
def _write_output(comm: Communicator, output: str | os.PathLike[str], schema: pa.Schema,
                  batches: Iterator[pa.RecordBatch], what: str, stats: dict[str, Any], local: bool) -> dict[str, Any]:
    """Stream this rank's ``batches`` into partition ``rank`` of ``output`` and return ``stats``.  A dataset
    (``local`` false) is committed by rank 0, manifest last; with ``local`` the directory is this rank's
    own and only the partition file is written.  An error on any rank is raised on every rank."""
    rank = comm.Get_rank()
    target = Path(output)
    if rank == 0 and not local:
        ds.uncommit(target)  # an earlier result stops existing before its files are replaced
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
    comm.Barrier()
    info, error, failure = None, None, None
    try:
        info = ds.write_partition(target, rank, batches, schema=schema, rank=rank)
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        error, failure = f"{type(exc).__name__}: {exc}", exc
    errors = comm.allgather(error)
    if failure is not None:
        raise failure
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise SpillError(f"{what}: rank {bad[0][0]} failed: {bad[0][1]}")
    if not local:
        infos = comm.gather(info, root=0)
        if rank == 0:
            assert infos is not None
            ds.commit(target, target.name, schema, [i for i in infos if i is not None], producer={"operator": what})
        comm.Barrier()
    return stats


def _batches(tables: Iterator[pa.Table], rows: int) -> Iterator[pa.RecordBatch]:
    """``tables`` as record batches of about ``rows`` rows: small tables are gathered (few, large
    batches keep the output's headers few), large ones cut.  A cut batch of a view column still
    points into the whole table's data buffers, and IPC writes them whole with every batch, so
    view columns are rebuilt per batch (``_compact``)."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        if count >= rows:
            yield from map(_compact, pa.concat_tables(held).combine_chunks().to_batches(max_chunksize=max(1, rows)))
            held, count = [], 0
    if count:
        yield from map(_compact, pa.concat_tables(held).combine_chunks().to_batches(max_chunksize=max(1, rows)))


def _compact(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with its view columns holding only their own values (through the plain layout)."""
    if not any(arrowtypes.has_view(f.type) for f in batch.schema):
        return batch
    table = pa.Table.from_batches([batch])
    return arrowtypes.restore(arrowtypes.to_kernel(table), table.schema).combine_chunks().to_batches()[0]


# --------------------------------------------------------------------------- join
def join(left: Share, right: Share, keys: Keys, *, right_keys: Keys | None = None, how: JoinHow = "inner",
         suffix: str = "_right", output: str | os.PathLike[str], memory_budget: int,
         spill_dir: str | os.PathLike[str] | None = None, local: bool = False) -> dict[str, Any]:
    """``left`` joined with ``right`` (grace hash join), written to ``output`` (see ``_write_output``)."""
    if how not in JOIN_HOWS:
        raise InvalidOptionError("join how", how, JOIN_HOWS)
    budget = _budget(memory_budget)
    lk = key_list(keys)
    rk = lk if right_keys is None else key_list(right_keys)
    if len(lk) != len(rk):
        raise InvalidOptionError("right_keys", rk, [f"{len(lk)} key(s) like {lk}"])
    for names, scan, side in ((lk, left, "join left side"), (rk, right, "join right side")):
        for n in names:
            if n not in scan.schema.names:
                raise ColumnNotFoundError(n, scan.schema.names, where=side)
    for a, b in zip(lk, rk):
        ta, tb = left.schema.field(a).type, right.schema.field(b).type
        if join_key_type(ta) != join_key_type(tb):
            raise KeyTypeMismatchError(f"join key type mismatch: left {a!r} is {ta}, right {b!r} is {tb}")
    comm = left.comm
    target = kernels.join_schema(left.schema, right.schema, rk, how, suffix)[0]
    total = sum(comm.allgather(left.local_bytes + right.local_bytes))
    buckets = bucket_count(total / comm.Get_size(), budget * JOIN_BUCKET_FRACTION)
    out_rows = _chunk_rows(left, budget)
    with spilldir.SpillDir(spill_dir) as directory, _duckdb_flush_threshold(budget // 16):
        lb = _partition(left, lk, buckets, directory, "left", budget, arrowtypes.to_kernel)
        rb = _partition(right, rk, buckets, directory, "right", budget, arrowtypes.to_kernel)
        spilled = sum(lb.bytes) + sum(rb.bytes)

        def produce() -> Iterator[pa.Table]:
            for b in range(buckets):
                lt, rt = lb.read(b), rb.read(b)
                if lt.num_rows or rt.num_rows:
                    joined = arrowtypes.restore(kernels.join(lt, rt, lk, rk, how, suffix), target)
                    del lt, rt
                    yield joined
                    del joined
                spilldir.release()

        stats = {"operator": "join", "buckets": buckets, "spilled_bytes": spilled, "spill_dir": str(directory)}
        return _write_output(comm, output, target, _batches(produce(), out_rows), f"join {how} on {lk}", stats, local)


# --------------------------------------------------------------------------- group-by
def group_aggregate(scan: Share, keys: list[str], aggs: list[tuple[str, str]], *, output: str | os.PathLike[str],
                    memory_budget: int, spill_dir: str | os.PathLike[str] | None = None,
                    local: bool = False) -> dict[str, Any]:
    """Grouped aggregates by grace hash partitioning, written to ``output`` (see ``_write_output``)."""
    budget = _budget(memory_budget)
    for k in keys:
        if k not in scan.schema.names:
            raise ColumnNotFoundError(k, scan.schema.names, where="group_by")
    for col, agg in aggs:
        if col not in scan.schema.names:
            raise ColumnNotFoundError(col, scan.schema.names, where="aggregate")
        if agg in ORDER_DEPENDENT:
            raise UnsupportedAggregationError(
                f"aggregation {agg!r} of {col!r} depends on row order, which the out-of-core group-by does not keep "
                f"(allowed: {sorted(set(kernels._PA_FUNC) - ORDER_DEPENDENT)})")
    target = kernels.aggregate_schema(scan.schema, keys, aggs)  # validates names and types
    needed = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
    work = scan.select(needed)
    comm = scan.comm
    share = len(needed) / max(1, len(scan.schema))  # only these columns are read
    total = sum(comm.allgather(int(work.local_bytes * share)))
    buckets = bucket_count(total / comm.Get_size(), budget * GROUP_BUCKET_FRACTION)
    out_rows = _chunk_rows(work, budget)
    plain = arrowtypes.plain_schema(target)

    def prepare(t: pa.Table) -> pa.Table:
        return partition.canonical_floats(arrowtypes.to_kernel(t), keys)  # -0.0 and 0.0 are one group

    with spilldir.SpillDir(spill_dir) as directory, _duckdb_flush_threshold(budget // 16):
        parts = _partition(work, keys, buckets, directory, "rows", budget, prepare)

        def produce() -> Iterator[pa.Table]:
            for b in range(buckets):
                rows = parts.read(b)
                if rows.num_rows:
                    res = arrowtypes.restore(kernels.group_aggregate(rows, keys, aggs, consume=True, schema=plain), target)
                    del rows
                    yield res
                    del res
                spilldir.release()

        stats = {"operator": "group_by", "buckets": buckets, "spilled_bytes": sum(parts.bytes),
                 "spill_dir": str(directory)}
        return _write_output(comm, output, target, _batches(produce(), out_rows), f"group_by {keys}", stats, local)


# --------------------------------------------------------------------------- sort
def _splitters(scan: Share, chunks: list[list[Slice]], by: list[tuple[str, str]], nulls: str,
               prepare: Callable[[pa.Table], pa.Table]) -> list[list[Any]]:
    """``P - 1`` splitter keys from evenly spaced samples of every chunk's key columns (collective)."""
    comm = scan.comm
    p = comm.Get_size()
    names = [c for c, _ in by]
    if p == 1:
        return []
    per_chunk = max(1, math.ceil(sorting.SAMPLES_PER_RANK / max(1, len(chunks))))
    samples = []
    for chunk in chunks:
        keys = prepare(scan.read(chunk, names))
        n = keys.num_rows
        k = min(n, per_chunk)
        samples.append(arrowtypes.take(keys, pa.array((np.arange(k, dtype=np.int64) * n) // max(k, 1))))
    mine = pa.concat_tables(samples) if samples else prepare(scan.schema.empty_table().select(names))
    everyone = kernels.sort(pa.concat_tables(tc.allgather_table(comm, mine)), by, nulls)
    m = everyone.num_rows
    if m == 0:
        return []
    return [sorting._row(everyone, names, min(m - 1, (j * m) // p)) for j in range(1, p)]


def _upper_bound(table: pa.Table, by: Sequence[tuple[str, str]], nulls: str, key: Sequence[Any]) -> int:
    """Rows of the sorted ``table`` ordered at or before ``key`` (a binary search of Python values; one
    integer-like key without nulls is searched in numpy)."""
    names = [c for c, _ in by]
    if len(by) == 1 and key[0] is not None and table.column(names[0]).null_count == 0:
        values = sorting._numeric_key(table, names[0])
        if values is not None:
            if by[0][1] == "ascending":
                return int(np.searchsorted(values, key[0], side="right"))
            return int(values.size - np.searchsorted(values[::-1], key[0], side="left"))
    lo, hi = 0, table.num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if sorting.compare(sorting._row(table, names, mid), key, by, nulls) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _sort(table: pa.Table, by: Sequence[tuple[str, str]], nulls: str) -> pa.Table:
    """``table`` sorted (ties in no particular order) by kernels whose scratch is handed back when freed
    (numpy's for one integer-like key without nulls: a stable sort that merges presorted runs, as the merge
    window is made of; else Arrow's, whose pool ``spilldir.release`` empties).  The in-memory kernels'
    (polars, the packed radix sort) stays resident in their allocators and would count against the budget."""
    if table.num_rows <= 1:
        return table
    values = None
    if len(by) == 1 and table.column(by[0][0]).null_count == 0:
        values = sorting._numeric_key(table, by[0][0])
    if values is not None:
        if by[0][1] == "ascending":
            order = np.argsort(values, kind="stable")
        else:
            order = (values.size - 1 - np.argsort(values[::-1], kind="stable"))[::-1]
        return arrowtypes.take(table, pa.array(order))
    order = pc.sort_indices(table.select([c for c, _ in by]), sort_keys=[(c, o, nulls) for c, o in by])
    return arrowtypes.take(table, order)


def _merge(runs: list[Iterator[pa.Table]], by: list[tuple[str, str]], nulls: str) -> Iterator[pa.Table]:
    """The sorted runs (each an iterator of its batches) merged, a window at a time: one batch of every
    run is held; the window ends at the smallest last key among them, so every row up to it (from every
    run) is final."""
    names = [c for c, _ in by]
    current: list[pa.Table | None] = [next(r, None) for r in runs]
    while True:
        live = [i for i, t in enumerate(current) if t is not None]
        if not live:
            return
        if len(live) == 1:  # the last run: no comparisons left to make
            t = current[live[0]]
            while t is not None:
                yield t
                t = next(runs[live[0]], None)
            return
        bound: list[Any] | None = None
        for i in live:
            t = current[i]
            assert t is not None
            last = sorting._row(t, names, t.num_rows - 1)
            if bound is None or sorting.compare(last, bound, by, nulls) < 0:
                bound = last
        assert bound is not None
        pieces = []
        for i in live:
            t = current[i]
            assert t is not None
            n = _upper_bound(t, by, nulls, bound)
            if n:
                pieces.append(t.slice(0, n))
            rest: pa.Table | None = t.slice(n)
            while rest is not None and rest.num_rows == 0:
                rest = next(runs[i], None)
            current[i] = rest
        if pieces:
            yield _sort(pa.concat_tables(pieces), by, nulls)
        del pieces
        spilldir.release()


def sort_by(scan: Share, sorting_: SortKey | Sequence[SortKey], *, nulls: NullPlacement = "at_end",
            output: str | os.PathLike[str], memory_budget: int,
            spill_dir: str | os.PathLike[str] | None = None, local: bool = False) -> dict[str, Any]:
    """``scan`` sorted (sample sort, then an external merge sort per rank), written to ``output`` (see
    ``_write_output``); partition ``r`` holds rank ``r``'s range, so the partitions in order are the sorted table."""
    if nulls not in NULL_PLACEMENTS:
        raise InvalidOptionError("nulls", nulls, NULL_PLACEMENTS)
    budget = _budget(memory_budget)
    by: list[tuple[str, str]] = list(sort_keys(sorting_))
    for col, _ in by:
        if col not in scan.schema.names:
            raise ColumnNotFoundError(col, scan.schema.names, where="sort_by")
        check_orderable(scan.schema.field(col), "sort_by")
    comm = scan.comm
    p, rank = comm.Get_size(), comm.Get_rank()
    target = scan.schema
    chunks = scan.chunks(_chunk_rows(scan, budget))
    prepare = arrowtypes.to_kernel
    run_bytes = budget * RUN_FRACTION
    with spilldir.SpillDir(spill_dir) as directory:
        spl = _splitters(scan, chunks, by, nulls, prepare)
        runs: list[Path] = []
        expected_runs = max(1, math.ceil(sum(comm.allgather(scan.local_bytes)) / p / run_bytes))
        run_batch_rows = max(256, int(budget * MERGE_FRACTION / scan.row_bytes / expected_runs))
        held: list[pa.Table] = []
        held_bytes = 0
        spilled = 0

        def flush() -> None:
            nonlocal held, held_bytes, spilled
            if not held:
                return
            run = _sort(pa.concat_tables(held).combine_chunks(), by, nulls)
            held, held_bytes = [], 0
            path = directory / f"run-{len(runs):05d}.arrow"
            spilldir.write_run(path, run, run_batch_rows)
            runs.append(path)
            spilled += int(run.nbytes)
            del run
            spilldir.release()

        for i in range(_max(comm, len(chunks))):
            table = prepare(scan.read(chunks[i]) if i < len(chunks) else scan.schema.empty_table())
            if p > 1:
                table = _sort(table, by, nulls)
                bounds = [0] + [sorting.lower_bound(table, by, nulls, key, None, rank, None) for key in spl]
                bounds = list(np.maximum.accumulate(bounds + [table.num_rows]))
                parts = [table.slice(bounds[j], bounds[j + 1] - bounds[j]) for j in range(p)]
                del table
                received = [t for t in tc.alltoall_tables(comm, parts) if t.num_rows]
                del parts
            else:
                received = [table] if table.num_rows else []
            for t in received:
                held.append(t)
                held_bytes += int(t.nbytes)
            del received
            if held_bytes >= run_bytes:
                flush()
            spilldir.release()
        flush()
        out_rows = _chunk_rows(scan, budget)

        def produce() -> Iterator[pa.Table]:
            for piece in _merge([spilldir.read_run(r) for r in runs], by, nulls):
                yield arrowtypes.restore(piece, target)

        stats = {"operator": "sort", "runs": len(runs), "spilled_bytes": spilled, "spill_dir": str(directory)}
        return _write_output(comm, output, target, _batches(produce(), out_rows), f"sort_by {by}", stats, local)
