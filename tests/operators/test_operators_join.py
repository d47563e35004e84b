"""Distributed join vs a plain-Python hash join on the gathered inputs (mpiexec -n 1/2/3)."""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa
import pytest

import _opdata as D

pytestmark = pytest.mark.mpi

HOWS = ("inner", "left", "right", "full", "semi", "anti")


def reference_join(left: pa.Table, right: pa.Table, lk: Sequence[str], rk: Sequence[str], how: str, suffix: str) -> pa.Table:
    """SQL join semantics written out by hand: null keys never match, keys coalesced into the left names."""
    lrows, rrows = left.to_pylist(), right.to_pylist()
    index: dict[tuple[Any, ...], list[int]] = {}
    for j, r in enumerate(rrows):
        key = tuple(r[k] for k in rk)
        if None not in key:
            index.setdefault(key, []).append(j)
    rnames = [n for n in right.schema.names if n not in rk]
    taken = set(left.schema.names)
    rout = []
    for n in rnames:
        rout.append(n + suffix if n in taken else n)
        taken.add(rout[-1])
    out: list[dict[str, Any]] = []
    matched_right: set[int] = set()
    for lrow in lrows:
        key = tuple(lrow[k] for k in lk)
        hits = index.get(key, []) if None not in key else []
        if how == "semi":
            if hits:
                out.append(dict(lrow))
            continue
        if how == "anti":
            if not hits:
                out.append(dict(lrow))
            continue
        for j in hits:
            matched_right.add(j)
            row = dict(lrow)
            row.update({o: rrows[j][n] for o, n in zip(rout, rnames)})
            out.append(row)
        if not hits and how in ("left", "full"):
            row = dict(lrow)
            row.update({o: None for o in rout})
            out.append(row)
    if how in ("right", "full"):
        for j, rrow in enumerate(rrows):
            if j in matched_right:
                continue
            row = {n: None for n in left.schema.names}
            for a, b in zip(lk, rk):
                row[a] = rrow[b]
            row.update({o: rrow[n] for o, n in zip(rout, rnames)})
            out.append(row)
    fields = list(left.schema)
    if how not in ("semi", "anti"):
        fields += [pa.field(o, right.schema.field(n).type) for o, n in zip(rout, rnames)]
    schema = pa.schema(fields)
    return pa.Table.from_pylist(out, schema=schema)


def run_join(comm: Any, seed: int, layout: str, keys: dict[str, pa.DataType], how: str, algorithm: str = "auto",
             right_names: dict[str, str] | None = None, n: int = 30) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    left = D.table(seed, rank, size, layout=layout, keys=keys, n=n, stream=1)
    rlayout = "balanced" if layout == "zero_rows" and seed % 2 else layout
    right = D.table(seed, rank, size, layout=rlayout, keys=keys, n=n, stream=2)
    right = right.drop_columns(["f"])
    rk = list(keys)
    if right_names:
        right = right.rename_columns([right_names.get(c, c) for c in right.schema.names])
        rk = [right_names.get(k, k) for k in keys]
    lt, rt = DTable(comm, left), DTable(comm, right)
    res = lt.join(rt, list(keys), right_keys=rk if right_names else None, how=how, algorithm=algorithm)
    got = res.gather()
    all_left, all_right = lt.gather(), rt.gather()
    if rank == 0:
        want = reference_join(all_left, all_right, list(keys), rk, how, "_right")
        ctx = f"seed={seed} layout={layout} keys={keys} how={how} algorithm={algorithm} ranks={size}"
        assert got.schema.names == want.schema.names, ctx
        D.assert_same_rows(got, want, ctx)
    assert "join" in res.explain()


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", list(D.KEY_TYPES))
def test_join_key_types(comm: Any, kind: str, how: str) -> None:
    seed = 1000 + list(D.KEY_TYPES).index(kind) * 10 + HOWS.index(how)
    layout = D.LAYOUTS[seed % 3]
    run_join(comm, seed, layout, {"k": D.KEY_TYPES[kind]}, how)


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("algorithm", ["hash", "broadcast", "sort"])
@pytest.mark.parametrize("how", HOWS)
def test_join_algorithms(comm: Any, how: str, algorithm: str, layout: str) -> None:
    if algorithm == "broadcast" and how == "full":
        from hetflow.operators.errors import InvalidOptionError
        from hetflow.operators import DTable

        t = DTable(comm, D.table(1, comm.Get_rank(), comm.Get_size()))
        if comm.Get_size() > 1:
            with pytest.raises(InvalidOptionError, match="broadcast"):
                t.join(t, "k", how="full", algorithm="broadcast")
        return
    seed = 2000 + HOWS.index(how) * 100 + ["hash", "broadcast", "sort"].index(algorithm) * 10 + D.LAYOUTS.index(layout)
    run_join(comm, seed, layout, {"k": pa.string()}, how, algorithm)


@pytest.mark.parametrize("how", HOWS)
def test_join_multi_key_and_right_keys(comm: Any, how: str) -> None:
    keys = {"a": pa.string(), "b": pa.int32()}
    run_join(comm, 3000 + HOWS.index(how), "balanced", keys, how, right_names={"a": "ra", "b": "rb"}, n=50)
    run_join(comm, 3100 + HOWS.index(how), "empty_rank", keys, how, algorithm="sort", n=50)


def test_join_broadcast_chosen_for_small_side(comm: Any) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    big = DTable(comm, D.table(7, rank, size, n=3000, null_frac=0.0))
    small = DTable(comm, D.table(8, rank, size, n=3, null_frac=0.0).select(["k", "s"]))
    res = big.join(small, "k")
    if size > 1:
        assert "broadcast right" in res.explain()
    assert "alternatives" in res.explain() or size == 1
