"""This rank's share of a table stored as Arrow IPC files, read a slice at a time (layer 0: files only).

A ``Share`` lists this rank's rows as slices of the files' record batches and
reads them a chunk at a time through a memory map that is closed after each
read (``spilldir.read_slice``), so a file larger than memory is never resident.
The out-of-core operators (``outofcore``) take shares; ``Scan`` (``scan``) is
the user-facing one with the operators as methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from . import spilldir
from .communicator import Communicator
from .errors import ColumnNotFoundError

_S = TypeVar("_S", bound="Share")

#: rows per slice the input is cut into before it is shared out (a chunk is one or more slices)
SLICE_ROWS = 1 << 16


@dataclass(frozen=True)
class Slice:
    """Rows ``offset:offset+length`` of record batch ``batch`` of the IPC file ``path``."""

    path: str
    batch: int
    offset: int
    length: int


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
    batches = [spilldir.read_slice(s.path, s.batch, s.offset, s.length, columns) for s in merged]
    return pa.Table.from_batches(batches, schema=want) if batches else want.empty_table()


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


class Share:
    """This rank's share (``slices``) of a table stored as Arrow IPC files, read a chunk at a time."""

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

    def select(self: _S, columns: Sequence[str]) -> _S:  # noqa: PYI019 - typing.Self needs Python 3.11
        """The same rows, only ``columns`` (only those are read)."""
        for c in columns:
            if c not in self.schema.names:
                raise ColumnNotFoundError(c, self.schema.names, where="scan select")
        return type(self)(self.comm, self.file_schema, self.slices, row_bytes=self.row_bytes, total_rows=self.num_rows,
                    stats=self.stats, columns=columns)
