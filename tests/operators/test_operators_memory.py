"""Kernels that consume their input, the scratch-buffer cache and the blockwise index builders (no MPI)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hetflow.operators import intkeys, kernels, memory


def _owned(arrays: dict[str, np.ndarray], types: dict[str, pa.DataType] | None = None) -> pa.Table:
    """A table whose columns alone own writable buffers (like a shuffle's result)."""
    types = types or {}
    cols = []
    for name, values in arrays.items():
        buf = memory.empty(values.size, values.dtype)
        buf[:] = values
        t = types.get(name, pa.from_numpy_dtype(values.dtype))
        cols.append(pa.Array.from_buffers(t, values.size, [None, pa.py_buffer(buf)]))
    return pa.table(cols, names=list(arrays))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("descending", [False, True])
def test_consuming_sort_matches_the_copying_one(seed: int, descending: bool) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300_000)) if seed else 0
    spread = [5, 1 << 20, 1 << 40][seed % 3]
    keys = rng.integers(-spread, spread, n)
    keys[::7] = keys[0] if n else 0  # ties: stability
    data = {"k": keys, "v": rng.integers(0, 1 << 40, n), "u": rng.integers(0, 255, n).astype(np.uint8)}
    t = pa.table(data)
    want = t.take(pc.sort_indices(t, [("k", "descending" if descending else "ascending")]))
    got = intkeys.sort_table(_owned(data), "k", descending, consume=True)
    assert got is not None and got.equals(want), f"seed={seed}"
    assert kernels.sort(_owned(data), [("k", "ascending")], "at_end", consume=True).equals(
        t.take(pc.sort_indices(t, [("k", "ascending")]))), f"seed={seed}"


def test_consuming_sort_of_temporal_keys() -> None:
    rng = np.random.default_rng(7)
    data = {"k": rng.integers(-10**12, 10**12, 5000), "i": np.arange(5000)}
    t = _owned(data, {"k": pa.timestamp("us")})
    want = pa.table({"k": pa.array(data["k"]).view(pa.timestamp("us")), "i": data["i"]})
    got = intkeys.sort_table(t, "k", False, consume=True)
    assert got is not None and got.equals(want.take(pc.sort_indices(want, [("k", "ascending")])))


@pytest.mark.parametrize("seed", range(6))
def test_consuming_group_by_matches_pyarrow(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200_000))
    keys = rng.integers(0, max(1, n // [1, 3, 1000][seed % 3]), n)
    data = {"k": keys, "v": rng.integers(-(1 << 40), 1 << 40, n)}
    aggs = [("v", "sum"), ("v", "count"), ("v", "min"), ("v", "mean")]
    t = pa.table(data)
    want = t.group_by("k").aggregate(aggs).sort_by("k")
    got = kernels.group_aggregate(_owned(data), ["k"], aggs, consume=True)
    assert got.select(want.schema.names).equals(want), f"seed={seed}"


def test_group_by_that_would_overflow_restores_a_consumed_key_column() -> None:
    """The exact-sum check fails only after the words are sorted (in the key column's own buffer):
    the keys go back to their rows, so the general kernel sees the input intact."""
    rng = np.random.default_rng(11)
    n = 50_000
    order = rng.permutation(n)
    keys = (np.arange(n) // 1000)[order]  # 50 groups of 1000 rows, half +2**61 and half -2**61 + 1:
    values = np.where(np.arange(n) % 2 == 0, 1 << 61, -(1 << 61) + 1).astype(np.int64)[order]  # bound trips, sums fit
    data = {"k": keys, "v": values}
    owned = _owned(data)
    schema = kernels.aggregate_schema(owned.schema, ["k"], [("v", "sum")])
    assert intkeys.group_aggregate(owned, ["k"], [("v", "sum")], schema, consume=True) is None
    assert np.array_equal(owned.column("k").to_numpy(), keys)
    got = kernels.group_aggregate(_owned(data), ["k"], [("v", "sum"), ("v", "count")], consume=True).sort_by("k")
    counts = np.bincount(keys)
    assert got.column("v_count").to_pylist() == [int(c) for c in counts if c]
    sums: dict[int, int] = {}
    for k, v in zip(keys.tolist(), values.tolist()):
        sums[k] = sums.get(k, 0) + v
    assert got.column("k").to_pylist() == sorted(sums)
    assert got.column("v_sum").to_pylist() == [sums[k] for k in sorted(sums)]


def test_group_by_of_the_key_column_itself_does_not_consume_it() -> None:
    data = {"k": np.array([3, 1, 3, 2, 1, 3], dtype=np.int64)}
    got = kernels.group_aggregate(_owned(data), ["k"], [("k", "sum"), ("k", "max")], consume=True)
    assert got.to_pydict() == {"k": [1, 2, 3], "k_sum": [2, 2, 9], "k_max": [1, 2, 3]}


@pytest.mark.parametrize("parts", [1, 2, 3, 16])
def test_indices_by_id_matches_flatnonzero(parts: int) -> None:
    rng = np.random.default_rng(parts)
    for n in (0, 1, memory.BLOCK - 1, memory.BLOCK, 3 * memory.BLOCK + 5):
        ids = rng.integers(0, parts, n).astype(np.uint8)
        got = memory.indices_by_id(ids, parts)
        assert len(got) == parts
        for j in range(parts):
            assert np.array_equal(got[j], np.flatnonzero(ids == j)), (parts, n, j)
        mask = ids == 0
        assert np.array_equal(memory.flatnonzero(mask), np.flatnonzero(mask))


def test_index_lists_are_int32_below_2_31_rows_and_int64_above() -> None:
    assert memory.indices_by_id(np.array([1, 0, 1], dtype=np.uint8), 2)[1].dtype == np.int32
    assert memory.flatnonzero(np.ones(5, dtype=bool)).dtype == np.int32
    assert memory.index_dtype(2**31 - 1) == np.int32
    assert memory.index_dtype(2**31) == np.int64


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_take_rows_matches_np_take_across_blocks(dtype: type) -> None:
    rng = np.random.default_rng(7)
    for n in (0, 5, memory.BLOCK, 3 * memory.BLOCK + 11):
        values = rng.integers(-(1 << 60), 1 << 60, (n + 3, 2))  # a 2-D column (fixed-size lists) too
        idx = np.sort(rng.integers(0, n + 3, n)).astype(dtype)
        out = np.empty((n, 2), dtype=values.dtype)
        assert memory.take_rows(values, idx, out) is out
        assert np.array_equal(out, np.take(values, idx.astype(np.int64), axis=0)), (dtype, n)


def test_scratch_buffers_are_reused_only_once_free_and_trimmed() -> None:
    memory.trim(0)
    a = memory.empty(1 << 20, np.int64)
    a[:] = 1
    b = memory.empty(1 << 20, np.int64)
    assert not np.shares_memory(a, b)  # a is alive: not handed out twice
    arr = pa.Array.from_buffers(pa.int64(), a.size, [None, pa.py_buffer(a)])
    address = a.ctypes.data
    del a
    c = memory.empty(1 << 20, np.int64)
    assert c.ctypes.data != address  # still referenced by the Arrow array
    assert arr.to_numpy()[0] == 1
    del arr, c
    d = memory.empty(1 << 20, np.int64)
    assert d.ctypes.data in {address, b.ctypes.data} or len(memory._cache) <= 3
    del b, d
    memory.trim(0)
    assert memory._cache == []
    small = memory.empty(10, np.int8)  # below POOL_MIN_BYTES: plain numpy
    assert small.shape == (10,) and memory._cache == []
    shaped = memory.empty((1 << 17, 2), np.uint64)
    assert shaped.shape == (1 << 17, 2) and shaped.flags.writeable and shaped.flags.c_contiguous


def test_a_bad_cache_size_setting_names_the_variable() -> None:
    from hetflow.operators import settings
    from hetflow.operators.errors import InvalidOptionError

    assert settings.from_environment({"HETFLOW_SCRATCH_CACHE_BYTES": "1024"}) == {"scratch_cache_bytes": 1024}
    for bad in ("1GiB", "-1"):
        with pytest.raises(InvalidOptionError, match=f"HETFLOW_SCRATCH_CACHE_BYTES '{bad}'.*whole number >= 0"):
            settings.from_environment({"HETFLOW_SCRATCH_CACHE_BYTES": bad})
