"""The numpy integer-key kernels against pyarrow's sort and group-by (no MPI)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from hetflow.operators import intkeys, kernels

DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64]


def _keys(rng: np.random.Generator, dtype: type, n: int, full_range: bool) -> np.ndarray:
    info = np.iinfo(dtype)
    lo, hi = (info.min, info.max) if full_range else (max(info.min, -40), min(info.max, 40))
    k = rng.integers(lo, hi, n, dtype=dtype, endpoint=True)
    k[::3] = k[0]  # many ties: stability matters
    return k


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_matches_pyarrow_stable_sort(dtype: type, n: int, descending: bool) -> None:
    rng = np.random.default_rng([DTYPES.index(dtype), n, descending])
    for full_range in (False, True):
        t = pa.table({"v": rng.integers(-5, 5, n), "k": _keys(rng, dtype, n, full_range) if n else np.empty(0, dtype)})
        want = t.take(pc.sort_indices(t, [("k", "descending" if descending else "ascending")]))
        got = intkeys.sort_table(t, "k", descending)
        if got is None:  # only when range and row count do not fit one word together
            assert full_range and np.dtype(dtype).itemsize == 8 and n > 1, (dtype, n)
            got = kernels.sort(t, [("k", "descending" if descending else "ascending")], "at_end")
        assert got.equals(want), f"dtype={dtype} n={n} descending={descending} full_range={full_range}"
        by = [("k", "descending" if descending else "ascending")]
        assert np.array_equal(kernels.sort_indices(t, by, "at_end"), pc.sort_indices(t, by).to_numpy())


@pytest.mark.parametrize("kind", [pa.date32(), pa.timestamp("us"), pa.timestamp("ns", tz="UTC"), pa.duration("s")])
def test_sort_temporal_keys_keep_their_type(kind: pa.DataType) -> None:
    rng = np.random.default_rng(3)
    storage = pa.int32() if kind == pa.date32() else pa.int64()
    k = pa.array(rng.integers(-1000, 1000, 200), storage).view(kind)
    t = pa.table({"k": k, "i": np.arange(200)})
    got = intkeys.sort_table(t, "k", False)
    assert got is not None and got.schema.equals(t.schema)
    assert got.equals(t.take(pc.sort_indices(t, [("k", "ascending")])))


def test_nulls_or_floats_take_the_general_path() -> None:
    assert intkeys.sort_table(pa.table({"k": pa.array([1, None, 2])}), "k", False) is None
    assert intkeys.sort_table(pa.table({"k": pa.array([1.0, 2.0])}), "k", False) is None


AGGS = [("v", "count"), ("v", "sum"), ("v", "mean"), ("v", "min"), ("v", "max"), ("u", "sum"), ("u", "max"), ("f", "count")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_by_matches_pyarrow(dtype: type) -> None:
    rng = np.random.default_rng(10 + DTYPES.index(dtype))
    n = 500
    t = pa.table({"k": _keys(rng, dtype, n, False), "v": rng.integers(-1000, 1000, n),
                  "u": rng.integers(0, 200, n).astype(np.uint16), "f": rng.normal(size=n)})
    schema = kernels.aggregate_schema(t.schema, ["k"], AGGS)
    got = intkeys.group_aggregate(t, ["k"], AGGS, schema)
    assert got is not None
    want = kernels.conform(kernels._pa_group_by(t, ["k"], AGGS), schema).sort_by("k")
    assert got.schema.equals(schema)
    for name in schema.names:
        a, b = got.column(name).to_numpy(), want.column(name).to_numpy()
        assert np.allclose(a, b, rtol=1e-12) if a.dtype.kind == "f" else np.array_equal(a, b), name


def test_group_by_refuses_a_sum_that_could_overflow() -> None:
    big = np.iinfo(np.int64).max // 2
    t = pa.table({"k": np.array([1, 1, 1, 2]), "v": np.array([big, big, big, 5])})
    schema = kernels.aggregate_schema(t.schema, ["k"], [("v", "sum")])
    assert intkeys.group_aggregate(t, ["k"], [("v", "sum")], schema) is None
    assert intkeys.group_aggregate(t, ["k"], [("v", "max")], kernels.aggregate_schema(t.schema, ["k"], [("v", "max")])) is not None


def test_group_by_needs_null_free_integer_values() -> None:
    t = pa.table({"k": [1, 2, 1], "v": pa.array([1, None, 3]), "f": [1.0, 2.0, 3.0]})
    for aggs in ([("v", "sum")], [("f", "sum")], [("v", "count")]):
        assert intkeys.group_aggregate(t, ["k"], aggs, kernels.aggregate_schema(t.schema, ["k"], aggs)) is None


@pytest.mark.parametrize("block", [1, 7, 64])
def test_blockwise_steps_match_one_block(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """Gather, key compaction and in-place reductions run in blocks; small blocks must agree."""
    rng = np.random.default_rng(block)
    n = 1000
    t = pa.table({"k": rng.integers(0, 300, n), "v": rng.integers(-50, 50, n), "w": rng.normal(size=n).astype(np.float32),
                  "s": pa.array([str(i) for i in range(n)])})
    aggs = [("v", "sum"), ("v", "min"), ("v", "count"), ("v", "mean"), ("v", "max")]
    schema = kernels.aggregate_schema(t.schema, ["k"], aggs)
    want_gb = intkeys.group_aggregate(t, ["k"], aggs, schema)
    want_sort = intkeys.sort_table(t, "k", True)
    monkeypatch.setattr(intkeys, "_BLOCK", block)
    assert intkeys.group_aggregate(t, ["k"], aggs, schema).equals(want_gb)
    got = intkeys.sort_table(t, "k", True)
    assert got.equals(want_sort) and got.equals(t.take(pc.sort_indices(t, [("k", "descending")])))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 17, 256, 300, 70000])
def test_partition_ids_shortcut_equals_multiply_shift(n: int) -> None:
    from hetflow.operators.partition import ids_from_hash

    h = np.random.default_rng(n).integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2) + np.uint64(n % 2)
    want = ((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)
    got = ids_from_hash(h, n)
    assert np.array_equal(got.astype(np.uint64), want) and got.max(initial=0) < n


@pytest.mark.parametrize("groups", [1, 1000, 50_000, 150_000, 10**9])
def test_groups_from_sample(groups: int) -> None:
    """The range group-by's group count from every 8th key is within 15% for keys drawn uniformly from
    ``groups`` values (or of the row count when nearly every key is distinct)."""
    from hetflow.operators import aggregate

    n = 400_000
    values = np.random.default_rng(groups).integers(0, groups, n)
    exact = np.unique(values).size
    est = aggregate._groups_from_sample(values)
    assert abs(est - exact) <= 0.15 * exact, (groups, est, exact)
    small = values[:1000]  # below SAMPLE_MIN_ROWS every key is counted
    assert abs(aggregate._groups_from_sample(small) - np.unique(small).size) <= 0.05 * np.unique(small).size
