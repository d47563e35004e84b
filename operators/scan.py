"""A lazily read distributed table: Arrow IPC files on disk, read a slice at a time.

``scan_ipc(comm, paths)`` lists the files (or a hetflow dataset's partitions,
from its manifest) and gives every rank a contiguous share of the rows, as
slices of the files' record batches; nothing is read yet.  The out-of-core
operators (``join``, ``sort_by``, ``group_by(...).aggregate``, see
``outofcore``) read the share a chunk at a time, and write their result as a
hetflow dataset that they return as a ``Scan`` again, so a chain of them never
holds more than its memory budget.  ``to_dtable()`` reads the share into memory
(an in-memory ``DTable``), for results that fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from .communicator import Communicator
from . import dataset as ds
from . import outofcore, spill
from .communicator import Communicator
from .dtable import DTable
from .errors import ColumnNotFoundError, InputError, SchemaMismatchError
from .io import _assign, _expand
from .typing import Aggregation, JoinHow, Keys, NullPlacement, SortKey

#: rows per slice the input is cut into before it is shared out (a chunk is one or more slices)
SLICE_ROWS = 1 << 16


@dataclass(frozen=True)
class Slice:
    """Rows ``offset:offset+length`` of record batch ``batch`` of the IPC file ``path``."""

    path: str
    batch: int
    offset: int
    length: int


def _files(paths: Any) -> list[str]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        d = Path(item)
        if d.is_dir() and (d / ds.MANIFEST).exists():
            out += [str(d / p.file) for p in ds.read_manifest(d).partitions]
        else:
            out += _expand([item], "ipc")
    return out


def slices_of(path: str, lengths: Sequence[int], rows: int = SLICE_ROWS) -> list[Slice]:
    """The record batches of ``path`` (their row counts ``lengths``) cut into slices of at most ``rows``."""
    return [Slice(path, b, o, min(rows, n - o)) for b, n in enumerate(lengths) for o in range(0, n, rows)]


def plan_chunks(slices: Sequence[Slice], rows: int) -> list[list[Slice]]:
    """Consecutive slices grouped into chunks of about ``rows`` rows (at least one slice each)."""
    chunks: list[list[Slice]] = []
    current: list[Slice] = []
    count = 0
    for s in slices:
        if current and count + s.length > rows:
            chunks.append(current)
            current, count = [], 0
        current.append(s)
        count += s.length
    if current:
        chunks.append(current)
    return chunks


def read_chunk(chunk: Sequence[Slice], schema: pa.Schema, columns: Sequence[str] | None = None) -> pa.Table:
    """The rows of ``chunk`` as one table (adjacent slices of one batch are read in one go)."""
    merged: list[Slice] = []
    for s in chunk:
        last = merged[-1] if merged else None
        if last is not None and (last.path, last.batch, last.offset + last.length) == (s.path, s.batch, s.offset):
            merged[-1] = Slice(s.path, s.batch, last.offset, last.length + s.length)
        else:
            merged.append(s)
    want = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    batches = [spill.read_slice(s.path, s.batch, s.offset, s.length, columns) for s in merged]
    return pa.Table.from_batches(batches, schema=want) if batches else want.empty_table()


class Scan:
    """This rank's share (``slices``) of a table stored as Arrow IPC files; collective methods."""

    def __init__(self, comm: Communicator, schema: pa.Schema, slices: list[Slice], *, row_bytes: float,
                 total_rows: int, stats: dict[str, Any] | None = None, columns: Sequence[str] | None = None) -> None:
        self.comm = comm
        self.file_schema = schema
        self.columns = None if columns is None else list(columns)
        self.schema = schema if columns is None else pa.schema([schema.field(c) for c in columns])
        self.slices = slices
        self.row_bytes = row_bytes
        self.num_rows = total_rows
        #: what the operator that wrote this table did (buckets, runs, bytes spilled), for ``explain``
        self.stats = dict(stats or {})

    @property
    def local_num_rows(self) -> int:
        """Rows in this rank's share of the files."""
        return sum(s.length for s in self.slices)

    @property
    def local_bytes(self) -> int:
        """Estimated in-memory bytes of this rank's share (file bytes per row times rows)."""
        return int(self.row_bytes * self.local_num_rows)

    def chunks(self, rows: int) -> list[list[Slice]]:
        """This rank's share cut into chunks of at most ``rows`` rows (each a list of file slices to :meth:`read`)."""
        return plan_chunks(self.slices, max(1, rows))

    def read(self, chunk: Sequence[Slice], columns: Sequence[str] | None = None) -> pa.Table:
        """The rows of ``chunk`` (of this scan's columns, or of ``columns``)."""
        return read_chunk(chunk, self.file_schema, self.columns if columns is None else columns)

    def select(self, columns: Sequence[str]) -> Scan:
        """The same rows, only ``columns`` (only those are read)."""
        for c in columns:
            if c not in self.schema.names:
                raise ColumnNotFoundError(c, self.schema.names, where="scan select")
        return Scan(self.comm, self.file_schema, self.slices, row_bytes=self.row_bytes, total_rows=self.num_rows,
                    stats=self.stats, columns=columns)

    def to_dtable(self) -> DTable:
        """This rank's share read into memory, as an in-memory distributed table."""
        return DTable(self.comm, self.read(self.slices), _checked=True)

    def __repr__(self) -> str:
        return (f"Scan(rank={self.comm.Get_rank()}/{self.comm.Get_size()}, local_rows={self.local_num_rows}, "
                f"schema={self.schema.names})")

    # the out-of-core operators (``outofcore``), pyarrow/polars names as on ``DTable``
    def join(self, right: Scan, keys: Keys, *, right_keys: Keys | None = None, how: JoinHow = "inner",
             suffix: str = "_right", output: str | os.PathLike[str], memory_budget: int,
             spill_dir: str | os.PathLike[str] | None = None) -> Scan:
        """Join with ``right`` out of core (grace hash buckets spilled under ``spill_dir``) into the dataset ``output``.

        ``how`` and ``suffix`` as :meth:`DTable.join`; ``memory_budget`` bounds each rank's working memory
        (bytes above the process's baseline).  Returns a :class:`Scan` of the written dataset.
        """
        stats = outofcore.join(self, right, keys, right_keys=right_keys, how=how, suffix=suffix, output=output,
                               memory_budget=memory_budget, spill_dir=spill_dir)
        return _written(self.comm, output, stats)

    def sort_by(self, sorting: SortKey | Sequence[SortKey], *, nulls: NullPlacement = "at_end",
                output: str | os.PathLike[str], memory_budget: int,
                spill_dir: str | os.PathLike[str] | None = None) -> Scan:
        """Sort out of core (sorted runs spilled under ``spill_dir``, then a k-way merge) into the dataset ``output``.

        Its partitions in rank order are the sorted table.  Returns a :class:`Scan` of it.
        """
        stats = outofcore.sort_by(self, sorting, nulls=nulls, output=output, memory_budget=memory_budget,
                                  spill_dir=spill_dir)
        return _written(self.comm, output, stats)

    def group_by(self, keys: Keys) -> ScanGroupBy:
        """Group by ``keys``; ``.aggregate([(column, agg), ...], output=..., memory_budget=...)`` runs it out of core.

        Output columns are named ``<column>_<agg>`` as for :meth:`DTable.group_by`.
        """
        return ScanGroupBy(self, [keys] if isinstance(keys, str) else list(keys))


class ScanGroupBy:
    """``Scan.group_by(keys)``; call :meth:`aggregate` on it."""

    def __init__(self, scan: Scan, keys: list[str]) -> None:
        for k in keys:
            if k not in scan.schema.names:
                raise ColumnNotFoundError(k, scan.schema.names, where="group_by")
        self._scan = scan
        self._keys = keys

    def aggregate(self, aggs: Sequence[Aggregation], *, output: str | os.PathLike[str], memory_budget: int,
                  spill_dir: str | os.PathLike[str] | None = None) -> Scan:
        """Grouped aggregates out of core (grace hash buckets spilled under ``spill_dir``) into the dataset
        ``output``; columns as :meth:`DTable.group_by`.  Returns a :class:`Scan` of it."""
        stats = outofcore.group_aggregate(self._scan, self._keys, list(aggs), output=output,
                                          memory_budget=memory_budget, spill_dir=spill_dir)
        return _written(self._scan.comm, output, stats)


def _written(comm: Communicator, output: str | os.PathLike[str], stats: dict[str, Any]) -> Scan:
    """A ``Scan`` of the dataset an out-of-core operator wrote, with what it did."""
    out = scan_ipc(comm, output)
    out.stats.update(stats)
    return out


#: record batches whose row counts are read through one memory map (each read maps the pages around the
#: batch's header, and they stay mapped until the map is closed)
_COUNT_GROUP = 32


def batch_lengths(path: str) -> tuple[pa.Schema, list[int]]:
    """The schema and the row count of every record batch of the IPC file ``path`` (headers only)."""
    lengths: list[int] = []
    with pa.memory_map(path, "r") as source:
        reader = pa.ipc.open_file(source)
        schema, count = reader.schema, reader.num_record_batches
    for start in range(0, count, _COUNT_GROUP):
        with pa.memory_map(path, "r") as source:
            reader = pa.ipc.open_file(source)
            lengths += [reader.get_batch(b).num_rows for b in range(start, min(count, start + _COUNT_GROUP))]
    return schema, lengths


def scan_ipc(comm: Communicator, paths: Any, *, columns: Sequence[str] | None = None) -> Scan:
    """Arrow IPC files (a path, directory, glob, list, or a hetflow dataset directory) as a ``Scan``:
    footers are read, rows are not (collective: every rank lists the same files)."""
    files = _files(paths)
    schema: pa.Schema | None = None
    slices: list[Slice] = []
    total_bytes = 0
    for f in files:
        try:
            file_schema, lengths = batch_lengths(f)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"scan_ipc: {f!r} is not a readable Arrow IPC file: {exc}") from exc
        if schema is None:
            schema = file_schema
        elif not file_schema.remove_metadata().equals(schema.remove_metadata()):
            raise SchemaMismatchError(f"scan_ipc: {f!r} has schema {file_schema}, the first file has {schema}")
        total_bytes += os.path.getsize(f)
        slices += slices_of(f, lengths)
    assert schema is not None
    total_rows = sum(s.length for s in slices)
    mine = _assign([s.length for s in slices], comm.Get_rank(), comm.Get_size())
    row_bytes = total_bytes / total_rows if total_rows else 1.0
    scan = Scan(comm, schema, [slices[i] for i in mine], row_bytes=max(1.0, row_bytes), total_rows=total_rows)
    return scan if columns is None else scan.select(list(columns))
