"""The dataset format of :mod:`hetflow.operators.dataset` on an object store (``s3://...``).

An object store has no rename, no directories and no file descriptors, so the commit protocol of a
file system (temp file, fsync, rename) becomes:

- **Partitions under unique keys.** Each write of a partition goes to a key no other write uses
  (``part-00000-<random>.arrow``), streamed through a pyarrow output stream (a multipart upload for
  large ones) with its crc32 and size counted on the way, as on a file system.  An upload that
  fails is never under a key a manifest names; it is deleted when that is still possible, and
  otherwise left to :func:`uncommit` or ``hetflow rm``.
- **The manifest is the commit**, written last (one PUT: an object store never shows half an
  object) and only when every partition it names is there with its size.  A committed manifest is
  never overwritten: :func:`commit` refuses when one is there, so two writers committing the same
  dataset never produce a mix — the first wins whole, the second fails naming it.  (Between the
  check and the PUT there is a window an object store without conditional writes cannot close;
  hetflow's own writers of one dataset are serialised by the run's owner.)
- **Reads are whole objects** (no memory map): a partition is read into memory, checked against
  its size and checksum, and opened as Arrow IPC from the buffer.

Every failed request is a :class:`~hetflow.operators.location.StorageError` naming bucket, key and
cause (:func:`~hetflow.operators.location.storage_error`).
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from .datasetformat import (MANIFEST, CorruptDataset, DatasetCommitted, DatasetNotFound, Manifest, PartitionInfo,
                            _is_part, check_entry)
from .location import Location, storage_error


def unique_partition_name(index: int) -> str:
    """``part-<index>-<random>.arrow``: a key no other write of this partition uses."""
    return f"part-{index:05d}-{secrets.token_hex(6)}.arrow"


_PARTITION_NAME = re.compile(r"part-\d+(?:-\d+)?-[0-9a-f]{12}\.arrow")
"""The names hetflow gives partition objects: :func:`unique_partition_name`, and a map stage's uploads
(``part-<item>-<rank>-<random>.arrow``, :func:`hetflow.mapping.assemble`)."""


def leftovers(directory: Location, *, before: float) -> list[Location]:
    """The partition objects directly under dataset ``directory`` that no committed manifest names — all of
    them when it has no manifest — and that were last modified before ``before`` (seconds since the epoch):
    uploads of attempts that never committed.  Only names hetflow gives partitions count; a manifest that
    cannot be read leaves the directory alone (nothing there is judged).

    :raises StorageError: the listing failed.
    """
    try:
        infos = directory.filesystem.get_file_info(pafs.FileSelector(directory.path, allow_not_found=True))
    except OSError as exc:
        raise storage_error(exc, directory, "list") from None
    files = {info.base_name: info for info in infos if info.type == pafs.FileType.File}
    named: set[str] = set()
    if MANIFEST in files:
        try:
            named = {str(part["file"]) for part in read_manifest_data(directory)["partitions"]}
        except (CorruptDataset, DatasetNotFound, KeyError, TypeError):
            return []
    return [directory.join(name) for name, info in sorted(files.items())
            if _PARTITION_NAME.fullmatch(name) and name not in named
            and info.mtime_ns is not None and info.mtime_ns < before * 1e9]


def delete(objects: Iterable[Location]) -> None:
    """Delete each of ``objects`` (one already gone is fine).

    :raises StorageError: a request failed; the objects before it are deleted.
    """
    for where in objects:
        try:
            where.filesystem.delete_file(where.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(exc, where, "delete") from None


class _Counting:
    """A binary sink over a pyarrow output stream that keeps the running crc32 and size."""

    def __init__(self, raw: pa.NativeFile) -> None:
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
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size


def _delete_quiet(where: Location) -> None:
    try:
        where.filesystem.delete_file(where.path)
    except OSError:
        pass  # the store is unreachable or the object never came to be: nothing a manifest names


def write_partition(directory: Location, index: int, batches: Iterable[pa.RecordBatch], schema: pa.Schema, *,
                    rank: int, node: str | None) -> PartitionInfo:
    """Stream one partition to a fresh key under ``directory``; return what the manifest records."""

    name = unique_partition_name(index)
    where = directory.join(name)
    rows = 0
    try:
        with where.filesystem.open_output_stream(where.path, metadata={"Content-Type": "application/vnd.apache.arrow.file"}) as raw:
            sink = _Counting(raw)
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                for batch in batches:
                    if batch.schema != schema:
                        raise ValueError(f"write_partition {where.uri}: batch schema {batch.schema} "
                                         f"does not match {schema}")
                    writer.write_batch(batch)
                    rows += batch.num_rows
    except OSError as exc:
        _delete_quiet(where)
        raise storage_error(exc, where, "write") from None
    except BaseException:
        _delete_quiet(where)
        raise
    return PartitionInfo(file=name, rows=rows, bytes=sink.size, checksum=f"crc32:{sink.crc:08x}",
                         node=socket.gethostname() if node is None else node, rank=rank)


def _sizes(directory: Location) -> dict[str, int]:
    """The objects directly under ``directory`` and their sizes (one listing)."""
    try:
        infos = directory.filesystem.get_file_info(pafs.FileSelector(directory.path, allow_not_found=True))
    except OSError as exc:
        raise storage_error(exc, directory, "list") from None
    return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}


def commit(directory: Location, name: str, schema: pa.Schema, partitions: Iterable[PartitionInfo], *,
           producer: Mapping[str, Any] | None = None) -> Manifest:
    """Publish a dataset: every partition there with its size, no manifest there yet; the manifest last.

    :raises CorruptDataset: a partition is missing or has another size.
    :raises DatasetCommitted: a manifest is there already (committed by another writer): never overwritten.
    """

    parts = tuple(sorted(partitions, key=lambda p: p.file))
    present = _sizes(directory)
    if MANIFEST in present:
        raise DatasetCommitted(f"dataset {name!r}: {directory.join(MANIFEST).uri} is committed already (by another "
                               "writer); a committed manifest is never overwritten, so this output was not committed")
    for part in parts:
        check_entry(directory.uri, part.file)
        if present.get(part.file) != part.bytes:
            raise CorruptDataset(f"dataset {name!r}: partition {directory.join(part.file).uri} is missing or has "
                                 f"the wrong size (expected {part.bytes} bytes)")
    manifest = Manifest(name=name, schema=schema, partitions=parts, producer=dict(producer or {}))
    target = directory.join(MANIFEST)
    try:
        with target.filesystem.open_output_stream(target.path, metadata={"Content-Type": "application/json"}) as out:
            out.write(json.dumps(manifest.to_json(), indent=1, sort_keys=True, default=str).encode())
    except OSError as exc:
        raise storage_error(exc, target, "write") from None
    listed = {p.file for p in parts}
    for stray in sorted(present):  # earlier attempts' uploads: named by no manifest, never read
        if _is_part(stray) and stray not in listed:
            _delete_quiet(directory.join(stray))
    return manifest


def uncommit(directory: Location) -> None:
    """Withdraw a dataset: the manifest first (it stops existing), then every object under it."""

    delete([directory.join(MANIFEST)])
    remove(directory)


def remove(directory: Location) -> None:
    """Delete every object under ``directory`` (nothing there is fine)."""
    try:
        directory.filesystem.delete_dir(directory.path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise storage_error(exc, directory, "delete") from None


def exists(directory: Location) -> bool:
    """Whether any object is under ``directory``."""
    try:
        return bool(directory.filesystem.get_file_info(pafs.FileSelector(directory.path, allow_not_found=True)))
    except OSError as exc:
        raise storage_error(exc, directory, "list") from None


def read_manifest_data(directory: Location) -> Any:
    """The manifest's JSON, or :class:`DatasetNotFound` when there is none."""

    target = directory.join(MANIFEST)
    try:
        with target.filesystem.open_input_stream(target.path) as stream:
            raw = stream.read()
    except FileNotFoundError:
        raise DatasetNotFound(f"no committed dataset at {directory.uri} (no {MANIFEST}; "
                              "an output without a manifest is incomplete and is never read)") from None
    except OSError as exc:
        raise storage_error(exc, target, "read") from None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptDataset(f"{target.uri}: unreadable manifest ({exc})") from None


def read_partition_bytes(where: Location, info: PartitionInfo, describe: str) -> pa.Buffer:
    """The partition object at ``where``, whole, checked to have the manifest's size."""

    try:
        with where.filesystem.open_input_file(where.path) as source:
            size = source.size()
            if size != info.bytes:
                raise CorruptDataset(f"{describe}: {size} bytes in the store, manifest says {info.bytes}")
            data = source.read_buffer()
    except FileNotFoundError:
        raise CorruptDataset(f"{describe}: partition object is missing") from None
    except CorruptDataset:
        raise
    except OSError as exc:
        raise storage_error(exc, where, "read") from None
    if data.size != info.bytes:  # the object changed between the size and the read
        raise CorruptDataset(f"{describe}: read {data.size} bytes, manifest says {info.bytes}")
    return data


def damage(directory: Location, manifest: Manifest, *, checksum: bool) -> str | None:
    """Why the partitions of ``manifest`` under ``directory`` are not intact (None when they are): one
    listing for the sizes; with ``checksum``, every partition is read and its crc32 compared."""
    present = _sizes(directory)
    for part in manifest.partitions:
        where = directory.join(part.file)
        size = present.get(part.file)
        if size is None:
            return f"partition object {where.uri} is missing"
        if size != part.bytes:
            return f"partition object {where.uri} has {size} bytes, the manifest says {part.bytes}"
        if checksum:
            crc = 0
            try:
                with where.filesystem.open_input_stream(where.path) as stream:
                    while chunk := stream.read(8 << 20):
                        crc = zlib.crc32(chunk, crc)
            except OSError as exc:
                raise storage_error(exc, where, "read") from None
            if f"crc32:{crc:08x}" != part.checksum:
                return f"partition object {where.uri} does not match its checksum {part.checksum}"
    return None
