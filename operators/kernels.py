"""Local kernels (layer 1): pure functions on ``pa.Table``, no communicator.

The engine per operator was chosen by measurement (one core, 10M rows of two
int64 columns, ~90% unique keys; see benchmarks/operators.py):

=============  ========  ========  ========  ==========
operator       pyarrow   polars    DuckDB    numpy (intkeys)
=============  ========  ========  ========  ==========
inner join     3.7 s     1.9 s     0.7 s     1.1 s (sort-merge)  -> DuckDB (SQL null semantics for free)
sort           2.0 s     0.4 s     0.8 s     0.12 s (packed sort) -> intkeys for one integer-like key
                                                        without nulls, else polars arg-sort + Arrow take
group-by sum   1.7 s     1.4 s     0.95 s    0.31 s (sort + reduceat) -> intkeys for one integer-like
                                                        key and count/sum/mean/min/max of integers
                                                        without nulls; else DuckDB for numeric
                                                        count/sum/mean/min/max/std/var, pyarrow
                                                        (ordered) for first/last/list/others
=============  ========  ========  ========  ==========

(CPU seconds; sort is the permutation only.)

All engines read the Arrow buffers without copying; results are cast back to
the schema pyarrow itself would produce, so a result never depends on which
engine ran.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import intkeys
from .partition import canonical_floats
from .errors import UnsupportedAggregationError
from .typing import AGG_NAMES

log = logging.getLogger(__name__)

#: local DuckDB hash-join throughput on one core (0.73 s for 2 x 160 MB above); the join cost model's compute term
JOIN_SECONDS_PER_BYTE = 2.3e-9

_local = threading.local()


def threads() -> int:
    """Kernel threads per rank: ``HETFLOW_OPERATOR_THREADS`` or the cores shared by this node's ranks."""
    env = os.environ.get("HETFLOW_OPERATOR_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = 1
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE"):
        if key in os.environ:
            local = int(os.environ[key])
            break
    return max(1, cores // max(1, local))


def _polars() -> Any:
    if "POLARS_MAX_THREADS" not in os.environ:
        os.environ["POLARS_MAX_THREADS"] = str(threads())
    import polars as pl

    return pl


def _duck() -> Any:
    con = getattr(_local, "duck", None)
    if con is None:
        import duckdb

        con = duckdb.connect(":memory:")
        con.execute(f"SET threads={threads()}")
        con.execute("SET preserve_insertion_order=false")
        _local.duck = con
    return con


def q(name: str) -> str:
    """Quote an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _duck_query(sql: str, **tables: pa.Table) -> pa.Table:
    con = _duck()
    try:
        for name, t in tables.items():
            con.register(name, t)
        return con.sql(sql).to_arrow_table()
    finally:
        for name in tables:
            con.unregister(name)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rename by position and cast to ``schema`` (no-op when already equal)."""
    if table.schema.equals(schema):
        return table
    table = table.rename_columns(schema.names)
    if table.num_rows == 0:
        return schema.empty_table()
    return table.cast(schema)


# --------------------------------------------------------------------------- join


def join_schema(left: pa.Schema, right: pa.Schema, right_keys: Sequence[str], how: str, suffix: str) -> tuple[pa.Schema, list[str]]:
    """Output schema of a join and the output names of the right side's non-key columns."""
    fields = [pa.field(f.name, f.type) for f in left]
    if how in ("semi", "anti"):
        return pa.schema(fields), []
    names = set(left.names)
    right_out = []
    for f in right:
        if f.name in right_keys:
            continue
        name = f.name + suffix if f.name in names else f.name
        names.add(name)
        right_out.append(name)
        fields.append(pa.field(name, f.type))
    return pa.schema(fields), right_out


def join(left: pa.Table, right: pa.Table, keys: Sequence[str], right_keys: Sequence[str], how: str, suffix: str) -> pa.Table:
    """SQL join (null keys never match); keys coalesced into the left key columns."""
    schema, right_out = join_schema(left.schema, right.schema, right_keys, how, suffix)
    if left.num_rows == 0 and how in ("inner", "left", "semi", "anti"):
        return schema.empty_table()
    if right.num_rows == 0 and how in ("inner", "right", "semi"):
        return schema.empty_table()
    on = " AND ".join(f"l.{q(a)} = r.{q(b)}" for a, b in zip(keys, right_keys))
    kmap = dict(zip(keys, right_keys))
    if how in ("semi", "anti"):
        exists = "EXISTS" if how == "semi" else "NOT EXISTS"
        sql = f"SELECT l.* FROM l WHERE {exists} (SELECT 1 FROM r WHERE {on})"
    else:
        cols = []
        for name in left.schema.names:
            if name in kmap and how in ("right", "full"):
                cols.append(f"COALESCE(l.{q(name)}, r.{q(kmap[name])})")
            else:
                cols.append(f"l.{q(name)}")
        rnames = [f.name for f in right.schema if f.name not in right_keys]
        cols += [f"r.{q(n)}" for n in rnames]
        select = ", ".join(f"{c} AS c{i}" for i, c in enumerate(cols))
        sql = f"SELECT {select} FROM l {how.upper()} JOIN r ON {on}"
    return conform(_duck_query(sql, l=left, r=right), schema)


# --------------------------------------------------------------------------- sort


def sort_indices(table: pa.Table, by: Sequence[tuple[str, str]], nulls: str) -> np.ndarray:
    """Stable order of rows (numpy int array) by the sort keys."""
    if len(by) == 1:
        values = intkeys.key_values(table.column(by[0][0]))
        fast = None if values is None else intkeys.packed_order(values, by[0][1] == "descending")
        if fast is not None:
            return fast[0]
    pl = _polars()
    names = [c for c, _ in by]
    sub = table.select(names).rename_columns([f"c{i}" for i in range(len(names))])
    df = pl.from_arrow(sub, rechunk=False)
    idx = df.select(
        pl.arg_sort_by(
            [f"c{i}" for i in range(len(names))],
            descending=[o == "descending" for _, o in by],
            nulls_last=[nulls == "at_end"] * len(by),
            maintain_order=True,
        )
    ).to_series()
    return np.asarray(idx.to_numpy())


def sort(table: pa.Table, by: Sequence[tuple[str, str]], nulls: str, *, consume: bool = False) -> pa.Table:
    """``table`` stably sorted; ``consume``: the caller gives ``table`` up (it alone owns its
    buffers, like a shuffle's result), so a kernel may overwrite them instead of copying."""
    if table.num_rows <= 1:
        return table
    if len(by) == 1:
        fast = intkeys.sort_table(table, by[0][0], by[0][1] == "descending", consume=consume)
        if fast is not None:
            return fast
    return table.take(pa.array(sort_indices(table, by, nulls)))


# --------------------------------------------------------------------------- aggregation

_PA_FUNC = {"count": "count", "count_distinct": "count_distinct", "sum": "sum", "mean": "mean",
            "min": "min", "max": "max", "stddev": "stddev", "variance": "variance",
            "first": "first", "last": "last", "list": "list"}
_DUCK_FUNC = {"count": "count({})", "count_distinct": "count(DISTINCT {})", "sum": "sum({})",
              "mean": "avg({})", "min": "min({})", "max": "max({})",
              "stddev": "stddev_samp({})", "variance": "var_samp({})"}


def agg_name(col: str, agg: str) -> str:
    return f"{col}_{agg}"


def _pa_options(agg: str) -> Any:
    if agg in ("stddev", "variance"):
        return pc.VarianceOptions(ddof=1)
    if agg in ("first", "last"):
        return pc.ScalarAggregateOptions(skip_nulls=False)
    if agg in ("count", "count_distinct"):
        return pc.CountOptions(mode="only_valid")
    return None


def aggregate_schema(schema: pa.Schema, keys: Sequence[str], aggs: Sequence[tuple[str, str]]) -> pa.Schema:
    """Output schema of a group-by aggregate: keys then one column per aggregation (pyarrow's types)."""
    for col, agg in aggs:
        if agg not in AGG_NAMES:
            raise UnsupportedAggregationError(f"unsupported aggregation {agg!r} on column {col!r} (supported: {list(AGG_NAMES)})")
    out = _pa_group_by(schema.empty_table(), keys, aggs)
    return out.schema


def _pa_group_by(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], *, ordered: bool = True) -> pa.Table:
    spec = [(col, _PA_FUNC[agg], _pa_options(agg)) for col, agg in aggs]
    try:
        if keys:
            res = table.group_by(list(keys), use_threads=not ordered and threads() > 1).aggregate(spec)
        else:
            res = _scalar_aggregate(table, aggs)
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        bad = [(c, a, str(table.schema.field(c).type)) for c, a in aggs]
        raise UnsupportedAggregationError(f"aggregation not supported for these column types {bad}: {exc}") from exc
    names = list(keys) + [agg_name(c, a) for c, a in aggs]
    key_cols, agg_cols = _split(res, len(keys), keys)
    return pa.table(key_cols + agg_cols, names=names)


def _split(res: pa.Table, n_keys: int, keys: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """(key columns, aggregate columns) of a pyarrow group-by result (keys first since pyarrow 20, last before)."""
    cols = list(res.columns)
    if n_keys == 0:
        return [], cols
    if list(res.schema.names[:n_keys]) == list(keys):
        return cols[:n_keys], cols[n_keys:]
    return cols[-n_keys:], cols[:-n_keys]


def _scalar_aggregate(table: pa.Table, aggs: Sequence[tuple[str, str]]) -> pa.Table:
    """Whole-table aggregates as a one-row table (pyarrow's grouped types)."""
    one = table.append_column("__all", pa.repeat(pa.scalar(0, pa.int8()), table.num_rows) if table.num_rows else pa.array([], pa.int8()))
    spec = [(col, _PA_FUNC[agg], _pa_options(agg)) for col, agg in aggs]
    res = one.group_by(["__all"], use_threads=False).aggregate(spec).drop_columns(["__all"])
    if res.num_rows == 0:  # SQL: aggregates over no rows give one row (count 0, others null)
        arrays = []
        for (col, agg), field in zip(aggs, res.schema):
            arrays.append(pa.array([0 if agg in ("count", "count_distinct") else None], field.type))
        res = pa.table(arrays, schema=res.schema)
    return res


def _duck_ok(schema: pa.Schema, aggs: Sequence[tuple[str, str]]) -> bool:
    for col, agg in aggs:
        t = schema.field(col).type
        if agg not in _DUCK_FUNC:
            return False
        if agg in ("count", "count_distinct"):
            continue
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            return False
    return True


def group_aggregate(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], *,
                    consume: bool = False) -> pa.Table:
    """Final aggregation of all rows of each group (SQL semantics: nulls form one group, aggregates skip nulls).
    ``consume`` as in ``sort``."""
    schema = aggregate_schema(table.schema, keys, aggs)
    if not keys:
        return conform(_scalar_aggregate(table, aggs), schema)
    if table.num_rows == 0:
        return schema.empty_table()
    fast = intkeys.group_aggregate(table, keys, aggs, schema, consume=consume)
    if fast is not None:
        return fast
    if _duck_ok(table.schema, aggs):
        cols = [q(k) for k in keys] + [_DUCK_FUNC[a].format(q(c)) for c, a in aggs]
        select = ", ".join(f"{c} AS c{i}" for i, c in enumerate(cols))
        sql = f"SELECT {select} FROM t GROUP BY ALL"
        return conform(_duck_query(sql, t=table), schema)
    return conform(_pa_group_by(table, keys, aggs), schema)


def partial_aggregate(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]]) -> pa.Table:
    """Per-rank partial state of decomposable aggregates (combine step of combine-shuffle-reduce)."""
    spec: list[tuple[str, str]] = []
    work = table
    for col, agg in aggs:
        if agg in ("count", "sum", "min", "max"):
            spec.append((col, agg))
        elif agg == "mean":
            spec += [(col, "sum"), (col, "count")]
        else:  # stddev / variance: count, mean, sum of squared deviations (Chan et al.)
            spec += [(col, "count"), (col, "mean"), (col, "m2")]
    spec = list(dict.fromkeys(spec))
    pa_spec = []
    for col, agg in spec:
        if agg == "m2":
            pa_spec.append((col, "variance", pc.VarianceOptions(ddof=0)))
        elif agg == "sum" and pa.types.is_integer(work.schema.field(col).type) is False:
            pa_spec.append((col, "sum", None))
        else:
            pa_spec.append((col, _PA_FUNC[agg], _pa_options(agg)))
    if keys:
        res = work.group_by(list(keys), use_threads=False).aggregate(pa_spec)
    else:
        res = work.append_column("__all", pa.array(np.zeros(work.num_rows, dtype=np.int8))).group_by(["__all"]).aggregate(pa_spec).drop_columns(["__all"])
    key_cols, agg_cols = _split(res, len(keys), keys)
    cols = list(key_cols)
    names = list(keys)
    for i, (col, agg) in enumerate(spec):
        c = agg_cols[i]
        if agg == "m2":  # variance(ddof=0) * count
            cnt = agg_cols[spec.index((col, "count"))]
            c = pc.multiply(pc.fill_null(c, 0.0), pc.cast(cnt, pa.float64()))
        cols.append(c)
        names.append(f"{col}__{agg}")
    return pa.table(cols, names=names)


def combine_aggregate(partials: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], schema: pa.Schema) -> pa.Table:
    """Merge partial states (same groups on one rank) into final aggregates, cast to ``schema``."""
    work = partials
    extra = []
    for col, agg in aggs:
        if agg in ("stddev", "variance") and col not in extra:
            n = pc.cast(work.column(f"{col}__count"), pa.float64())
            m = pc.fill_null(work.column(f"{col}__mean"), 0.0)
            work = work.append_column(f"{col}__nm", pc.multiply(n, m))
            work = work.append_column(f"{col}__nmm", pc.multiply(pc.multiply(n, m), m))
            extra.append(col)
    spec: list[tuple[str, str, Any]] = []
    for name in work.schema.names:
        if name in keys:
            continue
        col, part = name.rsplit("__", 1)
        func = {"count": "sum", "sum": "sum", "min": "min", "max": "max", "mean": "sum", "m2": "sum", "nm": "sum", "nmm": "sum"}[part]
        spec.append((name, func, None))
    if keys:
        res = work.group_by(list(keys), use_threads=False).aggregate(spec)
    else:
        res = work.append_column("__all", pa.array(np.zeros(work.num_rows, dtype=np.int8))).group_by(["__all"]).aggregate(spec).drop_columns(["__all"])
        if res.num_rows == 0:
            res = pa.table({f"{n}_{f}": pa.array([None], work.schema.field(n).type) for n, f, _ in spec})
    key_cols, agg_cols = _split(res, len(keys), keys)
    got = {n: agg_cols[i] for i, (n, _, _) in enumerate(spec)}
    cols: list[Any] = list(key_cols)
    for col, agg in aggs:
        if agg == "count":
            cols.append(pc.fill_null(got[f"{col}__count"], 0))
        elif agg in ("sum", "min", "max"):
            cols.append(got[f"{col}__{agg}"])
        elif agg == "mean":
            cnt = got[f"{col}__count"]
            total = pc.cast(got[f"{col}__sum"], pa.float64())
            cols.append(pc.if_else(pc.greater(cnt, 0), pc.divide(total, pc.cast(cnt, pa.float64())), pa.scalar(None, pa.float64())))
        else:
            n = pc.cast(got[f"{col}__count"], pa.float64())
            s = got[f"{col}__nm"]
            m2 = pc.add(pc.subtract(pc.add(got[f"{col}__m2"], got[f"{col}__nmm"]), pc.divide(pc.multiply(s, s), pc.max_element_wise(n, 1.0))), 0.0)
            m2 = pc.max_element_wise(m2, 0.0)
            var = pc.if_else(pc.greater(n, 1.0), pc.divide(m2, pc.subtract(n, 1.0)), pa.scalar(None, pa.float64()))
            cols.append(pc.sqrt(var) if agg == "stddev" else var)
    return conform(pa.table(cols, names=schema.names), schema)


# --------------------------------------------------------------------------- distinct / set operations


def first_per_key(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The first row (in table order) of every distinct value of ``keys`` (nulls equal)."""
    if table.num_rows == 0:
        return table
    pos = pa.array(np.arange(table.num_rows, dtype=np.int64))
    sub = canonical_floats(table.select(list(keys)), keys).append_column("__pos", pos)
    first = sub.group_by(list(keys), use_threads=False).aggregate([("__pos", "min")]).column("__pos_min")
    idx = np.sort(first.to_numpy())
    return table.take(pa.array(idx))


def set_operation(a: pa.Table, b: pa.Table, op: str) -> pa.Table:
    """``union`` (distinct), ``intersect`` or ``difference`` with SQL set semantics (nulls equal)."""
    names = a.schema.names
    a, b = canonical_floats(a, names), canonical_floats(b, names)
    both = pa.concat_tables([
        a.append_column("__side", pa.array(np.zeros(a.num_rows, dtype=np.int8))),
        b.append_column("__side", pa.array(np.ones(b.num_rows, dtype=np.int8))),
    ])
    if both.num_rows == 0:
        return a.schema.empty_table()
    g = both.group_by(names, use_threads=False).aggregate([("__side", "min"), ("__side", "max")])
    if op == "intersect":
        g = g.filter(pc.and_(pc.equal(g.column("__side_min"), 0), pc.equal(g.column("__side_max"), 1)))
    elif op == "difference":
        g = g.filter(pc.equal(g.column("__side_max"), 0))
    return conform(g.select(names), a.schema)


# --------------------------------------------------------------------------- rolling


def rolling(table: pa.Table, window: int, aggs: Sequence[tuple[str, str]], skip: int) -> pa.Table:
    """Trailing row windows of size ``window`` (current row included); drop the first ``skip`` (halo) rows."""
    pl = _polars()
    names = [c for c, _ in aggs]
    df = pl.from_arrow(table.select(sorted(set(names))), rechunk=True)
    exprs = []
    for col, agg in aggs:
        e = pl.col(col)
        out = f"{col}_rolling_{agg}"
        if agg == "count":
            exprs.append(e.is_not_null().cast(pl.Int64).rolling_sum(window, min_samples=1).alias(out))
        elif agg == "sum":
            exprs.append(e.rolling_sum(window, min_samples=1).alias(out))
        elif agg == "mean":
            exprs.append(e.cast(pl.Float64).rolling_mean(window, min_samples=1).alias(out))
        elif agg == "min":
            exprs.append(e.rolling_min(window, min_samples=1).alias(out))
        elif agg == "max":
            exprs.append(e.rolling_max(window, min_samples=1).alias(out))
        elif window < 2:  # sample stddev / variance of one value is NULL
            exprs.append(pl.repeat(None, df.height, dtype=pl.Float64).alias(out))
        elif agg == "stddev":
            exprs.append(e.cast(pl.Float64).rolling_std(window, min_samples=2, ddof=1).alias(out))
        else:
            exprs.append(e.cast(pl.Float64).rolling_var(window, min_samples=2, ddof=1).alias(out))
    res = df.select(exprs)
    out = table
    for s in res.iter_columns():
        out = out.append_column(s.name, s.to_arrow().cast(_rolling_type(table.schema.field(s.name.split("_rolling_")[0]).type, s.name.rsplit("_", 1)[1])))
    return out.slice(skip)


def _rolling_type(t: pa.DataType, agg: str) -> pa.DataType:
    if agg == "count":
        return pa.int64()
    if agg in ("mean", "stddev", "variance"):
        return pa.float64()
    if agg == "sum":
        if pa.types.is_signed_integer(t):
            return pa.int64()
        if pa.types.is_unsigned_integer(t):
            return pa.uint64()
        return pa.float64()
    return t
