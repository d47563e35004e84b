"""Spill files of the out-of-core operators (layer 0: files only, no communicator).

A ``SpillDir`` is one operator call's private directory (0700, made by
``tempfile.mkdtemp``) under the node-local directory, named
``hetflow-spill-<host>-<pid>-*``.  It is removed when the operator returns,
fails or is interrupted (``KeyboardInterrupt`` runs the ``finally``).  A
process killed outright (SIGKILL, a node failure) cannot clean up; the next
``SpillDir`` opened under the same directory on that host removes the
directories of its user whose process is gone.

Buckets are append-only Arrow IPC *stream* files (one per bucket and side),
written piece by piece as the shuffle delivers rows, read back whole (a bucket
is sized to fit the budget).  Slices of IPC *files* (the lazy input and the
sorted runs) are read through a memory map that is closed again at once, so
the mapped pages of a file larger than memory never accumulate in the
process: ``read_slice`` copies only the slice's pages.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

import pyarrow as pa

from .location import is_uri, resolve, storage_error

log = logging.getLogger(__name__)

PREFIX = "hetflow-spill-"


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(base: str | os.PathLike[str]) -> list[str]:
    """Remove this user's spill directories on this host under ``base`` whose process is gone."""
    removed: list[str] = []
    mine = f"{PREFIX}{_host()}-"
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(mine):
            continue
        pid_text = entry.name[len(mine):].split("-", 1)[0]
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not pid_text.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if not _alive(int(pid_text)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
            log.info("removed the spill directory %s of a process that is gone", entry.path)
    return removed


class SpillDir:
    """``with SpillDir(base) as path:`` a private directory removed on exit, however the block ends.

    ``base`` is the node-local directory (the pilot's ``node_local_dir``); ``None`` means the
    system's temporary directory."""

    def __init__(self, base: str | os.PathLike[str] | None) -> None:
        self.base = Path(base) if base is not None else Path(tempfile.gettempdir())
        self.path: Path | None = None

    def __enter__(self) -> Path:
        if not self.base.is_dir():
            raise FileNotFoundError(f"spill directory base {str(self.base)!r} does not exist (expected the "
                                    "node-local directory, e.g. the pilot's node_local_dir)")
        remove_orphans(self.base)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=self.base))
        return self.path

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class Buckets:
    """``count`` append-only IPC stream files ``<name>-<bucket>.arrows`` in ``directory``, one schema."""

    def __init__(self, directory: Path, name: str, schema: pa.Schema, count: int) -> None:
        self.directory, self.name, self.schema, self.count = directory, name, schema, count
        self._writers: dict[int, tuple[pa.NativeFile, pa.ipc.RecordBatchStreamWriter]] = {}
        self.bytes = [0] * count

    def path(self, bucket: int) -> Path:
        return self.directory / f"{self.name}-{bucket:05d}.arrows"

    def write(self, bucket: int, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if bucket not in self._writers:
            sink = pa.OSFile(str(self.path(bucket)), "wb")
            self._writers[bucket] = (sink, pa.ipc.new_stream(sink, self.schema))
        self._writers[bucket][1].write_table(table)
        self.bytes[bucket] += int(table.nbytes)

    def close(self) -> None:
        for sink, writer in self._writers.values():
            writer.close()
            sink.close()
        self._writers.clear()

    def read(self, bucket: int) -> pa.Table:
        """The bucket's rows (read into memory, not mapped), then its file is removed."""
        path = self.path(bucket)
        if not path.exists():
            return self.schema.empty_table()
        with pa.OSFile(str(path), "rb") as source:
            table = pa.ipc.open_stream(source).read_all()
        path.unlink()
        return table


def copy_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A deep copy of ``batch`` (through an in-memory IPC stream: only its slice's bytes)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


def read_slice(path: str, batch: int, offset: int, length: int, columns: Sequence[str] | None = None) -> pa.RecordBatch:
    """Rows ``offset:offset+length`` of record batch ``batch`` of the IPC file ``path``, copied out of a
    memory map that is closed before returning (only those rows' pages are touched).  ``path`` may be
    an object-store URI: then the footer and that batch's byte range are read."""
    if is_uri(path):
        where = resolve(path)
        try:
            with where.filesystem.open_input_file(where.path) as remote:
                rb = pa.ipc.open_file(remote).get_batch(batch).slice(offset, length)
        except OSError as exc:
            raise storage_error(exc, where, "read") from exc
        return rb if columns is None else rb.select(list(columns))
    with pa.memory_map(path, "r") as source:
        rb = pa.ipc.open_file(source).get_batch(batch).slice(offset, length)
        if columns is not None:
            rb = rb.select(list(columns))
        out = copy_batch(rb)
        del rb
    return out


def write_run(path: Path, table: pa.Table, batch_rows: int) -> None:
    """One sorted run as an IPC file of record batches of at most ``batch_rows`` rows (``read_run``)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, batch_rows))


def read_run(path: Path) -> Iterator[pa.Table]:
    """The record batches of a run, one at a time, each read (not mapped) when asked for."""
    with pa.OSFile(str(path), "rb") as source:
        reader = pa.ipc.open_file(source)
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            if batch.num_rows:
                yield pa.Table.from_batches([batch])


def release() -> None:
    """Hand the memory pool's freed pages back to the system (between buckets)."""
    pa.default_memory_pool().release_unused()
