"""The dataset format: atomic partitions, manifest last, checked zero-copy reads."""

from __future__ import annotations

import json
import os
import shutil
import stat
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


# --------------------------------------------- symlinks and manifest entries


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Files outside the dataset that a planted symlink or a bad entry would reach."""
    victim = tmp_path / "outside"
    victim.mkdir()
    os.chmod(victim, 0o755)
    (victim / "part-00000.arrow").write_bytes(b"precious")
    (victim / ds.MANIFEST).write_text('{"precious": true}')
    return victim


def _untouched(victim: Path) -> None:
    assert _mode(victim) == 0o755
    assert sorted(os.listdir(victim)) == sorted([ds.MANIFEST, "part-00000.arrow"])
    assert (victim / "part-00000.arrow").read_bytes() == b"precious"


@pytest.mark.parametrize("entry", ["../stolen.arrow", "ABSOLUTE", "", "part\x00.arrow", "sub/part-00000.arrow", ".."])
def test_manifest_entries_must_be_plain_names_in_the_dataset(tmp_path: Path, entry: str) -> None:
    data = tmp_path / "data"
    manifest = _write(data, [3])
    stolen = tmp_path / "stolen.arrow"
    shutil.copy(data / manifest.partitions[0].file, stolen)  # a valid partition: the old code read it happily
    if entry == "ABSOLUTE":
        entry = str(stolen)
    (data / "sub").mkdir()
    shutil.copy(data / manifest.partitions[0].file, data / "sub" / "part-00000.arrow")
    raw = json.loads((data / ds.MANIFEST).read_text())
    raw["partitions"][0]["file"] = entry
    (data / ds.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ds.CorruptDataset) as info:
        ds.open_dataset(data).to_table()
    message = str(info.value)
    assert str(data) in message and repr(entry) in message and "plain file name" in message


@pytest.mark.parametrize("entry", ["../x.arrow", "/etc/passwd", "", "a\x00b"])
def test_partition_info_rejects_bad_entries(entry: str) -> None:
    with pytest.raises(ds.CorruptDataset, match="plain file name"):
        ds.PartitionInfo(entry, 1, 10, "crc32:0")
    with pytest.raises(ds.CorruptDataset, match="plain file name"):
        ds.PartitionInfo.from_json({"file": entry, "rows": 1, "bytes": 10, "checksum": "crc32:0"})


def test_uncommit_refuses_a_symlinked_dataset_dir(tmp_path: Path, outside: Path) -> None:
    link = tmp_path / "datasets" / "numbers"
    link.parent.mkdir()
    os.symlink(outside, link)
    with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {link}: it is a symbolic link"):
        ds.uncommit(link)
    _untouched(outside)


def test_write_and_commit_refuse_a_symlinked_dataset_dir(tmp_path: Path, outside: Path) -> None:
    link = tmp_path / "numbers"
    os.symlink(outside, link)
    with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {link}: it is a symbolic link"):
        ds.write_partition(link, 1, pa.table({"x": [1]}))
    info = ds.PartitionInfo("part-00000.arrow", 1, len(b"precious"), "crc32:0")
    with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {link}"):
        ds.commit(link, "numbers", pa.schema([("x", pa.int64())]), [info])
    with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {link}"):
        ds.open_dataset(link)
    _untouched(outside)


@pytest.mark.parametrize("planted", ["part-00000.arrow", "part-00003.arrow", ds.MANIFEST])
def test_symlinked_entries_are_refused_not_followed(tmp_path: Path, outside: Path, planted: str) -> None:
    data = tmp_path / "data"
    _write(data, [3])
    (data / planted).unlink(missing_ok=True)
    os.symlink(outside / ("part-00000.arrow" if planted != ds.MANIFEST else ds.MANIFEST), data / planted)
    # uncommit removes nothing: it refuses before the manifest goes
    with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {data / planted}: it is a symbolic link"):
        ds.uncommit(data)
    if planted == "part-00000.arrow":
        with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {data / planted}"):
            ds.open_dataset(data, verify="none").to_table()
        with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {data / planted}"):
            ds.write_partition(data, 0, pa.table({"x": [1]}))
    elif planted == ds.MANIFEST:
        with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {data / planted}"):
            ds.read_manifest(data)
    else:  # a stray that commit would delete
        info = ds.read_manifest(data).partitions[0]
        with pytest.raises(ds.UnsafeDatasetPath, match=f"refusing {data / planted}"):
            ds.commit(data, "numbers", ds.read_manifest(data).schema, [info])
    assert (data / planted).is_symlink()
    _untouched(outside)


def test_files_and_new_dirs_are_private_under_a_narrow_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)  # takes the owner's write bit away from 0600/0700
    try:
        manifest = _write(tmp_path / "new" / "d", [3])
    finally:
        os.umask(old)
    assert _mode(tmp_path / "new") == _mode(tmp_path / "new" / "d") == 0o700
    assert _mode(tmp_path / "new" / "d" / ds.MANIFEST) == 0o600
    assert _mode(tmp_path / "new" / "d" / manifest.partitions[0].file) == 0o600
    assert ds.open_dataset(tmp_path / "new" / "d").num_rows == 3


def test_existing_dataset_dir_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o750)
    _write(shared, [2])
    assert _mode(shared) == 0o750


def test_a_dataset_of_more_partitions_than_open_files_allowed_is_read_whole(tmp_path: Path) -> None:
    """A map stage's output has a partition per item: reading 100,000 of them held a descriptor per
    partition (Python's mmap keeps a duplicate) and failed at the process's limit of open files; past
    ``MAPPED_PARTITIONS`` small partitions are read, not mapped (a process's maps are limited too)."""
    import subprocess
    import sys

    parts = [ds.write_partition(tmp_path, i, pa.table({"x": pa.array([i] * 4, pa.int64())}), durable=False)
             for i in range(300)]
    ds.commit(tmp_path, "many", pa.schema([("x", pa.int64())]), parts)
    probe = ("import resource, sys\n"
             "resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
             "from hetflow.operators import dataset as ds\n"
             "table = ds.open_dataset(sys.argv[1]).to_table()\n"
             "print(table.num_rows, sum(table['x'].to_pylist()))\n"
             "ds.MAPPED_PARTITIONS = 100\n"
             "table = ds.open_dataset(sys.argv[1]).to_table()\n"
             "maps = sum(sys.argv[1] in line for line in open('/proc/self/maps'))\n"
             "print(table.num_rows, maps)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.splitlines()
    assert first.split() == ["1200", str(4 * sum(range(300)))]
    assert second.split() == ["1200", "0"]   # read, not mapped (the first table and its maps are gone)
