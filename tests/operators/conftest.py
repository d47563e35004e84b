"""The 5-rank subset: which operator tests also run at 5 ranks (``mpi5``), in one place.

``make test-mpi`` runs every ``mpi`` test at 1, 2 and 3 ranks, then the tests marked
``mpi5`` again under ``mpiexec -n 5`` (more ranks than CI has cores).  The subset keeps one
representative of each kind of case: every operator and algorithm, the key layouts (balanced,
skewed, a rank without rows), view, dictionary, decimal, time-zone and nested types, the SQL
aggregate semantics, the spill path and the cost model; it leaves out the repetitions over
every key type and parameter that the 3-rank run already covers, so that it adds about two
minutes to CI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

Params = dict[str, Any]
EVERY: Callable[[Params], bool] = lambda p: True
TYPES = {"string_view", "dict_string", "decimal256", "timestamp_tz", "struct", "list"}
KEYS = {"int64", "string", "decimal", "timestamp_ns_utc"}

#: ``file::test`` -> which of its parameter sets run at 5 ranks
MPI5: dict[str, Callable[[Params], bool]] = {
    "test_operators_types.py::test_types_filter_sort_unique_repartition": lambda p: p["kind"] in TYPES,
    "test_operators_types.py::test_types_set_operations": lambda p: p["kind"] in ("string_view", "list"),
    "test_operators_types.py::test_types_join": lambda p: p["how"] in ("inner", "full") and p["kind"] in TYPES,
    "test_operators_types.py::test_types_join_algorithms": lambda p: p["kind"] in ("string_view", "decimal256"),
    "test_operators_types.py::test_types_group_by": lambda p: p["kind"] in TYPES and p["algorithm"] == "auto",
    "test_operators_types.py::test_types_group_by_few_groups": EVERY,
    "test_operators_types.py::test_types_write_read": EVERY,
    "test_operators_types.py::test_tables_from_polars_and_duckdb": EVERY,
    "test_operators_sql_aggregates.py::test_mean_of_decimals_keeps_its_digits": EVERY,
    "test_operators_sql_aggregates.py::test_decimal_aggregates_match_duckdb": EVERY,
    "test_operators_sql_aggregates.py::test_integer_sums_exact_or_raise": EVERY,
    "test_operators_sql_aggregates.py::test_uint64_sums": EVERY,
    "test_operators_join.py::test_join_key_types": lambda p: p["kind"] in KEYS and p["how"] in ("inner", "full", "anti"),
    "test_operators_join.py::test_join_algorithms": lambda p: p["layout"] in ("skew", "empty_rank") and p["how"] in ("inner", "full"),
    "test_operators_join.py::test_join_multi_key_and_right_keys": lambda p: p["how"] in ("left", "full"),
    "test_operators_join.py::test_join_broadcast_chosen_for_small_side": EVERY,
    "test_operators_sort.py::test_sort_key_types": lambda p: p["kind"] in KEYS | {"float64"} and p["nulls"] == "at_start",
    "test_operators_sort.py::test_sort_multi_column_mixed_order": EVERY,
    "test_operators_sort.py::test_sort_all_equal_keys_is_balanced": EVERY,
    "test_operators_sort.py::test_rolling": lambda p: p["window"] == 7 and p["agg"] in ("sum", "stddev"),
    "test_operators_sort.py::test_sort_partition_first_path_without_nulls": lambda p: p["kind"] in ("int64", "timestamp_ns_utc"),
    "test_operators_groupby.py::test_group_by_key_types_all_aggregations": lambda p: p["kind"] in KEYS | {"float64"},
    "test_operators_groupby.py::test_group_by_algorithms": lambda p: p["layout"] in ("skew", "empty_rank"),
    "test_operators_groupby.py::test_group_by_range_partitioned": lambda p: p["kind"] == "int64",
    "test_operators_groupby.py::test_unique": lambda p: p["layout"] == "empty_rank",
    "test_operators_groupby.py::test_set_operations": lambda p: p["layout"] == "skew",
    "test_operators_groupby.py::test_column_aggregates": lambda p: p["layout"] == "empty_rank",
    # semi and anti only: the left join on "s" (97 values) grows with the square of the ranks (5M rows
    # at 5), and inner and full on "k" took a minute each at 5 ranks on 2 cores
    "test_operators_spill.py::test_join_matches_duckdb": lambda p: p["how"] in ("semi", "anti"),
    "test_operators_spill.py::test_sort_matches_duckdb": EVERY,
    "test_operators_spill.py::test_group_by_matches_duckdb": EVERY,
    "test_operators_spill.py::test_result_chains_and_reads_back": EVERY,
    "test_operators_spill_views.py::test_join_result_with_string_views_is_not_inflated": EVERY,
    "test_operators_costmodel.py::test_estimated_exchange_bytes_equal_the_bytes_sent": EVERY,
    # SQL (issue 28 asks for 5 ranks): all of it, about 25 s at 5 ranks on 2 cores
    "test_sql_tpch.py::test_tpch_query_matches_duckdb": EVERY,
    "test_sql_tpch.py::test_parquet_paths_and_globs_as_tables": EVERY,
    "test_sql_tpch.py::test_tpch_query_on_rank_0_alone_matches_duckdb": EVERY,
    "test_sql.py::test_sql_matches_duckdb": EVERY,
    "test_sql.py::test_limit_without_order_keeps_n_rows": EVERY,
    "test_sql.py::test_explain_shows_the_exchanges": EVERY,
    "test_sql.py::test_names_keep_the_query_spelling_and_group_by_all": EVERY,
    "test_sql.py::test_copartitioned_sides_are_not_shuffled_again": EVERY,
    "test_sql.py::test_a_query_over_small_inputs_runs_on_rank_0_alone": EVERY,
    "test_operators_sql_gaps.py::test_decimal_sums_compare_with_literals_and_divide": EVERY,
    "test_operators_sql_gaps.py::test_string_view_in_callables_and_with_columns": EVERY,
    "test_operators_sql_gaps.py::test_count_star": EVERY,
    "test_operators_sql_gaps.py::test_rename": EVERY,
    "test_operators_sql_gaps.py::test_join_int32_keys_with_int64": EVERY,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the chosen tests ``mpi5``; an entry that names no collected test (a test renamed or
    removed in a collected file) is an error, so the subset cannot shrink unnoticed."""
    files, found = set(), set()
    for item in items:
        files.add(item.path.name)
        key = f"{item.path.name}::{item.originalname if isinstance(item, pytest.Function) else item.name}"
        chosen = MPI5.get(key)
        if chosen is None:
            continue
        found.add(key)
        params = item.callspec.params if isinstance(item, pytest.Function) and hasattr(item, "callspec") else {}
        if chosen(params):
            item.add_marker(pytest.mark.mpi5)
    stale = sorted(k for k in MPI5 if k.split("::")[0] in files and k not in found)
    if stale:
        raise pytest.UsageError(f"tests/operators/conftest.py MPI5 names tests that do not exist: {stale}")


@pytest.fixture(autouse=True)
def _sql_plans_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator tests' SQL runs its distributed plan on their small tables: a query over inputs this
    small would otherwise run on rank 0 alone (``sqlengine.SMALL_QUERY_BYTES``); the tests of that
    path set the bound themselves."""
    from hetflow.operators import sqlengine

    monkeypatch.setattr(sqlengine, "SMALL_QUERY_BYTES", 0)
