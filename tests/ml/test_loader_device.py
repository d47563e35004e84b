"""The loader's path to a device, on CPU: zero-copy up to the staging buffer, options, no pinning on CPU.

The CUDA path itself (pinned ring, side stream, prefetch) is exercised by
``tests/ml/test_loader_cuda.py`` on a machine with a GPU (``scripts/gpu-check.sh``).
"""

from __future__ import annotations

from pathlib import Path

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
