"""SQL semantics of decimal and integer aggregates, checked against DuckDB at any rank count.

Decimals: ``sum`` is ``decimal128(38, s)``, ``mean``/``variance``/``stddev`` are DuckDB's
doubles (the mean of 1, 2, 2 as ``decimal(10, 2)`` is 1.666..., not 1.67).  Integers: sums are
exact whatever the order of additions; a sum that leaves int64 (uint64) raises
``AggregateOverflowError`` naming the column, on every rank, where DuckDB's HUGEINT shows it.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi

DEC_AGGS = [("d", "sum"), ("d", "mean"), ("d", "variance"), ("d", "stddev"), ("d", "min"), ("d", "max"), ("d", "count"),
            ("w", "sum"), ("w", "mean"), ("w", "stddev")]
SQL = {"sum": "sum({c})", "mean": "avg({c})", "variance": "var_samp({c})", "stddev": "stddev_samp({c})",
       "min": "min({c})", "max": "max({c})", "count": "count({c})"}


def _exact_rows(got: pa.Table, want: pa.Table, ctx: str) -> None:
    """Same rows and DuckDB's types; decimals and integers equal exactly, floats to 1e-12 (a variance in
    float64 rounds differently with the order of the rows, in DuckDB too)."""
    for g, w in zip(got.schema, want.schema):
        assert g.type == w.type, f"{ctx}: column {g.name} is {g.type}, DuckDB says {w.type}"
    key = lambda r: tuple((v is None, repr(v)) for v in r)  # noqa: E731
    gr = sorted((tuple(r.values()) for r in got.to_pylist()), key=key)
    wr = sorted((tuple(r.values()) for r in want.to_pylist()), key=key)
    assert len(gr) == len(wr), ctx
    for a, b in zip(gr, wr):
        for x, y in zip(a, b):
            ok = x == y or (isinstance(x, float) and isinstance(y, float) and abs(x - y) <= 1e-12 * abs(y))
            assert ok, f"{ctx}: got {a}, DuckDB {b}"


def _dec_table(seed: int, rank: int, size: int, layout: str) -> pa.Table:
    rng = np.random.default_rng([seed, rank, size])
    n = D.rows_on_rank(layout, rank, size, 30)
    k = rng.integers(0, 4, n)
    cents = rng.integers(-10**9, 10**9, n)
    d = [None if i % 7 == 3 else Decimal(int(c)) / 100 for i, c in enumerate(cents)]
    w = [None if i % 5 == 1 else Decimal(int(c)) * 10**20 / 10**6 for i, c in enumerate(cents)]
    return pa.table({"k": pa.array(k, pa.int64()), "d": pa.array(d, pa.decimal128(10, 2)),
                     "w": pa.array(w, pa.decimal256(40, 6))})


def test_mean_of_decimals_keeps_its_digits(comm: Any) -> None:
    """The issue's example: 1, 2, 2 as decimal(10, 2), wherever the rows are."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    vals = [Decimal(1), Decimal(2), Decimal(2)]
    mine = [v for i, v in enumerate(vals) if i % size == rank]
    t = DTable(comm, pa.table({"k": pa.array([7] * len(mine), pa.int64()), "d": pa.array(mine, pa.decimal128(10, 2))}))
    want = D.duck("SELECT avg(d) AS m, sum(d) AS s FROM t", t=pa.table({"d": pa.array(vals, pa.decimal128(10, 2))}))
    got = t.aggregate([("d", "mean"), ("d", "sum")])
    assert got == {"d_mean": want.column("m")[0].as_py(), "d_sum": want.column("s")[0].as_py()}
    assert got["d_mean"] == pytest.approx(5 / 3, rel=1e-15)
    res = t.group_by("k").aggregate([("d", "mean")])
    assert res.schema.field("d_mean").type == pa.float64()
    g = res.gather()
    if rank == 0:
        assert g is not None and g.column("d_mean").to_pylist() == [want.column("m")[0].as_py()]


@pytest.mark.parametrize("layout", ["balanced", "skew", "empty_rank"])
@pytest.mark.parametrize("algorithm", ["auto", "shuffle"])
def test_decimal_aggregates_match_duckdb(comm: Any, layout: str, algorithm: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9600 + D.LAYOUTS.index(layout)
    t = DTable(comm, _dec_table(seed, rank, size, layout))
    got = t.group_by("k").aggregate(DEC_AGGS, algorithm=algorithm).gather()
    scalars = t.aggregate(DEC_AGGS)
    whole = t.gather()
    if rank == 0:
        assert got is not None and whole is not None
        exprs = ", ".join(SQL[a].format(c=c) for c, a in DEC_AGGS)
        narrow = whole.set_column(2, "w", whole.column("w").cast(pa.decimal128(38, 6)))  # DuckDB reads no decimal256
        want = D.duck(f"SELECT k, {exprs} FROM t GROUP BY k", t=narrow)
        wide_sum = pa.field("w_sum", pa.decimal256(76, 6))  # DuckDB's 38 digits, as decimal256 for a decimal256 input
        want = want.set_column(8, wide_sum, want.column(8).cast(wide_sum.type))
        ctx = f"seed={seed} layout={layout} algorithm={algorithm} ranks={size}"
        _exact_rows(got, want.rename_columns(got.schema.names), ctx)
        want1 = D.duck(f"SELECT {exprs} FROM t", t=narrow)
        vals = dict(zip(scalars, want1.to_pylist()[0].values()))
        for name, v in scalars.items():
            w = vals[name]
            assert v == w or isinstance(w, float) and abs(v - w) <= 1e-12 * abs(w), f"{ctx}: {name} {v} vs DuckDB {w}"


BIG = 2**62


@pytest.mark.parametrize("algorithm", ["auto", "shuffle", "combine", "range"])
def test_integer_sums_exact_or_raise(comm: Any, algorithm: str) -> None:
    """Sums of int64 values near 2**62: exact (DuckDB's HUGEINT) when the total fits, however the
    additions are grouped over ranks; an error naming the column on every rank when it does not."""
    from hetflow.operators import DTable
    from hetflow.operators.errors import AggregateOverflowError

    rank, size = comm.Get_rank(), comm.Get_size()
    # group 1: +BIG, +BIG, -BIG, -BIG ... (fits; partial sums do not); group 2: 3 * BIG (does not fit)
    rows = [(1, BIG), (1, BIG), (1, -BIG), (1, BIG), (1, -BIG), (1, -BIG), (1, BIG), (3, 5), (3, -7), (3, 2)]
    mine = [r for i, r in enumerate(rows) if i % size == rank]
    fits = DTable(comm, pa.table({"k": pa.array([k for k, _ in mine], pa.int64()), "v": pa.array([v for _, v in mine], pa.int64())}))
    aggs = [("v", "sum"), ("v", "mean"), ("v", "count")]
    got = fits.group_by("k").aggregate(aggs, algorithm=algorithm if size > 1 else "auto").gather()
    whole = pa.table({"k": pa.array([k for k, _ in rows], pa.int64()), "v": pa.array([v for _, v in rows], pa.int64())})
    want = D.duck("SELECT k, sum(v)::BIGINT, avg(v), count(v) FROM t GROUP BY k", t=whole)
    if rank == 0:
        assert got is not None
        _exact_rows(got, want.rename_columns(got.schema.names), f"algorithm={algorithm} ranks={size}")
    assert fits.aggregate(aggs)["v_sum"] == D.duck("SELECT sum(v) AS s FROM t", t=whole).column(0)[0].as_py()

    over = [(2, BIG)] * 3 + [(4, 1)]
    assert D.duck("SELECT sum(v) AS s FROM t WHERE k = 2", t=pa.table({"k": [k for k, _ in over], "v": [v for _, v in over]})
                  ).column(0)[0].as_py() > 2**63 - 1  # DuckDB: the true sum leaves int64
    mine = [r for i, r in enumerate(over) if i % size == rank]
    bad = DTable(comm, pa.table({"k": pa.array([k for k, _ in mine], pa.int64()), "v": pa.array([v for _, v in mine], pa.int64())}))
    with pytest.raises(AggregateOverflowError, match="column 'v' overflows int64"):
        bad.group_by("k").aggregate([("v", "sum")], algorithm=algorithm if size > 1 else "auto")
    with pytest.raises(OverflowError, match="'v'"):
        bad.aggregate([("v", "sum")])
    assert bad.group_by("k").aggregate([("v", "mean")]).num_rows == 2  # a mean does not overflow


def test_uint64_sums(comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import AggregateOverflowError

    rank, size = comm.Get_rank(), comm.Get_size()
    rows = [2**63, 2**62, 2**61]
    mine = [v for i, v in enumerate(rows) if i % size == rank]
    t = DTable(comm, pa.table({"k": pa.array([1] * len(mine), pa.int8()), "u": pa.array(mine, pa.uint64())}))
    want = D.duck("SELECT sum(u) AS s FROM t", t=pa.table({"u": pa.array(rows, pa.uint64())})).column(0)[0].as_py()
    assert t.aggregate([("u", "sum")])["u_sum"] == want
    mine = [v for i, v in enumerate([2**63] * 3) if i % size == rank]
    more = DTable(comm, pa.table({"k": pa.array([1] * len(mine), pa.int8()), "u": pa.array(mine, pa.uint64())}))
    with pytest.raises(AggregateOverflowError, match="'u' overflows uint64"):
        more.group_by("k").aggregate([("u", "sum")])
