"""The dataset format: atomic partitions, manifest last, checked zero-copy reads."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from hetflow.operators import dataset as ds


def _write(directory: Path, sizes: list[int]) -> ds.Manifest:
    parts = []
    offset = 0
    for index, size in enumerate(sizes):
        table = pa.table({"x": pa.array(range(offset, offset + size), pa.int64()), "s": pa.array([str(i) for i in range(size)], pa.string())})
        parts.append(ds.write_partition(directory, index, table, rank=index))
        offset += size
    schema = pa.schema([("x", pa.int64()), ("s", pa.string())])
    return ds.commit(directory, "numbers", schema, parts, producer={"stage": "gen", "run": "r", "attempt": 1,
                                                                    "ranks": len(sizes)})


def test_no_manifest_no_dataset(tmp_path: Path) -> None:
    ds.write_partition(tmp_path, 0, pa.table({"x": [1]}))
    with pytest.raises(ds.DatasetNotFound, match="no committed dataset"):
        ds.open_dataset(tmp_path)


def test_roundtrip_and_zero_copy(tmp_path: Path) -> None:
    manifest = _write(tmp_path, [5, 0, 7])
    assert manifest.num_rows == 12 and [p.rows for p in manifest.partitions] == [5, 0, 7]
    dataset = ds.open_dataset(tmp_path)
    assert dataset.to_table()["x"].to_pylist() == list(range(12))
    mapped = {dataset.partition(i)["x"].chunks[0].buffers()[1].address for i in (0, 2)}
    # rank slices share the partitions' buffers (which point into the memory map): no copy
    halves = [dataset.rows_for_rank(r, 2) for r in range(2)]
    addresses = {chunk.buffers()[1].address for half in halves for chunk in half["x"].chunks}
    assert addresses == mapped
    assert [h.num_rows for h in halves] == [6, 6]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_row_split_covers_every_row_once(tmp_path: Path, size: int) -> None:
    _write(tmp_path, [4, 0, 9, 1])
    dataset = ds.open_dataset(tmp_path)
    pieces = [dataset.rows_for_rank(r, size)["x"].to_pylist() for r in range(size)]
    assert sum(pieces, []) == list(range(14))
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_layout_kept_when_rank_counts_match(tmp_path: Path) -> None:
    _write(tmp_path, [4, 0, 9])
    dataset = ds.open_dataset(tmp_path)
    assert [dataset.partitions_for_rank(r, 3).num_rows for r in range(3)] == [4, 0, 9]


@pytest.mark.parametrize("damage", ["truncate", "flip", "zero", "garbage", "rows"])
def test_corruption_is_named(tmp_path: Path, damage: str) -> None:
    manifest = _write(tmp_path, [50, 60])
    target = tmp_path / manifest.partitions[1].file
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(data)
    elif damage == "zero":
        target.write_bytes(b"")
    elif damage == "garbage":
        target.write_bytes(b"not arrow at all".ljust(len(data), b"!"))
    else:  # a manifest that lies about rows: checksum off, only rows checked
        other = ds.write_partition(tmp_path, 1, pa.table({"x": pa.array([1], pa.int64()), "s": ["a"]}), rank=1)
        lying = ds.PartitionInfo(other.file, 60, other.bytes, other.checksum, other.node, 1)
        ds.commit(tmp_path, "numbers", manifest.schema, [manifest.partitions[0], lying],
                  producer=manifest.producer)
    with pytest.raises(ds.CorruptDataset) as info:
        ds.open_dataset(tmp_path, verify="size" if damage == "rows" else "checksum").to_table()
    message = str(info.value)
    assert "part-00001.arrow" in message and "stage 'gen'" in message


def test_commit_rejects_missing_partition_and_removes_strays(tmp_path: Path) -> None:
    info = ds.write_partition(tmp_path, 0, pa.table({"x": [1]}))
    ds.write_partition(tmp_path, 7, pa.table({"x": [2]}))  # a stray from an earlier attempt
    ds.commit(tmp_path, "t", pa.schema([("x", pa.int64())]), [info])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_manifest.json", "part-00000.arrow"]
    ghost = ds.PartitionInfo("part-00009.arrow", 1, 10, "crc32:0")
    with pytest.raises(ds.CorruptDataset, match="part-00009.arrow is missing"):
        ds.commit(tmp_path, "t", pa.schema([("x", pa.int64())]), [ghost])


def test_files_are_private(tmp_path: Path) -> None:
    _write(tmp_path / "d", [3])
    for path in (tmp_path / "d").iterdir():
        assert path.stat().st_mode & 0o077 == 0
