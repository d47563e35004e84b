"""Group-by, column aggregates, unique and set operations vs DuckDB on the gathered input."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi

ALL_AGGS = [("v", "count"), ("v", "sum"), ("v", "mean"), ("v", "min"), ("v", "max"), ("v", "stddev"),
            ("v", "variance"), ("f", "sum"), ("s", "count_distinct"), ("s", "min"), ("v", "first"),
            ("v", "last"), ("s", "list"), ("s", "count")]
DECOMPOSABLE = [("v", "count"), ("v", "sum"), ("v", "mean"), ("v", "min"), ("v", "max"), ("v", "stddev"),
                ("f", "variance"), ("f", "mean"), ("s", "max")]
SQL = {"count": "count({c})", "sum": "sum({c})", "mean": "avg({c})", "min": "min({c})", "max": "max({c})",
       "stddev": "stddev_samp({c})", "variance": "var_samp({c})", "count_distinct": "count(DISTINCT {c})",
       "first": "first({c} ORDER BY __idx)", "last": "last({c} ORDER BY __idx)", "list": "list({c} ORDER BY __idx)"}


def reference(whole: pa.Table, keys: list[str], aggs: list[tuple[str, str]]) -> pa.Table:
    exprs = ", ".join(SQL[a].format(c=D.q(c)) for c, a in aggs)
    if not keys:
        return D.duck(f"SELECT {exprs} FROM t", t=D.with_index(whole))
    k = D.cols(keys)
    return D.duck(f"SELECT {k}, {exprs} FROM t GROUP BY {k}", t=D.with_index(whole))


def run_group_by(comm: Any, seed: int, layout: str, keys: dict[str, pa.DataType], aggs: list[tuple[str, str]],
                 algorithm: str = "auto", n: int = 40, domain: int | None = None) -> Any:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(seed, rank, size, layout=layout, keys=keys, n=n, domain=domain))
    res = t.group_by(list(keys)).aggregate(aggs, algorithm=algorithm)
    got, whole = res.gather(), t.gather()
    if rank == 0:
        ctx = f"seed={seed} layout={layout} keys={keys} algorithm={algorithm} ranks={size}"
        assert got.schema.names == list(keys) + [f"{c}_{a}" for c, a in aggs], ctx
        D.assert_same_rows(got, reference(whole, list(keys), aggs), ctx)
    return res


@pytest.mark.parametrize("kind", list(D.KEY_TYPES))
def test_group_by_key_types_all_aggregations(comm: Any, kind: str) -> None:
    seed = 7000 + list(D.KEY_TYPES).index(kind)
    run_group_by(comm, seed, D.LAYOUTS[seed % 4], {"k": D.KEY_TYPES[kind]}, ALL_AGGS)


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("algorithm", ["auto", "combine", "shuffle"])
@pytest.mark.parametrize("domain", [3, 1000])
def test_group_by_algorithms(comm: Any, algorithm: str, layout: str, domain: int) -> None:
    seed = 7100 + ["auto", "combine", "shuffle"].index(algorithm) * 10 + D.LAYOUTS.index(layout) + domain
    res = run_group_by(comm, seed, layout, {"a": pa.string(), "b": pa.int16()}, DECOMPOSABLE, algorithm, n=60, domain=domain)
    if comm.Get_size() > 1 and algorithm == "auto" and layout == "balanced":
        expected = "combine-shuffle-reduce" if domain == 3 else "shuffle-compute"
        assert expected in res.explain(), res.explain()


def test_group_by_combine_rejects_non_decomposable(comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import UnsupportedAggregationError

    t = DTable(comm, D.table(1, comm.Get_rank(), comm.Get_size()))
    if comm.Get_size() > 1:
        with pytest.raises(UnsupportedAggregationError, match="combine"):
            t.group_by("k").aggregate([("s", "list")], algorithm="combine")


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_column_aggregates(comm: Any, layout: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 7500 + D.LAYOUTS.index(layout)
    t = DTable(comm, D.table(seed, rank, size, layout=layout, n=30))
    got = t.aggregate(ALL_AGGS)
    assert comm.allgather(repr(got)) == [repr(got)] * size, "aggregates must be replicated"
    whole = t.gather()
    if rank == 0:
        want = reference(whole, [], ALL_AGGS)
        assert list(got) == [f"{c}_{a}" for c, a in ALL_AGGS]
        D.assert_same_rows(pa.Table.from_pylist([got]), want, f"seed={seed} layout={layout} ranks={size}")


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("keys", [None, ["k"], ["k", "s"]])
def test_unique(comm: Any, layout: str, keys: list[str] | None) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 7600 + D.LAYOUTS.index(layout)
    base = D.table(seed, rank, size, layout=layout, n=40, domain=6)
    base = base.select(["k", "s", "v"]) if keys is None else base
    if keys is None:  # make whole-row duplicates likely
        base = pa.concat_tables([base, base.slice(0, base.num_rows // 2)])
    t = DTable(comm, base)
    got, whole = t.unique(keys).gather(), t.gather()
    if rank == 0:
        if keys is None:
            want = D.duck("SELECT DISTINCT * FROM t", t=whole)
        else:
            k = D.cols(keys)
            want = D.duck(f"SELECT * EXCLUDE (__idx, __rn) FROM (SELECT *, row_number() OVER (PARTITION BY {k} ORDER BY __idx) AS __rn FROM t) WHERE __rn = 1", t=D.with_index(whole))
        D.assert_same_rows(got, want, f"seed={seed} unique({keys}) layout={layout} ranks={size}")


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("op", ["union", "union_all", "intersect", "difference"])
def test_set_operations(comm: Any, op: str, layout: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 7700 + D.LAYOUTS.index(layout)
    keys = {"k": pa.int32(), "d": pa.date32()}
    a = DTable(comm, D.table(seed, rank, size, layout=layout, keys=keys, n=40, domain=5, payload=False, stream=1))
    b = DTable(comm, D.table(seed, rank, size, layout="balanced", keys=keys, n=40, domain=5, payload=False, stream=2))
    res = {"union": lambda: a.union(b), "union_all": lambda: a.union(b, distinct=False),
           "intersect": lambda: a.intersect(b), "difference": lambda: a.difference(b)}[op]()
    got, wa, wb = res.gather(), a.gather(), b.gather()
    if rank == 0:
        sql = {"union": "UNION", "union_all": "UNION ALL", "intersect": "INTERSECT", "difference": "EXCEPT"}[op]
        want = D.duck(f"SELECT * FROM a {sql} SELECT * FROM b", a=wa, b=wb)
        D.assert_same_rows(got, want, f"seed={seed} {op} layout={layout} ranks={size}")


RANGE_KEYS = ["int8", "int64", "uint64", "date32", "timestamp_us"]


def _no_null_keys(t: pa.Table, name: str) -> pa.Table:
    """The key column without nulls: they become the first key value (a heavier key); values keep theirs."""
    col = t.column(name)
    if col.null_count and t.num_rows > col.null_count:
        fill = next(x for x in col.to_pylist() if x is not None)
        col = pa.chunked_array([pa.array([fill if x is None else x for x in col.to_pylist()], col.type)])
    elif col.null_count:
        col = pa.chunked_array([pa.array([0] * t.num_rows, pa.int64()).cast(col.type)])
    return t.set_column(t.schema.get_field_index(name), name, col)


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("kind", RANGE_KEYS)
@pytest.mark.parametrize("algorithm", ["auto", "range"])
def test_group_by_range_partitioned(comm: Any, algorithm: str, kind: str, layout: str) -> None:
    """One integer-like key without nulls: range-shuffle-compute (equal keys meet on one rank) gives
    DuckDB's groups for every aggregation, with nulls in the values, skew and empty ranks."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 7300 + RANGE_KEYS.index(kind) * 10 + D.LAYOUTS.index(layout) + (5 if algorithm == "range" else 0)
    for domain, aggs in ((1000, ALL_AGGS), (3, DECOMPOSABLE)):
        t = _no_null_keys(D.table(seed, rank, size, layout=layout, keys={"k": D.KEY_TYPES[kind]}, n=80, domain=domain), "k")
        dt = DTable(comm, t)
        res = dt.group_by("k").aggregate(aggs, algorithm=algorithm)
        got, whole = res.gather(), dt.gather()
        ctx = f"seed={seed} layout={layout} kind={kind} domain={domain} algorithm={algorithm} ranks={size}"
        if size > 1 and (algorithm == "range" or domain == 1000):
            assert "range-shuffle-compute" in res.explain(), ctx + "\n" + res.explain()
        if size > 1 and algorithm == "auto" and domain == 3 and layout == "balanced":
            assert "combine-shuffle-reduce" in res.explain(), ctx + "\n" + res.explain()
        if rank == 0:
            D.assert_same_rows(got, reference(whole, ["k"], aggs), ctx)


def test_group_by_range_rejects_other_keys(comm: Any) -> None:
    """Explicit range needs one integer-like key without nulls on every rank; nulls on one rank suffice to refuse."""
    from hetflow.operators import DTable
    from hetflow.operators.errors import InvalidOptionError

    rank, size = comm.Get_rank(), comm.Get_size()
    t = _no_null_keys(D.table(11, rank, size, n=30), "k")
    if rank == size - 1:
        t = t.set_column(0, "k", pa.array([None] + t.column("k").to_pylist()[1:], pa.int64()))
    dt = DTable(comm, t)
    if size > 1:
        with pytest.raises(InvalidOptionError, match="range"):
            dt.group_by("k").aggregate([("v", "sum")], algorithm="range")
        with pytest.raises(InvalidOptionError, match="range"):
            DTable(comm, D.table(12, rank, size, keys={"s2": pa.string()}, n=30)).group_by("s2").aggregate(
                [("v", "sum")], algorithm="range")
    res = dt.group_by("k").aggregate([("v", "sum")])  # auto falls back to the hash shuffle
    got, whole = res.gather(), dt.gather()
    if size > 1:
        assert "range-shuffle-compute" not in res.explain()
    if rank == 0:
        D.assert_same_rows(got, reference(whole, ["k"], [("v", "sum")]), f"ranks={size}")
