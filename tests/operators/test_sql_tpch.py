"""The 22 TPC-H queries as published, through ``hetflow.operators.sql``, equal to DuckDB's answers.

Data: ``tpchgen-cli`` at scale factor 0.01 (decimals, ``string_view`` strings, int32 and int64
keys), read as DTables; DuckDB answers the same text over the same Parquet files.  Run at 1, 2 and
3 ranks (``make test-mpi``); a query whose answer depends on the rank count fails at that count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import _sqlcheck
import _tpch
import pytest

pytestmark = pytest.mark.mpi

SCALE = 0.01


@pytest.fixture(scope="module")
def tpch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any], dict[str, str]]]:
    """(communicator, DTables by name, Parquet paths by name), generated once by rank 0."""
    from hetflow.operators import read_parquet
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    paths = None
    if comm.Get_rank() == 0:
        paths = _tpch.generate(str(tmp_path_factory.mktemp("tpch")), SCALE)
    paths = comm.bcast(paths, root=0)
    tables = {name: read_parquet(comm, p) for name, p in paths.items()}
    yield comm, tables, paths
    comm.Free()


def _answer(query: str, paths: dict[str, str]) -> Any:
    import duckdb

    con = duckdb.connect()
    for name, p in paths.items():
        con.sql(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{p}')")
    try:
        return con.sql(query).to_arrow_table()
    finally:
        con.close()


@pytest.mark.parametrize("number", sorted(_tpch.QUERIES))
def test_tpch_query_matches_duckdb(tpch: Any, number: int) -> None:
    from hetflow.operators import sql

    comm, tables, paths = tpch
    query = _tpch.QUERIES[number]
    result = sql(comm, query, **tables)
    got = result.gather()
    if comm.Get_rank() == 0:
        want = _answer(query, paths)
        _sqlcheck.assert_same(got, want, ordered="order by" in query.lower(), ctx=f"TPC-H Q{number} at {comm.Get_size()} rank(s)")
        assert got.column_names == want.column_names, f"Q{number}: names {got.column_names}, DuckDB {want.column_names}"
    plan = result.explain()
    if comm.Get_size() > 1 and re.search(r"\bjoin\b|,\s*\w+\s*(,|\n)|\bfrom \w+ *, *\w+", query, re.IGNORECASE):
        assert "shuffle" in plan or "broadcast" in plan or "gather" in plan, plan


def test_parquet_paths_and_globs_as_tables(tpch: Any) -> None:
    """Tables given as a Parquet file and as a glob are read in parallel, only the columns named."""
    from hetflow.operators import sql

    comm, _, paths = tpch
    glob = paths["orders"].replace("orders.parquet", "ord*.parquet")
    query = _tpch.QUERIES[4]
    got = sql(comm, query, orders=glob, lineitem=paths["lineitem"]).gather()
    if comm.Get_rank() == 0:
        _sqlcheck.assert_same(got, _answer(query, paths), ordered=True, ctx="Q4 over Parquet paths")


def test_inequality_correlated_exists_runs_as_semi_and_anti_joins(tpch: Any) -> None:
    """Q21's EXISTS and NOT EXISTS, correlated on l_orderkey equal and l_suppkey unequal, run as a semi
    and an anti join on l_orderkey with the inequality in the join (sqlglot alone makes lists per order)."""
    from hetflow.operators import sql

    comm, tables, _ = tpch
    plan = sql(comm, _tpch.QUERIES[21], **tables).explain()
    assert "semi join" in plan and "anti join" in plan, plan



@pytest.mark.parametrize("number", sorted(_tpch.QUERIES))
def test_tpch_query_on_rank_0_alone_matches_duckdb(tpch: Any, number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query through the path of a query over small inputs (``SMALL_QUERY_BYTES``): each input's
    rows filtered by its own conditions on its rank, gathered to rank 0, the query run there alone;
    DuckDB's answer all the same."""
    from hetflow.operators import sql, sqlengine

    monkeypatch.setattr(sqlengine, "SMALL_QUERY_BYTES", 1 << 40)
    monkeypatch.setattr(sqlengine, "PREFILTER_MIN_BYTES", 0)  # every input's own conditions first, the small ones' too
    comm, tables, paths = tpch
    query = _tpch.QUERIES[number]
    result = sql(comm, query, **tables)
    got = result.gather()
    if comm.Get_rank() == 0:
        want = _answer(query, paths)
        _sqlcheck.assert_same(got, want, ordered="order by" in query.lower(), ctx=f"TPC-H Q{number} on rank 0 of {comm.Get_size()}")
        assert got.column_names == want.column_names, f"Q{number}: names {got.column_names}, DuckDB {want.column_names}"
    if comm.Get_size() > 1:
        assert result.plans[0].operation == "query" and "rank 0" in result.plans[0].algorithm, result.explain()
        assert comm.Get_rank() == 0 or result.local_num_rows == 0
