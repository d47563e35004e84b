"""Distributed table (layer 3): operators that compose kernels and collectives.

A ``DTable`` is this rank's partition of a logical table plus the
communicator that links the partitions.  Every method is collective: all ranks
call it in the same order.  Operators choose an algorithm with the Hockney
model and record it; ``explain()`` prints the choices that produced a table.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from . import aggregate, arrowtypes, hashjoin, io, kernels, memory, partition, sorting, spilling
from . import comm as tc
from .communicator import Communicator
from .costmodel import Cost, Plan, hockney, join_costs, shuffle_cost, sort_cost
from .errors import ColumnNotFoundError, InvalidOptionError, KeyTypeMismatchError, SchemaMismatchError
from .options import check_orderable, join_key_type, key_list, sort_keys
from .typing import (GROUPBY_ALGORITHMS, JOIN_ALGORITHMS, JOIN_HOWS, NULL_PLACEMENTS, ROLLING_AGG_NAMES,
                     Aggregation, GroupByAlgorithm, JoinAlgorithm, JoinHow, Keys, NullPlacement, SortKey)

log = logging.getLogger(__name__)

ColumnValue = Union[pc.Expression, pa.Array, pa.ChunkedArray, Callable[[pa.Table], Any]]
#: group-by switches to combine-shuffle-reduce when estimated groups / rows is at most this
COMBINE_MAX_GROUP_RATIO = 0.5


class DTable:
    """This rank's partition of a distributed Arrow table over ``comm``.

    Every method is collective: all ranks of ``comm`` call it, in the same order.
    Operators return a new ``DTable`` (the input is not changed); ``explain()``
    lists the algorithm each one chose.  Inside a stage, ``ctx.dtable(table)``
    builds one over the stage's communicator.

    :param comm: an mpi4py communicator, or anything that satisfies
        :class:`~hetflow.operators.Communicator`; never assumed to be ``COMM_WORLD``.
    :param table: this rank's partition (a ``pyarrow.Table`` or ``RecordBatch``).
    :raises SchemaMismatchError: the ranks' partitions do not have one schema.
    """

    def __init__(self, comm: Communicator, table: pa.Table | pa.RecordBatch, *, _plans: tuple[Plan, ...] = (), _checked: bool = False) -> None:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise TypeError(f"DTable needs a pyarrow.Table partition, got {type(table).__name__}")
        self._comm = comm
        self._table = table
        self._plans = _plans
        self._num_rows: int | None = None
        if not _checked:
            tc.check_same_schema(comm, table.schema, what="DTable partitions")

    # ------------------------------------------------------------------ basics
    @property
    def comm(self) -> Communicator:
        """The communicator that links the partitions."""
        return self._comm

    @property
    def schema(self) -> pa.Schema:
        """The table's Arrow schema (the same on every rank)."""
        return self._table.schema

    @property
    def column_names(self) -> list[str]:
        """The column names, in schema order."""
        return list(self._table.schema.names)

    @property
    def num_rows(self) -> int:
        """Global row count (collective the first time)."""
        if self._num_rows is None:
            self._num_rows = tc.allreduce_sum(self._comm, self._table.num_rows)
        return self._num_rows

    @property
    def local_num_rows(self) -> int:
        """Rows in this rank's partition (not collective)."""
        return int(self._table.num_rows)

    def to_arrow(self) -> pa.Table:
        """This rank's partition."""
        return self._table

    def gather(self, root: int = 0) -> pa.Table | None:
        """The whole table (rank order) on ``root``, ``None`` elsewhere."""
        parts = tc.gather_table(self._comm, self._table, root=root)
        return None if parts is None else pa.concat_tables(parts)

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The plans of the distributed operators that produced this table, in order (not collective)."""
        return self._plans

    def explain(self) -> str:
        """The algorithms chosen to produce this table, with their estimates (not collective)."""
        p = self._comm.Get_size()
        head = f"DTable[{p} rank(s)] {self.schema.names}"
        if not self._plans:
            return head + "\n  (input partition; no distributed operator applied)"
        lines = [head]
        models = {plan.model for plan in self._plans if plan.model}
        lines += [f"  Hockney model: {m}" for m in sorted(models)]
        lines += [f"  {i + 1}. {plan}" for i, plan in enumerate(self._plans)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DTable(rank={self._comm.Get_rank()}/{self._comm.Get_size()}, local_rows={self.local_num_rows}, schema={self.schema.names})"

    def _derive(self, table: pa.Table, plan: Plan | None = None) -> "DTable":
        if plan is not None and self._comm.Get_size() > 1 and not plan.model:
            plan = replace(plan, model=hockney(self._comm).describe())
        plans = self._plans + ((plan,) if plan is not None else ())
        memory.trim()  # an operator is done: keep only settings.scratch_cache_bytes of its free scratch buffers
        return DTable(self._comm, table, _plans=plans, _checked=True)

    def _check_columns(self, names: Iterable[str], where: str = "table") -> None:
        for n in names:
            if n not in self._table.schema.names:
                raise ColumnNotFoundError(n, self._table.schema.names, where=where)

    def _shuffle(self, table: pa.Table, keys: Sequence[str]) -> pa.Table:
        p = self._comm.Get_size()
        if p == 1:
            return table
        return tc.shuffle(self._comm, table, partition.partition_ids(table, keys, p))

    def _sizes(self, table: pa.Table | None = None) -> list[int]:
        """Every rank's bytes of ``table`` (default: this partition), in rank order (collective)."""
        nb = (self._table if table is None else table).nbytes
        return [int(b) for b in self._comm.allgather(int(nb))]

    # ------------------------------------------------------------------ embarrassingly parallel
    def select(self, columns: Sequence[str]) -> "DTable":
        """Only ``columns`` (a name or a list of names), in that order; no data moves between ranks.

        :raises ColumnNotFoundError: a name the table does not have (the message lists the columns).
        """
        cols = key_list(columns)
        self._check_columns(cols, "select")
        return self._derive(self._table.select(cols))

    def filter(self, expr: pc.Expression | Callable[[pa.Table], Any]) -> "DTable":
        """Rows where ``expr`` (a ``pyarrow.compute`` expression or ``fn(table) -> bool mask``) is true.

        ``fn`` gets the partition with view and dictionary columns as their plain types (pyarrow's
        kernels take ``string``, not ``string_view``).  Decimal columns whose arithmetic leaves
        ``decimal128``'s 38 digits (a ``sum`` is ``decimal128(38, s)``) are evaluated as
        ``decimal256``, else as ``float64``, where pyarrow refuses the precision.
        """
        if isinstance(expr, pc.Expression):
            try:
                out = arrowtypes.filter_table(self._table, expr)
            except (pa.ArrowInvalid, KeyError) as exc:
                self._raise_missing_field(exc)
                if not _decimal_precision_error(exc):
                    raise
                out = arrowtypes.filter_table(self._table, _decimal_retry(self._table, lambda t: _evaluate(arrowtypes.to_kernel(t), expr)))
        else:
            out = arrowtypes.filter_table(self._table, expr(arrowtypes.to_kernel(self._table)))
        return self._derive(out)

    def _raise_missing_field(self, exc: Exception) -> None:
        msg = str(exc)
        for part in msg.replace("'", '"').split('"'):
            if part and part not in self._table.schema.names and ("No match for FieldRef" in msg or "not found" in msg):
                if part.isidentifier():
                    raise ColumnNotFoundError(part, self._table.schema.names, where="expression") from exc

    def with_columns(self, **columns: ColumnValue) -> "DTable":
        """Add or replace columns: name = expression, array or ``fn(table) -> array``.

        Expressions and ``fn`` see view and dictionary columns as their plain types; decimal
        arithmetic beyond ``decimal128``'s 38 digits is done as ``decimal256`` and the result given
        DuckDB's type, ``decimal128`` of at most 38 digits (a value that does not fit raises), else as
        ``float64`` (a quotient of two sums, whose precision pyarrow puts at 77), as :meth:`filter` does.
        """
        table = self._table
        for name, value in columns.items():
            if isinstance(value, pc.Expression):
                try:
                    arr = _evaluate(arrowtypes.to_kernel(table), value)
                except pa.ArrowInvalid as exc:
                    if not _decimal_precision_error(exc):
                        raise
                    expr_: pc.Expression = value
                    arr = _decimal_retry(table, lambda t: _evaluate(arrowtypes.to_kernel(t), expr_))
            elif callable(value):
                arr = value(arrowtypes.to_kernel(table))
            else:
                arr = value
            if name in table.schema.names:
                table = table.set_column(table.schema.get_field_index(name), name, arr)
            else:
                table = table.append_column(name, arr)
        tc.check_same_schema(self._comm, table.schema, what="with_columns result")
        return self._derive(table)

    def rename(self, columns: Mapping[str, str]) -> "DTable":
        """Columns renamed, ``{old: new}`` (the others keep their names); no data moves.

        :raises ColumnNotFoundError: an old name the table does not have.
        """
        self._check_columns(list(columns), "rename")
        return self._derive(self._table.rename_columns([columns.get(n, n) for n in self.column_names]))

    def map_batches(self, fn: Callable[[pa.Table], pa.Table]) -> "DTable":
        """Apply ``fn`` to this rank's partition; the results must agree on the schema."""
        out = fn(self._table)
        if isinstance(out, pa.RecordBatch):
            out = pa.Table.from_batches([out])
        tc.check_same_schema(self._comm, out.schema, what="map_batches result")
        return self._derive(out)

    # ------------------------------------------------------------------ head / tail / repartition
    def head(self, n: int) -> "DTable":
        """The first ``n`` rows of the global order (rank 0's rows first); each rank keeps its part of
        them, so later ranks may hold none.  ``.head(n).gather()`` gives them on rank 0."""
        counts = self._comm.allgather(self.local_num_rows)
        before = sum(counts[: self._comm.Get_rank()])
        keep = max(0, min(self.local_num_rows, n - before))
        return self._derive(self._table.slice(0, keep))

    def tail(self, n: int) -> "DTable":
        """The last ``n`` rows of the global order; each rank keeps its part of them."""
        counts = self._comm.allgather(self.local_num_rows)
        after = sum(counts[self._comm.Get_rank() + 1 :])
        keep = max(0, min(self.local_num_rows, n - after))
        return self._derive(self._table.slice(self.local_num_rows - keep, keep))

    def repartition(self, *, by: Keys | None = None, n: int | None = None) -> "DTable":
        """Hash-partition by keys, or spread the rows (in order) evenly over the first ``n`` ranks."""
        p = self._comm.Get_size()
        if (by is None) == (n is None):
            raise InvalidOptionError("repartition arguments", {"by": by, "n": n}, ["by=keys", "n=int"])
        if by is not None:
            keys = key_list(by)
            self._check_columns(keys, "repartition")
            est = shuffle_cost(hockney(self._comm), self._sizes())
            return self._derive(self._shuffle(self._table, keys), Plan("repartition", f"hash by {keys}", est))
        assert n is not None
        if not 1 <= n <= p:
            raise InvalidOptionError("repartition n", n, [f"1..{p}"])
        counts = self._comm.allgather(self.local_num_rows)
        targets = partition.balanced_counts(sum(counts), p, n)
        slices = partition.range_slices(counts, self._comm.Get_rank(), targets)
        parts = [self._table.slice(o, ln) for o, ln in slices]
        out = pa.concat_tables(tc.alltoall_tables(self._comm, parts)) if p > 1 else self._table
        est = shuffle_cost(hockney(self._comm), self._sizes())  # an upper bound: only the imbalance moves
        return self._derive(out, Plan("repartition", f"range over {n} rank(s), order kept", est))

    def rebalance(self) -> "DTable":
        """Equal row counts on every rank, global order kept."""
        return self.repartition(n=self._comm.Get_size())

    # ------------------------------------------------------------------ join
    def join(self, right: "DTable", keys: Keys, *, right_keys: Keys | None = None, how: JoinHow = "inner",
             suffix: str = "_right", algorithm: JoinAlgorithm = "auto") -> "DTable":
        """SQL join of this table (left) with ``right`` on equal keys; null keys never match.

        Output columns: every left column (the key columns keep the left names; for ``right`` and
        ``full`` joins they hold the key of whichever side has one), then the right side's non-key
        columns, a name that clashes with a left column getting ``suffix``.  ``semi`` and ``anti``
        return the left columns only.  Row order is not defined: sort afterwards if it matters.

        :param right: the right table, over the same communicator.
        :param keys: the left key column(s); also the right ones unless ``right_keys`` is given.
        :param right_keys: the right key column(s), as many as ``keys``, with the same types (string
            and binary layouts — large, view, dictionary — count as one type; integer keys of two
            widths, ``int32`` against ``int64``, are compared as the wider; the key columns of the
            result keep the left's type, except for ``right`` and ``full`` joins, where they have the wider).
        :param how: ``inner``, ``left``, ``right``, ``full``, ``semi`` or ``anti``.
        :param suffix: appended to a right column whose name a left column already has.
        :param algorithm: ``auto`` (cheapest by the Hockney cost model: hash-shuffle both sides or
            broadcast the smaller one; out of core when the inputs are over ``settings.memory_budget``,
            see ``spilling``), ``hash``, ``broadcast`` or ``sort`` (range-partition both sides).
        :returns: the joined table, distributed over the same ranks.
        :raises ColumnNotFoundError: a key column that one side does not have.
        :raises KeyTypeMismatchError: a left and right key of different types.
        :raises InvalidOptionError: an unknown ``how`` or ``algorithm``, or ``right_keys`` of another length.
        :raises UnsupportedTypeError: ``algorithm="sort"`` with a list, struct, map or interval key.
        """
        if how not in JOIN_HOWS:
            raise InvalidOptionError("join how", how, JOIN_HOWS)
        if algorithm not in JOIN_ALGORITHMS:
            raise InvalidOptionError("join algorithm", algorithm, JOIN_ALGORITHMS)
        if not isinstance(right, DTable):
            raise TypeError(f"join needs a DTable on the right, got {type(right).__name__}")
        lk = key_list(keys)
        rk = key_list(right_keys) if right_keys is not None else list(lk)
        if len(lk) != len(rk):
            raise InvalidOptionError("right_keys", rk, [f"{len(lk)} key(s) like {lk}"])
        self._check_columns(lk, "join left side")
        right._check_columns(rk, "join right side")
        left_t, right_t = self._table, right._table
        for a, b in zip(lk, rk):
            ta, tb = left_t.schema.field(a).type, right_t.schema.field(b).type
            if join_key_type(ta) != join_key_type(tb):
                wide = _widened_integer(ta, tb)
                if wide is None:
                    raise KeyTypeMismatchError(f"join key type mismatch: left {a!r} is {ta}, right {b!r} is {tb}")
                left_t = left_t.set_column(left_t.schema.get_field_index(a), pa.field(a, wide), left_t.column(a).cast(wide))
                right_t = right_t.set_column(right_t.schema.get_field_index(b), pa.field(b, wide), right_t.column(b).cast(wide))
        if left_t is not self._table or right_t is not right._table:  # integer keys of two widths: join the widened tables
            out = DTable(self._comm, left_t, _plans=self._plans, _checked=True).join(
                DTable(right._comm, right_t, _plans=right._plans, _checked=True), lk, right_keys=rk, how=how, suffix=suffix,
                algorithm=algorithm)
            if how in ("right", "full"):  # the key columns hold either side's keys: the wider type
                return out
            table = out._table  # the left's keys only: the left's types, as SQL returns them
            for a in lk:
                i = table.schema.get_field_index(a)
                table = table.set_column(i, self.schema.field(a), table.column(i).cast(self.schema.field(a).type))
            return DTable(self._comm, table, _plans=out._plans, _checked=True)
        if algorithm == "sort":
            for a, b in zip(lk, rk):
                check_orderable(self.schema.field(a), "join algorithm 'sort'")
                check_orderable(right.schema.field(b), "join algorithm 'sort'")
        if algorithm == "auto" and spilling.needed(self._comm, self._table.nbytes + right._table.nbytes):
            return self._derive(*spilling.join(self._comm, self._table, right._table, lk, rk, how, suffix))
        p = self._comm.Get_size()
        target = kernels.join_schema(self.schema, right.schema, rk, how, suffix)[0]
        lt, rt = arrowtypes.to_kernel(self._table), arrowtypes.to_kernel(right._table)
        if p == 1:
            buckets = hashjoin.bucket_count(max(lt.num_rows, rt.num_rows), shuffled=False)
            out = arrowtypes.restore(hashjoin.hash_join(self._comm, lt, rt, lk, rk, how, suffix, buckets), target)
            local = join_costs(hockney(self._comm), [lt.nbytes], [rt.nbytes], how)["hash"]
            return self._derive(out, Plan("join", f"local {how} (1 rank)", local,
                                          detail=f"local kernel DuckDB {how} join in {buckets} hash bucket(s)"))
        stats = np.array(self._comm.allgather((int(lt.nbytes), int(rt.nbytes), lt.num_rows, rt.num_rows)), dtype=np.float64)
        l_total, r_total = stats[:, 0].sum(), stats[:, 1].sum()
        # communication (Hockney) + local join work on the bytes each rank ends up joining
        costs = join_costs(hockney(self._comm), stats[:, 0].tolist(), stats[:, 1].tolist(), how)
        if algorithm == "auto":
            choice = min(("hash", "broadcast", "broadcast_left"), key=lambda a: costs[a].seconds if a in costs else float("inf"))
        elif algorithm == "broadcast":
            if "broadcast" in costs and ("broadcast_left" not in costs or r_total <= l_total):
                choice = "broadcast"
            elif "broadcast_left" in costs:
                choice = "broadcast_left"
            else:
                raise InvalidOptionError(f"join algorithm for how={how!r}", algorithm, ["auto", "hash", "sort"])
        else:
            choice = algorithm
        if choice == "hash":  # null keys never match: hash_join keeps them home (no filtered copy)
            buckets = hashjoin.bucket_count(int(math.ceil(max(stats[:, 2].sum(), stats[:, 3].sum()) / p)))
            out = hashjoin.hash_join(self._comm, lt, rt, lk, rk, how, suffix, buckets)
        elif choice == "broadcast":
            rt = pa.concat_tables(tc.allgather_table(self._comm, rt))
        elif choice == "broadcast_left":
            lt = pa.concat_tables(tc.allgather_table(self._comm, lt))
        else:
            lt, rt = sorting.range_partition(self._comm, [lt, rt], [lk, rk])
        if choice != "hash":
            out = kernels.join(lt, rt, lk, rk, how, suffix)
        del lt, rt
        name = {"hash": "hash-shuffle", "broadcast": "broadcast right", "broadcast_left": "broadcast left", "sort": "sort (range-partition)"}[choice]
        detail = f"left {l_total / 1e6:.1f} MB, right {r_total / 1e6:.1f} MB, local kernel DuckDB {how} join"
        if choice == "hash":
            detail += f", shuffled and joined in {buckets} hash bucket(s) per rank"
        return self._derive(arrowtypes.restore(out, target),
                            Plan("join", name, costs[choice], {k: c.seconds for k, c in costs.items()}, detail))

    # ------------------------------------------------------------------ sort / rolling
    def sort_by(self, sorting_: SortKey | Sequence[SortKey], *, nulls: NullPlacement = "at_end") -> "DTable":
        """Sort globally across ranks (rank 0 holds the first rows); stable, except out of core (inputs
        over ``settings.memory_budget``, see ``spilling``), where ties keep no particular order.

        :param sorting_: a column name, ``(name, "ascending" | "descending")``, or a list of them.
        :param nulls: ``at_end`` or ``at_start``.
        :returns: the sorted table; partitions are balanced by sample sort, not equal in size.
        :raises UnsupportedTypeError: a list, struct, map or interval sort key.
        """
        by = sort_keys(sorting_)
        if nulls not in NULL_PLACEMENTS:
            raise InvalidOptionError("nulls", nulls, NULL_PLACEMENTS)
        self._check_columns([c for c, _ in by], "sort_by")
        for c, _ in by:
            check_orderable(self.schema.field(c), "sort_by")
        if spilling.needed(self._comm, self._table.nbytes):
            return self._derive(*spilling.sort_by(self._comm, self._table, by, nulls))
        p = self._comm.Get_size()
        table = arrowtypes.to_kernel(self._table)
        est = self._sort_estimate(table, by)
        out = arrowtypes.restore(sorting.sample_sort(self._comm, table, by, nulls), self.schema)
        del table
        return self._derive(out, Plan("sort_by", "sample sort (regular sampling, PSRS)" if p > 1 else "local sort", est,
                                      detail="local kernel numpy packed sort (one integer-like key without nulls) "
                                             "or polars arg-sort + take"))

    def _sort_estimate(self, table: pa.Table, by: Sequence[tuple[str, str]]) -> Cost:
        """``sort_cost`` with the samples ``sample_sort`` will gather: for one ascending integer-like
        key without nulls ``range_ids``' (key, rank-and-position) pairs, else ``SAMPLES_PER_RANK * p``
        rows of the key columns and two int64 tie breakers."""
        p = self._comm.Get_size()
        key_bytes = sum(table.column(c).nbytes for c, _ in by)
        stats = np.array(self._comm.allgather((int(table.nbytes), table.num_rows, int(key_bytes),
                                               sum(table.column(c).null_count for c, _ in by))), dtype=np.float64)
        sizes, rows = stats[:, 0].tolist(), stats[:, 1]
        total = float(rows.sum())
        t = table.schema.field(by[0][0]).type
        integer_key = (len(by) == 1 and by[0][1] == "ascending" and stats[:, 3].sum() == 0
                       and (pa.types.is_integer(t) or pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t)))
        if integer_key:
            width = 8.0 + t.bit_width // 8
            want = sorting.range_sample_rows(int(total), p)
        else:
            width = 16.0 + (float(stats[:, 2].sum()) / total if total else 0.0)
            want = sorting.SAMPLES_PER_RANK * p
        samples = [width * (want * n / total if total else 0.0) for n in rows]
        return sort_cost(hockney(self._comm), sizes, samples)

    def rolling(self, order_by: SortKey | Sequence[SortKey], window: int, aggs: Sequence[Aggregation]) -> "DTable":
        """Trailing windows of ``window`` rows over the global order given by ``order_by``.

        Halo rows come from the preceding ranks.  The output is the sorted table plus one column per
        aggregation, named ``<column>_rolling_<agg>`` (``count``, ``sum``, ``mean``, ``min``, ``max``,
        ``stddev``, ``variance``).

        :raises UnsupportedAggregationError: an aggregation outside that list.
        """
        if not isinstance(window, int) or window < 1:
            raise InvalidOptionError("rolling window", window, ["int >= 1"])
        for col, agg in aggs:
            if agg not in ROLLING_AGG_NAMES:
                from .errors import UnsupportedAggregationError

                raise UnsupportedAggregationError(f"unsupported rolling aggregation {agg!r} on {col!r} (supported: {list(ROLLING_AGG_NAMES)})")
        self._check_columns([c for c, _ in aggs], "rolling")
        ordered = self.sort_by(order_by)
        local = ordered._table
        need = window - 1
        rank, p = self._comm.Get_rank(), self._comm.Get_size()
        halo = local.slice(0, 0)
        if p > 1 and need > 0:  # chain: rank r gets the last window-1 rows before it from r-1
            if rank > 0:
                halo = tc.recv_table(self._comm, rank - 1, tag=81)
            if rank < p - 1:
                ext = pa.concat_tables([halo, local])
                tc.send_table(self._comm, ext.slice(max(0, ext.num_rows - need)), rank + 1, tag=81)
        out = kernels.rolling(pa.concat_tables([halo, local]), window, aggs, halo.num_rows)
        tc.check_same_schema(self._comm, out.schema, what="rolling result")
        plan = Plan("rolling", f"halo exchange of {need} row(s) between neighbours", Cost(exchange_s=(p - 1) * hockney(self._comm).alpha))
        return ordered._derive(out, plan)

    # ------------------------------------------------------------------ grouping / distinct / sets
    def group_by(self, keys: Keys) -> "GroupBy":
        """Group by ``keys`` (a name or a list); call :meth:`GroupBy.aggregate` on the result.

        :raises ColumnNotFoundError: a key the table does not have.
        """
        return GroupBy(self, key_list(keys))

    def aggregate(self, aggs: Sequence[Aggregation]) -> dict[str, Any]:
        """Whole-table aggregates, replicated on every rank as Python values.

        :param aggs: ``[(column, agg), ...]`` with ``agg`` one of ``count``, ``count_distinct``,
            ``sum``, ``mean``, ``min``, ``max``, ``stddev``, ``variance``, ``first``, ``last``, ``list``;
            ``("*", "count")`` counts rows (SQL ``count(*)``), keyed ``count``.
        :returns: a dict keyed ``<column>_<agg>``, e.g. ``{"v_min": 0, "v_sum": 10}``, identical on every rank.
        :raises UnsupportedAggregationError: an unknown aggregation, or one not defined for the column's type.
        :raises AggregateOverflowError: an integer sum outside int64/uint64 (raised on every rank).
        """
        if any(c == STAR for c, _ in aggs):
            out = aggregate.column_aggregates(self._comm, _with_star(self._table, aggs),
                                              [(_STAR_COLUMN if c == STAR else c, a) for c, a in aggs])
            return {("count" if k == f"{_STAR_COLUMN}_count" else k): v for k, v in out.items()}
        self._check_columns([c for c, _ in aggs], "aggregate")
        return aggregate.column_aggregates(self._comm, self._table, list(aggs))

    def unique(self, keys: Keys | None = None) -> "DTable":
        """Distinct rows, or the first row (global order) of every distinct ``keys`` value."""
        ks = self.column_names if keys is None else key_list(keys)
        self._check_columns(ks, "unique")
        p = self._comm.Get_size()
        table = arrowtypes.to_kernel(self._table)
        est = shuffle_cost(hockney(self._comm), self._sizes(table))
        shuffled = self._shuffle(table, ks)
        del table
        return self._derive(arrowtypes.restore(kernels.first_per_key(shuffled, ks), self.schema), Plan("unique", "hash-shuffle + first per key" if p > 1 else "local", est))

    def _set_op(self, other: "DTable", op: str) -> "DTable":
        if not other.schema.remove_metadata().equals(self.schema.remove_metadata()):
            raise SchemaMismatchError(f"{op}: schemas differ: {tc._short(self.schema)} vs {tc._short(other.schema)}")
        cols = self.column_names
        p = self._comm.Get_size()
        a, b = arrowtypes.to_kernel(self._table), arrowtypes.to_kernel(other._table.cast(self.schema))
        model = hockney(self._comm)
        est = shuffle_cost(model, self._sizes(a)) + shuffle_cost(model, self._sizes(b))
        a, b = self._shuffle(a, cols), self._shuffle(b, cols)
        return self._derive(arrowtypes.restore(kernels.set_operation(a, b, op), self.schema), Plan(op, "hash-shuffle both sides on all columns" if p > 1 else "local", est))

    def union(self, other: "DTable", *, distinct: bool = True) -> "DTable":
        """Rows of either table: SQL ``UNION`` (distinct rows, nulls equal) or, with
        ``distinct=False``, ``UNION ALL`` (a local concatenation, no data moves).

        :raises SchemaMismatchError: the two schemas differ.
        """
        if not distinct:
            if not other.schema.remove_metadata().equals(self.schema.remove_metadata()):
                raise SchemaMismatchError(f"union: schemas differ: {tc._short(self.schema)} vs {tc._short(other.schema)}")
            return self._derive(pa.concat_tables([self._table, other._table.cast(self.schema)]), Plan("union", "local concat (UNION ALL)"))
        return self._set_op(other, "union")

    def intersect(self, other: "DTable") -> "DTable":
        """Distinct rows present in both tables (SQL ``INTERSECT``; nulls equal).

        :raises SchemaMismatchError: the two schemas differ.
        """
        return self._set_op(other, "intersect")

    def difference(self, other: "DTable") -> "DTable":
        """Distinct rows of this table that ``other`` does not have (SQL ``EXCEPT``; nulls equal).

        :raises SchemaMismatchError: the two schemas differ.
        """
        return self._set_op(other, "difference")

    # ------------------------------------------------------------------ output
    def write_parquet(self, directory: str, *, filesystem: pafs.FileSystem | None = None) -> list[str]:
        """Write each rank's partition as ``<directory>/part-<rank>.parquet`` (five-digit rank).

        A local ``directory`` is created (mode 0700) if missing, and each file is written to a
        temporary name, fsynced and renamed, so a reader never sees a partial file.  An object-store
        URI (``s3://bucket/prefix``, through :mod:`hetflow.operators.location`), or a path on
        ``filesystem`` (a ``pyarrow.fs.FileSystem``), gets one object per rank, serialized first and
        then uploaded: an object becomes visible only once its upload completes, so a failed or
        killed writer leaves nothing under the final name (it may leave an incomplete multipart
        upload, which the store's lifecycle rules clean up).

        :returns: every rank's file path (or URI), in rank order, on every rank.
        :raises StorageError: the object store refused or could not be reached (names bucket, key, cause).
        """
        return io.write_partitions(self._comm, self._table, directory, "parquet", filesystem=filesystem)

    def write_ipc(self, directory: str) -> list[str]:
        """Like :meth:`write_parquet`, as Arrow IPC files ``part-<rank>.arrow`` (readable zero-copy
        with :func:`~hetflow.operators.read_ipc`)."""
        return io.write_partitions(self._comm, self._table, directory, "ipc")


#: ``("*", "count")`` counts rows (SQL ``count(*)``); its result is named ``count``
STAR = "*"
_STAR_COLUMN = "__hetflow_star"


def _with_star(table: pa.Table, aggs: Sequence[Aggregation]) -> pa.Table:
    """``table`` with a column of ones to count for ``("*", "count")``; ``*`` takes no other aggregation."""
    bad = [a for c, a in aggs if c == STAR and a != "count"]
    if bad:
        from .errors import UnsupportedAggregationError

        raise UnsupportedAggregationError(f"'*' only counts rows: ('*', 'count'), got ('*', {bad[0]!r})")
    return table.append_column(_STAR_COLUMN, pa.array(np.ones(table.num_rows, dtype=np.int8)))


def _decimal_precision_error(exc: Exception) -> bool:
    return isinstance(exc, pa.ArrowInvalid) and ("recision is not great enough" in str(exc) or "ecimal precision out of range" in str(exc))


def _decimal_retry(table: pa.Table, fn: Callable[[pa.Table], Any]) -> Any:
    """``fn`` over ``table`` with its decimal128 columns as decimal256, and failing that as float64: the
    same types on every rank (the failure is the types', not the data's)."""
    dec = [i for i, f in enumerate(table.schema) if pa.types.is_decimal(f.type)]
    wide = table
    for i in dec:
        f = table.schema.field(i)
        if pa.types.is_decimal128(f.type):
            t = pa.decimal256(f.type.precision, f.type.scale)
            wide = wide.set_column(i, f.with_type(t), table.column(i).cast(t))
    try:
        out = fn(wide)
        if pa.types.is_decimal256(out.type) and not any(pa.types.is_decimal256(table.schema.field(i).type) for i in dec):
            # DuckDB's result type: at most 38 digits, an overflowing value an error (a safe cast)
            out = out.cast(pa.decimal128(min(38, out.type.precision), out.type.scale))
        return out
    except pa.ArrowInvalid as exc:
        if not _decimal_precision_error(exc):
            raise
    floats = table
    for i in dec:
        f = table.schema.field(i)
        floats = floats.set_column(i, f.with_type(pa.float64()), table.column(i).cast(pa.float64()))
    return fn(floats)


def _widened_integer(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The integer type two join keys of different integer types are compared as (SQL widens
    ``int32 = int64`` to ``int64``), or ``None`` when one of them is not an integer or no integer
    type holds both (``int64`` against ``uint64``)."""
    if not (pa.types.is_integer(a) and pa.types.is_integer(b)):
        return None
    signed = pa.types.is_signed_integer
    if signed(a) == signed(b):
        return a if a.bit_width >= b.bit_width else b
    s, u = (a, b) if signed(a) else (b, a)
    for t in (pa.int16(), pa.int32(), pa.int64()):
        if t.bit_width > u.bit_width and t.bit_width >= s.bit_width:
            return t
    return None


def _evaluate(table: pa.Table, expr: pc.Expression) -> pa.ChunkedArray:
    import pyarrow.acero as ac

    decl = ac.Declaration.from_sequence([
        ac.Declaration("table_source", ac.TableSourceNodeOptions(table)),
        ac.Declaration("project", ac.ProjectNodeOptions([expr], ["__value"])),
    ])
    return decl.to_table(use_threads=False).column(0)


class GroupBy:
    """What ``DTable.group_by(keys)`` returns; call :meth:`aggregate` on it."""

    def __init__(self, table: DTable, keys: list[str]) -> None:
        table._check_columns(keys, "group_by")
        self._table = table
        self._keys = keys

    def aggregate(self, aggs: Sequence[Aggregation], *, algorithm: GroupByAlgorithm = "auto") -> DTable:
        """One row per distinct key value (nulls form one group) with one column per aggregation.

        Output columns: the keys, then ``<column>_<agg>`` for each ``(column, agg)`` in order —
        ``group_by("run").aggregate([("energy", "sum"), ("energy", "mean")])`` gives
        ``run, energy_sum, energy_mean``.  Types follow DuckDB: ``count``/``count_distinct`` int64;
        ``min``/``max``/``first``/``last`` the input's type, ``list`` a list of it; ``sum`` of integers
        int64 (uint64 for unsigned), of floats float64, of ``decimal(p, s)`` ``decimal128(38, s)``;
        ``mean``/``variance``/``stddev`` (sample, ddof 1) float64.  Group order is not defined.

        :param aggs: ``[(column, agg), ...]``; ``agg`` is one of ``count``, ``count_distinct``, ``sum``,
            ``mean``, ``min``, ``max``, ``stddev``, ``variance``, ``first``, ``last``, ``list``;
            ``("*", "count")`` counts the group's rows (SQL ``count(*)``) into a column named ``count``.
        :param algorithm: ``auto`` (combine-shuffle-reduce when few groups are estimated, else a
            range or hash shuffle; out of core when the inputs are over ``settings.memory_budget``,
            see ``spilling``), ``combine``, ``shuffle`` or ``range`` (one integer key without nulls).
        :raises UnsupportedAggregationError: an unknown aggregation, one not defined for the column's
            type, or ``combine`` with a non-decomposable one (``count_distinct``, ``first``, ``last``, ``list``).
        :raises AggregateOverflowError: an integer sum outside int64/uint64 (raised on every rank).
        :raises InvalidOptionError: an unknown ``algorithm``, or ``range`` for keys it cannot take.
        """
        if algorithm not in GROUPBY_ALGORITHMS:
            raise InvalidOptionError("group_by algorithm", algorithm, GROUPBY_ALGORITHMS)
        dt = self._table
        if any(c == STAR for c, _ in aggs):  # count(*): the count of a column of ones, named "count"
            star = DTable(dt.comm, _with_star(dt.to_arrow(), aggs), _plans=dt.plans, _checked=True)
            out = GroupBy(star, self._keys).aggregate([(_STAR_COLUMN if c == STAR else c, a) for c, a in aggs], algorithm=algorithm)
            return out.rename({f"{_STAR_COLUMN}_count": "count"})
        dt._check_columns([c for c, _ in aggs], "aggregate")
        work = dt.to_arrow().select(list(dict.fromkeys(self._keys + [c for c, _ in aggs])))
        if algorithm == "auto" and spilling.needed(dt.comm, work.nbytes):
            return dt._derive(*spilling.group_aggregate(dt.comm, work, self._keys, list(aggs)))
        out, plan = aggregate.group_aggregate(dt.comm, dt.to_arrow(), self._keys, list(aggs), algorithm)
        return dt._derive(out, plan)
