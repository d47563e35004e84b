"""A lazily read distributed table: Arrow IPC files on disk, read a slice at a time (the facade
over ``shares`` and ``outofcore``).

``scan_ipc(comm, paths)`` lists the files (or a hetflow dataset's partitions,
from its manifest) and gives every rank a contiguous share of the rows, as
slices of the files' record batches (a ``shares.Share``); nothing is read yet.  The out-of-core
operators (``join``, ``sort_by``, ``group_by(...).aggregate``, see
``outofcore``) read the share a chunk at a time, and write their result as a
hetflow dataset that they return as a ``Scan`` again, so a chain of them never
holds more than its memory budget.  ``to_dtable()`` reads the share into memory
(an in-memory ``DTable``), for results that fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import dataset as ds
from . import outofcore
from .communicator import Communicator
from .dtable import DTable
from .errors import ColumnNotFoundError, InputError, SchemaMismatchError
from .io import _assign, _expand, _File, _locate, ipc_layout
from .location import is_uri, resolve
from .shares import Share, Slice, slices_of
from .typing import Aggregation, JoinHow, Keys, NullPlacement, SortKey


def _files(paths: Any) -> list[_File]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[_File] = []
    for item in items:
        if is_uri(os.fspath(item)):
            out += _locate([item], "ipc")
            continue
        d = Path(item)
        if d.is_dir() and (d / ds.MANIFEST).exists():
            names = [str(d / p.file) for p in ds.read_manifest(d).partitions]
        else:
            names = _expand([item], "ipc")
        out += [_File(resolve(f), os.path.getsize(f)) for f in names]
    return out


class Scan(Share):
    """This rank's share of a table stored as Arrow IPC files, with the out-of-core operators as
    methods (collective) and :meth:`to_dtable` to read it into memory."""

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


def scan_ipc(comm: Communicator, paths: Any, *, columns: Sequence[str] | None = None) -> Scan:
    """Arrow IPC files (a path, directory, glob, list, or a hetflow dataset directory; or object-store
    URIs, ``s3://bucket/prefix/``) as a ``Scan``: footers and batch headers are read, rows are not
    (collective: every rank lists the same files).  On an object store each chunk is read as the byte
    ranges of its record batches."""
    files = _files(paths)
    layout = ipc_layout(comm, files)
    schema = layout[0][0] if layout else None
    slices: list[Slice] = []
    for f, (file_schema, lengths) in zip(files, layout):
        assert schema is not None
        if not file_schema.remove_metadata().equals(schema.remove_metadata()):
            raise SchemaMismatchError(f"scan_ipc: {f.where.uri!r} has schema {file_schema}, the first file has {schema}")
        slices += slices_of(f.where.uri, lengths)
    total_bytes = sum(f.size for f in files)
    if schema is None:
        raise InputError(f"scan_ipc: no Arrow IPC files in {paths!r}")
    total_rows = sum(s.length for s in slices)
    mine = _assign([s.length for s in slices], comm.Get_rank(), comm.Get_size())
    row_bytes = total_bytes / total_rows if total_rows else 1.0
    scan = Scan(comm, schema, [slices[i] for i in mine], row_bytes=max(1.0, row_bytes), total_rows=total_rows)
    return scan if columns is None else scan.select(list(columns))
