"""The DTable gaps that writing TPC-H with the dataframe API found (issue 28), each against DuckDB at
any rank count: decimal sums usable in expressions, ``string_view`` columns in callables and
``with_columns``, ``count(*)``, ``rename``, and join keys of int32 against int64."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import _sqlcheck
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

pytestmark = pytest.mark.mpi


def _full() -> pa.Table:
    rng = np.random.default_rng(3)
    n = 90
    return pa.table({
        "k": pa.array(rng.integers(0, 6, n), pa.int32()),
        "price": pa.array([Decimal(int(c)) / 100 for c in rng.integers(1, 10**7, n)], pa.decimal128(15, 2)),
        "flag": pa.array([["A", "N", "R"][i % 3] for i in range(n)], pa.string_view()),
        "x": pa.array([None if i % 7 == 0 else float(i) for i in range(n)]),
    })


def _dt(comm: Any, table: pa.Table) -> Any:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = table.num_rows * rank // size, table.num_rows * (rank + 1) // size
    return DTable(comm, table.slice(lo, hi - lo))


def _same(comm: Any, got: Any, query: str, **tables: pa.Table) -> None:
    g = got.gather()
    if comm.Get_rank() == 0:
        want = _sqlcheck.duckdb_answer(query, **tables)
        _sqlcheck.assert_same(g.rename_columns(want.column_names), want, ordered=False, ctx=query)


def test_decimal_sums_compare_with_literals_and_divide(comm: Any) -> None:
    """Was ``ArrowInvalid: Precision is not great enough`` (comparison) and ``precision out of range``."""
    t = _full()
    sums = _dt(comm, t).group_by("k").aggregate([("price", "sum")])
    big = sums.filter(pc.field("price_sum") > 60000)
    _same(comm, big, "select k, sum(price) from t group by k having sum(price) > 60000", t=t)
    scaled = sums.with_columns(half=pc.field("price_sum") * pc.scalar(Decimal("0.5")))
    _same(comm, scaled, "select k, sum(price), sum(price) * 0.5 from t group by k", t=t)
    ratio = sums.with_columns(one=pc.field("price_sum") / pc.field("price_sum"))
    assert ratio.schema.field("one").type == pa.float64()
    _same(comm, ratio, "select k, sum(price), sum(price)::double / sum(price)::double from t group by k", t=t)


def test_string_view_in_callables_and_with_columns(comm: Any) -> None:
    """Was ``'equal' has no kernel matching input types (string_view, string)``."""
    t = _full()
    dt = _dt(comm, t)
    kept = dt.filter(lambda tb: pc.equal(tb["flag"], "R"))
    _same(comm, kept, "select * from t where flag = 'R'", t=t)
    marked = dt.with_columns(is_a=pc.field("flag") == "A", upper=lambda tb: pc.utf8_lower(tb["flag"]))
    _same(comm, marked, "select *, flag = 'A', lower(flag) from t", t=t)


def test_count_star(comm: Any) -> None:
    t = _full()
    dt = _dt(comm, t)
    counted = dt.group_by("k").aggregate([("*", "count"), ("x", "count")])
    assert counted.column_names == ["k", "count", "x_count"]
    _same(comm, counted, "select k, count(*), count(x) from t group by k", t=t)
    assert dt.aggregate([("*", "count"), ("x", "count")]) == {"count": 90, "x_count": 90 - 13}


def test_rename(comm: Any) -> None:
    from hetflow.operators import ColumnNotFoundError

    dt = _dt(comm, _full())
    assert dt.rename({"price": "p", "x": "value"}).column_names == ["k", "p", "flag", "value"]
    with pytest.raises(ColumnNotFoundError, match="'nope'"):
        dt.rename({"nope": "p"})


def test_join_int32_keys_with_int64(comm: Any) -> None:
    """Was ``KeyTypeMismatchError``: SQL compares int32 with int64 as int64."""
    t = _full()
    dims = pa.table({"k": pa.array(range(8), pa.int64()), "name": [f"k{i}" for i in range(8)]})
    for how in ("inner", "left", "anti"):
        joined = _dt(comm, t).join(_dt(comm, dims), "k", how=how)
        assert joined.schema.field("k").type == pa.int32()
        if how == "anti":
            _same(comm, joined, "select * from t anti join dims using (k)", t=t, dims=dims)
        else:
            _same(comm, joined, f"select t.k, price, flag, x, name from t {how} join dims on t.k = dims.k", t=t, dims=dims)
    full = _dt(comm, t).join(_dt(comm, dims), "k", how="full")
    assert full.schema.field("k").type == pa.int64()
    _same(comm, full, "select coalesce(t.k, dims.k), price, flag, x, name from t full join dims on t.k = dims.k", t=t, dims=dims)
