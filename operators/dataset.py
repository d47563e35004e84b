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

A dataset may also live on an object store (``s3://bucket/.../name``): every public function here
takes the URI too, and :mod:`hetflow.operators.objectdataset` keeps the same promises there without
a rename (partitions under unique keys, the manifest written last and never over a committed one;
partitions read whole, as there is no memory map).

Nothing is followed through a symlink: the dataset directory itself and every
entry in it are opened with ``O_NOFOLLOW`` (entries relative to the directory's
file descriptor), and a symlink is refused with :class:`UnsafeDatasetPath`
naming it.  The directory's parents are the caller's to trust (hetflow checks
its run directories with ``hetflow.tasks.paths``).  Manifest entries are plain
file names inside the dataset directory.  Files are 0600 and directories this
module creates are 0700, whatever the umask.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import stat
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping

import pyarrow as pa

from . import safeio
from .datasetformat import (  # noqa: F401 - the format's names, re-exported from here
    FORMAT_VERSION, MANIFEST, CorruptDataset, DatasetCommitted, DatasetError, DatasetNotFound, Manifest,
    PartitionInfo, UnsafeDatasetPath, _is_part, check_entry, entry_problem, partition_name, schema_from_text,
    schema_to_text)
from .location import StorageError, is_object_store, resolve

Verify = Literal["checksum", "size", "none"]
_CHUNK = 8 << 20
_O_NOFOLLOW, _O_DIRECTORY, _O_PATH, _O_NONBLOCK = safeio.O_NOFOLLOW, safeio.O_DIRECTORY, safeio.O_PATH, safeio.O_NONBLOCK
_LINK_ERRNOS = safeio.LINK_ERRNOS


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


# -------------------------------------------------------- directories, safely
# The safe file I/O is hetflow's one copy (safeio); these names keep the dataset's wording of a refusal.
def _refusal(path: "str | os.PathLike[str]") -> UnsafeDatasetPath:
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        is_link = False
    if is_link:
        return UnsafeDatasetPath(path, "it is a symbolic link, and datasets are never read, written or "
                                 "deleted through one (remove it, or give the real path)")
    return UnsafeDatasetPath(path, "it is not a directory or regular file as a dataset needs")


def _open_dir(directory: Path, *, create: bool = False) -> int:
    """A read fd on ``directory``, opened with ``O_NOFOLLOW``: a symlink there is refused
    (:func:`safeio.open_dir_nofollow`)."""
    return safeio.open_dir_nofollow(directory, create=create, refuse=_refusal)


def _refuse_link(dfd: int, directory: Path, name: str) -> None:
    safeio.refuse_non_regular(dfd, directory, name, refuse=_refusal)


def _open_entry(dfd: int, directory: Path, name: str) -> int:
    """Open regular file ``name`` of the dataset directory for reading, never through a symlink."""
    return safeio.open_entry(dfd, directory, name, refuse=_refusal)


_fchmod = safeio.fchmod
_entry_mode = safeio.entry_mode
_create_temp = safeio.create_temp
_unlink_quiet = safeio.unlink_quiet


# ----------------------------------------------------------------- writing
def _full_paths(function: Any) -> Any:
    """Name the whole path in an OSError raised by ``function(directory, ...)``, whose files are
    opened relative to the directory's descriptor (a full disk, a read-only one)."""
    import functools

    @functools.wraps(function)
    def wrapper(directory: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(directory, *args, **kwargs)
        except OSError as exc:
            name = exc.filename
            if isinstance(exc, DatasetError) or not isinstance(name, str) or os.path.isabs(name):
                raise
            base = Path(directory)
            base = base.parent if function.__name__ == "write_json_atomic" else base
            raise type(exc)(exc.errno, exc.strerror, str(base / name)) from exc

    return wrapper


def write_partition(directory: "str | os.PathLike[str]", index: int,
                    data: "pa.Table | Iterable[pa.RecordBatch]", *, schema: pa.Schema | None = None,
                    rank: int = 0, node: str | None = None, durable: bool = True,
                    name: str | None = None) -> PartitionInfo:
    """Write one partition atomically (temp file, fsync, rename); return what the manifest records.

    ``data`` is a table or an iterable of record batches (streamed, so a rank
    never needs its whole output in memory); ``schema`` is required for an
    iterable.  ``node`` is the name recorded for the node holding the file:
    a pilot passes its own name for the node (the one its placement uses);
    left out, this host's name.  On an object store (``s3://...``) the partition goes to a key of
    its own (:mod:`hetflow.operators.objectdataset`).  ``durable=False`` leaves out the ``fsync`` of the file and its
    directory: for writers whose partitions are checked against their checksums before any reuse
    (a map stage's items), where one flush per tiny file would cost more than the item.  ``name``: the
    file's name in ``directory`` instead of ``part-<index>.arrow`` (a map stage's items share a directory,
    each file named by its item; a local directory only).
    """
    if isinstance(data, pa.Table):
        schema = data.schema
        batches: Iterable[pa.RecordBatch] = data.to_batches()
    else:
        if schema is None:
            raise ValueError("write_partition: a schema is required when data is an iterable of batches")
        batches = data
    if is_object_store(directory):  # no rename there: a key of its own, named by the manifest
        from . import objectdataset  # pyarrow.fs with its TLS: only for datasets on an object store

        return objectdataset.write_partition(resolve(directory), index, batches, schema, rank=rank, node=node)
    directory = Path(directory)
    if name is None:
        name = partition_name(index)
    elif "/" in name or name.startswith(".") or not name:
        raise ValueError(f"write_partition: {name!r} is not a file name (expected a name without '/' or a "
                         "leading '.')")
    final = directory / name
    rows = 0
    dfd = _open_dir(directory, create=True)
    try:
        _refuse_link(dfd, directory, name)
        tmp, fd = _create_temp(dfd, name)
        try:
            with os.fdopen(fd, "wb", buffering=_CHUNK) as raw:
                sink = _ChecksumFile(raw)
                with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                    for batch in batches:
                        if batch.schema != schema:
                            raise ValueError(f"write_partition {final}: batch schema {batch.schema} "
                                             f"does not match {schema}")
                        writer.write_batch(batch)
                        rows += batch.num_rows
                raw.flush()
                if durable:
                    os.fsync(raw.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            _unlink_quiet(dfd, tmp)
            raise OSError(exc.errno, f"cannot write partition {final}: {exc.strerror or exc}") from exc
        except BaseException:
            _unlink_quiet(dfd, tmp)
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)
    return PartitionInfo(file=name, rows=rows, bytes=sink.size, checksum=f"crc32:{sink.crc:08x}",
                         node=socket.gethostname() if node is None else node, rank=rank)


@_full_paths
def commit(directory: "str | os.PathLike[str]", name: str, schema: pa.Schema,
           partitions: Iterable[PartitionInfo], *, producer: Mapping[str, Any] | None = None) -> Manifest:
    """Publish a dataset: check the partitions exist, remove strays, write the manifest last.

    On an object store the manifest is written only where none is committed yet
    (:func:`hetflow.operators.objectdataset.commit`; :class:`DatasetCommitted` otherwise)."""
    if is_object_store(directory):
        from . import objectdataset

        return objectdataset.commit(resolve(directory), name, schema, partitions, producer=producer)
    directory = Path(directory)
    parts = tuple(sorted(partitions, key=lambda p: p.file))
    dfd = _open_dir(directory)
    try:
        for part in parts:
            check_entry(directory, part.file)
            mode = _entry_mode(dfd, part.file)
            if mode is not None and not stat.S_ISREG(mode):
                raise _refusal(directory / part.file)
            if mode is None or os.stat(part.file, dir_fd=dfd, follow_symlinks=False).st_size != part.bytes:
                raise CorruptDataset(f"dataset {name!r}: partition {directory / part.file} is missing or has "
                                     f"the wrong size (expected {part.bytes} bytes)")
        listed = {p.file for p in parts}
        for stray in sorted(os.listdir(dfd)):
            if _is_part(stray) and stray not in listed:
                _refuse_link(dfd, directory, stray)
                _unlink_quiet(dfd, stray)
        manifest = Manifest(name=name, schema=schema, partitions=parts, producer=dict(producer or {}))
        _write_json_at(dfd, directory, MANIFEST, manifest.to_json())
    finally:
        os.close(dfd)
    return manifest


@_full_paths
def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    """Write JSON to ``path`` (0600) via temp file + fsync + rename (+ fsync of the directory).

    Neither the directory nor ``path`` may be a symlink: refused, never written through.
    ``durable=False`` leaves out the two fsyncs: readers never see a partial file, but a
    crash of the machine may lose it (for files only this run reads, soon).
    """
    path = Path(path)
    dfd = _open_dir(path.parent)
    try:
        _write_json_at(dfd, path.parent, path.name, data, durable=durable)
    finally:
        os.close(dfd)


JSON_PIECES = 8192
"""Pieces of encoded JSON :func:`_write_json_at` joins and writes at a time."""


def _write_json_at(dfd: int, directory: Path, name: str, data: Any, *, durable: bool = True) -> None:
    """``data`` as ``json.dumps(data, indent=1, sort_keys=True, default=str)`` writes it, byte for byte, but
    written as it is encoded: ``json.dumps`` with an indent holds a list of every piece of the text (a few
    per value: a manifest of 100,000 partitions made millions of them, the peak of a large map's end)."""
    def write(fh: Any) -> None:
        pieces: list[str] = []
        for piece in json.JSONEncoder(indent=1, sort_keys=True, default=str).iterencode(data):
            pieces.append(piece)
            if len(pieces) == JSON_PIECES:
                fh.write("".join(pieces).encode())
                pieces.clear()
        fh.write("".join(pieces).encode())

    safeio.write_at(dfd, directory, name, write, durable=durable, refuse=_refusal)


def fsync_dir(directory: Path) -> None:
    safeio.fsync_dir(directory, refuse=_refusal)


@_full_paths
def uncommit(directory: "str | os.PathLike[str]") -> None:
    """Withdraw a dataset (manifest first, so it stops existing before its files go).

    A symlink as the directory, the manifest or a partition is refused before
    anything is removed.  On an object store every object under the dataset goes.
    """
    if is_object_store(directory):
        from . import objectdataset

        objectdataset.uncommit(resolve(directory))
        return
    directory = Path(directory)
    try:
        dfd = _open_dir(directory)
    except FileNotFoundError:
        return
    try:
        names = sorted(os.listdir(dfd))
        doomed = [n for n in names if _is_part(n)]
        for entry in [MANIFEST, *doomed]:
            _refuse_link(dfd, directory, entry)
        removed = _unlink_quiet(dfd, MANIFEST)
        for entry in doomed:
            removed = _unlink_quiet(dfd, entry) or removed
        if removed:  # a fresh output directory (every stage's first attempt) has nothing to make durable
            os.fsync(dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------- reading
def read_manifest(directory: "str | os.PathLike[str]") -> Manifest:
    if is_object_store(directory):
        from . import objectdataset

        where = resolve(directory)
        return _manifest_from(objectdataset.read_manifest_data(where), where.uri, where.join(MANIFEST).uri)
    directory = Path(directory)
    path = directory / MANIFEST
    missing = DatasetNotFound(f"no committed dataset at {directory} (no {MANIFEST}; "
                              "an output without a manifest is incomplete and is never read)")
    try:
        dfd = _open_dir(directory)
    except FileNotFoundError:
        raise missing from None
    try:
        try:
            fd = _open_entry(dfd, directory, MANIFEST)
        except FileNotFoundError:
            raise missing from None
    finally:
        os.close(dfd)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise CorruptDataset(f"{path}: unreadable manifest ({exc})") from None
    return _manifest_from(data, directory, path)


def _manifest_from(data: Any, directory: "str | os.PathLike[str]", path: "str | os.PathLike[str]") -> Manifest:
    if isinstance(data, dict) and isinstance(data.get("partitions"), list):
        for entry in data["partitions"]:
            if isinstance(entry, dict) and "file" in entry:
                check_entry(directory, entry["file"])
    return Manifest.from_json(data, source=str(path))


class Dataset:
    """A committed dataset opened for reading; partitions are memory-mapped, not copied.

    On an object store (``s3://...``, no memory map there) each partition is read whole into memory
    when first used, with the same checks."""

    def __init__(self, directory: "str | os.PathLike[str]", *, verify: Verify = "checksum") -> None:
        self.remote = resolve(directory) if is_object_store(directory) else None
        self.path: "Path | str" = Path(directory) if self.remote is None else self.remote.uri
        self.manifest = read_manifest(self.path if self.remote is None else directory)
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
        name = check_entry(self.path, info.file)
        if self.remote is not None:
            return self._remote_partition(index, info, name)
        assert isinstance(self.path, Path)
        path = self.path / name
        where = f"{path} (dataset {self.manifest.name!r}, produced by {_producer_text(self.producer)})"
        try:
            dfd = _open_dir(self.path)
            try:
                fd = _open_entry(dfd, self.path, name)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            raise CorruptDataset(f"{where}: partition file is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != info.bytes:
                raise CorruptDataset(f"{where}: {size} bytes on disk, manifest says {info.bytes}")
            if size == 0:
                raise CorruptDataset(f"{where}: empty file, not a readable Arrow IPC file")
            buffer = _mapped(fd, size, small=len(self.manifest.partitions) > MAPPED_PARTITIONS)
        finally:
            os.close(fd)
        return self._checked(index, info, buffer, where)

    def _remote_partition(self, index: int, info: PartitionInfo, name: str) -> pa.Table:
        assert self.remote is not None
        place = self.remote.join(name)
        where = f"{place.uri} (dataset {self.manifest.name!r}, produced by {_producer_text(self.producer)})"
        if info.bytes == 0:
            raise CorruptDataset(f"{where}: empty object, not a readable Arrow IPC file")
        from . import objectdataset

        return self._checked(index, info, objectdataset.read_partition_bytes(place, info, where), where)

    def _checked(self, index: int, info: PartitionInfo, buffer: pa.Buffer, where: str) -> pa.Table:
        """The partition in ``buffer`` (of the manifest's size), checked against the manifest and cached."""
        source = pa.BufferReader(buffer)
        if self.verify == "checksum":
            crc = 0
            view = memoryview(buffer)
            for start in range(0, len(view), 64 << 20):
                crc = zlib.crc32(view[start:start + (64 << 20)], crc)
            view.release()
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


MAPPED_PARTITIONS = 4096
"""A dataset of at most this many partitions has each read through a memory map (zero-copy); one of more
(a map stage's output: a partition per item, often a few KB each) maps only those of at least
:data:`MAPPED_FROM` bytes and reads the others into memory: a process has a limited number of maps
(``vm.max_map_count``, 65,530 by default on Linux)."""

MAPPED_FROM = 1 << 20


def _mapped(fd: int, size: int, small: bool = False) -> pa.Buffer:
    """The file open as ``fd`` (``size`` bytes) memory-mapped, or read into memory when ``small`` and under
    :data:`MAPPED_FROM` bytes; no file descriptor is held once this returns.

    Python's ``mmap`` keeps a duplicate of the descriptor for as long as the map lives: a dataset of
    tens of thousands of partitions (a map stage's output, a partition per item) then ran out of
    descriptors when read whole.  Arrow's map, closed once its buffer is taken, keeps only the mapping,
    released with the last buffer over it."""
    if small and size < MAPPED_FROM:
        data = bytearray(size)
        view, done = memoryview(data), 0
        while done < size:
            got = os.preadv(fd, [view[done:]], done)
            if got == 0:
                break  # shorter than its size: the checks against the manifest say so
            done += got
        return pa.py_buffer(data if done == size else bytes(data[:done]))
    proc = f"/proc/self/fd/{fd}"
    if not os.path.exists(proc):  # no /proc (not Linux): the descriptor stays with the map
        return pa.py_buffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
    source = pa.memory_map(proc)
    try:
        return source.read_buffer(size)
    finally:
        source.close()


def _producer_text(producer: Mapping[str, Any]) -> str:
    if not producer:
        return "an unknown producer"
    stage = producer.get("stage", "?")
    return f"stage {stage!r} (run {producer.get('run', '?')}, attempt {producer.get('attempt', '?')})"


def open_dataset(path: "str | os.PathLike[str]", *, verify: Verify = "checksum") -> Dataset:
    """Open a committed dataset: ``.to_table()`` for all of it, ``.partitions()`` to iterate."""
    return Dataset(path, verify=verify)


def damage(directory: "str | os.PathLike[str]", *, fingerprint: str | None = None,
           checksum_up_to: int = 0) -> str | None:
    """Why the committed dataset at ``directory`` cannot be reused as it is, or ``None`` when it is intact.

    Checked: the manifest is there (and has ``fingerprint`` when one is given: it was not rewritten),
    every partition it names is there as a regular file (an object) of its size, and, when the dataset
    is at most ``checksum_up_to`` bytes, of its checksum.  One line naming the file at fault.
    """
    remote = is_object_store(directory)
    try:
        manifest = read_manifest(directory)
        shown = resolve(directory).uri if remote else str(directory)
        if fingerprint is not None and manifest.fingerprint() != fingerprint:
            return f"{shown}/{MANIFEST} no longer describes what was committed (it was rewritten)"
        check = manifest.num_bytes <= checksum_up_to
        if remote:
            from . import objectdataset

            return objectdataset.damage(resolve(directory), manifest, checksum=check)
    except (DatasetError, StorageError) as exc:  # an unreachable store: not reused, as a missing file
        return str(exc)
    path = Path(directory)
    for part in manifest.partitions:
        file = path / part.file
        try:
            info = os.lstat(file)
        except OSError:
            return f"partition file {file} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"partition {file} is not a regular file"
        if info.st_size != part.bytes:
            return f"partition file {file} has {info.st_size} bytes, the manifest says {part.bytes}"
        if check and _file_crc32(file) != part.checksum:
            return f"partition file {file} does not match its checksum {part.checksum}"
    return None


def _file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"
