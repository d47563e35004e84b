"""Seeded random tables for the operator tests, and result comparison.

Every table is generated per rank from ``(seed, rank)`` so a failure names a
seed that reproduces it.  Layouts put the rows on the ranks in different ways:
balanced, everything on rank 0 (skew), the last rank empty, no rows at all.
The reference is DuckDB (or pyarrow) on the gathered input.
"""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

KEY_TYPES: dict[str, pa.DataType] = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float32": pa.float32(), "float64": pa.float64(),
    "string": pa.string(), "large_string": pa.large_string(), "binary": pa.binary(), "bool": pa.bool_(),
    "date32": pa.date32(), "timestamp_us": pa.timestamp("us"), "timestamp_ns_utc": pa.timestamp("ns", tz="UTC"),
    "decimal": pa.decimal128(12, 2),
}
LAYOUTS = ("balanced", "skew", "empty_rank", "zero_rows")


def values(kind: pa.DataType, ints: np.ndarray) -> list[Any]:
    """Python values of type ``kind`` that are equal exactly when the ints are equal."""
    i = [int(x) for x in ints]
    t = kind
    if pa.types.is_boolean(t):
        return [x % 2 == 1 for x in i]
    if pa.types.is_unsigned_integer(t):
        return [x + (2**63 if t == pa.uint64() and x % 3 == 0 else 0) for x in i]
    if pa.types.is_integer(t):
        return [x - 50 if t.bit_width > 8 else x - 20 for x in i]
    if pa.types.is_floating(t):
        return [x * 0.5 - 3 for x in i]
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return [("ü" if x % 5 == 0 else "k") + str(x) for x in i]
    if pa.types.is_binary(t):
        return [b"\x00b" + str(x).encode() for x in i]
    if pa.types.is_date(t):
        return [dt.date(2020, 1, 1) + dt.timedelta(days=x) for x in i]
    if pa.types.is_timestamp(t):
        base = dt.datetime(2021, 3, 4, tzinfo=dt.timezone.utc if t.tz else None)
        return [base + dt.timedelta(seconds=x, microseconds=x) for x in i]
    if pa.types.is_decimal(t):
        return [Decimal(x) / 4 for x in i]
    if pa.types.is_duration(t):
        return [dt.timedelta(seconds=x, microseconds=x) for x in i]
    raise AssertionError(f"no generator for {t}")


def rows_on_rank(layout: str, rank: int, size: int, n: int) -> int:
    if layout == "balanced":
        return n
    if layout == "skew":
        return n * size if rank == 0 else 0
    if layout == "empty_rank":
        return 0 if rank == size - 1 else n
    if layout == "zero_rows":
        return 0
    raise AssertionError(layout)


def column(rng: np.random.Generator, kind: pa.DataType, n: int, domain: int, null_frac: float) -> pa.Array:
    if pa.types.is_boolean(kind):
        domain = 2
    elif pa.types.is_integer(kind) and kind.bit_width == 8:
        domain = min(domain, 100)
    ints = rng.integers(0, max(domain, 1), n)
    vals: list[Any] = values(kind, ints)
    mask = rng.random(n) < null_frac
    return pa.array([None if m else v for v, m in zip(vals, mask)], type=kind)


def table(seed: int, rank: int, size: int, *, layout: str = "balanced", n: int = 40,
          keys: dict[str, pa.DataType] | None = None, domain: int | None = None,
          null_frac: float = 0.15, payload: bool = True, stream: int = 0) -> pa.Table:
    """This rank's partition: key columns, plus ``v`` int64, ``f`` float64, ``s`` string payloads."""
    rng = np.random.default_rng([seed, stream, rank, size])
    rows = rows_on_rank(layout, rank, size, n)
    keys = keys if keys is not None else {"k": pa.int64()}
    dom = domain if domain is not None else max(4, n // 2)
    cols = {name: column(rng, kind, rows, dom, null_frac) for name, kind in keys.items()}
    if payload:
        cols["v"] = column(rng, pa.int64(), rows, 1000, null_frac)
        cols["f"] = pa.array(np.round(rng.normal(size=rows), 3)).cast(pa.float64())
        cols["s"] = column(rng, pa.string(), rows, 30, null_frac)
    return pa.table(cols)


# --------------------------------------------------------------------------- comparison


def _normalise(t: pa.Table) -> pa.Table:
    cols = []
    for c in t.columns:
        ty = c.type
        if pa.types.is_timestamp(ty):
            c = c.cast(pa.timestamp("ns", tz=ty.tz)).cast(pa.int64())
        elif pa.types.is_large_string(ty) or pa.types.is_string_view(ty):
            c = c.cast(pa.string())
        cols.append(c)
    return pa.table(cols, names=[f"c{i}" for i in range(t.num_columns)])


def rows(t: pa.Table) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in _normalise(t).to_pylist()]


def _sort_key(row: tuple[Any, ...]) -> tuple[Any, ...]:
    # -0.0 formats as "-0", so it would sort apart from 0.0; add 0.0 to make them one value
    return tuple((v is None, type(v).__name__, repr(v) if not isinstance(v, float) else f"{v + 0.0:.6g}") for v in row)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (float, Decimal)) or isinstance(b, (float, Decimal)):
        if math.isnan(float(a)) or math.isnan(float(b)):  # SQL: NaN equals NaN
            return math.isnan(float(a)) and math.isnan(float(b))
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_same_rows(got: pa.Table, want: pa.Table, context: str, *, ordered: bool = False,
                     key: Callable[[tuple[Any, ...]], Any] | None = None) -> None:
    """Same multiset (or sequence) of rows; floats compared with a relative tolerance."""
    assert got.num_columns == want.num_columns, f"{context}: columns {got.schema.names} vs {want.schema.names}"
    g, w = rows(got), rows(want)
    assert len(g) == len(w), f"{context}: {len(g)} rows, reference has {len(w)}"
    if not ordered:
        g, w = sorted(g, key=key or _sort_key), sorted(w, key=key or _sort_key)
    for i, (x, y) in enumerate(zip(g, w)):
        assert len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y)), f"{context}: row {i}: got {x}, reference {y}"


def duck(sql: str, **tables: pa.Table) -> pa.Table:
    """The reference engine: a fresh DuckDB connection over the gathered tables."""
    import duckdb

    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con.sql(sql).to_arrow_table()


def with_index(t: pa.Table) -> pa.Table:
    return t.append_column("__idx", pa.array(np.arange(t.num_rows, dtype=np.int64)))


def q(name: str) -> str:
    return '"' + name + '"'


def cols(names: Sequence[str], prefix: str = "") -> str:
    return ", ".join(prefix + q(n) for n in names)
