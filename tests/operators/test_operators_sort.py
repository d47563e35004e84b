"""Global sort, rolling windows, head/tail and repartitioning vs DuckDB / pyarrow on the gathered input."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi


def _order_sql(by: list[tuple[str, str]], nulls: str) -> str:
    nl = "NULLS LAST" if nulls == "at_end" else "NULLS FIRST"
    return ", ".join(f"{D.q(c)} {'ASC' if o == 'ascending' else 'DESC'} {nl}" for c, o in by) + ", __idx"


def run_sort(comm: Any, seed: int, layout: str, keys: dict[str, pa.DataType], by: list[tuple[str, str]], nulls: str, n: int = 40) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(seed, rank, size, layout=layout, keys=keys, n=n))
    res = t.sort_by(by, nulls=nulls)
    assert res.num_rows == t.num_rows
    got, whole = res.gather(), t.gather()
    if rank == 0:
        want = D.duck(f"SELECT * EXCLUDE (__idx) FROM t ORDER BY {_order_sql(by, nulls)}", t=D.with_index(whole))
        D.assert_same_rows(got, want, f"seed={seed} layout={layout} by={by} nulls={nulls} ranks={size}", ordered=True)


@pytest.mark.parametrize("nulls", ["at_end", "at_start"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("kind", list(D.KEY_TYPES))
def test_sort_key_types(comm: Any, kind: str, order: str, nulls: str) -> None:
    seed = 4000 + list(D.KEY_TYPES).index(kind) * 10 + (order == "descending") * 2 + (nulls == "at_start")
    run_sort(comm, seed, D.LAYOUTS[seed % 4], {"k": D.KEY_TYPES[kind]}, [("k", order)], nulls)


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_sort_multi_column_mixed_order(comm: Any, layout: str) -> None:
    keys = {"a": pa.string(), "b": pa.float64(), "c": pa.timestamp("us")}
    seed = 4500 + D.LAYOUTS.index(layout)
    run_sort(comm, seed, layout, keys, [("a", "ascending"), ("b", "descending"), ("c", "ascending")], "at_end", n=60)


def test_sort_all_equal_keys_is_balanced(comm: Any) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(5, rank, size, layout="skew", n=300, domain=1, null_frac=0.0))
    res = t.sort_by("k")
    counts = comm.allgather(res.local_num_rows)
    assert max(counts) - min(counts) <= 300 * size // 4 + 1, counts  # regular sampling splits ties by position
    got, whole = res.gather(), t.gather()
    if rank == 0:
        D.assert_same_rows(got, whole, "stable sort of equal keys keeps input order", ordered=True)


@pytest.mark.parametrize("agg", ["sum", "count", "mean", "min", "max", "stddev", "variance"])
@pytest.mark.parametrize("window", [1, 3, 7])
@pytest.mark.parametrize("layout", ["balanced", "skew", "empty_rank"])
def test_rolling(comm: Any, layout: str, window: int, agg: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 5000 + window * 10 + D.LAYOUTS.index(layout)
    n = 4 if layout == "balanced" else 12  # windows wider than a partition need several ranks' rows
    t = DTable(comm, D.table(seed, rank, size, layout=layout, n=n))
    res = t.rolling("k", window, [("v", agg), ("f", agg)])
    got, whole = res.gather(), t.gather()
    if rank == 0:
        fn = {"mean": "avg", "stddev": "stddev_samp", "variance": "var_samp"}.get(agg, agg)
        w = f"OVER (ORDER BY k ASC NULLS LAST, __idx ROWS BETWEEN {window - 1} PRECEDING AND CURRENT ROW)"
        want = D.duck(f"SELECT * EXCLUDE (__idx), {fn}(v) {w}, {fn}(f) {w} FROM t ORDER BY k ASC NULLS LAST, __idx", t=D.with_index(whole))
        D.assert_same_rows(got, want, f"seed={seed} rolling {agg} window={window} layout={layout} ranks={size}", ordered=True)


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("count", [0, 1, 5, 1000])
def test_head_tail(comm: Any, layout: str, count: int) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(6000 + count, rank, size, layout=layout, n=7))
    h, tl, whole = t.head(count).gather(), t.tail(count).gather(), t.gather()
    if rank == 0:
        D.assert_same_rows(h, whole.slice(0, count), f"head({count}) layout={layout}", ordered=True)
        D.assert_same_rows(tl, whole.slice(max(0, whole.num_rows - count)), f"tail({count}) layout={layout}", ordered=True)


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_rebalance_and_repartition(comm: Any, layout: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(6100, rank, size, layout=layout, n=11, keys={"k": pa.string()}))
    whole = t.gather()
    bal = t.rebalance()
    counts = comm.allgather(bal.local_num_rows)
    assert max(counts) - min(counts) <= 1, counts
    one = t.repartition(n=1)
    assert comm.allgather(one.local_num_rows)[1:] == [0] * (size - 1)
    by = t.repartition(by="k")
    mine = set(by.to_arrow().column("k").to_pylist())
    everyone = comm.allgather(mine)
    for i in range(size):
        for j in range(i + 1, size):
            assert not (everyone[i] & everyone[j]), f"key on ranks {i} and {j}: {everyone[i] & everyone[j]}"
    for res in (bal.gather(), one.gather()):
        if rank == 0:
            D.assert_same_rows(res, whole, f"rebalance layout={layout}", ordered=True)
    got = by.gather()
    if rank == 0:
        D.assert_same_rows(got, whole, f"repartition(by) layout={layout}")


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("kind", ["int8", "int64", "uint64", "date32", "timestamp_ns_utc"])
def test_sort_partition_first_path_without_nulls(comm: Any, kind: str, layout: str) -> None:
    """Single ascending integer-like key without nulls takes the partition-first path (one local sort)."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 4700 + list(D.KEY_TYPES).index(kind) * 10 + D.LAYOUTS.index(layout)
    t = DTable(comm, D.table(seed, rank, size, layout=layout, keys={"k": D.KEY_TYPES[kind]}, n=50, domain=9, null_frac=0.0))
    got, whole = t.sort_by("k").gather(), t.gather()
    if rank == 0:
        want = D.duck("SELECT * EXCLUDE (__idx) FROM t ORDER BY k, __idx", t=D.with_index(whole))
        D.assert_same_rows(got, want, f"seed={seed} kind={kind} layout={layout} ranks={size}", ordered=True)
