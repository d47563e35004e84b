"""Reading files into a ``DTable`` (layer 3, the facade over ``io``): each rank reads its share of
the files (``io.*_partition``), then the rows are rebalanced so every rank holds an equal,
order-preserving share (file order, then row order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from . import io
from .communicator import Communicator
from .dtable import DTable
from .io import Paths


def read_parquet(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None,
                 filesystem: pafs.FileSystem | None = None) -> DTable:
    """Parquet files as one distributed table, balanced over the ranks of ``comm`` (collective).

    Each footer is read by one rank and shared; each rank then reads only the byte ranges of its
    row groups, and rows are rebalanced so every rank holds an equal, order-preserving share (file
    order, then row order).

    :param comm: the communicator (in a stage: ``ctx.comm``).
    :param paths: a file, a directory (its ``*.parquet``/``*.pq`` files, sorted), a glob, or a list of
        them; local paths or object-store URIs (``s3://bucket/prefix/``, ``s3://bucket/p/*.parquet``),
        reached through :mod:`hetflow.operators.location` (the AWS environment).
    :param columns: read only these columns.
    :param filesystem: a ``pyarrow.fs.FileSystem`` that ``paths`` are on (as in ``pyarrow.parquet``).
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    :raises StorageError: the object store refused or could not be reached (names bucket, key, cause).
    :raises SchemaMismatchError: the files' schemas cannot be unified.
    """
    return DTable(comm, io.parquet_partition(comm, paths, columns=columns, filesystem=filesystem),
                  _checked=True).rebalance()


def read_ipc(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None,
             filesystem: pafs.FileSystem | None = None) -> DTable:
    """Arrow IPC files as one distributed table balanced over the ranks: local files memory-mapped
    (zero-copy); on an object store each rank reads only its record batches' byte ranges.

    :param paths: a file, a directory (its ``*.arrow``/``*.ipc``/``*.feather`` files), a glob, or a
        list; local paths or object-store URIs as for :func:`read_parquet`.
    :param columns: keep only these columns.
    :param filesystem: a ``pyarrow.fs.FileSystem`` that ``paths`` are on.
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    :raises StorageError: the object store refused or could not be reached (names bucket, key, cause).
    """
    return DTable(comm, io.ipc_partition(comm, paths, columns=columns, filesystem=filesystem),
                  _checked=True).rebalance()


def read_csv(comm: Communicator, paths: Paths, *, schema: pa.Schema | None = None,
             filesystem: pafs.FileSystem | None = None, **read_options: Any) -> DTable:
    """CSV files as one distributed table: whole files split over the ranks by size, then rebalanced by rows.

    With ``schema`` every file is read with those column types; otherwise the
    inferred types of all files are unified (int + double -> double).  An empty
    field is null.

    :param paths: a file, a directory (its ``*.csv``/``*.csv.gz`` files), a glob, or a list; local
        paths or object-store URIs as for :func:`read_parquet`.
    :param schema: the column types to read with (``pyarrow.csv.ConvertOptions(column_types=...)``).
    :param filesystem: a ``pyarrow.fs.FileSystem`` that ``paths`` are on.
    :param read_options: passed to ``pyarrow.csv.read_csv`` (``read_options=``, ``parse_options=``).
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    :raises StorageError: the object store refused or could not be reached (names bucket, key, cause).
    :raises SchemaMismatchError: the files' inferred types cannot be unified.
    """
    return DTable(comm, io.csv_partition(comm, paths, schema=schema, filesystem=filesystem, **read_options),
                  _checked=True).rebalance()
