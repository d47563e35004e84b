"""Reading files into a ``DTable`` (layer 3, the facade over ``io``): each rank reads its share of
the files (``io.*_partition``), then the rows are rebalanced so every rank holds an equal,
order-preserving share (file order, then row order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from . import io
from .communicator import Communicator
from .dtable import DTable
from .io import Paths


def read_parquet(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None) -> DTable:
    """Parquet files as one distributed table, balanced over the ranks of ``comm`` (collective).

    Each rank reads only the row groups of its share (footers first), then rows are rebalanced
    so every rank holds an equal, order-preserving share (file order, then row order).

    :param comm: the communicator (in a stage: ``ctx.comm``).
    :param paths: a file, a directory (its ``*.parquet``/``*.pq`` files, sorted), a glob, or a list of them.
    :param columns: read only these columns.
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    :raises SchemaMismatchError: the files' schemas cannot be unified.
    """
    return DTable(comm, io.parquet_partition(comm, paths, columns=columns), _checked=True).rebalance()


def read_ipc(comm: Communicator, paths: Paths, *, columns: Sequence[str] | None = None) -> DTable:
    """Arrow IPC files (memory-mapped, zero-copy) as one distributed table balanced over the ranks.

    :param paths: a file, a directory (its ``*.arrow``/``*.ipc``/``*.feather`` files), a glob, or a list.
    :param columns: keep only these columns.
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    """
    return DTable(comm, io.ipc_partition(comm, paths, columns=columns), _checked=True).rebalance()


def read_csv(comm: Communicator, paths: Paths, *, schema: pa.Schema | None = None, **read_options: Any) -> DTable:
    """CSV files as one distributed table: whole files split over the ranks by size, then rebalanced by rows.

    With ``schema`` every file is read with those column types; otherwise the
    inferred types of all files are unified (int + double -> double).  An empty
    field is null.

    :param paths: a file, a directory (its ``*.csv``/``*.csv.gz`` files), a glob, or a list.
    :param schema: the column types to read with (``pyarrow.csv.ConvertOptions(column_types=...)``).
    :param read_options: passed to ``pyarrow.csv.read_csv`` (``read_options=``, ``parse_options=``).
    :returns: a :class:`~hetflow.operators.DTable`.
    :raises InputError: no file matches, or a listed file does not exist.
    :raises SchemaMismatchError: the files' inferred types cannot be unified.
    """
    return DTable(comm, io.csv_partition(comm, paths, schema=schema, **read_options), _checked=True).rebalance()
