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
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import pyarrow as pa

from .communicator import Communicator
from .errors import InputError, InvalidOptionError, SchemaMismatchError
from .typing import WriteFormat

Paths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_EXT = {"parquet": "parquet", "ipc": "arrow"}


def _expand(paths: Paths, fmt: str) -> list[str]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        s = os.fspath(item)
        if os.path.isdir(s):
            exts = (".parquet", ".pq") if fmt == "parquet" else (".arrow", ".ipc", ".feather") if fmt == "ipc" else (".csv", ".csv.gz")
            out += sorted(str(p) for p in Path(s).iterdir() if p.name.endswith(exts))
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


def parquet_partition(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None) -> pa.Table:
    """This rank's row groups of the Parquet files ``paths`` (footers first), in the schema every rank
    agrees on (collective).  Arguments and errors as :func:`hetflow.operators.read_parquet`."""
    import pyarrow.parquet as pq

    files = _expand(paths, "parquet")
    units: list[tuple[int, int, int]] = []
    schema = None
    for i, f in enumerate(files):  # footers only
        md = pq.ParquetFile(f).metadata
        if schema is None:
            schema = pq.read_schema(f)
        for g in range(md.num_row_groups):
            units.append((i, g, md.row_group(g).num_rows))
    mine = _assign([u[2] for u in units], comm.Get_rank(), comm.Get_size())
    parts = []
    for j in mine:
        fi, g, _ = units[j]
        parts.append(pq.ParquetFile(files[fi]).read_row_group(g, columns=list(columns) if columns else None))
    if schema is not None and columns:
        schema = pa.schema([schema.field(c) for c in columns])
    table = pa.concat_tables(parts, promote_options="permissive") if parts else None
    return _finish(comm, table, None, "read_parquet", fallback=schema)


def ipc_partition(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None) -> pa.Table:
    """This rank's record batches of the Arrow IPC files ``paths``, memory-mapped (zero-copy), in the
    schema every rank agrees on (collective).  Arguments and errors as :func:`hetflow.operators.read_ipc`."""
    files = _expand(paths, "ipc")
    readers = [pa.ipc.open_file(pa.memory_map(f, "r")) for f in files]
    units = [(i, b, r.get_batch(b).num_rows) for i, r in enumerate(readers) for b in range(r.num_record_batches)]
    mine = _assign([u[2] for u in units], comm.Get_rank(), comm.Get_size())
    batches = [readers[i].get_batch(b) for i, b, _ in (units[j] for j in mine)]
    schema = readers[0].schema
    table = pa.Table.from_batches(batches, schema=schema) if batches else None
    if columns:
        table = table.select(list(columns)) if table is not None else None
        schema = pa.schema([schema.field(c) for c in columns])
    return _finish(comm, table, None, "read_ipc", fallback=schema)


def csv_partition(comm: Communicator, paths: Paths, *, schema: pa.Schema | None = None,
                  **read_options: Any) -> pa.Table:
    """This rank's whole CSV files of ``paths`` (split over the ranks by size), in the schema every rank
    agrees on (collective).  Arguments and errors as :func:`hetflow.operators.read_csv`."""
    import pyarrow.csv as pcsv

    files = _expand(paths, "csv")
    mine = _assign([os.path.getsize(f) for f in files], comm.Get_rank(), comm.Get_size())
    # an empty field is NULL (what write_csv produces for a null string)
    convert = pcsv.ConvertOptions(column_types=schema, strings_can_be_null=True)
    parts = [pcsv.read_csv(files[i], convert_options=convert, **read_options) for i in mine]
    table = None
    if parts:
        try:
            table = pa.concat_tables(parts, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SchemaMismatchError(f"read_csv: files {[files[i] for i in mine]} disagree on the schema: {exc}") from exc
    return _finish(comm, table, schema, "read_csv")


def write_partitions(comm: Communicator, table: pa.Table, directory: str | os.PathLike[str],
                     fmt: WriteFormat) -> list[str]:
    """Write this rank's partition as ``part-<rank>.<ext>``; returns every rank's file (rank order)."""
    if fmt not in _EXT:
        raise InvalidOptionError("format", fmt, list(_EXT))
    d = Path(directory)
    if comm.Get_rank() == 0:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    comm.Barrier()
    path = d / f"part-{comm.Get_rank():05d}.{_EXT[fmt]}"
    tmp = d / f".{path.name}.tmp{os.getpid()}"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    else:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    os.chmod(tmp, 0o600)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    comm.Barrier()
    return [str(p) for p in comm.allgather(str(path))]
