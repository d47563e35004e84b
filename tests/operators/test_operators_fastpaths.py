"""The fast paths against the general ones and DuckDB (mpiexec -n 1/2/3).

* ``comm.shuffle`` sends fixed-width null-free tables column by column; any other
  table as Arrow IPC: both must deliver the same rows in the same order.
* The int64 key hash (numpy multiplicative) and the general one (polars
  ``hash_rows``) must each co-locate equal keys of two tables.
* Integer keys without nulls sort and group with the numpy kernels (``intkeys``).
* Float keys with NaN, -0.0/0.0, +-inf and nulls follow SQL (DuckDB): NaN equals
  NaN and sorts above every number, -0.0 equals 0.0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi

FIXED = {"i8": pa.int8(), "u16": pa.uint16(), "i32": pa.int32(), "i64": pa.int64(), "u64": pa.uint64(),
         "f32": pa.float32(), "f64": pa.float64(), "d32": pa.date32(), "ts": pa.timestamp("ns", tz="UTC"),
         "dur": pa.duration("us"), "dec": pa.decimal128(20, 3)}


def _fixed_table(seed: int, rank: int, size: int, layout: str, null_on_rank: int | None = None) -> pa.Table:
    rng = np.random.default_rng([seed, rank, size])
    n = D.rows_on_rank(layout, rank, size, 57)
    cols = {name: D.column(rng, t, n, 1000, 0.3 if rank == null_on_rank else 0.0) for name, t in FIXED.items()}
    return pa.table(cols)


@pytest.mark.parametrize("block", [None, 7])
@pytest.mark.parametrize("nulls_somewhere", [False, True])
@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_raw_shuffle_equals_ipc_shuffle(comm: Any, layout: str, nulls_somewhere: bool, block: int | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``block=7``: the int32 index lists and the blockwise takes cross many block boundaries."""
    from hetflow.operators import collectives as tc, memory, partition

    if block is not None:
        monkeypatch.setattr(memory, "BLOCK", block)
    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9100 + D.LAYOUTS.index(layout) * 2 + nulls_somewhere
    t = _fixed_table(seed, rank, size, layout, null_on_rank=size - 1 if nulls_somewhere else None)
    ids = partition.partition_ids(t, ["i64"], size)
    got = tc.shuffle(comm, t, ids)
    want = pa.concat_tables(tc.alltoall_tables(comm, partition.split_by_ids(t, ids, size)))
    assert got.schema.equals(t.schema), f"seed={seed}: {got.schema} vs {t.schema}"
    assert got.equals(want), f"seed={seed} layout={layout} rank={rank}/{size}: raw and IPC shuffles differ"
    if not nulls_somewhere and size > 1 and t.num_rows:
        assert got.column("i64").num_chunks <= 1  # the raw path delivers one contiguous chunk
    total = tc.allreduce_sum(comm, got.num_rows)
    assert total == tc.allreduce_sum(comm, t.num_rows)


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_int64_fast_hash_and_general_hash_both_colocate(comm: Any, layout: str) -> None:
    """Each hash sends every key of two tables to one rank; together the parts are the input."""
    from hetflow.operators import collectives as tc, partition

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9200 + D.LAYOUTS.index(layout)
    a = D.table(seed, rank, size, layout=layout, keys={"k": pa.int64()}, n=60, null_frac=0.1)
    b = D.table(seed, rank, size, layout=layout, keys={"k": pa.int64()}, n=60, null_frac=0.1, stream=1)
    for name, keys in (("numpy int64", ["k"]), ("polars hash_rows", ["k", "k2"])):
        a2 = a.append_column("k2", pa.array(np.zeros(a.num_rows, dtype=np.int8)))
        b2 = b.append_column("k2", pa.array(np.zeros(b.num_rows, dtype=np.int8)))
        sa = tc.shuffle(comm, a2, partition.partition_ids(a2, keys, size))
        sb = tc.shuffle(comm, b2, partition.partition_ids(b2, keys, size))
        mine = set(sa.column("k").to_pylist()) | set(sb.column("k").to_pylist())
        everyone = comm.allgather(mine)
        for r in range(size):
            for s in range(r + 1, size):
                assert not (everyone[r] & everyone[s]), f"{name}: keys {everyone[r] & everyone[s]} on ranks {r} and {s} (seed={seed})"
        got, whole = D.rows(pa.concat_tables(tc.gather_table(comm, sa) or [a2.slice(0, 0)])), D.rows(a2)
        every_input = comm.gather(whole, root=0)
        if rank == 0:
            assert every_input is not None
            assert sorted(got, key=D._sort_key) == sorted([r for part in every_input for r in part], key=D._sort_key), f"{name}: rows lost or duplicated"


INT_KEYS = ["int8", "uint8", "int16", "int32", "int64", "uint32", "uint64", "date32", "timestamp_us", "timestamp_ns_utc"]


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("kind", INT_KEYS)
def test_integer_key_sort_without_nulls(comm: Any, kind: str, order: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9300 + INT_KEYS.index(kind) * 2 + (order == "descending")
    layout = D.LAYOUTS[seed % 3]  # balanced, skew, empty rank
    t = DTable(comm, D.table(seed, rank, size, layout=layout, keys={"k": D.KEY_TYPES[kind]}, n=70, domain=25,
                             null_frac=0.0).select(["k", "v", "f"]))
    got, whole = t.sort_by([("k", order)]).gather(), t.gather()
    if rank == 0:
        want = D.duck(f"SELECT * EXCLUDE (__idx) FROM t ORDER BY k {'DESC' if order == 'descending' else 'ASC'}, __idx",
                      t=D.with_index(whole))
        D.assert_same_rows(got, want, f"seed={seed} kind={kind} order={order} ranks={size}", ordered=True)


@pytest.mark.parametrize("algorithm", ["auto", "shuffle", "combine"])
@pytest.mark.parametrize("kind", INT_KEYS)
def test_integer_key_group_by_without_nulls(comm: Any, kind: str, algorithm: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9400 + INT_KEYS.index(kind) * 3 + ["auto", "shuffle", "combine"].index(algorithm)
    t = DTable(comm, D.table(seed, rank, size, layout=D.LAYOUTS[seed % 3], keys={"k": D.KEY_TYPES[kind]}, n=70,
                             domain=30, null_frac=0.0).select(["k", "v", "f"]))
    aggs = [("v", "count"), ("v", "sum"), ("v", "mean"), ("v", "min"), ("v", "max"), ("f", "count")]
    got, whole = t.group_by("k").aggregate(aggs, algorithm=algorithm).gather(), t.gather()
    if rank == 0:
        want = D.duck("SELECT k, count(v), sum(v), avg(v), min(v), max(v), count(f) FROM t GROUP BY k", t=whole)
        D.assert_same_rows(got, want, f"seed={seed} kind={kind} algorithm={algorithm} ranks={size}")


def _float_keys(seed: int, rank: int, size: int, layout: str, n: int = 40, stream: int = 0) -> pa.Table:
    rng = np.random.default_rng([seed, stream, rank, size])
    rows = D.rows_on_rank(layout, rank, size, n)
    special = np.array([0.0, -0.0, np.nan, -np.nan, 1.5, -2.25, np.inf, -np.inf, 3.0])
    k = rng.choice(special, rows)
    # a NaN with another payload: still NaN, must meet the others
    k[rng.random(rows) < 0.1] = np.frombuffer(np.uint64(0x7FF8000000000123).tobytes(), dtype=np.float64)[0]
    mask = rng.random(rows) < 0.1
    return pa.table({"k": pa.array(k, mask=mask), "v": pa.array(rng.integers(0, 100, rows)), "s": pa.array([f"r{rank}-{i}" for i in range(rows)], pa.string())})


@pytest.mark.parametrize("algorithm", ["hash", "broadcast", "sort"])
@pytest.mark.parametrize("how", ["inner", "left", "full", "semi", "anti"])
def test_nan_and_signed_zero_join_keys(comm: Any, how: str, algorithm: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9500 + ["inner", "left", "full", "semi", "anti"].index(how) * 3 + ["hash", "broadcast", "sort"].index(algorithm)
    layout = D.LAYOUTS[seed % 3]
    if how == "full" and algorithm == "broadcast":  # no broadcast plan for a full join
        algorithm = "auto"
    left = DTable(comm, _float_keys(seed, rank, size, layout))
    right = DTable(comm, _float_keys(seed, rank, size, "balanced", n=25, stream=1).rename_columns(["k", "w", "t"]))
    got = left.join(right, "k", how=how, algorithm=algorithm).gather()
    lw, rw = left.gather(), right.gather()
    if rank == 0:
        if how in ("semi", "anti"):
            sql = f"SELECT * FROM l {how.upper()} JOIN r ON l.k = r.k"
        else:
            k = "COALESCE(l.k, r.k)" if how == "full" else "l.k"
            sql = f"SELECT {k} AS k, l.v, l.s, r.w, r.t FROM l {how.upper()} JOIN r ON l.k = r.k"
        D.assert_same_rows(got, D.duck(sql, l=lw, r=rw), f"seed={seed} how={how} algorithm={algorithm} ranks={size}")


@pytest.mark.parametrize("algorithm", ["auto", "shuffle", "combine"])
def test_nan_and_signed_zero_group_keys(comm: Any, algorithm: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9600 + ["auto", "shuffle", "combine"].index(algorithm)
    t = DTable(comm, _float_keys(seed, rank, size, D.LAYOUTS[seed % 3], n=60))
    got = t.group_by("k").aggregate([("v", "sum"), ("v", "count"), ("v", "min")], algorithm=algorithm).gather()
    uniq = t.unique("k").gather()
    whole = t.gather()
    if rank == 0:
        ctx = f"seed={seed} algorithm={algorithm} ranks={size}"
        D.assert_same_rows(got, D.duck("SELECT k, sum(v), count(v), min(v) FROM t GROUP BY k", t=whole), ctx)
        assert uniq.num_rows == D.duck("SELECT DISTINCT k FROM t", t=whole).num_rows, ctx


@pytest.mark.parametrize("nulls", ["at_end", "at_start"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_nan_and_signed_zero_sort_keys(comm: Any, order: str, nulls: str) -> None:
    """NaN sorts above +inf (DuckDB); -0.0 and 0.0 tie, so only the keys are compared in order."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9700 + (order == "descending") * 2 + (nulls == "at_start")
    t = DTable(comm, _float_keys(seed, rank, size, D.LAYOUTS[seed % 3], n=50))
    got, whole = t.sort_by([("k", order)], nulls=nulls).gather(), t.gather()
    if rank == 0:
        nl = "NULLS LAST" if nulls == "at_end" else "NULLS FIRST"
        want = D.duck(f"SELECT * FROM t ORDER BY k {'DESC' if order == 'descending' else 'ASC'} {nl}", t=whole)
        ctx = f"seed={seed} order={order} nulls={nulls} ranks={size}"
        D.assert_same_rows(got.select(["k"]), want.select(["k"]), ctx, ordered=True)
        D.assert_same_rows(got, want, ctx)
