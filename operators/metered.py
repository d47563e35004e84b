"""A communicator that meters what it carries: bytes and seconds per call.

``MeteredComm(comm)`` wraps an mpi4py communicator (or an object with the same
methods) and forwards every call to it unchanged.  The calls that move data
between ranks also add to ``meter``, keyed by the call's name: the bytes of this
rank's data that go to other ranks (``sent``), the bytes that arrive from them
(``received``), and the seconds spent inside the call, which include waiting for
the slowest rank.  A rank's own share is never counted.  Buffer calls
(``Alltoall``, ``Alltoallv``, ``Allgatherv``, ``Gatherv``, ``Bcast``, ``Send``,
``Recv``, ``Sendrecv``) are counted exactly from their counts; object calls
(``allgather``, ``alltoall``, ``bcast``, ``gather``, ``allreduce``) by the
pickled size of what this rank sends, and nothing as received.

It is what checks the cost model: an operator's estimated exchange bytes
(``DTable.plans``) against the bytes its exchanges actually sent, summed over
the ranks (``benchmarks/operators.py --phases`` and the cost-model tests).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI


@dataclass
class Meter:
    """Per call name: calls, bytes sent to and received from other ranks, seconds inside."""

    calls: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, sent: int, received: int, seconds: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.sent[name] = self.sent.get(name, 0) + int(sent)
        self.received[name] = self.received.get(name, 0) + int(received)
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def reset(self) -> None:
        for d in (self.calls, self.sent, self.received, self.seconds):
            d.clear()

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def _extent(datatype: Any) -> int:
    return int(datatype.Get_extent()[1]) if isinstance(datatype, MPI.Datatype) else 1


def _size(spec: Any) -> int:
    """Bytes of a buffer argument: an array, ``[buf, datatype]`` or ``[buf, count, datatype]``."""
    if spec is None:
        return 0
    if isinstance(spec, (list, tuple)):
        if len(spec) == 3 and not isinstance(spec[1], (list, tuple)):
            return int(spec[1]) * _extent(spec[2])
        return int(np.asarray(spec[0]).nbytes)
    return int(np.asarray(spec).nbytes)


def _counts(spec: Any) -> np.ndarray:
    """Per-rank bytes of a ``[buf, (counts, displacements), datatype]`` argument."""
    counts = spec[1][0] if isinstance(spec[1], (list, tuple)) else spec[1]
    return np.asarray(counts, dtype=np.int64) * _extent(spec[2] if len(spec) > 2 else None)


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class MeteredComm:
    """``comm`` with every data-moving call metered into ``self.meter`` (see the module docstring)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.meter = Meter()

    def __getattr__(self, name: str) -> Any:  # everything not metered goes straight through
        return getattr(self._comm, name)

    @property
    def comm(self) -> Any:
        """The wrapped communicator."""
        return self._comm

    def Get_rank(self) -> int:
        return int(self._comm.Get_rank())

    def Get_size(self) -> int:
        return int(self._comm.Get_size())

    def _call(self, name: str, sent: int, received: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.meter.add(name, sent, received, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ buffer calls
    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        p = self.Get_size()
        share = (p - 1) / p
        self._call("Alltoall", round(_size(sendbuf) * share), round(_size(recvbuf) * share), self._comm.Alltoall, sendbuf, recvbuf)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        rank = self.Get_rank()
        s, r = _counts(sendbuf), _counts(recvbuf)
        self._call("Alltoallv", int(s.sum() - s[rank]), int(r.sum() - r[rank]), self._comm.Alltoallv, sendbuf, recvbuf)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        r = _counts(recvbuf)
        sent = _size(sendbuf) * (self.Get_size() - 1)
        self._call("Allgatherv", sent, int(r.sum() - r[self.Get_rank()]), self._comm.Allgatherv, sendbuf, recvbuf)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        if self.Get_rank() == root:
            r = _counts(recvbuf)
            self._call("Gatherv", 0, int(r.sum() - r[root]), self._comm.Gatherv, sendbuf, recvbuf, root=root)
        else:
            self._call("Gatherv", _size(sendbuf), 0, self._comm.Gatherv, sendbuf, recvbuf, root=root)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        n = _size(buf)
        mine = self.Get_rank() == root
        self._call("Bcast", n * (self.Get_size() - 1) if mine else 0, 0 if mine else n, self._comm.Bcast, buf, root=root)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._call("Send", _size(buf), 0, self._comm.Send, buf, dest, tag)

    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None) -> None:
        self._call("Recv", 0, _size(buf), self._comm.Recv, buf, source, tag, status)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = MPI.ANY_SOURCE,
                 recvtag: int = MPI.ANY_TAG, status: Any = None) -> None:
        rank = self.Get_rank()
        sent = _size(sendbuf) if dest != rank else 0
        received = _size(recvbuf) if source != rank else 0
        self._call("Sendrecv", sent, received, self._comm.Sendrecv, sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    # ------------------------------------------------------------------ object (pickled) calls
    def allgather(self, obj: Any) -> Any:
        return self._call("allgather", _pickled(obj) * (self.Get_size() - 1), 0, self._comm.allgather, obj)

    def alltoall(self, objs: Any) -> Any:
        rank = self.Get_rank()
        sent = sum(_pickled(o) for j, o in enumerate(objs) if j != rank)
        return self._call("alltoall", sent, 0, self._comm.alltoall, objs)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        sent = _pickled(obj) * (self.Get_size() - 1) if self.Get_rank() == root else 0
        return self._call("bcast", sent, 0, self._comm.bcast, obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> Any:
        sent = _pickled(obj) if self.Get_rank() != root else 0
        return self._call("gather", sent, 0, self._comm.gather, obj, root=root)

    def allreduce(self, obj: Any, op: Any = MPI.SUM) -> Any:
        return self._call("allreduce", _pickled(obj) if self.Get_size() > 1 else 0, 0, self._comm.allreduce, obj, op=op)


# ------------------------------------------------------------------------------- file system
@dataclass
class ReadMeter:
    """What a :func:`metered_filesystem` read: bytes returned to the reader and read calls."""

    bytes: int = 0
    reads: int = 0


class _MeteredFile:
    """A file object over a pyarrow ``NativeFile`` that adds what each ``read`` returns to a meter."""

    def __init__(self, raw: Any, meter: ReadMeter) -> None:
        self._raw = raw
        self._meter = meter

    def read(self, nbytes: int = -1) -> bytes:
        data: bytes = self._raw.read() if nbytes is None or nbytes < 0 else self._raw.read(nbytes)
        self._meter.bytes += len(data)
        self._meter.reads += 1
        return data

    def seek(self, position: int, whence: int = 0) -> int:
        return int(self._raw.seek(position, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def size(self) -> int:
        return int(self._raw.size())

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def writable(self) -> bool:
        return False


def metered_filesystem(fs: Any) -> tuple[Any, ReadMeter]:
    """``fs`` (a ``pyarrow.fs.FileSystem``) behind a wrapper that counts the bytes read through it, and
    the meter it adds to: the reads an operator asks of the storage (ranged reads on an object
    store), as the storage returns them.  Writes, listings and the rest pass through unmetered."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    meter = ReadMeter()

    class Handler(pafs.FileSystemHandler):   # type: ignore[misc]
        def get_type_name(self) -> str:
            return f"metered-{fs.type_name}"

        def normalize_path(self, path: str) -> str:
            return str(fs.normalize_path(path))

        def get_file_info(self, paths: list[str]) -> list[Any]:
            return list(fs.get_file_info(paths))

        def get_file_info_selector(self, selector: Any) -> list[Any]:
            return list(fs.get_file_info(selector))

        def create_dir(self, path: str, recursive: bool) -> None:
            fs.create_dir(path, recursive=recursive)

        def delete_dir(self, path: str) -> None:
            fs.delete_dir(path)

        def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
            fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

        def delete_root_dir_contents(self) -> None:
            raise OSError("a metered file system never deletes its root")

        def delete_file(self, path: str) -> None:
            fs.delete_file(path)

        def move(self, src: str, dest: str) -> None:
            fs.move(src, dest)

        def copy_file(self, src: str, dest: str) -> None:
            fs.copy_file(src, dest)

        def open_input_stream(self, path: str) -> Any:
            return pa.PythonFile(_MeteredFile(fs.open_input_stream(path, compression=None), meter), mode="r")

        def open_input_file(self, path: str) -> Any:
            return pa.PythonFile(_MeteredFile(fs.open_input_file(path), meter), mode="r")

        def open_output_stream(self, path: str, metadata: Any) -> Any:
            return fs.open_output_stream(path, metadata=metadata)

        def open_append_stream(self, path: str, metadata: Any) -> Any:
            return fs.open_append_stream(path, metadata=metadata)

    return pafs.PyFileSystem(Handler()), meter
