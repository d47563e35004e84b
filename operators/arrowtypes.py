"""Arrow types at the kernel boundary (layer 1): what the kernels cannot take is cast on the way in
and cast back on the way out, so an operator's output types follow its input.

* **View layouts** (``string_view``, ``binary_view``, ``list_view``, ``large_list_view``, at any
  nesting depth) have no take/filter/hash kernels in pyarrow; they become ``large_string``,
  ``large_binary`` and ``large_list`` (``plain_type``) and are cast back by ``restore``.
* **Dictionary** columns are decoded to their values, so that every rank hashes, groups and sorts
  by the value and not by an index into its own dictionary; ``restore`` encodes them again.
* **Key encodings** (``key_encode``) give the engines an equality-preserving (and, where the
  engine sorts, order-preserving) type they accept: ``halffloat`` as ``float``, ``decimal256``
  that fits 38 digits as ``decimal128`` (else its exact text: equality only), ``duration`` as its
  ``int64`` count, ``month_day_nano_interval`` as its 16 bytes (equality only).

Operators call ``to_kernel`` on their inputs and ``restore`` on their results; ``take`` and
``filter`` are the view-aware row selections for the layers below (shuffle, partition).
"""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc


def _is_view(t: pa.DataType) -> bool:
    return bool(pa.types.is_string_view(t) or pa.types.is_binary_view(t) or pa.types.is_list_view(t)
                or pa.types.is_large_list_view(t))


def plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` without view layouts or dictionaries (recursively)."""
    if pa.types.is_dictionary(t):
        return plain_type(t.value_type)
    if pa.types.is_string_view(t):
        return pa.large_string()
    if pa.types.is_binary_view(t):
        return pa.large_binary()
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return pa.large_list(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(plain_type(t.key_type)), t.item_field.with_type(plain_type(t.item_type)),
                       t.keys_sorted)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(plain_type(f.type)) for f in t])
    return t


def has_view(t: pa.DataType) -> bool:
    """Whether ``t`` has a view layout somewhere inside (no take/filter kernel in pyarrow)."""
    if _is_view(t):
        return True
    if pa.types.is_dictionary(t):
        return has_view(t.value_type)
    return any(has_view(t.field(i).type) for i in range(t.num_fields))


def needs_plain(schema: pa.Schema) -> bool:
    return any(plain_type(f.type) != f.type for f in schema)


# --------------------------------------------------------------------------- arrays


def _to_plain(arr: pa.Array, target: pa.DataType) -> pa.Array:
    t = arr.type
    if t == target:
        return arr
    if pa.types.is_dictionary(t):
        return _to_plain(arr.dictionary_decode(), target)
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        values = _to_plain(arr.flatten(), target.value_type)
        sizes = pc.fill_null(pc.list_value_length(arr), 0).cast(pa.int64())
        offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(sizes)])
        return pa.LargeListArray.from_arrays(offsets, values, type=target, mask=arr.is_null() if arr.null_count else None)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        flat = arr.flatten()  # the logical values, slicing applied
        values = _to_plain(flat, target.value_type)
        if pa.types.is_fixed_size_list(t):
            return pa.FixedSizeListArray.from_arrays(values, type=target, mask=arr.is_null() if arr.null_count else None)
        sizes = pc.fill_null(pc.list_value_length(arr), 0).cast(pa.int64())
        offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(sizes)])
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        return cls.from_arrays(offsets.cast(pa.int32()) if cls is pa.ListArray else offsets, values, type=target,
                               mask=arr.is_null() if arr.null_count else None)
    if pa.types.is_struct(t):
        children = [_to_plain(arr.field(i), target.field(i).type) for i in range(t.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=arr.is_null() if arr.null_count else None)
    return arr.cast(target)


def _from_plain(arr: pa.Array, target: pa.DataType) -> pa.Array:
    t = arr.type
    if t == target:
        return arr
    if pa.types.is_dictionary(target):
        values = _from_plain(arr, target.value_type)
        enc = values.dictionary_encode()
        return pa.DictionaryArray.from_arrays(enc.indices.cast(target.index_type), enc.dictionary, ordered=target.ordered)
    if pa.types.is_list_view(target) or pa.types.is_large_list_view(target):
        sizes = pc.fill_null(pc.list_value_length(arr), 0)
        values = _from_plain(arr.flatten(), target.value_type)
        off_type = pa.int32() if pa.types.is_list_view(target) else pa.int64()
        offsets = pc.subtract(pc.cumulative_sum(sizes), sizes)
        cls = pa.ListViewArray if pa.types.is_list_view(target) else pa.LargeListViewArray
        return cls.from_arrays(offsets.cast(off_type), sizes.cast(off_type), values, type=target,
                               mask=arr.is_null() if arr.null_count else None)
    if pa.types.is_list(target) or pa.types.is_large_list(target) or pa.types.is_fixed_size_list(target):
        values = _from_plain(arr.flatten(), target.value_type)
        mask = arr.is_null() if arr.null_count else None
        if pa.types.is_fixed_size_list(target):
            return pa.FixedSizeListArray.from_arrays(values, type=target, mask=mask)
        sizes = pc.fill_null(pc.list_value_length(arr), 0).cast(pa.int64())
        offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(sizes)])
        if pa.types.is_list(target):
            return pa.ListArray.from_arrays(offsets.cast(pa.int32()), values, type=target, mask=mask)
        return pa.LargeListArray.from_arrays(offsets, values, type=target, mask=mask)
    if pa.types.is_struct(target) and pa.types.is_struct(t):
        children = [_from_plain(arr.field(i), target.field(i).type) for i in range(target.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=arr.is_null() if arr.null_count else None)
    return arr.cast(target)


def _column(col: pa.ChunkedArray | pa.Array, target: pa.DataType, fn: Any) -> pa.ChunkedArray:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    return pa.chunked_array([fn(c, target) for c in chunks], target)


def plain_column(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    target = plain_type(col.type)
    return col if target == col.type else _column(col, target, _to_plain)


def restore_column(col: pa.ChunkedArray | pa.Array, target: pa.DataType) -> pa.ChunkedArray | pa.Array:
    """``col`` (a kernel's result) as ``target``, the type the user's input had."""
    return col if col.type == target else _column(col, target, _from_plain)


# --------------------------------------------------------------------------- tables


def to_kernel(table: pa.Table, names: Sequence[str] | None = None) -> pa.Table:
    """``table`` with the view and dictionary columns (of ``names``, default all) made plain."""
    if not needs_plain(table.schema):
        return table
    wanted = set(table.schema.names if names is None else names)
    for i, f in enumerate(table.schema):
        if f.name in wanted and plain_type(f.type) != f.type:
            col = plain_column(table.column(i))
            table = table.set_column(i, f.with_type(col.type), col)
    return table


def restore(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` (a kernel's result with ``schema``'s column names, in order) cast to ``schema``."""
    if table.schema.equals(schema):
        return table
    cols = [restore_column(c, f.type) for c, f in zip(table.columns, schema)]
    return pa.Table.from_arrays(cols, schema=schema)


def plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_type(plain_type(f.type)) for f in schema])


def take(table: pa.Table, indices: Any) -> pa.Table:
    """``table.take(indices)`` for every type (view columns through their plain equivalents)."""
    if not any(has_view(f.type) for f in table.schema):
        return table.take(indices)
    views = [f.name for f in table.schema if has_view(f.type)]
    plain = to_kernel(table, views).take(indices)
    return restore(plain, table.schema)


def filter_table(table: pa.Table, mask: Any) -> pa.Table:
    """``table.filter(mask)`` (an expression or a boolean mask) for every type."""
    if not any(has_view(f.type) for f in table.schema):
        return table.filter(mask)
    views = [f.name for f in table.schema if has_view(f.type)]
    return restore(to_kernel(table, views).filter(mask), table.schema)


# --------------------------------------------------------------------------- key encodings


def key_encoding(t: pa.DataType) -> pa.DataType | None:
    """The type a key column of (plain) type ``t`` is encoded as for the engines, ``None`` if it needs none."""
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_decimal256(t):
        return pa.decimal128(t.precision, t.scale) if t.precision <= 38 else pa.string()
    if pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_interval(t):
        return pa.binary(16)
    if pa.types.is_null(t):
        return pa.int8()
    return None


def key_encode(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    target = key_encoding(col.type)
    if target is None:
        return col
    if pa.types.is_interval(col.type):
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        return pa.chunked_array([c.view(target) for c in chunks], target)
    return col.cast(target)


def encode_keys(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``table`` with its ``keys`` columns (plain already) in their key encodings."""
    for name in keys:
        i = table.schema.get_field_index(name)
        col = table.column(i)
        if key_encoding(col.type) is not None:
            enc = key_encode(col)
            table = table.set_column(i, pa.field(name, enc.type), enc)
    return table
