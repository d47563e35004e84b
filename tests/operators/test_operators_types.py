"""Every Arrow type through the operators, at any rank count, against DuckDB on the gathered input.

Seeded random tables carry view types, dictionaries, large and nested types, time zones,
decimals, durations, halffloat and the null type.  Each operator must keep the input's types
(``string_view`` stays ``string_view``) and give DuckDB's rows.  The reference sees a copy of the
gathered input rebuilt from Python values with types DuckDB reads (``duck_friendly``, written
here, not with the operators' own casts); the result is compared after the same rebuild.
Also: tables that polars and DuckDB themselves produce with view types.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi

PAYLOAD: dict[str, pa.DataType] = {
    "sv": pa.string_view(), "bv": pa.binary_view(), "lv": pa.list_view(pa.int32()),
    "llv": pa.large_list_view(pa.string_view()), "dct": pa.dictionary(pa.int8(), pa.string()),
    "ls": pa.large_string(), "lb": pa.large_binary(), "lst": pa.list_(pa.int64()),
    "st": pa.struct([("a", pa.int32()), ("b", pa.string_view())]), "mp": pa.map_(pa.string(), pa.int64()),
    "tz": pa.timestamp("ms", tz="Asia/Tokyo"), "d128": pa.decimal128(10, 2), "d256": pa.decimal256(40, 5),
    "nul": pa.null(), "fsl": pa.list_(pa.int16(), 2), "dur": pa.duration("ms"), "f16": pa.float16(),
    "fsb": pa.binary(3),
}
KEYS: dict[str, pa.DataType] = {
    "int64": pa.int64(), "string_view": pa.string_view(), "binary_view": pa.binary_view(),
    "dict_string": pa.dictionary(pa.int32(), pa.string()), "dict_int": pa.dictionary(pa.int16(), pa.int64()),
    "large_string": pa.large_string(), "decimal128": pa.decimal128(12, 2), "decimal256": pa.decimal256(40, 5),
    "timestamp_tz": pa.timestamp("us", tz="America/New_York"), "duration": pa.duration("s"),
    "float16": pa.float16(), "fixed_binary": pa.binary(2), "time32": pa.time32("s"),
}
NESTED_KEYS: dict[str, pa.DataType] = {"list": pa.list_(pa.int64()), "struct": pa.struct([("a", pa.int8()), ("b", pa.string())])}
ORDERED = [k for k in KEYS]


def value(t: pa.DataType, x: int) -> Any:
    """A Python value of type ``t``; equal exactly when the ints are equal (nested: by construction)."""
    if pa.types.is_dictionary(t):
        return value(t.value_type, x)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return ("é" if x % 3 == 0 else "s") + str(x) + ("-long-enough-not-inline" if x % 4 == 0 else "")
    if pa.types.is_fixed_size_binary(t):
        return (b"%03d" % x)[-t.byte_width:]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return b"\x00" + str(x).encode()
    if pa.types.is_fixed_size_list(t):
        return [x, None if x % 5 == 0 else -x]
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return [value(t.value_type, x + i) for i in range(x % 3)]
    if pa.types.is_struct(t):
        return {f.name: value(f.type, x) for f in t}
    if pa.types.is_map(t):
        return [(value(t.key_type, x), x)]
    if pa.types.is_timestamp(t):
        return dt.datetime(2024, 3, 10, 1, tzinfo=dt.timezone.utc) + dt.timedelta(hours=x, milliseconds=x)
    if pa.types.is_duration(t):
        return dt.timedelta(seconds=x - 5)
    if pa.types.is_time(t):
        return dt.time(x % 24, x % 60, 7)
    if pa.types.is_decimal(t):
        return Decimal(x - 7) / 8 if t.scale >= 3 else Decimal(x - 7) / 4
    if pa.types.is_float16(t):
        return (x - 4) * 0.5
    if pa.types.is_null(t):
        return None
    if pa.types.is_integer(t):
        return x - 10
    raise AssertionError(t)


def column(rng: np.random.Generator, t: pa.DataType, n: int, domain: int, null_frac: float = 0.15) -> pa.Array:
    ints = rng.integers(0, domain, n)
    mask = rng.random(n) < null_frac
    vals = [None if m else value(t, int(x)) for x, m in zip(ints, mask)]
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):  # no conversion from Python lists
        base = pa.array(vals, pa.large_list(t.value_type))
        sizes = pc.fill_null(pc.list_value_length(base), 0)
        offsets = pc.subtract(pc.cumulative_sum(sizes), sizes)
        cls = pa.ListViewArray if pa.types.is_list_view(t) else pa.LargeListViewArray
        ot = pa.int32() if pa.types.is_list_view(t) else pa.int64()
        return cls.from_arrays(offsets.cast(ot), sizes.cast(ot), base.flatten(), type=t, mask=base.is_null())
    if pa.types.is_dictionary(t):
        return pa.array(vals, t.value_type).dictionary_encode().cast(t)
    if pa.types.is_float16(t):
        return pa.array(np.array([0 if v is None else v for v in vals], dtype=np.float16), mask=np.array(mask))
    return pa.array(vals, t)


def table(seed: int, rank: int, size: int, key: pa.DataType, *, n: int = 24, domain: int = 9, layout: str = "balanced",
          payload: dict[str, pa.DataType] = PAYLOAD, stream: int = 0) -> pa.Table:
    rng = np.random.default_rng([seed, stream, rank, size])
    rows = D.rows_on_rank(layout, rank, size, n)
    cols = {"k": column(rng, key, rows, domain), "id": pa.array(np.arange(rows, dtype=np.int64) + 1000 * rank + 100000 * stream)}
    for name, t in payload.items():
        cols[name] = column(rng, t, rows, 50)
    return pa.table(cols)


def friendly_type(t: pa.DataType) -> pa.DataType:
    """A type DuckDB reads and hands back unchanged, holding the same Python values as ``t``."""
    if pa.types.is_dictionary(t):
        return friendly_type(t.value_type)
    if pa.types.is_string_view(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_binary_view(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return pa.binary()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(friendly_type(t.value_type), t.list_size)
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t) or pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(friendly_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, friendly_type(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(friendly_type(t.key_type), friendly_type(t.item_type))
    if pa.types.is_decimal256(t):
        return pa.decimal128(min(38, t.precision), t.scale)
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=t.tz)
    if pa.types.is_time(t):
        return pa.time64("us")
    return t


def _conv(v: Any, t: pa.DataType) -> Any:
    if v is None:
        return None
    if pa.types.is_dictionary(t):
        return _conv(v, t.value_type)
    if pa.types.is_duration(t):
        return v // dt.timedelta(microseconds=1)
    if pa.types.is_float16(t):
        return float(v)
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t)
            or pa.types.is_fixed_size_list(t)):
        return [_conv(x, t.value_type) for x in v]
    return v


def friendly(t: pa.Table) -> pa.Table:
    """``t`` rebuilt from its Python values with ``friendly_type``s (independent of the operators' casts)."""
    cols = [pa.array([_conv(v, c.type) for v in c.to_pylist()], friendly_type(c.type)) for c in t.columns]
    return pa.table(cols, names=t.schema.names)


def check(got: pa.Table, want: pa.Table, ctx: str, *, ordered: bool = False) -> None:
    D.assert_same_rows(friendly(got), want, ctx, ordered=ordered, key=None if ordered else _key)


def _key(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((v is None, repr(v)) for v in row)


def _gather_check_schema(res: Any, schema: pa.Schema, ctx: str) -> pa.Table | None:
    assert res.schema.equals(schema), f"{ctx}: output types do not follow the input:\n{res.schema}\nvs\n{schema}"
    return res.gather()


# --------------------------------------------------------------------------- row-preserving operators


@pytest.mark.parametrize("kind", list(KEYS) + list(NESTED_KEYS))
def test_types_filter_sort_unique_repartition(comm: Any, kind: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    key = {**KEYS, **NESTED_KEYS}[kind]
    seed = 9000 + list({**KEYS, **NESTED_KEYS}).index(kind)
    layout = D.LAYOUTS[seed % 3]
    t = DTable(comm, table(seed, rank, size, key, layout=layout))
    whole = t.gather()
    ctx = f"seed={seed} key={kind} layout={layout} ranks={size}"
    res = {
        "filter": t.filter(pc.not_equal(pc.bit_wise_and(pc.field("id"), 3), 0)),
        "filter_fn": t.filter(lambda tb: pc.greater(pc.bit_wise_and(tb.column("id"), 1), 0)),
        "unique": t.unique("k"),
        "repartition": t.repartition(by="k"),
        "head": t.head(7), "tail": t.tail(5),
    }
    if kind in ORDERED:
        res["sort"] = t.sort_by("k")
        res["sort_desc"] = t.sort_by([("k", "descending"), ("id", "ascending")], nulls="at_start")
    got = {name: _gather_check_schema(r, t.schema, f"{name} {ctx}") for name, r in res.items()}
    if rank != 0:
        return
    f = D.with_index(friendly(whole))
    cols = ", ".join(D.q(c) for c in whole.schema.names)
    sql = {
        "filter": f"SELECT {cols} FROM t WHERE (id & 3) <> 0",
        "filter_fn": f"SELECT {cols} FROM t WHERE (id & 1) > 0",
        "unique": f"SELECT {cols} FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY __idx) AS rn FROM t) WHERE rn = 1",
        "repartition": f"SELECT {cols} FROM t",
        "head": f"SELECT {cols} FROM t ORDER BY __idx LIMIT 7",
        "tail": f"SELECT {cols} FROM (SELECT * FROM t ORDER BY __idx DESC LIMIT 5) ORDER BY __idx",
        "sort": f"SELECT {cols} FROM t ORDER BY k ASC NULLS LAST, __idx",
        "sort_desc": f"SELECT {cols} FROM t ORDER BY k DESC NULLS FIRST, id, __idx",
    }
    for name, g in got.items():
        assert g is not None
        check(g, D.duck(sql[name], t=f), f"{name} {ctx}", ordered=name in ("head", "tail", "sort", "sort_desc"))


@pytest.mark.parametrize("kind", ["string_view", "dict_string", "decimal256", "timestamp_tz", "float16", "duration", "list"])
def test_types_set_operations(comm: Any, kind: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    key = {**KEYS, **NESTED_KEYS}[kind]
    seed = 9100 + len(kind)
    cols = {n: PAYLOAD[n] for n in ("sv", "dct", "tz", "d256", "lv")}
    a = table(seed, rank, size, key, domain=4, payload={}, stream=1).drop_columns(["id"])
    b = table(seed, rank, size, key, domain=4, payload={}, stream=2).drop_columns(["id"])
    extra_a = pa.table({n: column(np.random.default_rng([seed, 1, rank]), t, a.num_rows, 2, 0.3) for n, t in cols.items()})
    extra_b = pa.table({n: column(np.random.default_rng([seed, 2, rank]), t, b.num_rows, 2, 0.3) for n, t in cols.items()})
    da = DTable(comm, pa.table(a.columns + extra_a.columns, names=a.schema.names + extra_a.schema.names))
    db = DTable(comm, pa.table(b.columns + extra_b.columns, names=b.schema.names + extra_b.schema.names))
    wa, wb = da.gather(), db.gather()
    for op, sql in (("union", "UNION"), ("intersect", "INTERSECT"), ("difference", "EXCEPT")):
        res = getattr(da, op)(db)
        got = _gather_check_schema(res, da.schema, f"{op} key={kind}")
        if rank == 0:
            assert got is not None
            want = D.duck(f"SELECT * FROM a {sql} SELECT * FROM b", a=friendly(wa), b=friendly(wb))
            check(got, want, f"seed={seed} {op} key={kind} ranks={size}")


# --------------------------------------------------------------------------- join


@pytest.mark.parametrize("kind", list(KEYS) + list(NESTED_KEYS))
@pytest.mark.parametrize("how", ["inner", "left", "full", "semi"])
def test_types_join(comm: Any, kind: str, how: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    key = {**KEYS, **NESTED_KEYS}[kind]
    seed = 9200 + list({**KEYS, **NESTED_KEYS}).index(kind)
    left = DTable(comm, table(seed, rank, size, key, n=20, stream=1))
    right_payload = {n: PAYLOAD[n] for n in ("sv", "lv", "dct", "d256", "dur", "f16", "mp")}
    right = DTable(comm, table(seed, rank, size, key, n=15, payload=right_payload, stream=2,
                               layout="empty_rank" if seed % 2 else "balanced"))
    res = left.join(right, "k", how=how)
    out_fields = list(left.schema) if how == "semi" else list(left.schema) + [
        pa.field(f.name + "_right" if f.name in left.schema.names else f.name, f.type) for f in right.schema if f.name != "k"]
    got = _gather_check_schema(res, pa.schema(out_fields), f"join {how} key={kind}")
    wl, wr = left.gather(), right.gather()
    if rank == 0:
        assert got is not None
        lcols = ", ".join(("COALESCE(l.k, r.k) AS k" if c == "k" and how == "full" else f"l.{D.q(c)}") for c in wl.schema.names)
        if how == "semi":
            sql = f"SELECT {lcols} FROM l SEMI JOIN r ON l.k = r.k"
        else:
            rcols = ", ".join(f"r.{D.q(c)} AS {D.q(c + '_right' if c in wl.schema.names else c)}" for c in wr.schema.names if c != "k")
            sql = f"SELECT {lcols}, {rcols} FROM l {how.upper()} JOIN r ON l.k = r.k"
        check(got, D.duck(sql, l=friendly(wl), r=friendly(wr)), f"seed={seed} join {how} key={kind} ranks={size}")


@pytest.mark.parametrize("kind", ["string_view", "dict_int", "decimal256", "timestamp_tz", "float16", "time32"])
@pytest.mark.parametrize("algorithm", ["broadcast", "sort"])
def test_types_join_algorithms(comm: Any, kind: str, algorithm: str) -> None:
    """The broadcast and the sort-merge (range-partitioned) join with the same types."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9250 + list(KEYS).index(kind)
    payload = {n: PAYLOAD[n] for n in ("sv", "llv", "dct", "d256", "f16")}
    left = DTable(comm, table(seed, rank, size, KEYS[kind], n=20, payload=payload, stream=1))
    right = DTable(comm, table(seed, rank, size, KEYS[kind], n=10, payload={"bv": PAYLOAD["bv"]}, stream=2))
    res = left.join(right, "k", how="left", algorithm=algorithm)
    out = pa.schema(list(left.schema) + [pa.field("id_right", pa.int64()), right.schema.field("bv")])
    got = _gather_check_schema(res, out, f"join {algorithm} key={kind}")
    wl, wr = left.gather(), right.gather()
    if rank == 0:
        assert got is not None
        lcols = ", ".join(f"l.{D.q(c)}" for c in wl.schema.names)
        want = D.duck(f"SELECT {lcols}, r.id AS id_right, r.bv FROM l LEFT JOIN r ON l.k = r.k", l=friendly(wl), r=friendly(wr))
        check(got, want, f"seed={seed} join {algorithm} key={kind} ranks={size}")


@pytest.mark.parametrize("kind", ["list", "struct"])
def test_types_without_order_are_refused_as_sort_keys(comm: Any, kind: str) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import UnsupportedTypeError

    t = DTable(comm, table(9280, comm.Get_rank(), comm.Get_size(), NESTED_KEYS[kind], payload={}))
    with pytest.raises(UnsupportedTypeError, match="'k'.*cannot be a sort key"):
        t.sort_by("k")
    with pytest.raises(UnsupportedTypeError, match="cannot be a sort key"):
        t.join(t, "k", algorithm="sort")


# --------------------------------------------------------------------------- group-by


FIRSTS = [(c, a) for c in PAYLOAD for a in ("count", "first", "last", "list")]
ORDERABLE = ["sv", "bv", "dct", "ls", "lb", "tz", "d128", "d256", "dur", "f16", "fsb"]
MINMAX = [(c, a) for c in ORDERABLE for a in ("min", "max")]
NUMERIC = [(c, a) for c in ("d128", "d256", "f16", "id") for a in ("sum", "mean", "variance", "stddev")]
SQL = {"count": "count({c})", "first": "first({c} ORDER BY __idx)", "last": "last({c} ORDER BY __idx)",
       "list": "list({c} ORDER BY __idx)", "min": "min({c})", "max": "max({c})", "sum": "sum({c})",
       "mean": "avg({c})", "variance": "var_samp({c})", "stddev": "stddev_samp({c})"}


@pytest.mark.parametrize("kind", list(KEYS) + list(NESTED_KEYS))
@pytest.mark.parametrize("algorithm", ["auto", "shuffle"])
def test_types_group_by(comm: Any, kind: str, algorithm: str) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.kernels import aggregate_schema

    rank, size = comm.Get_rank(), comm.Get_size()
    key = {**KEYS, **NESTED_KEYS}[kind]
    seed = 9300 + list({**KEYS, **NESTED_KEYS}).index(kind)
    layout = D.LAYOUTS[seed % 4]
    t = DTable(comm, table(seed, rank, size, key, n=30, domain=6, layout=layout))
    aggs = FIRSTS + MINMAX + NUMERIC
    res = t.group_by("k").aggregate(aggs, algorithm=algorithm)
    got = _gather_check_schema(res, aggregate_schema(t.schema, ["k"], aggs), f"group_by key={kind}")
    whole = t.gather()
    for name in ("sv", "dct", "llv", "st"):  # types follow the input
        assert res.schema.field(f"{name}_first").type == t.schema.field(name).type
        assert res.schema.field(f"{name}_list").type == pa.list_(t.schema.field(name).type)
    if rank == 0:
        exprs = ", ".join(SQL[a].format(c=D.q(c)) for c, a in aggs)
        want = D.duck(f"SELECT k, {exprs} FROM t GROUP BY k", t=D.with_index(friendly(whole)))
        check(got, want, f"seed={seed} group_by key={kind} layout={layout} algorithm={algorithm} ranks={size}")


@pytest.mark.parametrize("kind", ["string_view", "dict_string", "int64"])
def test_types_group_by_few_groups(comm: Any, kind: str) -> None:
    """Few groups (auto takes combine-shuffle-reduce where the value types allow it) with min/max/count
    of every orderable type, and sums/means of the numbers."""
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    seed = 9350 + list(KEYS).index(kind)
    t = DTable(comm, table(seed, rank, size, KEYS[kind], n=40, domain=3))
    numeric = [("id", "sum"), ("id", "mean"), ("id", "max"), ("id", "count")]
    cases = [(MINMAX + [(c, "count") for c in ORDERABLE] + numeric, "auto"), (numeric, "auto"),
             (numeric, "combine"), (MINMAX, "shuffle")]
    got = [t.group_by("k").aggregate(aggs, algorithm=alg if size > 1 else "auto").gather() for aggs, alg in cases]
    whole = t.gather()
    if rank == 0:
        assert whole is not None
        for (aggs, alg), g in zip(cases, got):
            assert g is not None
            exprs = ", ".join(SQL[a].format(c=D.q(c)) for c, a in aggs)
            want = D.duck(f"SELECT k, {exprs} FROM t GROUP BY k", t=friendly(whole))
            check(g, want, f"seed={seed} few groups key={kind} algorithm={alg} aggs={len(aggs)} ranks={size}")


# --------------------------------------------------------------------------- partitioned I/O


@pytest.mark.parametrize("fmt", ["parquet", "ipc"])
def test_types_write_read(comm: Any, fmt: str, tmp_path_factory: Any) -> None:
    """Partitioned files keep every type (Parquet stores the Arrow schema), rows in order."""
    from hetflow.operators import DTable, read_ipc, read_parquet

    rank, size = comm.Get_rank(), comm.Get_size()
    base = comm.bcast(str(tmp_path_factory.mktemp("types")) if rank == 0 else None)
    t = DTable(comm, table(9400, rank, size, pa.string_view(), layout="skew" if fmt == "ipc" else "balanced"))
    d = str(Path(base) / fmt)
    if fmt == "parquet":
        t.write_parquet(d)
        back = read_parquet(comm, d)
    else:
        t.write_ipc(d)
        back = read_ipc(comm, d)
    got = _gather_check_schema(back, t.schema, f"{fmt} roundtrip")
    whole = t.gather()
    if rank == 0:
        assert got is not None and whole is not None
        check(got, friendly(whole), f"{fmt} roundtrip ranks={size}", ordered=True)


# --------------------------------------------------------------------------- tables from polars and DuckDB


def _foreign(engine: str, rank: int, size: int) -> pa.Table:
    n = 40
    ids = list(range(rank * n, rank * n + n))
    if engine == "polars":
        import polars as pl

        df = pl.DataFrame({"id": ids, "name": [f"name-{i % 7}" if i % 5 else None for i in ids],
                           "tags": [[f"t{i % 3}", "x"] for i in ids], "amount": [float(i % 11) for i in ids]})
        out = df.to_arrow(compat_level=pl.CompatLevel.newest())
        assert pa.types.is_string_view(out.schema.field("name").type), out.schema
        return out
    import duckdb

    con = duckdb.connect()
    con.execute("SET arrow_output_version = '1.5'")
    con.execute("SET produce_arrow_string_view = true")
    con.execute("SET arrow_output_list_view = true")
    out = con.sql(f"SELECT i AS id, CASE WHEN i % 5 <> 0 THEN 'name-' || (i % 7) END AS name, "
                  f"['t' || (i % 3), 'x'] AS tags, (i % 11)::DOUBLE AS amount "
                  f"FROM range({rank * n}, {rank * n + n}) t(i)").to_arrow_table()
    assert pa.types.is_string_view(out.schema.field("name").type) and pa.types.is_list_view(out.schema.field("tags").type), out.schema
    return out


@pytest.mark.parametrize("engine", ["polars", "duckdb"])
def test_tables_from_polars_and_duckdb(comm: Any, engine: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, _foreign(engine, rank, size))
    whole = t.gather()
    res = {
        "group_by": t.group_by("name").aggregate([("amount", "sum"), ("tags", "first"), ("id", "count"), ("name", "max")]),
        "join": t.join(t.select(["name", "tags"]).unique("name"), "name"),
        "sort": t.sort_by([("name", "descending"), ("id", "ascending")]),
        "filter": t.filter(pc.field("name") == "name-3"),
        "unique": t.unique("name"),
    }
    got = {k: v.gather() for k, v in res.items()}
    assert res["sort"].schema.equals(t.schema) and res["filter"].schema.equals(t.schema)
    assert res["group_by"].schema.field("name").type == pa.string_view()
    if rank == 0:
        f = D.with_index(friendly(whole))
        want = {
            "group_by": "SELECT name, sum(amount), first(tags ORDER BY __idx), count(id), max(name) FROM t GROUP BY name",
            "join": "SELECT t.id, t.name, t.tags, t.amount, u.tags FROM t JOIN (SELECT name, first(tags ORDER BY __idx) AS tags "
                    "FROM t GROUP BY name) u ON t.name = u.name",
            "sort": "SELECT id, name, tags, amount FROM t ORDER BY name DESC NULLS LAST, id",
            "filter": "SELECT id, name, tags, amount FROM t WHERE name = 'name-3'",
            "unique": "SELECT id, name, tags, amount FROM (SELECT *, row_number() OVER (PARTITION BY name ORDER BY __idx) AS rn FROM t) WHERE rn = 1",
        }
        for name, sql in want.items():
            check(got[name], D.duck(sql, t=f), f"{engine} {name} ranks={size}", ordered=name == "sort")
