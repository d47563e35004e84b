"""Option types of the operators (one place for every ``Literal``)."""

from __future__ import annotations

from typing import Literal, Sequence, Union, get_args

JoinHow = Literal["inner", "left", "right", "full", "semi", "anti"]
JoinAlgorithm = Literal["auto", "hash", "broadcast", "sort"]
GroupByAlgorithm = Literal["auto", "combine", "shuffle", "range"]
SortOrder = Literal["ascending", "descending"]
NullPlacement = Literal["at_start", "at_end"]
AggName = Literal[
    "count", "count_distinct", "sum", "mean", "min", "max",
    "stddev", "variance", "first", "last", "list",
]
WriteFormat = Literal["parquet", "ipc"]
RollingAggName = Literal["count", "sum", "mean", "min", "max", "stddev", "variance"]

#: ``"k"``, or ``("k", "descending")``
SortKey = Union[str, tuple[str, SortOrder]]
Keys = Union[str, Sequence[str]]
Aggregation = tuple[str, AggName]

JOIN_HOWS: tuple[str, ...] = get_args(JoinHow)
JOIN_ALGORITHMS: tuple[str, ...] = get_args(JoinAlgorithm)
GROUPBY_ALGORITHMS: tuple[str, ...] = get_args(GroupByAlgorithm)
SORT_ORDERS: tuple[str, ...] = get_args(SortOrder)
NULL_PLACEMENTS: tuple[str, ...] = get_args(NullPlacement)
AGG_NAMES: tuple[str, ...] = get_args(AggName)
ROLLING_AGG_NAMES: tuple[str, ...] = get_args(RollingAggName)
WRITE_FORMATS: tuple[str, ...] = get_args(WriteFormat)
#: aggregations that have a partial/combine form (combine-shuffle-reduce)
DECOMPOSABLE_AGGS: frozenset[str] = frozenset({"count", "sum", "mean", "min", "max", "stddev", "variance"})
