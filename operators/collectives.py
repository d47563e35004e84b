"""Table collectives on an explicit mpi4py communicator (layer 2).

Tables travel as Arrow IPC streams written straight into one preallocated
send buffer (no pickle, no intermediate ``bytes``), moved with ``Alltoallv`` /
``Allgatherv`` / ``Gatherv`` on bytes, and read back zero-copy from the
receive buffer.  A rank's own share never leaves the process.  Pickle-based
object collectives are used only for small metadata (counts, schemas).

``shuffle`` (the hash/range exchange of operators) sends fixed-width null-free
tables column by column instead: each destination's rows are gathered with
``np.take`` straight into one column's send buffer and received straight into
the final contiguous column (no IPC framing, no concat, one chunk).  Only ``Get_rank``,
``Get_size``, ``Alltoall``, ``Alltoallv`` (and ``Sendrecv`` above 1 GiB) of the
communicator are used, so any object with that mpi4py subset works.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import pyarrow as pa
from mpi4py import MPI

from . import memory
from .communicator import Communicator
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
    buf = memory.empty(int(sizes.sum()), np.uint8)
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


def alltoall_tables(comm: Communicator, parts: Sequence[pa.Table]) -> list[pa.Table]:
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
    recvbuf = memory.empty(int(recvsizes.sum()), np.uint8)
    _exchange(comm, sendbuf, sendsizes, recvbuf, recvsizes)
    del sendbuf
    received = deserialize(recvbuf, recvsizes)
    received[rank] = own
    return [t if t is not None else own.slice(0, 0) for t in received]


def _pairwise_exchange(comm: Communicator, sendbuf: np.ndarray, ss: np.ndarray, sd: np.ndarray,
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


# --------------------------------------------------------------------------- hash/range shuffle of one table

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_width(t: pa.DataType) -> int | None:
    """Bytes per value when a column of type ``t`` is one plain data buffer (ints, floats,
    temporal, decimal); ``None`` for everything else (bit-packed bool, variable width, nested)."""
    if isinstance(t, (pa.DictionaryType, pa.ExtensionType)) or t.num_fields or t.num_buffers != 2:
        return None
    try:
        bits = t.bit_width
    except ValueError:
        return None
    w = bits // 8
    return w if bits % 8 == 0 and (w in _UINT or w % 8 == 0) else None


def _values(arr: pa.Array, w: int) -> np.ndarray:
    """Zero-copy numpy view of a null-free fixed-width array's values (rows along axis 0)."""
    if len(arr) == 0:
        return np.empty(0, dtype=_UINT[w]) if w in _UINT else np.empty((0, w // 8), dtype=np.uint64)
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[arr.offset * w : (arr.offset + len(arr)) * w]
    return raw.view(_UINT[w]) if w in _UINT else raw.view(np.uint64).reshape(-1, w // 8)


def raw_columns(table: pa.Table) -> list[tuple[np.ndarray, int]] | None:
    """Per column (values view, width) when every column is fixed-width without nulls, else ``None``."""
    widths = [raw_width(f.type) for f in table.schema]
    if not widths or any(w is None for w in widths) or any(c.null_count for c in table.columns):
        return None
    out = []
    for col, w in zip(table.columns, widths):
        assert w is not None
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        out.append((_values(arr, w), w))
    return out


def shuffle(comm: Communicator, table: pa.Table, ids: np.ndarray | None, groups: Sequence[np.ndarray] | None = None, *,
            columns: list[tuple[np.ndarray, int]] | None | bool = True) -> pa.Table:
    """Send row ``i`` of ``table`` to rank ``ids[i]``; returns the rows every rank sent here,
    in source-rank order, row order kept within a source.

    When every rank's table is fixed-width without nulls, each column travels in its own
    ``Alltoallv``: the rows for each destination are gathered with ``np.take`` straight into
    a send buffer of that one column, and received straight into the final contiguous column
    (this rank's own rows are taken into their slot), so the result has one chunk, no
    receive buffer outlives the call, and at most one column's send buffer exists at a time.
    Otherwise the parts travel as Arrow IPC (``alltoall_tables``).  ``groups`` (row indices
    per destination, ascending; ``ids`` is then ignored) may be passed when the caller already
    has them, and ``columns`` (``raw_columns(table)``) when it shuffles several row subsets of
    one table, so that multi-chunk columns are combined once.  With more than one rank the
    result never shares a buffer with ``table`` (kernels may consume it).
    """
    from . import partition

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return table
    if groups is None:
        assert ids is not None, "shuffle needs ids or groups"
        groups = partition.split_indices(ids, size)
    groups = list(groups)
    raw = raw_columns(table) if columns is True else (columns or None)
    meta = np.array([(g.size, raw is not None) for g in groups], dtype=np.int64)  # rows, can send raw
    rmeta = np.empty_like(meta)
    comm.Alltoall(meta, rmeta)
    if raw is None or not rmeta[:, 1].all():  # some rank has nulls or a variable-width column
        from . import arrowtypes

        parts = [arrowtypes.take(table, pa.array(g)) for g in groups]
        del groups
        return pa.concat_tables(alltoall_tables(comm, parts))
    rows_in = rmeta[:, 0].copy()
    rows_in[rank] = 0
    rows_out = meta[:, 0].copy()
    rows_out[rank] = 0
    total = int(rmeta[:, 0].sum())
    slot = int(rmeta[:rank, 0].sum())
    arrays = []
    # one send buffer serves every column in turn (sized for the widest): one allocation, not one per column
    scratch = memory.empty(int(rows_out.sum()) * max(w for _, w in raw), np.uint8)
    for (values, w), field in zip(raw, table.schema):
        shape = values.shape[1:]
        out = memory.empty((total,) + shape, values.dtype)
        memory.take_rows(values, groups[rank], out[slot : slot + groups[rank].size])
        sendbuf = scratch[: int(rows_out.sum()) * w].view(values.dtype).reshape((-1,) + shape)
        offset = 0
        for j, g in enumerate(groups):
            if j != rank:
                memory.take_rows(values, g, sendbuf[offset : offset + g.size])
                offset += g.size
        _exchange(comm, sendbuf.reshape(-1).view(np.uint8), rows_out * w, out.reshape(-1).view(np.uint8), rows_in * w,
                  rdispl=_displs(rmeta[:, 0]) * w)
        arrays.append(pa.Array.from_buffers(field.type, total, [None, pa.py_buffer(out)]))
    return pa.Table.from_arrays(arrays, schema=table.schema)


def _exchange(comm: Communicator, sendbuf: np.ndarray, sendsizes: np.ndarray, recvbuf: np.ndarray, recvsizes: np.ndarray,
              rdispl: np.ndarray | None = None, sdispl: np.ndarray | None = None) -> None:
    sdispl = _displs(sendsizes) if sdispl is None else sdispl
    rdispl = _displs(recvsizes) if rdispl is None else rdispl
    if max(int(sendbuf.size), int(recvbuf.size)) < _MAX_CHUNK:
        comm.Alltoallv([sendbuf, (sendsizes, sdispl), MPI.BYTE], [recvbuf, (recvsizes, rdispl), MPI.BYTE])
    else:
        _pairwise_exchange(comm, sendbuf, sendsizes, sdispl, recvbuf, recvsizes, rdispl)


def allgather_table(comm: Communicator, table: pa.Table) -> list[pa.Table]:
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


def gather_table(comm: Communicator, table: pa.Table, root: int = 0) -> list[pa.Table] | None:
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


def bcast_table(comm: Communicator, table: pa.Table | None, root: int = 0) -> pa.Table:
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


def scatter_tables(comm: Communicator, parts: Sequence[pa.Table] | None, root: int = 0) -> pa.Table:
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


def send_table(comm: Communicator, table: pa.Table, dest: int, tag: int = 80) -> None:
    buf, sizes = serialize([table])
    comm.send(int(sizes[0]), dest=dest, tag=tag)
    for start in range(0, max(buf.size, 1), _MAX_CHUNK):
        chunk = buf[start : start + _MAX_CHUNK]
        comm.Send([chunk, chunk.size, MPI.BYTE], dest=dest, tag=tag)


def recv_table(comm: Communicator, source: int, tag: int = 80) -> pa.Table:
    n = comm.recv(source=source, tag=tag)
    buf = np.empty(n, dtype=np.uint8)
    for start in range(0, max(n, 1), _MAX_CHUNK):
        chunk = buf[start : start + _MAX_CHUNK]
        comm.Recv([chunk, chunk.size, MPI.BYTE], source=source, tag=tag)
    return _read_from(buf, 0, n)


def allreduce_sum(comm: Communicator, value: int) -> int:
    return int(comm.allreduce(int(value)))


def exscan_sum(comm: Communicator, value: int) -> int:
    """Sum of ``value`` over the ranks before this one (0 on rank 0)."""
    counts = comm.allgather(int(value))
    return int(sum(counts[: comm.Get_rank()]))


def check_same_schema(comm: Communicator, schema: pa.Schema, *, what: str = "table") -> None:
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
