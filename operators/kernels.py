"""Local kernels (layer 1): pure functions on ``pa.Table``, no communicator.

The engine per operator, chosen by measurement (docs/benchmarks.md, "Local kernels"):

- join: DuckDB (fastest, and SQL null semantics for free);
- sort: ``intkeys``' packed sort for one integer-like key without nulls, else
  polars arg-sort + Arrow take;
- group-by: ``intkeys`` for one integer-like key and count/sum/mean/min/max of
  integers without nulls; else DuckDB for numeric count/sum/mean/min/max/std/var,
  pyarrow (ordered) for first/last/list/others.

All engines read the Arrow buffers without copying; results are cast to one
schema (``join_schema``, ``aggregate_schema``: SQL's types, as DuckDB gives them),
so a result never depends on which engine ran.  Kernels take plain tables
(``arrowtypes.to_kernel``: no view layouts, no dictionaries); the operators cast
their results back to the input's types.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import intkeys
from .partition import canonical_floats
from . import arrowtypes, settings
from .errors import AggregateOverflowError, UnsupportedAggregationError
from .optiontypes import AGG_NAMES

log = logging.getLogger(__name__)

_local = threading.local()


def threads() -> int:
    """Kernel threads per rank: ``settings.current().threads``, else the cores this rank may use divided
    among the node's ranks (the launcher's local-size variable)."""
    chosen = settings.current().threads
    if chosen is not None:
        return chosen
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


_opened: list[tuple[int, Any]] = []  # (pid that opened it, connection)
_opened_lock = threading.Lock()


def _duck() -> Any:
    """This thread's DuckDB connection, opened on first use and closed at interpreter exit: with
    :func:`threads` worker threads, or, inside :func:`duck_threads`, with that many (a database of its
    own per count, kept open: changing a database's thread count starts or joins its threads on every
    change, while idle workers block on a semaphore and take no CPU)."""
    wide = getattr(_local, "wide", None)
    key = wide if wide is not None else 0
    cons = getattr(_local, "ducks", None)
    if cons is None:
        cons = _local.ducks = {}
    con = cons.get(key)
    if con is None:
        import duckdb

        con = duckdb.connect(":memory:", config={"threads": wide or threads(), "preserve_insertion_order": False})
        with _opened_lock:
            if not _opened:
                atexit.register(_close_connections)
            _opened.append((os.getpid(), con))
        cons[key] = con
    return con


@contextlib.contextmanager
def duck_threads(workers: int) -> Iterator[None]:
    """Within it, this thread's DuckDB statements (:func:`_duck_query`) run on ``workers`` threads
    instead of :func:`threads`: for a statement a rank runs while others lend it their cores."""
    if workers < 1:
        raise ValueError(f"duck_threads: workers must be at least 1, got {workers}")
    before = getattr(_local, "wide", None)
    _local.wide = None if workers == threads() else workers
    try:
        yield
    finally:
        _local.wide = before


def _close_connections() -> None:
    """Close every connection :func:`_duck` opened, joining DuckDB's worker threads while the interpreter
    is whole.  Left to interpreter teardown, a database's threads were destroyed still joinable now and
    then (``terminate called without an active exception``, SIGABRT after a program's last line)."""
    with _opened_lock:
        opened, _opened[:] = list(_opened), []
    for pid, con in opened:
        if pid != os.getpid():  # a forked child's copy: its threads stayed in the parent, nothing to join
            continue
        try:
            con.close()
        except Exception as exc:  # noqa: BLE001 - a connection another thread still uses: leave it
            log.debug("could not close a DuckDB connection at exit: %s", exc)


def q(name: str) -> str:
    """Quote an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


_FRAGMENT = compile("__hf_out = __hf_con.sql(__hf_sql).to_arrow_table()", "<hetflow fragment>", "exec")


def _duck_query(sql: str, /, **tables: pa.Table) -> pa.Table:
    """Run ``sql`` on this thread's DuckDB connection over ``tables`` (Arrow, by name).

    The tables reach DuckDB through its replacement scan of the calling frame's names: the query runs
    in a frame whose locals are exactly ``tables``, instead of ``register``/``unregister`` around it,
    since each change of the catalog made DuckDB do more work per query than the query itself on the
    small fragments of a distributed plan (docs/benchmarks.md, TPC-H).
    """
    if any(name.startswith("__hf_") for name in tables):
        raise ValueError(f"table names starting with __hf_ are reserved: {sorted(tables)}")
    scope: dict[str, Any] = {**tables, "__hf_con": _duck(), "__hf_sql": sql}
    exec(_FRAGMENT, {"__builtins__": {}}, scope)  # noqa: S102 - fixed code; the SQL is data to DuckDB
    out: pa.Table = scope["__hf_out"]
    return out


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rename by position and cast to ``schema`` (no-op when already equal)."""
    if table.schema.equals(schema):
        return table
    table = table.rename_columns(schema.names)
    if table.num_rows == 0:
        return schema.empty_table()
    cols = [c if c.type == f.type else c.cast(f.type) for c, f in zip(table.columns, schema)]
    return pa.Table.from_arrays(cols, schema=schema)


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
    if all(duck_native(f.type) for f in left.schema) and all(duck_native(f.type) for f in right.schema):
        return conform(_duck_query(sql, l=left, r=right), schema)
    return _join_by_position(left, right, keys, right_keys, how, schema)


def _join_by_position(left: pa.Table, right: pa.Table, keys: Sequence[str], right_keys: Sequence[str], how: str,
                      schema: pa.Schema) -> pa.Table:
    """The join of tables with columns DuckDB cannot hand back as they are (durations, halffloat,
    decimal256, fixed-size lists, intervals, ...): DuckDB joins the (encoded) keys and row positions,
    Arrow takes the rows."""
    names = [f"k{i}" for i in range(len(keys))]
    lk = arrowtypes.encode_keys(left.select(list(keys)).rename_columns(names), names)
    rk = arrowtypes.encode_keys(right.select(list(right_keys)).rename_columns(names), names)
    lk = lk.append_column("__l", pa.array(np.arange(left.num_rows, dtype=np.int64)))
    rk = rk.append_column("__r", pa.array(np.arange(right.num_rows, dtype=np.int64)))
    on = " AND ".join(f"l.{q(n)} = r.{q(n)}" for n in names)
    if how in ("semi", "anti"):
        exists = "EXISTS" if how == "semi" else "NOT EXISTS"
        li = _duck_query(f"SELECT l.__l FROM l WHERE {exists} (SELECT 1 FROM r WHERE {on})", l=lk, r=rk).column(0)
        return conform(left.take(pa.array(np.sort(li.to_numpy()))), schema)
    res = _duck_query(f"SELECT l.__l, r.__r FROM l {how.upper()} JOIN r ON {on}", l=lk, r=rk)
    li, ri = res.column(0), res.column(1)
    kmap = dict(zip(keys, right_keys))
    cols = []
    for name in left.schema.names:
        col = left.column(name).take(li)
        if name in kmap and how in ("right", "full"):
            col = pc.coalesce(col, right.column(kmap[name]).take(ri).cast(col.type))
        cols.append(col)
    cols += [right.column(f.name).take(ri) for f in right.schema if f.name not in right_keys]
    return conform(pa.Table.from_arrays(cols, names=schema.names), schema)


# --------------------------------------------------------------------------- sort


def sort_indices(table: pa.Table, by: Sequence[tuple[str, str]], nulls: str) -> np.ndarray:
    """Stable order of rows (numpy int array) by the sort keys."""
    if len(by) == 1:
        values = intkeys.key_values(table.column(by[0][0]))
        fast = None if values is None else intkeys.packed_order(values, by[0][1] == "descending")
        if fast is not None:
            return fast[0]
    if any(pa.types.is_decimal256(table.schema.field(c).type) for c, _ in by):  # polars has no 256-bit decimals
        return np.asarray(pc.sort_indices(table.select([c for c, _ in by]),
                                          sort_keys=[(c, o, nulls) for c, o in by]).to_numpy())
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
    return arrowtypes.take(table, pa.array(sort_indices(table, by, nulls)))


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


def native_aggregate_type(t: pa.DataType) -> bool:
    """Types whose values pyarrow's hash aggregates take directly (after ``arrowtypes.to_kernel``)."""
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) and not pa.types.is_float16(t)
                or pa.types.is_decimal128(t) or pa.types.is_decimal256(t) or pa.types.is_boolean(t)
                or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_date(t)
                or pa.types.is_time(t) or pa.types.is_timestamp(t))


def _compute_type(t: pa.DataType) -> pa.DataType | None:
    """The type a value column of (plain) type ``t`` is cast to for the numeric aggregations, if any."""
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_decimal32(t) or pa.types.is_decimal64(t):
        return pa.decimal128(t.precision, t.scale)
    if pa.types.is_duration(t):
        return pa.int64()
    return None


def _sum_type(t: pa.DataType) -> pa.DataType | None:
    """SQL (DuckDB) sum of decimals: 38 digits (76 for decimal256) at the input's scale."""
    if pa.types.is_decimal256(t):
        return pa.decimal256(76, t.scale)
    if pa.types.is_decimal(t):
        return pa.decimal128(38, t.scale)
    return None


def _orderable(t: pa.DataType) -> bool:
    return not (t.num_fields or pa.types.is_interval(t) or pa.types.is_null(t))


def aggregate_schema(schema: pa.Schema, keys: Sequence[str], aggs: Sequence[tuple[str, str]]) -> pa.Schema:
    """Output schema of a group-by aggregate: keys then one column per aggregation.

    SQL (DuckDB) types: ``count``/``count_distinct`` int64; ``min``/``max``/``first``/``last`` the
    input's type and ``list`` a list of it; ``sum`` of integers int64 (uint64 for unsigned; a sum
    that leaves that range raises ``AggregateOverflowError`` instead of wrapping), of floats
    float64, of ``decimal(p, s)`` ``decimal128(38, s)`` (``decimal256(76, s)``); ``mean``,
    ``variance`` and ``stddev`` float64 (a decimal's mean is its exact sum over the count)."""
    fields = [schema.field(k) for k in keys]
    for col, agg in aggs:
        if agg not in AGG_NAMES:
            raise UnsupportedAggregationError(f"unsupported aggregation {agg!r} on column {col!r} (supported: {list(AGG_NAMES)})")
        t = schema.field(col).type
        p = arrowtypes.plain_type(t)
        name = agg_name(col, agg)
        numeric = pa.types.is_integer(p) or pa.types.is_floating(p) or pa.types.is_decimal(p)
        if agg in ("count", "count_distinct"):
            out: pa.DataType = pa.int64()
        elif agg in ("first", "last"):
            out = t
        elif agg == "list":
            out = pa.list_(t)
        elif agg in ("min", "max"):
            if not _orderable(p):
                raise UnsupportedAggregationError(f"aggregation {agg!r} is not defined for column {col!r} of type {t} (no order)")
            out = t
        elif not numeric:
            raise UnsupportedAggregationError(f"aggregation {agg!r} is not defined for column {col!r} of type {t} (numbers only)")
        elif agg == "sum":
            out = _sum_type(p) or (pa.uint64() if pa.types.is_unsigned_integer(p) else pa.int64() if pa.types.is_integer(p) else pa.float64())
        else:
            out = pa.float64()
        fields.append(pa.field(name, out))
    return pa.schema(fields)


def _int_sum_exact(col: pa.ChunkedArray | pa.Array, rows: int) -> bool:
    """Whether int64/uint64 sums of any ``rows`` values of ``col`` surely stay in range (bound check)."""
    if rows == 0 or not pa.types.is_integer(col.type):
        return True
    mm = pc.min_max(col)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    if lo is None:
        return True
    limit = 1 << (64 if pa.types.is_unsigned_integer(col.type) else 63)
    return bool(max(abs(lo), abs(hi)) * rows < limit)


def check_sum(col: pa.ChunkedArray | pa.Array, target: pa.DataType, column: str) -> pa.ChunkedArray | pa.Array:
    """An exact (decimal) sum column as ``target`` (int64/uint64), or ``AggregateOverflowError`` naming ``column``."""
    if col.type == target:
        return col
    try:
        return col.cast(target)
    except pa.ArrowInvalid as exc:
        lim = "uint64" if pa.types.is_unsigned_integer(target) else "int64"
        mm = pc.min_max(col)
        raise AggregateOverflowError(
            f"sum of column {column!r} overflows {lim} (range of the sums: {mm['min'].as_py()} .. {mm['max'].as_py()}); "
            f"cast the column to decimal128(38, 0) first for an exact wide sum") from exc


def _pa_group_by(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], schema: pa.Schema | None = None, *,
                 ordered: bool = True) -> pa.Table:
    """Group-by with pyarrow's hash aggregates on a plain table (``arrowtypes.to_kernel``); every type
    pyarrow has no kernel for goes through a cast (``_compute_type``) or the row positions (first,
    last, list of nested, interval and null values).  No keys: one row (SQL: count 0, others null)."""
    schema = schema or aggregate_schema(table.schema, keys, aggs)
    work = table
    rep = None
    if not keys:
        work = work.append_column("__all", pa.array(np.zeros(work.num_rows, dtype=np.int8)))
    elif any(table.schema.field(k).type.num_fields for k in keys):  # lists, structs, maps: DuckDB numbers the groups
        sub = arrowtypes.encode_keys(table.select(list(keys)), keys)
        sub = sub.append_column("__pos", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        part = ", ".join(q(k) for k in keys)
        rep = _duck_query(f"SELECT min(__pos) OVER (PARTITION BY {part}) AS r FROM t ORDER BY __pos", t=sub).column(0)
        work = work.append_column("__rep", rep)
    gkeys = ["__rep"] if rep is not None else list(keys) if keys else ["__all"]
    work = arrowtypes.encode_keys(work, gkeys)
    spec: list[tuple[str, str, Any]] = []
    finish: list[Any] = []
    derived: dict[str, Any] = {}

    def add(name: str, column: Any, func: str, opts: Any = None) -> int:
        if name not in derived and name not in table.schema.names:
            derived[name] = column
        spec.append((name, func, opts))
        return len(spec) - 1

    pos_name = "__pos"
    for col, agg in aggs:
        src = table.column(col)
        p = src.type
        ct = _compute_type(p)
        out_t = schema.field(agg_name(col, agg)).type
        if agg in ("first", "last", "list") and (not native_aggregate_type(p) and ct is None or agg != "list" and (
                pa.types.is_decimal(p) or pa.types.is_fixed_size_binary(p))):  # no hash_first_last kernel
            i = add(pos_name, pa.array(np.arange(table.num_rows, dtype=np.int64)),
                    {"first": "first", "last": "last", "list": "list"}[agg], _pa_options(agg) if agg != "list" else None)
            finish.append(("pos", i, col, agg))
            continue
        if agg == "count":
            i = add(f"__valid_{col}", pc.cast(pc.is_valid(src), pa.int64()), "sum")
            finish.append(("count", i))
            continue
        value = src if ct is None else src.cast(ct)
        vname = col if ct is None else f"__{col}_as_{ct}"
        if pa.types.is_decimal(value.type) and agg in ("sum", "mean"):
            wide = _sum_type(value.type)
            i = add(f"__{col}_wide", value.cast(wide), "sum")
            if agg == "sum":
                finish.append(("plain", i))
            else:
                j = add(f"__valid_{col}", pc.cast(pc.is_valid(src), pa.int64()), "sum")
                finish.append(("mean", i, j))
            continue
        if pa.types.is_decimal(value.type) and agg in ("stddev", "variance"):
            value, vname = value.cast(pa.float64()), f"__{col}_f64"
        if pa.types.is_integer(value.type) and agg in ("sum", "mean") and not _int_sum_exact(value, table.num_rows):
            i = add(f"__{col}_wide", value.cast(pa.decimal128(38, 0)), "sum")
            if agg == "sum":
                finish.append(("sum", i, out_t, col))
            else:
                j = add(f"__valid_{col}", pc.cast(pc.is_valid(src), pa.int64()), "sum")
                finish.append(("mean", i, j))
            continue
        i = add(vname, value, _PA_FUNC[agg], _pa_options(agg))
        finish.append(("plain", i))
    for name, column in derived.items():
        work = work.append_column(name, column)
    threaded = not ordered and threads() > 1 and all(f != "first" and f != "last" and f != "list" for _, f, _ in spec)
    try:
        res = work.group_by(gkeys, use_threads=threaded).aggregate(spec)
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        bad = [(c, a, str(table.schema.field(c).type)) for c, a in aggs]
        raise UnsupportedAggregationError(f"aggregation not supported for these column types {bad}: {exc}") from exc
    key_cols, agg_cols = _split(res, len(gkeys), gkeys)
    if not keys and res.num_rows == 0:  # SQL: aggregates over no rows give one row
        key_cols = []
        agg_cols = [pa.array([0 if f in ("count", "sum") and n.startswith("__valid_") else None], c.type)
                    for (n, f, _), c in zip(spec, agg_cols)]
    elif not keys:
        key_cols = []
    elif rep is not None:  # each group's keys from its first row
        key_cols = [table.column(k).take(key_cols[0]) for k in keys]
    else:  # the keys as they were (the group-by saw their key encodings)
        key_cols = [kc if kc.type == table.schema.field(k).type else _decode_key(kc, table.schema.field(k).type)
                    for kc, k in zip(key_cols, keys)]
    cols: list[Any] = list(key_cols)
    for item in finish:
        kind = item[0]
        if kind == "plain":
            cols.append(agg_cols[item[1]])
        elif kind == "count":
            cols.append(pc.fill_null(agg_cols[item[1]], 0))
        elif kind == "sum":
            cols.append(check_sum(agg_cols[item[1]], item[2], item[3]))
        elif kind == "mean":
            total, cnt = agg_cols[item[1]], pc.fill_null(agg_cols[item[2]], 0)
            mean = pc.divide(pc.cast(total, pa.float64()), pc.cast(pc.max_element_wise(cnt, 1), pa.float64()))
            cols.append(pc.if_else(pc.greater(cnt, 0), mean, pa.scalar(None, pa.float64())))
        else:  # positions of first / last / list values
            _, i, col, agg = item
            pos = agg_cols[i]
            src = table.column(col)
            if agg == "list":
                pos = pos.combine_chunks() if isinstance(pos, pa.ChunkedArray) else pos
                values = src.take(pos.flatten())
                values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
                cols.append(pa.ListArray.from_arrays(pos.offsets, values, type=pa.list_(values.type)))
            else:
                cols.append(src.take(pos))
    names = list(keys) + [agg_name(c, a) for c, a in aggs]
    return pa.table(cols, names=names)


def _decode_key(col: Any, t: pa.DataType) -> Any:
    if pa.types.is_interval(t):
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        return pa.chunked_array([c.view(t) for c in chunks], t)
    if pa.types.is_null(t):
        return pa.nulls(len(col))
    return col.cast(t)


def _split(res: pa.Table, n_keys: int, keys: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """(key columns, aggregate columns) of a pyarrow group-by result (keys first since pyarrow 20, last before)."""
    cols = list(res.columns)
    if n_keys == 0:
        return [], cols
    if list(res.schema.names[:n_keys]) == list(keys):
        return cols[:n_keys], cols[n_keys:]
    return cols[-n_keys:], cols[:-n_keys]


#: types DuckDB reads from Arrow and hands back as the same type (after ``conform``)
def duck_native(t: pa.DataType) -> bool:
    if t.num_fields:
        return all(duck_native(t.field(i).type) for i in range(t.num_fields)) and not pa.types.is_fixed_size_list(t) \
            and not pa.types.is_dictionary(t) and not arrowtypes.has_view(t)
    return bool(pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t) or pa.types.is_boolean(t)
                or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_date(t) or pa.types.is_timestamp(t)
                or pa.types.is_time(t) or pa.types.is_decimal128(t) or pa.types.is_decimal32(t)
                or pa.types.is_decimal64(t) or pa.types.is_null(t))


def _duck_ok(schema: pa.Schema, keys: Sequence[str], aggs: Sequence[tuple[str, str]]) -> bool:
    if not all(duck_native(schema.field(k).type) and not schema.field(k).type.num_fields for k in keys):
        return False
    for col, agg in aggs:
        t = schema.field(col).type
        if agg not in _DUCK_FUNC:
            return False
        if agg in ("count", "count_distinct"):
            if not duck_native(t):
                return False
            continue
        if not (pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t)):
            return False
    return True


def group_aggregate(table: pa.Table, keys: Sequence[str], aggs: Sequence[tuple[str, str]], *,
                    consume: bool = False, schema: pa.Schema | None = None) -> pa.Table:
    """Final aggregation of all rows of each group (SQL semantics: nulls form one group, aggregates skip nulls)
    of a plain table (``arrowtypes.to_kernel``), as ``schema`` (``aggregate_schema`` of the table).
    ``consume`` as in ``sort``."""
    schema = arrowtypes.plain_schema(schema or aggregate_schema(table.schema, keys, aggs))
    if not keys:
        return conform(_pa_group_by(table, keys, aggs, schema), schema)
    if table.num_rows == 0:
        return schema.empty_table()
    fast = intkeys.group_aggregate(table, keys, aggs, schema, consume=consume)
    if fast is not None:
        return fast
    if _duck_ok(table.schema, keys, aggs):
        cols = [q(k) for k in keys] + [_DUCK_FUNC[a].format(q(c)) for c, a in aggs]
        select = ", ".join(f"{c} AS c{i}" for i, c in enumerate(cols))
        sql = f"SELECT {select} FROM t GROUP BY ALL"
        needed = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
        res = _duck_query(sql, t=table.select(needed))
        for i, (c, a) in enumerate(aggs):  # DuckDB sums integers as HUGEINT: exact, checked here
            if a == "sum":
                j = len(keys) + i
                res = res.set_column(j, res.schema.field(j).name, check_sum(res.column(j), schema.field(j).type, c))
        return conform(res, schema)
    return conform(_pa_group_by(table, keys, aggs, schema), schema)


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
    for col in {c for c, a in spec if a == "sum"}:  # integer sums that could wrap are summed exactly
        if not _int_sum_exact(work.column(col), work.num_rows):
            i = work.schema.get_field_index(col)
            work = work.set_column(i, col, work.column(i).cast(pa.decimal128(38, 0)))
    pa_spec = []
    for col, agg in spec:
        if agg == "m2":
            pa_spec.append((col, "variance", pc.VarianceOptions(ddof=0)))
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
        elif agg == "sum" and pa.types.is_integer(table.schema.field(col).type):
            c = c.cast(pa.decimal128(38, 0))  # one partial type on every rank, merged without wrapping
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
        elif agg == "sum":
            cols.append(check_sum(got[f"{col}__sum"], schema.field(len(cols)).type, col) if pa.types.is_decimal(got[f"{col}__sum"].type)
                        and pa.types.is_integer(schema.field(len(cols)).type) else got[f"{col}__sum"])
        elif agg in ("min", "max"):
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


def _grouped(sub: pa.Table, keys: Sequence[str], spec: Sequence[tuple[str, str]]) -> pa.Table:
    """``sub.group_by(keys).aggregate(spec)`` (min/max of integer columns named ``<col>_<func>``, keys
    dropped): pyarrow, or DuckDB for the keys pyarrow cannot group by (lists, structs, maps)."""
    sub = arrowtypes.encode_keys(canonical_floats(sub, keys), keys)
    try:
        res = sub.group_by(list(keys), use_threads=False).aggregate(list(spec))
        return res.select([f"{c}_{f}" for c, f in spec])
    except pa.ArrowNotImplementedError:
        select = ", ".join(f"{f}({q(c)}) AS {q(c + '_' + f)}" for c, f in spec)
        return _duck_query(f"SELECT {select} FROM t GROUP BY {', '.join(q(k) for k in keys)}", t=sub)


def first_per_key(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The first row (in table order) of every distinct value of ``keys`` (nulls equal)."""
    if table.num_rows == 0:
        return table
    pos = pa.array(np.arange(table.num_rows, dtype=np.int64))
    sub = table.select(list(keys)).append_column("__pos", pos)
    first = _grouped(sub, keys, [("__pos", "min")]).column(0)
    idx = np.sort(first.to_numpy())
    return arrowtypes.take(table, pa.array(idx))


def set_operation(a: pa.Table, b: pa.Table, op: str) -> pa.Table:
    """``union`` (distinct), ``intersect`` or ``difference`` with SQL set semantics (nulls equal):
    the first row of each distinct value, of ``a`` where it has one (the rows themselves, so any type)."""
    names = a.schema.names
    both = pa.concat_tables([a, b])
    if both.num_rows == 0:
        return a.schema.empty_table()
    side = np.zeros(both.num_rows, dtype=np.int8)
    side[a.num_rows:] = 1
    sub = both.append_column("__side", pa.array(side)).append_column("__pos", pa.array(np.arange(both.num_rows, dtype=np.int64)))
    g = _grouped(sub, names, [("__side", "min"), ("__side", "max"), ("__pos", "min")])
    if op == "intersect":
        g = g.filter(pc.and_(pc.equal(g.column(0), 0), pc.equal(g.column(1), 1)))
    elif op == "difference":
        g = g.filter(pc.equal(g.column(1), 0))
    idx = np.sort(g.column(2).to_numpy())
    return arrowtypes.take(both, pa.array(idx))


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
