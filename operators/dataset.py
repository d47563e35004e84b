"""The on-disk dataset format: Arrow IPC partitions plus a manifest written last.

A dataset is a directory::

    part-00000.arrow   one Arrow IPC file per partition (uncompressed, so it
    part-00001.arrow   opens zero-copy through a memory map)
    _manifest.json     schema, partitions (rows, bytes, crc32, node, rank),
                       producer; written last via temp file + fsync + rename

A directory without ``_manifest.json`` is not a dataset: readers never see half
an output.  Every partition file is itself written to a temporary name, fsynced
and renamed, so a crash leaves either the old file or the new one.

Consumers with another rank count get rows split evenly by :meth:`Dataset.rows_for_rank`
(zero-copy slices of the mapped partitions).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping

import pyarrow as pa

MANIFEST = "_manifest.json"
FORMAT_VERSION = 1
Verify = Literal["checksum", "size", "none"]
_CHUNK = 8 << 20


class DatasetError(Exception):
    """Root of dataset errors."""


class DatasetNotFound(DatasetError, FileNotFoundError):
    """No committed dataset (no manifest) at a path."""


class CorruptDataset(DatasetError, ValueError):
    """A partition or manifest does not match what the manifest promises."""


@dataclass(frozen=True)
class PartitionInfo:
    """One committed partition file (``file`` is relative to the dataset directory)."""

    file: str
    rows: int
    bytes: int
    checksum: str
    node: str = ""
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes,
                "checksum": self.checksum, "node": self.node, "rank": self.rank}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PartitionInfo":
        return cls(file=str(data["file"]), rows=int(data["rows"]), bytes=int(data["bytes"]),
                   checksum=str(data["checksum"]), node=str(data.get("node", "")), rank=int(data.get("rank", 0)))


@dataclass(frozen=True)
class Manifest:
    name: str
    schema: pa.Schema
    partitions: tuple[PartitionInfo, ...]
    producer: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    @property
    def num_bytes(self) -> int:
        return sum(p.bytes for p in self.partitions)

    def fingerprint(self) -> str:
        """A stable digest of the content this manifest commits (for cache keys)."""
        parts = ",".join(f"{p.file}:{p.rows}:{p.bytes}:{p.checksum}" for p in self.partitions)
        text = f"{schema_to_text(self.schema)}|{parts}"
        return f"{zlib.crc32(text.encode()):08x}-{self.num_rows}-{self.num_bytes}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "name": self.name,
            "num_rows": self.num_rows,
            "num_bytes": self.num_bytes,
            "schema": schema_to_text(self.schema),
            "schema_fields": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in self.schema],
            "partitions": [p.to_json() for p in self.partitions],
            "producer": dict(self.producer),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str) -> "Manifest":
        try:
            return cls(
                name=str(data["name"]),
                schema=schema_from_text(str(data["schema"])),
                partitions=tuple(PartitionInfo.from_json(p) for p in data["partitions"]),
                producer=dict(data.get("producer", {})),
                format_version=int(data.get("format_version", FORMAT_VERSION)),
            )
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise CorruptDataset(f"{source}: not a valid hetflow manifest ({exc!s})") from None


def schema_to_text(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def partition_name(index: int) -> str:
    return f"part-{index:05d}.arrow"


# ----------------------------------------------------------------- writing
class _ChecksumFile:
    """A binary sink that keeps a running crc32 and byte count of what passes through."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.crc = 0
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size


def write_partition(directory: "str | os.PathLike[str]", index: int,
                    data: "pa.Table | Iterable[pa.RecordBatch]", *, schema: pa.Schema | None = None,
                    rank: int = 0) -> PartitionInfo:
    """Write one partition atomically (temp file, fsync, rename); return what the manifest records.

    ``data`` is a table or an iterable of record batches (streamed, so a rank
    never needs its whole output in memory); ``schema`` is required for an
    iterable.
    """
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    name = partition_name(index)
    final = directory / name
    tmp = directory / f".{name}.tmp-{os.getpid()}"
    if isinstance(data, pa.Table):
        schema = data.schema
        batches: Iterable[pa.RecordBatch] = data.to_batches()
    else:
        if schema is None:
            raise ValueError("write_partition: a schema is required when data is an iterable of batches")
        batches = data
    rows = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=_CHUNK) as raw:
            sink = _ChecksumFile(raw)
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                for batch in batches:
                    if batch.schema != schema:
                        raise ValueError(f"write_partition {final}: batch schema {batch.schema} does not match {schema}")
                    writer.write_batch(batch)
                    rows += batch.num_rows
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write partition {final}: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return PartitionInfo(file=name, rows=rows, bytes=sink.size, checksum=f"crc32:{sink.crc:08x}",
                         node=socket.gethostname(), rank=rank)


def commit(directory: "str | os.PathLike[str]", name: str, schema: pa.Schema,
           partitions: Iterable[PartitionInfo], *, producer: Mapping[str, Any] | None = None) -> Manifest:
    """Publish a dataset: check the partitions exist, remove strays, write the manifest last."""
    directory = Path(directory)
    parts = tuple(sorted(partitions, key=lambda p: p.file))
    for part in parts:
        path = directory / part.file
        if not path.is_file() or path.stat().st_size != part.bytes:
            raise CorruptDataset(f"dataset {name!r}: partition {path} is missing or has the wrong size "
                                 f"(expected {part.bytes} bytes)")
    listed = {p.file for p in parts}
    for stray in directory.glob("*part-*.arrow*"):
        if stray.name not in listed:
            stray.unlink(missing_ok=True)
    manifest = Manifest(name=name, schema=schema, partitions=parts, producer=dict(producer or {}))
    write_json_atomic(directory / MANIFEST, manifest.to_json())
    return manifest


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via temp file + fsync + rename (+ fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def uncommit(directory: "str | os.PathLike[str]") -> None:
    """Withdraw a dataset (manifest first, so it stops existing before its files go)."""
    directory = Path(directory)
    (directory / MANIFEST).unlink(missing_ok=True)
    for part in directory.glob("*part-*.arrow*"):
        part.unlink(missing_ok=True)


# ----------------------------------------------------------------- reading
def read_manifest(directory: "str | os.PathLike[str]") -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise DatasetNotFound(f"no committed dataset at {directory} (no {MANIFEST}; "
                              "an output without a manifest is incomplete and is never read)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptDataset(f"{path}: unreadable manifest ({exc})") from None
    return Manifest.from_json(data, source=str(path))


class Dataset:
    """A committed dataset opened for reading; partitions are memory-mapped, not copied."""

    def __init__(self, directory: "str | os.PathLike[str]", *, verify: Verify = "checksum") -> None:
        self.path = Path(directory)
        self.manifest = read_manifest(self.path)
        self.verify = verify
        self._cache: dict[int, pa.Table] = {}

    @property
    def schema(self) -> pa.Schema:
        return self.manifest.schema

    @property
    def num_rows(self) -> int:
        return self.manifest.num_rows

    @property
    def producer(self) -> Mapping[str, Any]:
        return self.manifest.producer

    def __len__(self) -> int:
        return len(self.manifest.partitions)

    def __repr__(self) -> str:
        return f"Dataset({str(self.path)!r}, rows={self.num_rows}, partitions={len(self)})"

    def partition(self, index: int) -> pa.Table:
        """Partition ``index`` as a zero-copy table over a memory map, checked against the manifest."""
        if index in self._cache:
            return self._cache[index]
        info = self.manifest.partitions[index]
        path = self.path / info.file
        where = f"{path} (dataset {self.manifest.name!r}, produced by {_producer_text(self.producer)})"
        try:
            size = path.stat().st_size
        except OSError:
            raise CorruptDataset(f"{where}: partition file is missing") from None
        if size != info.bytes:
            raise CorruptDataset(f"{where}: {size} bytes on disk, manifest says {info.bytes}")
        source = pa.memory_map(str(path), "r")
        if self.verify == "checksum":
            crc = 0
            for start in range(0, size, 64 << 20):
                crc = zlib.crc32(memoryview(source.read_at(min(64 << 20, size - start), start)), crc)
            if f"crc32:{crc:08x}" != info.checksum:
                raise CorruptDataset(f"{where}: checksum crc32:{crc:08x} does not match manifest {info.checksum}")
        try:
            table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptDataset(f"{where}: not a readable Arrow IPC file ({exc})") from None
        if table.num_rows != info.rows:
            raise CorruptDataset(f"{where}: {table.num_rows} rows, manifest says {info.rows}")
        if not table.schema.equals(self.schema, check_metadata=False):
            raise CorruptDataset(f"{where}: schema {table.schema} differs from the manifest's {self.schema}")
        self._cache[index] = table
        return table

    def partitions(self) -> Iterator[pa.Table]:
        for index in range(len(self)):
            yield self.partition(index)

    def to_table(self) -> pa.Table:
        if not len(self):
            return self.schema.empty_table()
        return pa.concat_tables(list(self.partitions())).replace_schema_metadata(self.schema.metadata)

    def rows_for_rank(self, rank: int, size: int) -> pa.Table:
        """Rows ``[N*rank/size, N*(rank+1)/size)`` of the dataset, as zero-copy slices."""
        total = self.num_rows
        start, stop = total * rank // size, total * (rank + 1) // size
        pieces: list[pa.Table] = []
        offset = 0
        for index, info in enumerate(self.manifest.partitions):
            lo, hi = max(start, offset), min(stop, offset + info.rows)
            if lo < hi:
                pieces.append(self.partition(index).slice(lo - offset, hi - lo))
            offset += info.rows
        if not pieces:
            return self.schema.empty_table()
        return pa.concat_tables(pieces).replace_schema_metadata(self.schema.metadata)

    def partitions_for_rank(self, rank: int, size: int) -> pa.Table:
        """The partitions the producer's rank ``rank`` (mod ``size``) wrote: keeps the layout."""
        pieces = [self.partition(i) for i, info in enumerate(self.manifest.partitions) if info.rank % size == rank]
        if not pieces:
            return self.schema.empty_table()
        return pa.concat_tables(pieces).replace_schema_metadata(self.schema.metadata)


def _producer_text(producer: Mapping[str, Any]) -> str:
    if not producer:
        return "an unknown producer"
    stage = producer.get("stage", "?")
    return f"stage {stage!r} (run {producer.get('run', '?')}, attempt {producer.get('attempt', '?')})"


def open_dataset(path: "str | os.PathLike[str]", *, verify: Verify = "checksum") -> Dataset:
    """Open a committed dataset: ``.to_table()`` for all of it, ``.partitions()`` to iterate."""
    return Dataset(path, verify=verify)
