"""The loader's path to a device, on CPU: zero-copy up to the staging buffer, options, no pinning on CPU.

The CUDA path itself (pinned ring, side stream, prefetch) is exercised by
``tests/ml/test_loader_cuda.py`` on a machine with a GPU (``scripts/gpu-check.sh``).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pyarrow import ipc

torch = pytest.importorskip("torch")

from hetflow.ml import ArrowLoader, arrow_data_address
from hetflow.ml.loader import _PARALLEL_VALUES, gather_label, gather_rows


def _mapped(tmp_path: Path, table: pa.Table) -> pa.Table:
    """``table`` written as an Arrow IPC file and opened memory-mapped (how a stage gets its inputs)."""
    path = tmp_path / "part.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return ipc.open_file(pa.memory_map(str(path))).read_all()


def _table(n: int = 257) -> pa.Table:
    rng = np.random.default_rng(3)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=n * 3).astype(np.float32)), 3)
    return pa.table({"a": rng.normal(size=n).astype(np.float32), "b": rng.normal(size=n),
                     "v": vec, "y": rng.normal(size=n).astype(np.float32)})


def test_column_tensors_are_the_mapped_arrow_buffers_before_and_after_an_epoch(tmp_path: Path) -> None:
    table = _mapped(tmp_path, _table())
    loader = ArrowLoader(table, ["a", "v"], "y", batch_size=32, seed=1)
    assert loader.copies == {}
    shared = {c.name: c.tensor.data_ptr() for c in [*loader.columns, loader.label_column]}  # type: ignore[list-item]
    assert shared == {name: arrow_data_address(table.column(name)) for name in ("a", "v", "y")}
    seen = sorted(float(v) for _, y in loader for v in y)
    assert seen == sorted(table.column("y").to_pylist())
    assert {c.name: c.tensor.data_ptr() for c in [*loader.columns, loader.label_column]} == shared  # type: ignore[list-item]


def test_one_column_of_the_buffers_dtype_is_gathered_straight_into_it(tmp_path: Path) -> None:
    table = _mapped(tmp_path, _table())
    loader = ArrowLoader(table, ["v"], "y", batch_size=8)
    rows = np.array([5, 0, 256, 17])
    out = torch.full((10, 3), -1.0)
    got = gather_rows(loader.columns, rows, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (4, 3)  # written in place: the staging buffer
    assert got.tolist() == [table.column("v")[int(r)].as_py() for r in rows]
    assert out[4:].eq(-1.0).all()  # nothing written past the batch
    single = ArrowLoader(table, ["a"], None, batch_size=8)
    one = gather_rows(single.columns, rows, torch.empty((4, 1)))
    assert one[:, 0].tolist() == pytest.approx([table.column("a")[int(r)].as_py() for r in rows])


def test_mixed_columns_are_cast_into_their_places_in_the_buffer(tmp_path: Path) -> None:
    table = _mapped(tmp_path, _table())
    loader = ArrowLoader(table, ["b", "v", "a"], "y", batch_size=8)
    rows = np.array([3, 2, 1])
    got = gather_rows(loader.columns, rows, torch.empty((3, loader.width), dtype=torch.float64))
    want = [[table.column("b")[int(r)].as_py(), *table.column("v")[int(r)].as_py(), table.column("a")[int(r)].as_py()]
            for r in rows]
    assert got.dtype == torch.float64 and np.array_equal(got.numpy(), np.array(want))
    label = gather_label(loader.label_column.tensor, rows, torch.empty(3, dtype=torch.float64))  # type: ignore[union-attr]
    assert label.tolist() == pytest.approx([table.column("y")[int(r)].as_py() for r in rows])
    with pytest.raises(ValueError, match=r"out must be a \(rows >= 3, width\) tensor, got shape \(2, 5\)"):
        gather_rows(loader.columns, rows, torch.empty((2, 5)))
    with pytest.raises(ValueError, match="5 feature values per row but out has width 6"):
        gather_rows(loader.columns, rows, torch.empty((3, 6)))


def test_cpu_batches_are_plain_tensors_and_equal_the_table_rows() -> None:
    table = _table()
    loader = ArrowLoader(table, ["a", "b"], "y", batch_size=50, shuffle=False, prefetch=3,
                         normalization={"b": (1.0, 2.0)})
    assert loader.prefetch == 0 and loader.pin_memory is False  # nothing is staged or pinned on a CPU device
    x, y = next(iter(loader))
    assert not x.is_pinned() and not y.is_pinned() and x.device.type == "cpu"
    a = np.asarray(table.column("a"))[:50]
    b = (np.asarray(table.column("b"))[:50] - 1.0) / 2.0
    assert x.numpy() == pytest.approx(np.stack([a, b], axis=1).astype(np.float32))
    assert y.numpy().tolist() == np.asarray(table.column("y"))[:50].tolist()


def test_bad_device_options_are_rejected() -> None:
    table = _table(10)
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device, got device 'cpu'"):
        ArrowLoader(table, ["a"], "y", batch_size=4, pin_memory=True)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
            ArrowLoader(table, ["a"], "y", batch_size=4, prefetch=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [np.arange(40, 6040), np.random.default_rng(1).permutation(20000)[:6000]],
                         ids=["consecutive", "shuffled"])
def test_parallel_and_serial_gathers_give_the_same_batch(rows: np.ndarray) -> None:
    table = _table(20000)
    loader = ArrowLoader(table, ["a", "b", "v"], "y", batch_size=8)
    assert len(rows) * len(loader.columns) >= _PARALLEL_VALUES  # above the parallel threshold
    serial = gather_rows(loader.columns, rows, torch.empty((len(rows), 5)), threads=1)
    parallel = gather_rows(loader.columns, rows, torch.empty((len(rows), 5)), threads=3)
    want = np.column_stack([np.asarray(table.column("a"))[rows], np.asarray(table.column("b"))[rows],
                            np.stack(table.column("v").to_numpy(zero_copy_only=False))[rows]]).astype(np.float32)
    assert np.array_equal(serial.numpy(), want) and np.array_equal(parallel.numpy(), want)
    with torch.inference_mode():  # as in predict: the gather threads write an inference tensor
        inferred = gather_rows(loader.columns, rows, torch.empty((len(rows), 5)), threads=3)
    assert np.array_equal(inferred.numpy(), want)


def test_consecutive_rows_of_same_typed_columns_are_stacked_into_the_buffer() -> None:
    table = pa.table({"a": np.arange(100, dtype=np.float32), "c": -np.arange(100, dtype=np.float32)})
    loader = ArrowLoader(table, ["a", "c"], None, batch_size=8, shuffle=False)
    out = torch.full((12, 2), 7.0)
    got = gather_rows(loader.columns, np.arange(30, 40), out)
    assert got.data_ptr() == out.data_ptr()
    assert got.tolist() == [[float(i), -float(i)] for i in range(30, 40)] and out[10:].eq(7.0).all()
    assert [x[:, 0].tolist() for x in loader][3] == [float(i) for i in range(24, 32)]


def _mixed(n: int = 1001) -> pa.Table:
    """Features of every kind a loader casts (float64, int64, int32, uint32, bool, a fixed_size_list, nulls)."""
    rng = np.random.default_rng(11)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=n * 3)), 3)  # float64 values
    with_nulls = pa.array([None if i % 7 == 0 else float(v) for i, v in enumerate(rng.normal(size=n))], pa.float32())
    return pa.table({"f32": rng.normal(size=n).astype(np.float32), "f64": rng.normal(size=n) * 1e3,
                     "i64": rng.integers(-2**40, 2**40, n), "i32": rng.integers(-1000, 1000, n, dtype=np.int32),
                     "u32": rng.integers(0, 2**32 - 1, n, dtype=np.uint32), "flag": rng.random(n) < 0.5,
                     "v": vec, "gaps": with_nulls, "y": rng.integers(0, 9, n)})


MIXED = ["f32", "f64", "i64", "i32", "u32", "flag", "v", "gaps"]


@pytest.mark.parametrize("order", [
    {"num_batches": 13, "shuffle": True},   # what fit asks for: shuffled, nearly equal batches
    {"batch_size": 100, "shuffle": False},  # what predict asks for: consecutive rows
], ids=["shuffled", "consecutive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_major_batches_equal_the_column_path_batches(order: dict[str, Any], dtype: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetflow.ml.tensors

    monkeypatch.setattr(hetflow.ml.tensors, "_ROW_BLOCK_BYTES", 64 * 10 * 8)  # blocks of 64 or 128 rows, the last short
    table = _mixed()
    kwargs = {**order, "seed": 5, "rank": 1, "fill": {"gaps": -3.0}, "dtype": dtype,
              "normalization": {"f64": (10.0, 250.0), "v": (0.5, 2.0)}}
    rows = ArrowLoader(table, MIXED, "y", layout="rows", **kwargs)
    cols = ArrowLoader(table, MIXED, "y", layout="columns", **kwargs)
    assert (rows.layout, cols.layout) == ("rows", "columns") and rows.layout_seconds > 0 == cols.layout_seconds
    want_x = np.column_stack([np.asarray(table.column(c).fill_null(-3.0) if c == "gaps" else table.column(c))
                              for c in MIXED if c != "v"]
                             + [np.stack(table.column("v").to_numpy(zero_copy_only=False))])
    want_x = want_x[:, [0, 1, 2, 3, 4, 5, 7, 8, 9, 6]]  # back to MIXED's order: v's three values before gaps
    for epoch, start in ((0, 0), (1, 0), (1, 4)):  # start: resuming inside an epoch
        got = list(rows.batches(epoch, start=start))
        ref = list(cols.batches(epoch, start=start))
        indices = rows.batch_indices(epoch)[start:]
        assert len(got) == len(ref) == len(indices) > 0
        for (gx, gy), (rx, ry), idx in zip(got, ref, indices):
            assert gx.dtype == dtype and gy.dtype == dtype
            assert torch.equal(gx, rx) and torch.equal(gy, ry)  # bit for bit: same casts, same normalisation
            raw = rows.gather(idx, torch.empty((len(idx), rows.width), dtype=dtype)).numpy()
            assert np.array_equal(raw, want_x[idx].astype(raw.dtype))  # and both are the table's rows
            assert np.array_equal(gy.numpy(), np.asarray(table.column("y"))[idx].astype(gy.numpy().dtype))


def test_auto_layout_lays_rows_out_when_the_data_fit_twice_and_keeps_columns_otherwise(tmp_path: Path) -> None:
    from hetflow.ml.loader import ROW_MAJOR_SHARE, choose_layout, memory_share_of

    table = _mapped(tmp_path, _table())
    loader = ArrowLoader(table, ["a", "b", "v"], "y", batch_size=8)
    assert loader.layout == "rows"  # 257 rows fit on any machine that runs these tests
    matrix_bytes = loader.num_rows * loader.width * 4
    fits = int(matrix_bytes / ROW_MAJOR_SHARE)
    assert choose_layout(loader.columns, loader.num_rows, loader.width, torch.float32, fits) == "rows"
    assert choose_layout(loader.columns, loader.num_rows, loader.width, torch.float32, fits - 1) == "columns"
    assert choose_layout(loader.columns, loader.num_rows, loader.width, torch.float32, None) == "columns"
    # a rank plans only for its share of the node (ranks and tasks beside it build their own)
    assert choose_layout(loader.columns, loader.num_rows, loader.width, torch.float32, 2 * fits, 0.5) == "rows"
    assert choose_layout(loader.columns, loader.num_rows, loader.width, torch.float32, 2 * fits - 2, 0.5) == "columns"
    node = os.cpu_count() or 1
    assert memory_share_of(SimpleNamespace(cores=tuple(range(max(1, node // 2))))) == max(1, node // 2) / node
    assert memory_share_of(SimpleNamespace(cores=())) == 1.0 and memory_share_of(None) == 1.0
    with pytest.raises(ValueError, match=r"memory_share must be in \(0, 1\], got 0"):
        ArrowLoader(table, ["a"], "y", batch_size=8, memory_share=0)
    # one fixed_size_list column of the loader's dtype is row-major as it stands: used in place, whatever the memory
    single = ArrowLoader(table, ["v"], "y", batch_size=8)
    assert choose_layout(single.columns, single.num_rows, single.width, torch.float32, 0) == "rows"
    assert single._matrix is not None and single._matrix.data_ptr() == arrow_data_address(table.column("v"))
    with pytest.raises(ValueError, match=r"layout must be one of \['auto', 'rows', 'columns'\], got 'row'"):
        ArrowLoader(table, ["a"], "y", batch_size=8, layout="row")
