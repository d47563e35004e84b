"""Checks and normal forms of operator options shared by the in-memory and out-of-core operators
(layer 0: no communicator, no table data)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pyarrow as pa

from . import arrowtypes
from .errors import InvalidOptionError, UnsupportedTypeError
from .optiontypes import SORT_ORDERS, Keys, SortKey, SortOrder


def key_list(keys: Keys) -> list[str]:
    """``"k"`` or ``["k", ...]`` as a list of names."""
    return [keys] if isinstance(keys, str) else list(keys)


def join_key_type(t: pa.DataType) -> pa.DataType:
    """The key type two join sides must agree on: views, large and dictionary-encoded layouts count as one."""
    t = arrowtypes.plain_type(t)
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    return t


def check_orderable(field: pa.Field, what: str) -> None:
    """Sort keys: scalars only (intervals have no order; lists, structs and maps are not range-partitioned)."""
    t = arrowtypes.plain_type(field.type)
    if t.num_fields or pa.types.is_interval(t):
        raise UnsupportedTypeError(f"{what}: column {field.name!r} of type {field.type} cannot be a sort key "
                                   "(numbers, strings, binaries, temporal types and decimals can)")


def sort_keys(sorting: SortKey | Sequence[SortKey]) -> list[tuple[str, SortOrder]]:
    """``"k"``, ``("k", "descending")`` or a list of them as ``[(name, order), ...]`` (at least one)."""
    items: Sequence[SortKey] = [sorting] if isinstance(sorting, (str, tuple)) else sorting
    out: list[tuple[str, SortOrder]] = []
    for item in items:
        col, order = (item, "ascending") if isinstance(item, str) else item
        if order not in SORT_ORDERS:
            raise InvalidOptionError(f"sort order of {col!r}", order, SORT_ORDERS)
        out.append((col, cast(SortOrder, order)))
    if not out:
        raise InvalidOptionError("sort keys", sorting, ["at least one column"])
    return out
