"""Comparing a distributed SQL result with DuckDB's on the gathered input (the SQL tests' reference)."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import pyarrow as pa


def _close(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(x, Decimal) and isinstance(y, Decimal):
        return x == y
    return x == y and type(x) is type(y)


def assert_same(got: pa.Table, want: pa.Table, *, ordered: bool, ctx: str) -> None:
    """Same column types as DuckDB's and the same rows (in order when ``ordered``); decimals, integers
    and strings exactly, floats to a relative 1e-9 (sums in another order round differently)."""
    assert got.num_columns == want.num_columns, f"{ctx}: columns {got.column_names}, DuckDB {want.column_names}"
    for g, w in zip(got.schema, want.schema):
        gt = pa.string() if pa.types.is_string_view(g.type) or pa.types.is_large_string(g.type) else g.type
        wt = pa.string() if pa.types.is_string_view(w.type) or pa.types.is_large_string(w.type) else w.type
        assert gt == wt, f"{ctx}: column {g.name} is {g.type}, DuckDB says {w.type}"
    gr = [tuple(r.values()) for r in got.to_pylist()]
    wr = [tuple(r.values()) for r in want.to_pylist()]
    assert len(gr) == len(wr), f"{ctx}: {len(gr)} rows, DuckDB {len(wr)}"
    if not ordered:
        key = lambda r: tuple((v is None, repr(v)) for v in r)
        gr, wr = sorted(gr, key=key), sorted(wr, key=key)
    for i, (a, b) in enumerate(zip(gr, wr)):
        assert len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b)), f"{ctx}: row {i} is {a}, DuckDB {b}"


def duckdb_answer(query: str, **tables: pa.Table) -> pa.Table:
    import duckdb

    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    try:
        return con.sql(query).to_arrow_table()
    finally:
        con.close()
