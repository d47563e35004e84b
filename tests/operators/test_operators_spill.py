"""Out-of-core join, sort and group-by (``scan_ipc`` + ``memory_budget``), checked against DuckDB at any
rank count.  A budget of a few hundred KiB forces many buckets and runs on a small table, so every path
(shuffle into buckets, runs, k-way merge) runs; types and nulls as the in-memory operators take them.
Peak memory and clean-up are in ``test_operators_spill_memory.py``."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from decimal import Decimal
from pathlib import Path
from typing import Any

import _opdata as D
import numpy as np
import pyarrow as pa
import pytest
from hetflow.operators import DTable, scan_ipc

pytestmark = pytest.mark.mpi

BUDGET = 1 << 20  # bytes: below the inputs (about 2 MB per rank) by more than the buckets' and runs' share


def _table(rank: int, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, rank])
    k = rng.integers(0, n // 2 + 1, n)
    kmask = rng.random(n) < 0.03
    s = [None if x % 17 == 0 else f"s{x % 97}" for x in rng.integers(0, 10_000, n)]
    return pa.table({
        "k": pa.array(k, pa.int64(), mask=kmask),
        "s": pa.array(s, pa.string()),
        "x": pa.array(rng.integers(-1000, 1000, n), pa.int32()),
        "d": pa.array([Decimal(int(v)) / 100 for v in rng.integers(0, 10**6, n)], pa.decimal128(12, 2)),
        "ts": pa.array(rng.integers(0, 10**15, n), pa.timestamp("us", tz="Europe/Paris")),
        "sv": pa.array([f"payload-{v}" for v in rng.integers(0, 10**6, n)], pa.string_view()),
    })


def _write_inputs(comm: Any, tables: dict[str, pa.Table]) -> str:
    """Every rank writes its tables as ``<name>/part-<rank>.arrow`` under one shared directory (small batches)."""
    root = comm.bcast(tempfile.mkdtemp(prefix="hetflow-spill-test-") if comm.Get_rank() == 0 else None, root=0)
    for name, t in tables.items():
        (Path(root) / name).mkdir(exist_ok=True)
        with pa.OSFile(str(Path(root) / name / f"part-{comm.Get_rank():05d}.arrow"), "wb") as sink, \
                pa.ipc.new_file(sink, t.schema) as writer:
            writer.write_table(t, max_chunksize=3000)
    comm.Barrier()
    return str(root)


def _gathered(comm: Any, table: pa.Table) -> pa.Table | None:
    parts = comm.gather(table, root=0)
    return None if parts is None else pa.concat_tables(parts)


def _plain(t: pa.Table) -> pa.Table:
    """string_view as string and time zones as UTC (DuckDB answers in UTC; Python compares an ambiguous
    local time unequal to the same instant in another zone), for DuckDB and for comparing values."""
    def plain(c: pa.ChunkedArray) -> pa.ChunkedArray:
        if pa.types.is_string_view(c.type):
            return c.cast(pa.string())
        if pa.types.is_timestamp(c.type) and c.type.tz:
            return c.cast(pa.timestamp(c.type.unit, tz="UTC"))
        return c

    return pa.Table.from_arrays([plain(c) for c in t.columns], names=t.column_names)


def _rows(t: pa.Table) -> list[tuple[Any, ...]]:
    key = lambda r: tuple((v is None, repr(v)) for v in r)
    return sorted((tuple(r.values()) for r in _plain(t).to_pylist()), key=key)


def _same_rows(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    """Equal rows; floats (a decimal mean in float64) to 1e-12 relative, as DuckDB's own order of additions varies."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert x == y or (isinstance(x, float) and isinstance(y, float) and abs(x - y) <= 1e-12 * abs(y)), \
                f"got {a}, DuckDB {b}"


def _cleanup(comm: Any, root: str) -> None:
    comm.Barrier()
    if comm.Get_rank() == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _spill_base(comm: Any) -> str:
    """A private base for the spill directories, empty again after every operator (checked)."""
    return str(comm.bcast(tempfile.mkdtemp(prefix="hetflow-spill-base-") if comm.Get_rank() == 0 else None, root=0))


def _assert_cleaned(comm: Any, base: str) -> None:
    """Every rank's spill directory (all on this host, under one base) is gone once all have returned."""
    comm.Barrier()
    assert os.listdir(base) == [], "spill files left behind"
    comm.Barrier()


@pytest.mark.parametrize(("how", "on"), [("inner", "k"), ("left", "s"), ("full", "k"), ("semi", "s"), ("anti", "k")])
def test_join_matches_duckdb(comm: Any, how: str, on: str) -> None:
    rank = comm.Get_rank()
    n = 0 if rank == 1 else 6000 + 1000 * rank  # an empty rank when there are two or more
    left, right = _table(rank, n, 1), _table(rank, n // 2, 2).select([on, "x", "sv"])
    root = _write_inputs(comm, {"left": left, "right": right})
    base = _spill_base(comm)
    out = scan_ipc(comm, f"{root}/left").join(scan_ipc(comm, f"{root}/right"), on, how=how, output=f"{root}/out",
                                               memory_budget=BUDGET, spill_dir=base)
    assert out.stats["buckets"] > 1 and out.stats["spilled_bytes"] > 0
    _assert_cleaned(comm, base)
    in_memory = DTable(comm, left).join(DTable(comm, right), on, how=how)
    assert out.schema == in_memory.schema  # output types follow the input (string_view stays one)
    got = out.to_dtable().gather()
    all_left, all_right = _gathered(comm, left), _gathered(comm, right)
    if rank == 0:
        assert got is not None and all_left is not None and all_right is not None
        if how in ("semi", "anti"):
            sql = f"SELECT l.* FROM l {how.upper()} JOIN r ON l.{on} = r.{on}"
        else:
            sql = f"SELECT l.*, r.* EXCLUDE ({on}) FROM l {how.upper()} JOIN r ON l.{on} = r.{on}"
            if how == "full":  # the key column is coalesced, as in the in-memory join
                sql = sql.replace("SELECT l.*", f"SELECT l.* REPLACE (coalesce(l.{on}, r.{on}) AS {on})")
        want = D.duck(sql, l=_plain(all_left), r=_plain(all_right))
        assert got.num_rows == want.num_rows
        assert _rows(got) == _rows(want.rename_columns(got.column_names))
    _cleanup(comm, root)


def test_sort_matches_duckdb(comm: Any) -> None:
    rank = comm.Get_rank()
    t = _table(rank, 9000 + 3000 * rank, 3)
    root = _write_inputs(comm, {"t": t})
    base = _spill_base(comm)
    out = scan_ipc(comm, f"{root}/t").sort_by([("s", "ascending"), ("k", "descending")], output=f"{root}/out",
                                               memory_budget=BUDGET, spill_dir=base)
    assert out.stats["runs"] > 1
    _assert_cleaned(comm, base)
    assert out.schema == t.schema
    got = out.to_dtable().gather()
    everything = _gathered(comm, t)
    if rank == 0:
        assert got is not None and everything is not None
        want = D.duck("SELECT * FROM t ORDER BY s ASC NULLS LAST, k DESC NULLS LAST", t=_plain(everything))
        assert got.select(["s", "k"]).to_pylist() == want.select(["s", "k"]).to_pylist()
        assert _rows(got) == _rows(want)  # ties keep no particular order: the rows themselves
    _cleanup(comm, root)


def test_group_by_matches_duckdb(comm: Any) -> None:
    rank = comm.Get_rank()
    t = _table(rank, 12000, 4)
    root = _write_inputs(comm, {"t": t})
    base = _spill_base(comm)
    aggs = [("x", "sum"), ("x", "count"), ("d", "sum"), ("d", "mean"), ("ts", "min"), ("sv", "max"), ("x", "count_distinct")]
    out = scan_ipc(comm, f"{root}/t").group_by(["s", "k"]).aggregate(aggs, output=f"{root}/out",
                                                                     memory_budget=BUDGET, spill_dir=base)
    assert out.stats["buckets"] > 1
    _assert_cleaned(comm, base)
    assert out.schema == DTable(comm, t).group_by(["s", "k"]).aggregate(aggs).schema
    got = out.to_dtable().gather()
    everything = _gathered(comm, t)
    if rank == 0:
        assert got is not None and everything is not None
        want = D.duck("SELECT s, k, sum(x), count(x), sum(d), avg(d), min(ts), max(sv), count(DISTINCT x) "
                      "FROM t GROUP BY s, k", t=_plain(everything))
        assert got.num_rows == want.num_rows
        _same_rows(_rows(got), _rows(want.rename_columns(got.column_names).cast(_plain(got).schema)))
    _cleanup(comm, root)


def test_result_chains_and_reads_back(comm: Any) -> None:
    """An out-of-core result is a dataset on disk; it is the next operator's input without being loaded."""
    rank = comm.Get_rank()
    t = _table(rank, 5000, 5).select(["k", "x"])
    root = _write_inputs(comm, {"t": t})
    grouped = scan_ipc(comm, f"{root}/t").group_by("k").aggregate([("x", "sum")], output=f"{root}/g", memory_budget=BUDGET)
    ordered = grouped.sort_by(("x_sum", "descending"), output=f"{root}/o", memory_budget=BUDGET)
    got = ordered.to_dtable().gather()
    everything = _gathered(comm, t)
    if rank == 0:
        assert got is not None and everything is not None
        want = D.duck("SELECT k, sum(x) AS x_sum FROM t GROUP BY k ORDER BY x_sum DESC", t=everything)
        assert got.column("x_sum").to_pylist() == want.column("x_sum").to_pylist()
        assert sorted(map(str, got.to_pylist())) == sorted(map(str, want.cast(got.schema).to_pylist()))
    _cleanup(comm, root)


def test_timestamp_key_sort(comm: Any) -> None:
    """A temporal key through the splitters and the merge's comparisons."""
    rank = comm.Get_rank()
    t = _table(rank, 4000, 6).select(["ts", "x"])
    root = _write_inputs(comm, {"t": t})
    out = scan_ipc(comm, f"{root}/t").sort_by("ts", output=f"{root}/o", memory_budget=BUDGET)
    got = out.to_dtable().gather()
    if rank == 0:
        assert got is not None
        ts = got.column("ts").to_pylist()
        assert ts == sorted(ts) and all(isinstance(v, dt.datetime) for v in ts)
        assert got.num_rows == 4000 * comm.Get_size()
    _cleanup(comm, root)
