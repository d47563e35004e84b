"""Arrow columns to tensors: zero-copy where the types allow, otherwise a reported copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from hetflow.ml import (ArrowLoader, ColumnTypeError, CopyRequiredError, NullValuesError,  # noqa: E402
                        arrow_data_address, to_tensor)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8])
def test_fixed_width_without_nulls_shares_the_arrow_buffer(dtype: type) -> None:
    arr = pa.array(np.arange(100).astype(dtype))
    conv = to_tensor(arr, name="x", allow_copy=False)
    assert not conv.copied and conv.reason is None
    assert conv.tensor.data_ptr() == arrow_data_address(arr)
    assert conv.tensor.numpy().tolist() == arr.to_pylist()


def test_a_slice_and_a_one_chunk_column_are_still_views() -> None:
    table = pa.table({"x": np.linspace(0, 1, 50)}).slice(7, 20)
    conv = to_tensor(table.column("x"), name="x", allow_copy=False)
    assert conv.tensor.data_ptr() == arrow_data_address(table.column("x"))
    assert conv.tensor.numpy().tolist() == table.column("x").to_pylist()


def test_fixed_size_list_column_is_a_zero_copy_matrix() -> None:
    flat = np.arange(30, dtype=np.float32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(flat), 3).slice(2)
    conv = to_tensor(arr, allow_copy=False)
    assert conv.tensor.shape == (8, 3)
    assert conv.tensor.data_ptr() == arrow_data_address(arr)
    assert conv.tensor.numpy().tolist() == arr.to_pylist()


@pytest.mark.parametrize("column, expected", [
    (pa.chunked_array([[1.0, 2.0], [3.0]]), "2 chunks concatenated"),
    (pa.array([True, False, True]), "bit-packed"),
    (pa.array([1, 2, 3], pa.uint32()), "widened"),
])
def test_unavoidable_copies_are_reported_with_the_reason(column: pa.Array, expected: str) -> None:
    conv = to_tensor(column, name="c")
    assert conv.copied and expected in (conv.reason or "")
    assert conv.tensor.numpy().astype(float).tolist() == [float(v) for v in column.to_pylist()]
    with pytest.raises(CopyRequiredError, match="'c'"):
        to_tensor(column, name="c", allow_copy=False)


def test_a_dtype_cast_is_a_reported_copy() -> None:
    conv = to_tensor(pa.array([1, 2, 3]), name="n", dtype=torch.float32)
    assert conv.copied and "cast" in (conv.reason or "") and conv.tensor.dtype == torch.float32


def test_nulls_are_an_error_naming_the_column_unless_filled() -> None:
    arr = pa.array([1.5, None, 2.5, None])
    with pytest.raises(NullValuesError, match=r"'mag_r'.*2 null"):
        to_tensor(arr, name="mag_r")
    filled = to_tensor(arr, name="mag_r", fill={"mag_r": -1.0})
    assert filled.copied and "2 null" in (filled.reason or "")
    assert filled.tensor.tolist() == [1.5, -1.0, 2.5, -1.0]
    assert to_tensor(pa.array([1, None], pa.int32()), fill=7).tensor.tolist() == [1, 7]
    with pytest.raises(NullValuesError, match="'other'"):
        to_tensor(arr, name="other", fill={"mag_r": 0.0})


def test_nulls_inside_a_fixed_size_list_are_filled() -> None:
    arr = pa.array([[1.0, None], None, [3.0, 4.0]], pa.list_(pa.float64(), 2))
    with pytest.raises(NullValuesError):
        to_tensor(arr, name="v")
    assert to_tensor(arr, name="v", fill=0.0).tensor.tolist() == [[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]]


def test_variable_width_columns_are_rejected_with_the_allowed_types() -> None:
    with pytest.raises(ColumnTypeError, match=r"'band'.*string.*allowed"):
        to_tensor(pa.array(["u", "g"]), name="band")


def test_loader_reports_which_columns_were_copied() -> None:
    table = pa.table({"a": np.ones(4, np.float32), "b": pa.chunked_array([[1.0, 2.0], [3.0, 4.0]]),
                      "y": np.zeros(4)})
    loader = ArrowLoader(table, ["a", "b"], "y", batch_size=2, shuffle=False)
    assert set(loader.copies) == {"b"}
    assert loader.columns[0].tensor.data_ptr() == arrow_data_address(table.column("a"))
    assert loader.label_column is not None
    assert loader.label_column.tensor.data_ptr() == arrow_data_address(table.column("y"))


def test_a_memory_mapped_dataset_partition_becomes_tensors_without_copies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hetflow.operators import dataset as ds

    tables = [pa.table({"x": np.arange(10, dtype=np.float32) + 10 * i, "y": np.arange(10, dtype=np.int64)})
              for i in range(2)]
    infos = [ds.write_partition(tmp_path, i, t, rank=i) for i, t in enumerate(tables)]
    ds.commit(tmp_path, "points", tables[0].schema, infos, producer={"ranks": 2})
    dataset = ds.Dataset(tmp_path)
    part = dataset.partitions_for_rank(1, 2)  # what the worker hands rank 1 of a 2-rank consumer
    loader = ArrowLoader(part, ["x"], "y", batch_size=4)
    assert loader.copies == {}
    tensor = loader.columns[0].tensor
    assert tensor.numpy().tolist() == tables[1]["x"].to_pylist()
    assert tensor.data_ptr() == arrow_data_address(part.column("x"))
    # and that memory is the partition file's memory map (Linux: /proc/self/maps)
    maps = Path("/proc/self/maps")
    if maps.exists():
        target = str((tmp_path / infos[1].file).resolve())
        regions = [line.split()[0].split("-") for line in maps.read_text().splitlines() if line.endswith(target)]
        assert any(int(lo, 16) <= tensor.data_ptr() < int(hi, 16) for lo, hi in regions), regions
    # rows that span two partition files cannot be one contiguous view: the copy is reported
    spanning = dataset.rows_for_rank(0, 1)
    assert "2 chunks" in (to_tensor(spanning.column("x"), name="x").reason or "")
