"""Partitioned input and output: Parquet, CSV and Arrow IPC (layer 2: functions of ``(comm, ...)``).

Reading: every rank lists the same sorted files, cuts them into units (Parquet
row groups, IPC record batches, whole CSV files), takes a contiguous run of
units holding about its share of the rows (bytes for CSV), reads only those,
and the ranks agree on one schema; the ``*_partition`` functions return that
partition as a ``pa.Table``.  ``DTable``'s readers (``hetflow.operators.read_parquet``
& co., in ``readers``) then rebalance it so every rank holds an equal,
order-preserving share.  Writing: each rank writes ``part-<rank>.<ext>``
atomically (temp file + rename) into a 0700 directory.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from . import ipcfile, safeio
from .communicator import Communicator
from .errors import InputError, InvalidOptionError, SchemaMismatchError
from .location import (Location, StorageError, bucket_and_key, check_bucket, glob_files, glob_start, is_uri, redact,
                       resolve, storage_error)
from .shares import batch_lengths
from .optiontypes import WriteFormat

Paths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_EXT = {"parquet": "parquet", "ipc": "arrow"}


_EXTS = {"parquet": (".parquet", ".pq"), "ipc": (".arrow", ".ipc", ".feather"), "csv": (".csv", ".csv.gz")}


def _expand(paths: Paths, fmt: str) -> list[str]:
    """The local files ``paths`` names (a file, a directory's ``fmt`` files, a glob, or a list), sorted per item."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        s = os.fspath(item)
        if os.path.isdir(s):
            out += sorted(str(p) for p in Path(s).iterdir() if p.name.endswith(_EXTS[fmt]))
        elif any(ch in s for ch in "*?["):
            out += sorted(glob.glob(s))
        else:
            out.append(s)
    if not out:
        raise InputError(f"no {fmt} files match {paths!r}")
    for f in out:
        if not os.path.isfile(f):
            raise InputError(f"{fmt} input {f!r} does not exist")
    return out


@dataclass(frozen=True)
class _File:
    """One input file: where it is, and its size in bytes."""

    where: Location
    size: int

    @property
    def path(self) -> str:
        return self.where.path

    def open(self) -> pa.NativeFile:
        """The file for random access (ranged reads on an object store), or a :class:`StorageError`."""
        try:
            return self.where.filesystem.open_input_file(self.where.path)
        except OSError as exc:
            raise storage_error(exc, self.where, "read") from exc


def _locate(paths: Paths, fmt: str, filesystem: pafs.FileSystem | None = None) -> list[_File]:
    """The files ``paths`` names, local or on an object store (``s3://bucket/prefix/``, a glob under it,
    a list), or paths on ``filesystem`` when one is given.

    :raises InputError: nothing matches, or a named file does not exist (naming bucket and key).
    :raises StorageError: listing failed (no credentials, no bucket, access denied, endpoint down).
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if filesystem is None and not any(is_uri(os.fspath(i)) for i in items):
        return [_File(resolve(f), os.path.getsize(f)) for f in _expand(paths, fmt)]
    out: list[_File] = []
    for item in items:
        text = os.fspath(item)
        if filesystem is not None:
            where = Location(filesystem, text, text, False)
        else:
            where = resolve(text)
        out += _listed(where, fmt)
    if not out:
        raise InputError(f"no {fmt} files match {[_shown(os.fspath(i)) for i in items]!r}")
    return out


def _shown(text: str) -> str:
    return redact(text) if is_uri(text) else text


def _listed(where: Location, fmt: str) -> list[_File]:
    """The files of one item on a file system: the file, a directory's ``fmt`` files, or a glob's matches."""
    fs, path = where.filesystem, where.path
    try:
        if glob_start(path) >= 0:
            found = glob_files(where)
            if not found:
                raise InputError(f"no {fmt} files match {where.uri}{bucket_and_key(where)}")
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
                found = sorted((i for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(_EXTS[fmt])),
                               key=lambda i: i.path)
                if not found:
                    raise InputError(f"no {fmt} files in {where.uri}{bucket_and_key(where)}")
            elif info.type == pafs.FileType.File:
                found = [info]
            else:
                check_bucket(where)
                raise InputError(f"{fmt} input {where.uri}{bucket_and_key(where)} does not exist")
    except (InputError, StorageError):
        raise
    except OSError as exc:
        raise storage_error(exc, where, "list") from exc
    base_uri = where.uri[: len(where.uri) - len(where.path)] if where.uri.endswith(where.path) else ""
    return [_File(Location(fs, i.path, base_uri + i.path, where.is_local), int(i.size or 0)) for i in found]


def _assign(weights: Sequence[int], rank: int, size: int) -> list[int]:
    """Indices of a contiguous run of units whose weight midpoints fall in this rank's share."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if total == 0:
        return list(range(len(w))) if rank == 0 else []
    mid = np.cumsum(w) - w / 2
    owner = np.minimum((mid * size / total).astype(np.int64), size - 1)
    return [int(i) for i in np.flatnonzero(owner == rank)]


def _finish(comm: Communicator, table: pa.Table | None, schema: pa.Schema | None, what: str, *, fallback: pa.Schema | None = None) -> pa.Table:
    """This rank's ``table`` in the one schema the ranks agree on (given, else unified from what they read)."""
    schemas = comm.allgather(None if table is None else table.schema.remove_metadata().serialize().to_pybytes())
    known = [pa.ipc.read_schema(pa.py_buffer(s)) for s in schemas if s is not None]
    if schema is None:
        if not known:
            if fallback is None:
                raise InputError(f"{what}: no rank read any data")
            known = [fallback.remove_metadata()]
        try:
            schema = pa.unify_schemas(known, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SchemaMismatchError(f"{what}: input files disagree on the schema: {exc}") from exc
    if table is None:
        table = schema.empty_table()
    elif not table.schema.equals(schema):
        try:
            table = table.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, KeyError) as exc:
            raise SchemaMismatchError(f"{what}: partition schema {table.schema} does not match {schema}: {exc}") from exc
    return table


def _share(comm: Communicator, count: int) -> range:
    """This rank's indices of ``count`` items dealt round-robin (footers and headers: each read by one rank)."""
    return range(comm.Get_rank(), count, comm.Get_size())


def parquet_partition(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None,
                      filesystem: pafs.FileSystem | None = None) -> pa.Table:
    """This rank's row groups of the Parquet files ``paths`` (footers first), in the schema every rank
    agrees on (collective).  Arguments and errors as :func:`hetflow.operators.read_parquet`.

    Each footer is read by one rank and shared (the ranks deal the files out); then each rank opens
    only the files holding its row groups and reads those row groups' byte ranges.
    """
    import pyarrow.parquet as pq

    files = _locate(paths, "parquet", filesystem)
    footers: dict[int, Any] = {}
    for i in _share(comm, len(files)):
        with files[i].open() as source:
            try:
                footers[i] = pq.ParquetFile(source).metadata
            except pa.ArrowInvalid as exc:
                raise InputError(f"read_parquet: {files[i].where.uri} is not a readable Parquet file: {exc}") from exc
            except OSError as exc:
                raise storage_error(exc, files[i].where, "read") from exc
    metadata: dict[int, Any] = {}
    for part in comm.allgather(footers):
        metadata.update(part)
    units = [(i, g, metadata[i].row_group(g).num_rows)
             for i in range(len(files)) for g in range(metadata[i].num_row_groups)]
    mine = _assign([u[2] for u in units], comm.Get_rank(), comm.Get_size())
    groups: dict[int, list[int]] = {}
    for j in mine:
        groups.setdefault(units[j][0], []).append(units[j][1])
    parts = []
    for fi, gs in groups.items():
        with files[fi].open() as source:
            reader = pq.ParquetFile(source, metadata=metadata[fi], pre_buffer=not files[fi].where.is_local)
            parts.append(reader.read_row_groups(gs, columns=list(columns) if columns else None))
    schema = metadata[0].schema.to_arrow_schema() if files else None
    if schema is not None and columns:
        schema = pa.schema([schema.field(c) for c in columns])
    table = pa.concat_tables(parts, promote_options="permissive") if parts else None
    return _finish(comm, table, None, "read_parquet", fallback=schema)


def ipc_partition(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None,
                  filesystem: pafs.FileSystem | None = None) -> pa.Table:
    """This rank's record batches of the Arrow IPC files ``paths``, in the schema every rank agrees on
    (collective).  Local files are memory-mapped (zero-copy); on an object store each rank reads its
    batches' byte ranges, located by the files' footers (:mod:`ipcfile`).  Arguments and errors as
    :func:`hetflow.operators.read_ipc`."""
    files = _locate(paths, "ipc", filesystem)
    layout = ipc_layout(comm, files)
    units = [(i, b, n) for i, (_, rows) in enumerate(layout) for b, n in enumerate(rows)]
    mine = _assign([u[2] for u in units], comm.Get_rank(), comm.Get_size())
    wanted: dict[int, list[int]] = {}
    for j in mine:
        wanted.setdefault(units[j][0], []).append(units[j][1])
    batches = []
    for i, bs in wanted.items():
        with _ipc_source(files[i]) as source:
            reader = _open_ipc(files[i], source)
            batches += [reader.get_batch(b) for b in bs]
    schema = layout[0][0]
    table = pa.Table.from_batches(batches, schema=schema) if batches else None
    if columns:
        table = table.select(list(columns)) if table is not None else None
        schema = pa.schema([schema.field(c) for c in columns]) if schema is not None else None
    return _finish(comm, table, None, "read_ipc", fallback=schema)


def _ipc_source(file: _File) -> pa.NativeFile:
    return pa.memory_map(file.path, "r") if file.where.is_local else file.open()


def _open_ipc(file: _File, source: pa.NativeFile) -> pa.ipc.RecordBatchFileReader:
    try:
        return pa.ipc.open_file(source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"read_ipc: {file.where.uri} is not a readable Arrow IPC file: {exc}") from exc


def ipc_layout(comm: Communicator, files: Sequence[_File]) -> list[tuple[pa.Schema, list[int]]]:
    """The schema and the row count of every record batch of every IPC file (collective).  Local files:
    through memory maps (:func:`shares.batch_lengths`), on every rank; on an object store: the files are dealt out, each rank reads
    its files' footers and batch headers (never a body, :mod:`ipcfile`), and the ranks share them."""
    local = all(f.where.is_local for f in files)
    mine: dict[int, tuple[pa.Schema, list[int]]] = {}
    for i in range(len(files)) if local else _share(comm, len(files)):
        f = files[i]
        try:
            if f.where.is_local:
                mine[i] = batch_lengths(f.path)
            else:
                with f.open() as source:
                    mine[i] = (pa.ipc.open_file(source).schema, ipcfile.batch_rows(source, f.size))
        except (pa.ArrowInvalid, ValueError) as exc:
            raise InputError(f"{f.where.uri} is not a readable Arrow IPC file: {exc}") from exc
        except OSError as exc:
            raise storage_error(exc, f.where, "read") from exc
    if not local:
        for part in comm.allgather(mine):
            mine.update(part)
    return [mine[i] for i in range(len(files))]


def csv_partition(comm: Communicator, paths: Paths, *, schema: pa.Schema | None = None,
                  filesystem: pafs.FileSystem | None = None, **read_options: Any) -> pa.Table:
    """This rank's whole CSV files of ``paths`` (split over the ranks by size), in the schema every rank
    agrees on (collective).  Arguments and errors as :func:`hetflow.operators.read_csv`."""
    import pyarrow.csv as pcsv

    files = _locate(paths, "csv", filesystem)
    mine = _assign([f.size for f in files], comm.Get_rank(), comm.Get_size())
    # an empty field is NULL (what write_csv produces for a null string)
    convert = pcsv.ConvertOptions(column_types=schema, strings_can_be_null=True)
    parts = []
    for i in mine:
        if files[i].where.is_local:
            parts.append(pcsv.read_csv(files[i].path, convert_options=convert, **read_options))
            continue
        try:
            with files[i].where.filesystem.open_input_stream(files[i].path) as source:
                parts.append(pcsv.read_csv(source, convert_options=convert, **read_options))
        except OSError as exc:
            raise storage_error(exc, files[i].where, "read") from exc
    table = None
    if parts:
        try:
            table = pa.concat_tables(parts, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SchemaMismatchError(f"read_csv: files {[files[i].where.uri for i in mine]} disagree on the schema: {exc}") from exc
    return _finish(comm, table, schema, "read_csv")


def write_partitions(comm: Communicator, table: pa.Table, directory: str | os.PathLike[str],
                     fmt: WriteFormat, *, filesystem: pafs.FileSystem | None = None) -> list[str]:
    """Write this rank's partition as ``part-<rank>.<ext>``; returns every rank's file (rank order).

    ``directory`` is a local path (the file is written to a temporary name, fsynced and renamed) or an
    object-store URI (the file is serialized in memory, then uploaded as one object: S3 makes an
    object visible only when its PUT or multipart upload completes, so a failed or killed writer
    leaves nothing under the final key).  With ``filesystem``, ``directory`` is a path on it, written
    the object-store way.
    """
    if fmt not in _EXT:
        raise InvalidOptionError("format", fmt, list(_EXT))
    name = f"part-{comm.Get_rank():05d}.{_EXT[fmt]}"
    if filesystem is not None:
        key = f"{os.fspath(directory).rstrip('/')}/{name}"
        _upload(Location(filesystem, key, key, False), _serialized(table, fmt))
        comm.Barrier()
        return [str(p) for p in comm.allgather(key)]
    if is_uri(os.fspath(directory)):
        where = resolve(os.fspath(directory)).join(name)
        if where.is_local:
            return write_partitions(comm, table, Path(where.path).parent, fmt)
        _upload(where, _serialized(table, fmt))
        comm.Barrier()
        return [str(u) for u in comm.allgather(where.uri)]
    d = Path(os.path.realpath(directory))   # the user's path, resolved once; below it nothing is followed
    if comm.Get_rank() == 0:
        os.close(safeio.open_dir_nofollow(d, create=True))   # 0700 when made here
    comm.Barrier()
    safeio.atomic_write(d / name, lambda sink: _write_file(table, fmt, sink))   # temp, fsync, rename: 0600
    comm.Barrier()
    return [str(p) for p in comm.allgather(str(Path(directory) / name))]


def _write_file(table: pa.Table, fmt: str, sink: Any) -> None:
    """``table`` as one Parquet or Arrow IPC file, written to ``sink`` (a file object or pyarrow stream)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, sink)
    else:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)


def _serialized(table: pa.Table, fmt: str) -> pa.Buffer:
    """``table`` as the bytes of one Parquet or Arrow IPC file."""
    sink = pa.BufferOutputStream()
    _write_file(table, fmt, sink)
    return sink.getvalue()


def _upload(where: Location, data: pa.Buffer) -> None:
    """``data`` (a whole serialized file, so nothing can fail half-way through writing the table) as
    the object ``where``."""
    try:
        with where.filesystem.open_output_stream(where.path) as out:
            out.write(data)
    except OSError as exc:
        raise storage_error(exc, where, "write") from exc
