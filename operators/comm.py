"""Table collectives on an explicit mpi4py communicator (layer 2).

Tables travel as Arrow IPC streams written straight into one preallocated
send buffer (no pickle, no intermediate ``bytes``), moved with ``Alltoallv`` /
``Allgatherv`` / ``Gatherv`` on bytes, and read back zero-copy from the
receive buffer.  A rank's own share never leaves the process.  Pickle-based
object collectives are used only for small metadata (counts, schemas).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI
import pyarrow as pa

from .errors import SchemaMismatchError

log = logging.getLogger(__name__)

#: MPI counts are C ints; larger messages go in rounds of this many bytes
_MAX_CHUNK = 1 << 30


def ipc_size(table: pa.Table) -> int:
    """Bytes of ``table`` as an IPC stream (computed without copying data)."""
    sink = pa.MockOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return int(sink.size())


def _write_into(buf: np.ndarray, offset: int, size: int, table: pa.Table) -> None:
    target = pa.py_buffer(buf[offset : offset + size].data)
    sink = pa.FixedSizeBufferWriter(target)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _read_from(buf: np.ndarray, offset: int, size: int) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(buf[offset : offset + size].data)).read_all()


def serialize(tables: Sequence[pa.Table | None]) -> tuple[np.ndarray, np.ndarray]:
    """Serialise ``tables`` into one byte buffer; ``None`` entries take 0 bytes."""
    sizes = np.array([0 if t is None else ipc_size(t) for t in tables], dtype=np.int64)
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    offset = 0
    for t, size in zip(tables, sizes):
        if t is not None:
            _write_into(buf, offset, int(size), t)
        offset += int(size)
    return buf, sizes


def deserialize(buf: np.ndarray, sizes: np.ndarray) -> list[pa.Table | None]:
    out: list[pa.Table | None] = []
    offset = 0
    for size in sizes:
        out.append(_read_from(buf, offset, int(size)) if size else None)
        offset += int(size)
    return out


def _displs(sizes: np.ndarray) -> np.ndarray:
    d = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=d[1:])
    return d


def alltoall_tables(comm: Any, parts: Sequence[pa.Table]) -> list[pa.Table]:
    """Shuffle: ``parts[j]`` goes to rank ``j``; returns what every rank sent here, by source rank.

    When ``parts`` is a list it is consumed: the entries sent away are replaced by
    ``None`` once serialised, so their memory is freed before the exchange.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if len(parts) != size:
        raise ValueError(f"alltoall_tables needs one part per rank ({size}), got {len(parts)}")
    if size == 1:
        return [parts[0]]
    own = parts[rank]
    outgoing = [None if j == rank else parts[j] for j in range(size)]
    sendbuf, sendsizes = serialize(outgoing)
    del outgoing
    if isinstance(parts, list):
        for j in range(size):
            parts[j] = None
    recvsizes = np.empty(size, dtype=np.int64)
    comm.Alltoall(sendsizes, recvsizes)
    recvbuf = np.empty(int(recvsizes.sum()), dtype=np.uint8)
    sdispl, rdispl = _displs(sendsizes), _displs(recvsizes)
    if max(int(sendsizes.max()), int(recvsizes.max()), int(sendbuf.size), int(recvbuf.size)) < _MAX_CHUNK:
        comm.Alltoallv([sendbuf, (sendsizes, sdispl), MPI.BYTE], [recvbuf, (recvsizes, rdispl), MPI.BYTE])
    else:
        _pairwise_exchange(comm, sendbuf, sendsizes, sdispl, recvbuf, recvsizes, rdispl)
    del sendbuf
    received = deserialize(recvbuf, recvsizes)
    received[rank] = own
    return [t if t is not None else own.slice(0, 0) for t in received]


def _pairwise_exchange(comm: Any, sendbuf: np.ndarray, ss: np.ndarray, sd: np.ndarray,
                       recvbuf: np.ndarray, rs: np.ndarray, rd: np.ndarray) -> None:
    """Large messages: pairwise Sendrecv rounds in chunks below the C-int count limit."""
    size, rank = comm.Get_size(), comm.Get_rank()
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        sent = got = 0
        while sent < ss[dst] or got < rs[src]:
            n_send = int(min(_MAX_CHUNK, ss[dst] - sent))
            n_recv = int(min(_MAX_CHUNK, rs[src] - got))
            comm.Sendrecv(
                [sendbuf[sd[dst] + sent : sd[dst] + sent + n_send], n_send, MPI.BYTE], dst, 77,
                [recvbuf[rd[src] + got : rd[src] + got + n_recv], n_recv, MPI.BYTE], src, 77,
            )
            sent += n_send
            got += n_recv


def allgather_table(comm: Any, table: pa.Table) -> list[pa.Table]:
    """Every rank's table, on every rank, in rank order."""
    if comm.Get_size() == 1:
        return [table]
    sendbuf, sizes = serialize([table])
    allsizes = np.array(comm.allgather(int(sizes[0])), dtype=np.int64)
    recvbuf = np.empty(int(allsizes.sum()), dtype=np.uint8)
    if int(allsizes.sum()) < _MAX_CHUNK:
        comm.Allgatherv([sendbuf, MPI.BYTE], [recvbuf, (allsizes, _displs(allsizes)), MPI.BYTE])
        out = deserialize(recvbuf, allsizes)
    else:
        out = [bcast_table(comm, table if comm.Get_rank() == r else None, root=r) for r in range(comm.Get_size())]
    rank = comm.Get_rank()
    out[rank] = table
    return [t if t is not None else table.slice(0, 0) for t in out]


def gather_table(comm: Any, table: pa.Table, root: int = 0) -> list[pa.Table] | None:
    """Every rank's table on ``root`` (rank order), ``None`` elsewhere."""
    if comm.Get_size() == 1:
        return [table]
    sendbuf, sizes = serialize([table])
    counts = np.array(comm.allgather(int(sizes[0])), dtype=np.int64)
    rank = comm.Get_rank()
    small = int(counts.sum()) < _MAX_CHUNK
    if small:
        if rank != root:
            comm.Gatherv([sendbuf, MPI.BYTE], None, root=root)
            return None
        recvbuf = np.empty(int(counts.sum()), dtype=np.uint8)
        comm.Gatherv([sendbuf, MPI.BYTE], [recvbuf, (counts, _displs(counts)), MPI.BYTE], root=root)
        out = deserialize(recvbuf, counts)
    else:
        if rank != root:
            send_table(comm, table, root, tag=78)
            return None
        out = [None if src == root else recv_table(comm, src, tag=78) for src in range(comm.Get_size())]
    out[rank] = table
    return [t if t is not None else table.slice(0, 0) for t in out]


def bcast_table(comm: Any, table: pa.Table | None, root: int = 0) -> pa.Table:
    """``root``'s table on every rank."""
    if comm.Get_size() == 1:
        assert table is not None
        return table
    if comm.Get_rank() == root:
        assert table is not None
        buf, sizes = serialize([table])
        comm.bcast(int(sizes[0]), root=root)
    else:
        n = comm.bcast(None, root=root)
        buf = np.empty(n, dtype=np.uint8)
    for start in range(0, max(buf.size, 1), _MAX_CHUNK):
        chunk = buf[start : start + _MAX_CHUNK]
        comm.Bcast([chunk, chunk.size, MPI.BYTE], root=root)
    if comm.Get_rank() == root:
        return table
    return _read_from(buf, 0, buf.size)


def scatter_tables(comm: Any, parts: Sequence[pa.Table] | None, root: int = 0) -> pa.Table:
    """``parts[j]`` (given on ``root``) becomes rank ``j``'s table."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank == root:
        if parts is None or len(parts) != size:
            raise ValueError(f"scatter_tables needs one part per rank ({size}) on the root")
        for dst in range(size):
            if dst != root:
                send_table(comm, parts[dst], dst, tag=79)
        return parts[root]
    return recv_table(comm, root, tag=79)


def send_table(comm: Any, table: pa.Table, dest: int, tag: int = 80) -> None:
    buf, sizes = serialize([table])
    comm.send(int(sizes[0]), dest=dest, tag=tag)
    for start in range(0, max(buf.size, 1), _MAX_CHUNK):
        chunk = buf[start : start + _MAX_CHUNK]
        comm.Send([chunk, chunk.size, MPI.BYTE], dest=dest, tag=tag)


def recv_table(comm: Any, source: int, tag: int = 80) -> pa.Table:
    n = comm.recv(source=source, tag=tag)
    buf = np.empty(n, dtype=np.uint8)
    for start in range(0, max(n, 1), _MAX_CHUNK):
        chunk = buf[start : start + _MAX_CHUNK]
        comm.Recv([chunk, chunk.size, MPI.BYTE], source=source, tag=tag)
    return _read_from(buf, 0, n)


def allreduce_sum(comm: Any, value: int) -> int:
    return int(comm.allreduce(int(value)))


def exscan_sum(comm: Any, value: int) -> int:
    """Sum of ``value`` over the ranks before this one (0 on rank 0)."""
    counts = comm.allgather(int(value))
    return int(sum(counts[: comm.Get_rank()]))


def check_same_schema(comm: Any, schema: pa.Schema, *, what: str = "table") -> None:
    """Raise ``SchemaMismatchError`` (on every rank) unless all ranks hold the same schema."""
    if comm.Get_size() == 1:
        return
    mine = schema.remove_metadata().serialize().to_pybytes()
    everyone = comm.allgather(mine)
    if all(s == everyone[0] for s in everyone):
        return
    schemas = [pa.ipc.read_schema(pa.py_buffer(s)) for s in everyone]
    for r, s in enumerate(schemas):
        if not s.equals(schemas[0]):
            raise SchemaMismatchError(
                f"{what}: rank {r} has schema {_short(s)} but rank 0 has {_short(schemas[0])}"
            )


def _short(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"
