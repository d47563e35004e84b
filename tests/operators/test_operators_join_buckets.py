"""Bucketed hash join: the same rows as the unbucketed join, DuckDB and the hand-written reference
(mpiexec -n 1/2/3), and bucket ids that keep every row on the rank the plain shuffle picks."""

from __future__ import annotations

from typing import Any

import _opdata as D
import numpy as np
import pyarrow as pa
import pytest
from test_operators_join import HOWS, reference_join

NO_BUCKETS = 10**12


def duck_join(left: pa.Table, right: pa.Table, keys: list[str], how: str, suffix: str) -> pa.Table:
    """DuckDB on the gathered inputs, shaped like hetflow's result (keys coalesced into the left names)."""
    on = " AND ".join(f"l.{D.q(k)} = r.{D.q(k)}" for k in keys)
    if how in ("semi", "anti"):
        exists = "EXISTS" if how == "semi" else "NOT EXISTS"
        return D.duck(f"SELECT l.* FROM l WHERE {exists} (SELECT 1 FROM r WHERE {on})", l=left, r=right)
    cols = [f"COALESCE(l.{D.q(n)}, r.{D.q(n)})" if n in keys and how in ("right", "full") else f"l.{D.q(n)}"
            for n in left.schema.names]
    for n in right.schema.names:
        if n not in keys:
            cols.append(f"r.{D.q(n)} AS {D.q(n + suffix if n in left.schema.names else n)}")
    return D.duck(f"SELECT {', '.join(cols)} FROM l {how.upper()} JOIN r ON {on}", l=left, r=right)


def raw_table(seed: int, rank: int, size: int, layout: str, n: int, stream: int) -> pa.Table:
    """Fixed-width columns without nulls (the column-wise raw shuffle path)."""
    rng = np.random.default_rng([seed, stream, rank, size])
    rows = D.rows_on_rank(layout, rank, size, n)
    return pa.table({"k": rng.integers(-5, n // 2, rows), "v": rng.integers(0, 1000, rows),
                     "w": rng.random(rows).astype(np.float32)})


def run(comm: Any, monkeypatch: pytest.MonkeyPatch, left: pa.Table, right: pa.Table, keys: list[str], how: str,
        ctx: str) -> None:
    from hetflow.operators import DTable, settings

    lt, rt = DTable(comm, left), DTable(comm, right)
    with settings.override(join_bucket_rows=3):
        bucketed = lt.join(rt, keys, how=how, algorithm="hash")
    with settings.override(join_bucket_rows=NO_BUCKETS):
        plain = lt.join(rt, keys, how=how, algorithm="hash")
    rows = max(lt.num_rows, rt.num_rows)
    got, base = bucketed.gather(), plain.gather()
    all_left, all_right = lt.gather(), rt.gather()
    buckets = int(bucketed.explain().split(" hash bucket(s)")[0].rsplit(" ", 1)[1])
    assert (buckets > 1) == (rows > 3 * comm.Get_size()), f"{ctx}: {bucketed.explain()}"
    assert "in 1 hash bucket(s)" in plain.explain(), ctx
    if comm.Get_rank() == 0:
        assert got.schema == base.schema, ctx
        D.assert_same_rows(got, base, ctx + " (vs unbucketed)")
        D.assert_same_rows(got, duck_join(all_left, all_right, keys, how, "_right"), ctx + " (vs DuckDB)")
        D.assert_same_rows(got, reference_join(all_left, all_right, keys, keys, how, "_right"), ctx + " (vs reference)")


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", [1, 3, 64])
@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("how", HOWS)
def test_bucketed_join_raw_columns(comm: Any, monkeypatch: pytest.MonkeyPatch, how: str, layout: str, exchange: int) -> None:
    """Raw columns take the permuted path; ``exchange`` buckets move per exchange (one, some, all)."""
    from hetflow.operators import settings

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 4000 + HOWS.index(how) * 10 + D.LAYOUTS.index(layout)
    left = raw_table(seed, rank, size, layout, 60, 1)
    right = raw_table(seed, rank, size, "skew" if layout == "balanced" else layout, 45, 2)
    with settings.override(join_exchange_buckets=exchange):
        run(comm, monkeypatch, left, right, ["k"], how, f"seed={seed} layout={layout} how={how} ranks={size} exchange={exchange}")


@pytest.mark.mpi
@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("how", HOWS)
def test_bucketed_join_nulls_and_strings(comm: Any, monkeypatch: pytest.MonkeyPatch, how: str, layout: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 5000 + HOWS.index(how) * 10 + D.LAYOUTS.index(layout)
    keys = {"a": pa.string(), "b": pa.int32()}
    left = D.table(seed, rank, size, layout=layout, keys=keys, n=50, stream=1)
    right = D.table(seed, rank, size, layout=layout, keys=keys, n=50, stream=2).drop_columns(["f"])
    run(comm, monkeypatch, left, right, list(keys), how, f"seed={seed} layout={layout} how={how} ranks={size}")


@pytest.mark.parametrize("block", [1 << 20, 37])
@pytest.mark.parametrize("buckets", [1, 3, 4, 7])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["int64", "string", "float64"])
def test_bucket_ids_keep_rank_placement(monkeypatch: pytest.MonkeyPatch, kind: str, ranks: int, buckets: int,
                                        block: int) -> None:
    from hetflow.operators import hashjoin, partition

    monkeypatch.setattr(hashjoin, "_BLOCK", block)  # several blocks exercise the blockwise counting sort

    t = D.table(17, 0, 1, n=500, keys={"k": D.KEY_TYPES[kind]}, payload=False)
    groups = hashjoin.bucket_groups(t, ["k"], ranks, buckets)
    assert len(groups) == ranks * buckets
    seen = np.concatenate(groups)
    assert np.array_equal(np.sort(seen), np.arange(t.num_rows))
    rank_of = partition.partition_ids(t, ["k"], ranks)
    for j, g in enumerate(groups):
        assert np.all(np.diff(g) > 0)
        assert np.all(rank_of[g] == j // buckets), (kind, ranks, buckets, j)
    if buckets > 1:  # every key value sits in exactly one bucket
        keys = t.column("k").to_pylist()
        owner: dict[Any, int] = {}
        for j, g in enumerate(groups):
            for i in g:
                assert owner.setdefault(keys[i], j) == j


def test_bucket_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetflow.operators import hashjoin, settings

    monkeypatch.setattr(settings, "_current", settings.Settings())
    assert hashjoin.bucket_count(0) == 1
    assert hashjoin.bucket_count(hashjoin.BUCKET_ROWS) == 1
    assert hashjoin.bucket_count(hashjoin.BUCKET_ROWS + 1) == 2
    assert hashjoin.bucket_count(10**12) == hashjoin.MAX_BUCKETS
    assert hashjoin.bucket_count(10**12, shuffled=False) == 1
    settings.configure(join_bucket_rows=10)
    assert hashjoin.bucket_count(31, shuffled=False) == hashjoin.bucket_count(31) == 4


@pytest.mark.parametrize("block", [1 << 20, 29])
@pytest.mark.parametrize("buckets", [1, 4])
@pytest.mark.parametrize("ranks", [1, 3])
def test_bucket_groups_leave_null_keys_out(monkeypatch: pytest.MonkeyPatch, ranks: int, buckets: int, block: int) -> None:
    from hetflow.operators import hashjoin

    monkeypatch.setattr(hashjoin, "_BLOCK", block)

    t = D.table(23, 0, 1, n=400, keys={"a": pa.string(), "b": pa.int64()}, payload=False, null_frac=0.2)
    every = hashjoin.bucket_groups(t, ["a", "b"], ranks, buckets)
    valid = hashjoin.bucket_groups(t, ["a", "b"], ranks, buckets, drop_null_keys=True)
    a, b = t.column("a").to_pylist(), t.column("b").to_pylist()
    assert any(x is None or y is None for x, y in zip(a, b))
    for g_all, g_valid in zip(every, valid):
        keep = [i for i in g_all if a[i] is not None and b[i] is not None]
        assert g_valid.tolist() == keep


@pytest.mark.parametrize("block", [1 << 16, 7])
@pytest.mark.parametrize("buckets", [1, 3])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_permuted_columns_match_bucket_order(monkeypatch: pytest.MonkeyPatch, ranks: int, buckets: int, block: int) -> None:
    """The blockwise counting sort puts every row where ``bucket_order``'s indices say (same partitions,
    ascending row order within each), for columns of several widths."""
    from hetflow.operators import collectives as tc
    from hetflow.operators import hashjoin

    monkeypatch.setattr(hashjoin, "_PERMUTE_BLOCK", block)
    monkeypatch.setattr(hashjoin, "_BLOCK", 29)
    t = raw_table(31, 0, 1, "balanced", 300, 1).append_column("d", pa.array([i * 3 for i in range(300)], pa.decimal128(20, 2)))
    raw = tc.raw_columns(t)
    assert raw is not None
    columns, bounds = hashjoin.permuted_columns(t, ["k"], ranks, buckets, raw)
    order, expect = hashjoin.bucket_order(t, ["k"], ranks, buckets)
    assert np.array_equal(bounds, expect)
    for (values, _), got in zip(raw, columns):
        assert np.array_equal(got, values[order])


@pytest.mark.mpi
@pytest.mark.parametrize("how", HOWS)
def test_bucketed_join_raw_on_some_ranks_only(comm: Any, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Rank 0's right side has null values (not raw), the other ranks' are raw: every rank takes the
    general per-bucket shuffle together."""
    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 6000 + HOWS.index(how)
    left = raw_table(seed, rank, size, "balanced", 40, 1)
    right = raw_table(seed, rank, size, "balanced", 40, 2)
    if rank == 0:
        v = right.column("v").to_pylist()
        right = right.set_column(1, "v", pa.array([None if i % 3 == 0 else x for i, x in enumerate(v)], pa.int64()))
    run(comm, monkeypatch, left, right, ["k"], how, f"seed={seed} how={how} ranks={size} nulls on rank 0")
