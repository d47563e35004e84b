"""Arrow columns to torch tensors, without copying where the types allow.

A fixed-width column (integers, floats, or a fixed-size list of them) with no
nulls in one contiguous chunk becomes a numpy view of the Arrow data buffer
and then a tensor over that same memory (``torch.from_numpy``).  Everything
else needs a copy — several chunks, nulls to fill, bit-packed booleans, a
dtype cast — and :class:`ConvertedColumn` says which copy was made and why,
so a user can see when a pipeline pays for one.  Strings and other
variable-width types are rejected.

Tensors that share Arrow memory are read-only in spirit: Arrow buffers are
immutable and may be memory-mapped from a dataset file.  Never modify them in
place; the loader only ever gathers batches out of them.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Union

import numpy as np
import pyarrow as pa

from hetflow.ml.errors import ColumnTypeError, CopyRequiredError, NullValuesError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: a fill policy: one value for every column, or a value per column name
Fill = Union[float, int, Mapping[str, Union[float, int]], None]

# numpy dtypes torch.from_numpy cannot take, and the wider type a cast goes to
_WIDEN = {np.dtype("uint16"): np.dtype("int32"), np.dtype("uint32"): np.dtype("int64"),
          np.dtype("uint64"): np.dtype("int64")}
_ALLOWED = "integer, floating point, boolean, or fixed_size_list of those"


@dataclass(frozen=True)
class ConvertedColumn:
    """One column as a tensor, and whether that cost a copy."""

    name: str
    tensor: "torch.Tensor"
    copied: bool
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.copied != (self.reason is not None):
            raise ValueError(f"copied={self.copied} needs a reason exactly when a copy was made")


def _fill_for(name: str, fill: Fill) -> float | int | None:
    if fill is None or isinstance(fill, (int, float)):
        return fill
    return fill.get(name)


def _value_type(arr: pa.Array) -> pa.DataType:
    return arr.type.value_type if pa.types.is_fixed_size_list(arr.type) else arr.type


def _check_type(name: str, typ: pa.DataType) -> None:
    inner = typ.value_type if pa.types.is_fixed_size_list(typ) else typ
    if not (pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_boolean(inner)):
        raise ColumnTypeError(f"column {name!r} has Arrow type {typ}, which cannot become a tensor "
                              f"(allowed: {_ALLOWED})")


def to_tensor(column: pa.Array | pa.ChunkedArray, *, name: str = "column", fill: Fill = None,
              dtype: "torch.dtype | None" = None, allow_copy: bool = True) -> ConvertedColumn:
    """Turn one Arrow column into a tensor, sharing its memory when possible.

    ``fill`` replaces nulls (a number, or a mapping from column name to
    number); without it nulls raise :class:`NullValuesError` naming the
    column.  ``dtype`` casts (a copy when it differs).  ``allow_copy=False``
    turns every copy into :class:`CopyRequiredError`.
    """
    import torch

    reasons: list[str] = []
    _check_type(name, column.type)
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            arr = column.chunk(0)
        else:
            if column.num_chunks > 1:
                reasons.append(f"{column.num_chunks} chunks concatenated")
            arr = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], column.type)
    else:
        arr = column
    nested_nulls = pa.types.is_fixed_size_list(arr.type) and arr.values.null_count > 0
    if arr.null_count > 0 or nested_nulls:
        value = _fill_for(name, fill)
        nulls = arr.null_count if not nested_nulls else arr.null_count + arr.values.null_count
        if value is None:
            raise NullValuesError(f"column {name!r} has {nulls} null value(s) of {len(arr)}; "
                                  f"pass fill=<number> or fill={{{name!r}: <number>}} to replace them")
        if pa.types.is_fixed_size_list(arr.type):
            size = arr.type.list_size
            values = arr.values.slice(arr.offset * size, len(arr) * size).fill_null(value)
            matrix = values.to_numpy(zero_copy_only=False).reshape(len(arr), size).copy()
            matrix[np.asarray(arr.is_null())] = value
            arr = pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel()), size)
        else:
            typ = arr.type
            arr = arr.fill_null(float(value) if pa.types.is_floating(typ)
                                else bool(value) if pa.types.is_boolean(typ) else int(value))
        reasons.append(f"{nulls} null(s) filled with {value!r}")
    if pa.types.is_boolean(_value_type(arr)):
        reasons.append("boolean is bit-packed in Arrow")
    if pa.types.is_fixed_size_list(arr.type):
        size = arr.type.list_size
        values = arr.values.slice(arr.offset * size, len(arr) * size)
        flat = values.to_numpy(zero_copy_only=False)
        array = flat.reshape(len(arr), size)
    else:
        array = arr.to_numpy(zero_copy_only=False)
    if array.dtype in _WIDEN:
        reasons.append(f"{array.dtype} widened to {_WIDEN[array.dtype]} (not a torch dtype)")
        array = array.astype(_WIDEN[array.dtype])
    with warnings.catch_warnings():
        # Arrow memory is immutable, so the view is read-only; torch warns about that.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    if dtype is not None and tensor.dtype != dtype:
        reasons.append(f"cast {tensor.dtype} to {dtype}")
        tensor = tensor.to(dtype)
    reason = "; ".join(reasons) if reasons else None
    if reason is not None:
        if not allow_copy:
            raise CopyRequiredError(f"column {name!r} cannot be viewed without a copy: {reason}")
        log.info("column %r copied: %s", name, reason)
    return ConvertedColumn(name=name, tensor=tensor, copied=reason is not None, reason=reason)


def table_to_tensors(table: pa.Table, columns: list[str], *, fill: Fill = None,
                     dtype: "torch.dtype | None" = None, allow_copy: bool = True) -> list[ConvertedColumn]:
    """:func:`to_tensor` for each named column of ``table`` (missing names raise KeyError)."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise KeyError(f"column(s) {missing} not in the table (columns: {table.column_names})")
    return [to_tensor(table.column(c), name=c, fill=fill, dtype=dtype, allow_copy=allow_copy)
            for c in columns]


def arrow_data_address(column: pa.Array | pa.ChunkedArray) -> int:
    """Address of the first value of a one-chunk fixed-width column (for checking shared memory)."""
    arr: Any = column.chunk(0) if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_fixed_size_list(arr.type):
        size = arr.type.list_size
        arr = arr.values.slice(arr.offset * size)
    width = arr.type.bit_width // 8
    return int(arr.buffers()[1].address + arr.offset * width)


def row_major(columns: list[ConvertedColumn], dtype: "torch.dtype", *, threads: int = 1) -> "torch.Tensor":
    """The columns side by side as one contiguous ``(rows, width)`` tensor of ``dtype``.

    A single column that is already ``dtype`` (a ``fixed_size_list`` feature
    matrix, or one scalar column) is returned as a ``(rows, width)`` view of
    itself: it is row-major as it stands.  Otherwise the matrix is written in
    one pass, in blocks of rows small enough to stay in cache while every
    column writes its slice of them (a column at a time over the whole matrix
    would touch every cache line once per column); the blocks are spread
    over up to ``threads`` threads (the copies release the GIL).  Values are
    cast as the column-by-column gather casts them (C conversions), so a row
    equals the row that gather makes.
    """
    import torch

    if not columns:
        raise ValueError("row_major needs at least one column")
    rows = int(columns[0].tensor.shape[0])
    widths = [1 if c.tensor.dim() == 1 else int(c.tensor.shape[1]) for c in columns]
    width = sum(widths)
    if len(columns) == 1 and columns[0].tensor.dtype == dtype:
        return columns[0].tensor.reshape(rows, width)
    matrix = torch.empty((rows, width), dtype=dtype)
    itemsize = matrix.element_size()
    block = max(1, _ROW_BLOCK_BYTES // max(1, width * itemsize))
    try:  # numpy's strided assignment costs less per call than torch's on blocks this small
        dest: Any = matrix.numpy()
        sources: list[Any] = [c.tensor.numpy().reshape(rows, w) for c, w in zip(columns, widths)]
    except TypeError:  # a dtype numpy lacks (bfloat16): the same blocks through torch
        dest, sources = matrix, [c.tensor.reshape(rows, w) for c, w in zip(columns, widths)]
    offsets = np.concatenate([[0], np.cumsum(widths)]).tolist()

    def fill(start: int) -> None:
        stop = min(rows, start + block)
        for src, lo, hi in zip(sources, offsets[:-1], offsets[1:]):
            dest[start:stop, lo:hi] = src[start:stop]

    starts = range(0, rows, block)
    if threads > 1 and len(starts) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(starts)), thread_name_prefix="hetflow-layout") as pool:
            list(pool.map(fill, starts))
    else:
        for start in starts:
            fill(start)
    return matrix


_ROW_BLOCK_BYTES = 4 * 2**20
"""Bytes of the row-major matrix written per block by :func:`row_major` (a few MiB: stays in cache)."""
