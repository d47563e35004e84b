"""A communicator over TCP with the part of mpi4py's ``Comm`` that hetflow uses.

For ranks that are not MPI ranks (Dask workers on several hosts): the table
collectives in :mod:`.comm`, every ``DTable`` operator and the torch Gloo
rendezvous of ``hetflow.ml`` run on it unchanged.  Object methods (``bcast``,
``allgather``, ``allreduce`` ...) pickle; buffer methods (``Alltoallv``,
``Allgatherv``, ``Allreduce``, ``Send``/``Recv`` ...) move raw bytes.

Wiring.  Every pair of ranks has one TCP connection (a full mesh).  Rank 0
listens on a port the kernel picks and publishes ``host:port`` in the
*rendezvous file* (a private file on a file system every rank sees); rank
``r`` connects to rank 0 with its own listening address, rank 0 answers with
everyone's, then rank ``r`` connects to ranks ``1..r-1`` and accepts ranks
``r+1..``.  A thread per connection reads every incoming frame at once into a
mailbox, so a send never waits for the peer to post a receive: pairwise
exchanges (``Sendrecv``, all-to-all) cannot deadlock.

Security.  Each task has a random secret, read from an owner-only file.  Both
ends of every connection prove they know it (HMAC-SHA256 challenge-response
with a nonce from each side) before any frame is read; a connection that
fails is closed and logged, and nothing it sent is ever unpickled.  Every
frame that carries a pickle (and every abort/close frame) is then MACed with
a per-connection key and sequence number, so a frame injected into an
established connection is refused too.  Bulk byte frames are not MACed (they
are never unpickled).  The traffic is not encrypted.

Failure.  ``Abort(code)`` tells every peer and exits; a peer that gets the
abort, or sees a connection end without a goodbye (its peer died), exits with
that code at once, even if it is computing rather than communicating (the
default ``on_failure="exit"``, like an MPI job).  With ``on_failure="raise"``
pending and later calls raise :class:`PeerLost` instead.  A wait longer than
``timeout`` raises :class:`CommTimeout` naming the rank that did not answer.

Configuration: :func:`connect` takes everything as arguments; this module reads
no environment (a pipeline's worker reads the variables its backend set, in
``hetflow.tasks.tcpenv``).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from . import safeio
from .errors import OperatorError

log = logging.getLogger(__name__)

ANY_TAG = -1
"""``recv(tag=ANY_TAG)`` takes the next message with any (non-negative) tag, like ``MPI.ANY_TAG``."""

_COLL = -7  # tag of collective traffic; users' tags are >= 0
_MAGIC = b"HFTCP\x00v1"
_HEADER = struct.Struct("!BiiQ")  # kind, context, tag, payload bytes
_OBJ, _RAW, _ABORT, _BYE, _HELLO = 1, 2, 3, 4, 5
_MAC = 32
_HELLO_LIMIT = 1 << 16
_ABORT_GRACE = 0.5  # seconds a rank that lost a peer waits for an abort frame before it exits

OnFailure = Literal["exit", "raise"]


class TcpCommError(OperatorError, ConnectionError):
    """Root of the TCP communicator's errors."""


class AuthenticationError(TcpCommError, PermissionError):
    """A peer did not prove it knows the task's secret (or the secret file is not private)."""


class CommTimeout(TcpCommError, TimeoutError):
    """A rank did not answer (connect, or send a message) within the timeout; the message names it."""


class PeerLost(TcpCommError):
    """A peer aborted, died or closed the communicator while this rank needed it."""


# ------------------------------------------------------------------ reductions
@dataclass(frozen=True)
class Op:
    """A reduction: ``py`` on Python objects, ``ufunc`` on numpy buffers (``py`` when ``None``)."""

    name: str
    py: Callable[[Any, Any], Any]
    ufunc: Any = None

    def __call__(self, x: Any, y: Any) -> Any:
        return self.py(x, y)


SUM = Op("SUM", lambda x, y: x + y, np.add)
PROD = Op("PROD", lambda x, y: x * y, np.multiply)
MAX = Op("MAX", lambda x, y: y if y > x else x, np.maximum)
MIN = Op("MIN", lambda x, y: y if y < x else x, np.minimum)
LAND = Op("LAND", lambda x, y: x and y, np.logical_and)
LOR = Op("LOR", lambda x, y: x or y, np.logical_or)
BAND = Op("BAND", lambda x, y: x & y, np.bitwise_and)
BOR = Op("BOR", lambda x, y: x | y, np.bitwise_or)
ops = {op.name: op for op in (SUM, PROD, MAX, MIN, LAND, LOR, BAND, BOR)}
"""The predefined reductions by MPI name; ``mpi4py``'s ``MPI.SUM`` etc. are accepted too."""


def _op(op: Any) -> Op:
    if isinstance(op, Op):
        return op
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        for name, ours in ops.items():
            if op == getattr(mpi, name, None):
                return ours
    if callable(op):
        return Op(getattr(op, "__name__", "user"), op)
    raise ValueError(f"unknown reduction {op!r} (known: {sorted(ops)} or a function of two values)")


# ------------------------------------------------------------- buffer specs
class _InPlace:
    def __repr__(self) -> str:
        return "IN_PLACE"


IN_PLACE = _InPlace()


def _is(value: Any, name: str) -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and value is getattr(mpi, name, object()) or (name == "IN_PLACE" and value is IN_PLACE)


def _is_byte(datatype: Any) -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return datatype == "B" or (mpi is not None and datatype == mpi.BYTE)


@dataclass
class _Buf:
    obj: Any
    data: memoryview  # the whole buffer as bytes
    nbytes: int
    counts: list[int] | None = None  # bytes per rank (v-variants)
    displs: list[int] | None = None


def _buf(spec: Any) -> _Buf:
    """``buf``, ``[buf, datatype]``, ``[buf, count, datatype]``, ``[buf, (counts, displs), datatype]``."""
    obj, rest = (spec[0], list(spec[1:])) if isinstance(spec, (list, tuple)) else (spec, [])
    datatype = None
    if rest and not isinstance(rest[-1], (int, np.integer, tuple, list, np.ndarray)):
        datatype = rest.pop()
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("the TCP communicator needs C-contiguous buffers")
    item = 1 if datatype is not None and _is_byte(datatype) else view.itemsize
    data = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if not rest:
        return _Buf(obj, data, data.nbytes)
    if len(rest) == 1 and isinstance(rest[0], (int, np.integer)):
        return _Buf(obj, data, int(rest[0]) * item)
    counts, displs = (rest[0][0], rest[0][1]) if len(rest) == 1 and isinstance(rest[0], tuple) else \
        (rest[0], rest[1] if len(rest) > 1 else None)
    c = [int(n) * item for n in counts]
    if displs is None:
        d = [sum(c[:i]) for i in range(len(c))]
    else:
        d = [int(n) * item for n in displs]
    return _Buf(obj, data, sum(c), c, d)


# ---------------------------------------------------------------- transport
def _mac(key: bytes, seq: int, header: bytes, payload: Any) -> bytes:
    h = hmac.new(key, seq.to_bytes(8, "big"), hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None, raw: bool = False) -> Any:
    """``n`` bytes (``None`` on EOF before the first byte); socket timeouts retry until ``deadline``.

    ``raw``: into an uninitialised numpy byte array (bulk data: no zero-filling).
    """
    buf: Any = np.empty(n, dtype=np.uint8) if raw else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout(f"no data within the time allowed ({got} of {n} bytes read)") from None
            continue
        if k == 0:
            if got == 0:
                return None
            raise PeerLost(f"connection closed in the middle of a frame ({got} of {n} bytes)")
        got += k
    return buf


class _Peer:
    """One authenticated connection to one other rank."""

    def __init__(self, rank: int, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.rank, self.sock = rank, sock
        self.send_key, self.recv_key = send_key, recv_key
        self.send_seq = self.recv_seq = 0
        self.lock = threading.Lock()
        self.state = "open"  # open | bye (it said goodbye) | lost
        self.thread: threading.Thread | None = None

    def send(self, kind: int, context: int, tag: int, payload: Any, wait: float = -1) -> None:
        header = _HEADER.pack(kind, context, tag, memoryview(payload).nbytes)
        if not self.lock.acquire(timeout=wait):
            raise CommTimeout(f"the connection to rank {self.rank} is busy")
        try:
            mac = b""
            if kind != _RAW:
                mac = _mac(self.send_key, self.send_seq, header, payload)
                self.send_seq += 1
            self.sock.sendall(header)
            self.sock.sendall(payload)
            if mac:
                self.sock.sendall(mac)
        finally:
            self.lock.release()

    def read(self, deadline: float | None = None) -> tuple[int, int, int, bytearray] | None:
        """The next frame (``None`` at a clean end of stream); raises on a bad MAC."""
        header = _read_exact(self.sock, _HEADER.size, deadline)
        if header is None:
            return None
        kind, context, tag, n = _HEADER.unpack(bytes(header))
        if kind not in (_OBJ, _RAW, _ABORT, _BYE, _HELLO):
            raise AuthenticationError(f"unknown frame kind {kind} from rank {self.rank}")
        if kind != _RAW and n > (1 << 40):
            raise AuthenticationError(f"implausible frame of {n} bytes from rank {self.rank}")
        payload = _read_exact(self.sock, n, deadline, raw=kind == _RAW) if n else bytearray()
        if payload is None:
            raise PeerLost(f"rank {self.rank} closed the connection in the middle of a frame")
        if kind != _RAW:
            mac = _read_exact(self.sock, _MAC, deadline)
            if mac is None or not hmac.compare_digest(bytes(mac), _mac(self.recv_key, self.recv_seq, bytes(header),
                                                                           payload)):
                raise AuthenticationError(f"frame from rank {self.rank} failed authentication")
            self.recv_seq += 1
        return kind, context, tag, payload


def _handshake(sock: socket.socket, key: bytes, server: bool, timeout: float) -> tuple[bytes, bytes]:
    """Mutual proof of ``key``; returns (send key, receive key) of this connection."""
    sock.settimeout(min(timeout, 1.0))
    deadline = time.monotonic() + timeout
    try:
        if server:
            ns = secrets.token_bytes(32)
            sock.sendall(_MAGIC + ns)
            answer = _read_exact(sock, len(_MAGIC) + 32 + _MAC, deadline)
            if answer is None or bytes(answer[:len(_MAGIC)]) != _MAGIC:
                raise AuthenticationError("peer did not speak the hetflow TCP communicator protocol")
            nc, proof = bytes(answer[len(_MAGIC):-_MAC]), bytes(answer[-_MAC:])
            if not hmac.compare_digest(proof, hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()):
                raise AuthenticationError("peer does not know the task's secret")
            sock.sendall(hmac.new(key, b"server" + nc + ns, hashlib.sha256).digest())
        else:
            hello = _read_exact(sock, len(_MAGIC) + 32, deadline)
            if hello is None or bytes(hello[:len(_MAGIC)]) != _MAGIC:
                raise AuthenticationError("the listener did not speak the hetflow TCP communicator protocol")
            ns, nc = bytes(hello[len(_MAGIC):]), secrets.token_bytes(32)
            sock.sendall(_MAGIC + nc + hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest())
            proof = _read_exact(sock, _MAC, deadline)
            if proof is None or not hmac.compare_digest(bytes(proof), hmac.new(key, b"server" + nc + ns,
                                                                               hashlib.sha256).digest()):
                raise AuthenticationError("the listener does not know the task's secret")
    except (socket.timeout, TimeoutError) as exc:
        raise CommTimeout(f"authentication handshake did not finish within {timeout} s") from exc
    s2c = hmac.new(key, b"s2c" + ns + nc, hashlib.sha256).digest()
    c2s = hmac.new(key, b"c2s" + ns + nc, hashlib.sha256).digest()
    return (s2c, c2s) if server else (c2s, s2c)


class _Mesh:
    """The connections of one rank to all others, the mailbox and the failure policy."""

    def __init__(self, rank: int, size: int, timeout: float | None, on_failure: OnFailure) -> None:
        self.rank, self.size, self.timeout, self.on_failure = rank, size, timeout, on_failure
        self.peers: dict[int, _Peer] = {}
        self.cond = threading.Condition()
        self.boxes: dict[tuple[int, int], deque[tuple[int, int, bytearray]]] = {}
        self.contexts = 0
        self.closing = False
        self.failure: str | None = None

    def start(self) -> None:
        for peer in self.peers.values():
            peer.sock.settimeout(self.timeout)
            peer.thread = threading.Thread(target=self._receive, args=(peer,), daemon=True,
                                           name=f"tcpcomm-recv-{self.rank}-from-{peer.rank}")
            peer.thread.start()

    def _receive(self, peer: _Peer) -> None:
        try:
            while True:
                frame = peer.read()
                if frame is None:
                    break
                kind, context, tag, payload = frame
                if kind == _ABORT:
                    code = int(payload.decode() or 1)
                    self._fail(f"rank {peer.rank} called Abort({code})", code, peer, hard=True)
                    return
                if kind == _BYE:
                    with self.cond:
                        peer.state = "bye"
                        self.cond.notify_all()
                    continue
                with self.cond:
                    self.boxes.setdefault((peer.rank, context), deque()).append((tag, kind, payload))
                    self.cond.notify_all()
        except (OSError, ValueError) as exc:
            if not self.closing:
                why = f"the connection to rank {peer.rank} failed: {exc}" if isinstance(exc, AuthenticationError) \
                    else f"rank {peer.rank} went away ({exc})"
                self._fail(why, 1, peer)
                return
        with self.cond:
            if peer.state != "bye" and not self.closing:
                peer.state = "lost"
                self._fail(f"rank {peer.rank} went away without closing the communicator (did it die?)", 1, peer)
            self.cond.notify_all()

    def _fail(self, why: str, code: int, peer: _Peer | None = None, hard: bool = False) -> None:
        """A peer aborted (``hard``) or was lost: exit now, or make every wait raise."""
        if self.on_failure == "exit" and (hard or not self.closing):
            if not hard:
                # A peer that got an Abort exits at once, and its connection may end before the
                # aborting rank's own frame is read here: give that frame (and its code) a moment.
                time.sleep(_ABORT_GRACE)
            os.write(2, f"hetflow tcpcomm: rank {self.rank}/{self.size}: {why}; exiting with {code}\n".encode())
            os._exit(code)
        with self.cond:
            if peer is not None:
                peer.state = "lost"
            self.failure = self.failure or why
            self.cond.notify_all()

    def send(self, dest: int, context: int, tag: int, kind: int, payload: Any) -> None:
        if dest == self.rank:
            with self.cond:
                self.boxes.setdefault((dest, context), deque()).append((tag, kind, bytearray(payload)))
                self.cond.notify_all()
            return
        peer = self._peer(dest)
        if peer.state == "lost" or self.failure:
            raise PeerLost(f"rank {self.rank}: cannot send to rank {dest}: {self.failure or 'it is gone'}")
        try:
            peer.send(kind, context, tag, payload)
        except socket.timeout as exc:
            raise CommTimeout(f"rank {self.rank}: rank {dest} did not take a message within {self.timeout} s") from exc
        except OSError as exc:
            raise PeerLost(f"rank {self.rank}: sending to rank {dest} failed: {exc}") from exc

    def recv(self, source: int, context: int, tag: int, what: str) -> tuple[int, bytearray]:
        if source != self.rank:
            self._peer(source)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        box_key = (source, context)
        with self.cond:
            while True:
                box = self.boxes.get(box_key)
                if box:
                    for i, (t, kind, payload) in enumerate(box):
                        if t == tag or (tag == ANY_TAG and t >= 0):
                            del box[i]
                            return kind, payload
                peer = self.peers.get(source)
                if self.failure:
                    raise PeerLost(f"rank {self.rank}: {self.failure} (waiting for rank {source} in {what})")
                if peer is not None and peer.state != "open":
                    raise PeerLost(f"rank {self.rank}: rank {source} has "
                                   f"{'closed the communicator' if peer.state == 'bye' else 'gone away'} "
                                   f"(waiting for it in {what})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommTimeout(f"rank {self.rank}: no message from rank {source} within {self.timeout} s "
                                      f"(waiting in {what})")
                self.cond.wait(left)

    def _peer(self, rank: int) -> _Peer:
        if rank not in self.peers:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank} (ranks: 0..{self.size - 1})")
        return self.peers[rank]

    def abort(self, code: int) -> None:
        payload = str(int(code)).encode()
        for peer in self.peers.values():
            try:
                peer.sock.settimeout(2.0)
                peer.send(_ABORT, 0, 0, payload, wait=1.0)
            except OSError:
                pass  # it is gone already, or stuck: it sees our connection close when we exit
        os.write(2, f"hetflow tcpcomm: rank {self.rank}/{self.size} called Abort({code})\n".encode())
        os._exit(code)

    def close(self) -> None:
        """Say goodbye, wait until every peer has said it too (or gone), close."""
        if self.closing:
            return
        self.closing = True
        for peer in self.peers.values():
            try:
                peer.send(_BYE, 0, 0, b"")
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for peer in self.peers.values():
            if peer.thread is not None:
                peer.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            peer.sock.close()


# ------------------------------------------------------------ communicator
class TcpComm:
    """A communicator of ``size`` ranks over TCP; method names and semantics follow mpi4py."""

    def __init__(self, mesh: _Mesh, context: int = 0) -> None:
        self._mesh, self._context = mesh, context
        self.rank, self.size = mesh.rank, mesh.size

    def __repr__(self) -> str:
        return f"TcpComm(rank={self.rank}, size={self.size}, context={self._context})"

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Dup(self) -> "TcpComm":
        """A communicator over the same ranks whose messages never mix with this one's (collective)."""
        self._mesh.contexts += 1  # every rank duplicates in the same order, so the ids agree
        return TcpComm(self._mesh, self._mesh.contexts)

    def Free(self) -> None:
        """Free a duplicate; freeing the communicator :func:`connect` returned closes the connections."""
        if self._context == 0:
            self._mesh.close()

    def Abort(self, errorcode: int = 0) -> None:
        """End every rank now: the peers exit with ``errorcode`` too (never returns)."""
        self._mesh.abort(errorcode)

    # --------------------------------------------------------- point to point
    def _check_tag(self, tag: int) -> int:
        if int(tag) < 0:
            raise ValueError(f"message tags must be >= 0, got {tag}")
        return int(tag)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._mesh.send(dest, self._context, self._check_tag(tag), _OBJ, pickle.dumps(obj, protocol=5))

    def recv(self, buf: Any = None, source: int = 0, tag: int = ANY_TAG, status: Any = None) -> Any:
        return self._load(source, tag, "recv")

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = 0,
                 recvtag: int = ANY_TAG, status: Any = None) -> Any:
        self.send(sendobj, dest, sendtag)
        return self.recv(source=source, tag=recvtag)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        b = _buf(buf)
        self._mesh.send(dest, self._context, self._check_tag(tag), _RAW, b.data[: b.nbytes])

    def Recv(self, buf: Any, source: int = 0, tag: int = ANY_TAG, status: Any = None) -> None:
        b = _buf(buf)
        self._into(b.data, 0, b.nbytes, source, tag, "Recv", exact=False)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = 0,
                 recvtag: int = ANY_TAG, status: Any = None) -> None:
        self.Send(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag)

    def _load(self, source: int, tag: int, what: str) -> Any:
        kind, payload = self._mesh.recv(source, self._context, tag, what)
        if kind != _OBJ:
            raise TcpCommError(f"rank {self.rank}: {what} expected an object from rank {source}, got raw bytes "
                               "(mismatched send/Send?)")
        return pickle.loads(payload)

    def _into(self, data: memoryview, offset: int, n: int, source: int, tag: int, what: str,
              exact: bool = True) -> None:
        kind, payload = self._mesh.recv(source, self._context, tag, what)
        if kind != _RAW or len(payload) > n or (exact and len(payload) != n):
            raise TcpCommError(f"rank {self.rank}: {what} expected {n} bytes from rank {source}, got "
                               f"{len(payload)} {'bytes' if kind == _RAW else 'as an object'}")
        data[offset: offset + len(payload)] = payload

    # ------------------------------------------------------ object collectives
    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def allgather(self, sendobj: Any) -> list[Any]:
        data = pickle.dumps(sendobj, protocol=5)
        for r in self._others():
            self._mesh.send(r, self._context, _COLL, _OBJ, data)
        return [pickle.loads(data) if r == self.rank else self._load(r, _COLL, "allgather") for r in range(self.size)]

    def barrier(self) -> None:
        for r in self._others():
            self._mesh.send(r, self._context, _COLL, _OBJ, b"")
        for r in self._others():
            self._mesh.recv(r, self._context, _COLL, "barrier")

    Barrier = barrier

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        if self.rank != root:
            return self._load(root, _COLL, f"bcast from root {root}")
        data = pickle.dumps(obj, protocol=5)
        for r in self._others():
            self._mesh.send(r, self._context, _COLL, _OBJ, data)
        return obj

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        if self.rank != root:
            self._mesh.send(root, self._context, _COLL, _OBJ, pickle.dumps(sendobj, protocol=5))
            return None
        return [sendobj if r == root else self._load(r, _COLL, f"gather to root {root}") for r in range(self.size)]

    def scatter(self, sendobj: Sequence[Any] | None, root: int = 0) -> Any:
        if self.rank != root:
            return self._load(root, _COLL, f"scatter from root {root}")
        if sendobj is None or len(sendobj) != self.size:
            raise ValueError(f"scatter needs one item per rank ({self.size}) on the root")
        for r in self._others():
            self._mesh.send(r, self._context, _COLL, _OBJ, pickle.dumps(sendobj[r], protocol=5))
        return sendobj[root]

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        if len(sendobj) != self.size:
            raise ValueError(f"alltoall needs one item per rank ({self.size}), got {len(sendobj)}")
        for r in self._others():
            self._mesh.send(r, self._context, _COLL, _OBJ, pickle.dumps(sendobj[r], protocol=5))
        return [sendobj[r] if r == self.rank else self._load(r, _COLL, "alltoall") for r in range(self.size)]

    def allreduce(self, sendobj: Any, op: Any = SUM) -> Any:
        """Every rank reduces the same values in rank order, so results are identical everywhere."""
        return functools.reduce(_op(op).py, self.allgather(sendobj))

    def reduce(self, sendobj: Any, op: Any = SUM, root: int = 0) -> Any:
        values = self.gather(sendobj, root)
        return None if values is None else functools.reduce(_op(op).py, values)

    def scan(self, sendobj: Any, op: Any = SUM) -> Any:
        return functools.reduce(_op(op).py, self.allgather(sendobj)[: self.rank + 1])

    def exscan(self, sendobj: Any, op: Any = SUM) -> Any:
        values = self.allgather(sendobj)[: self.rank]
        return functools.reduce(_op(op).py, values) if values else None

    # ------------------------------------------------------ buffer collectives
    def _send_raw(self, dest: int, data: Any) -> None:
        self._mesh.send(dest, self._context, _COLL, _RAW, data)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        b = _buf(buf)
        if self.rank == root:
            for r in self._others():
                self._send_raw(r, b.data[: b.nbytes])
        else:
            self._into(b.data, 0, b.nbytes, root, _COLL, f"Bcast from root {root}")

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        s, r = _buf(sendbuf), _buf(recvbuf)
        self.Allgatherv([s.obj, s.nbytes, "B"] if not _is(sendbuf, "IN_PLACE") else sendbuf,
                        [r.obj, ([r.nbytes // self.size] * self.size, None), "B"])

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        r = _buf(recvbuf)
        assert r.counts is not None and r.displs is not None
        mine = r.data[r.displs[self.rank]: r.displs[self.rank] + r.counts[self.rank]]
        if not _is(sendbuf, "IN_PLACE"):
            s = _buf(sendbuf)
            mine[:] = s.data[: s.nbytes]
        for p in self._others():
            self._send_raw(p, mine)
        for p in self._others():
            self._into(r.data, r.displs[p], r.counts[p], p, _COLL, "Allgatherv")

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        s = _buf(sendbuf)
        if self.rank != root:
            self._send_raw(root, s.data[: s.nbytes])
            return
        r = _buf(recvbuf)
        assert r.counts is not None and r.displs is not None
        r.data[r.displs[root]: r.displs[root] + s.nbytes] = s.data[: s.nbytes]
        for p in self._others():
            self._into(r.data, r.displs[p], r.counts[p], p, _COLL, f"Gatherv to root {root}")

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        s, r = _buf(sendbuf), _buf(recvbuf)
        n, m = s.nbytes // self.size, r.nbytes // self.size
        self.Alltoallv([s.obj, ([n] * self.size, None), "B"], [r.obj, ([m] * self.size, None), "B"])

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        s, r = _buf(sendbuf), _buf(recvbuf)
        assert s.counts is not None and s.displs is not None and r.counts is not None and r.displs is not None
        for p in self._others():
            self._send_raw(p, s.data[s.displs[p]: s.displs[p] + s.counts[p]])
        me = self.rank
        r.data[r.displs[me]: r.displs[me] + r.counts[me]] = s.data[s.displs[me]: s.displs[me] + s.counts[me]]
        for p in self._others():
            self._into(r.data, r.displs[p], r.counts[p], p, _COLL, "Alltoallv")

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = SUM) -> None:
        """Numpy buffers, reduced in rank order on every rank (identical results everywhere)."""
        target = np.asarray(_buf(recvbuf).obj)
        local = target.copy() if _is(sendbuf, "IN_PLACE") else np.ascontiguousarray(_buf(sendbuf).obj)
        local = local.reshape(target.shape).astype(target.dtype, copy=False)
        parts = self.allgather_arrays(local)
        reduction = _op(op)
        result = functools.reduce(reduction.ufunc or reduction.py, parts)
        target[...] = result

    def allgather_arrays(self, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's array of the same shape and dtype, as raw bytes (no pickle)."""
        array = np.ascontiguousarray(array)
        out = np.empty((self.size,) + array.shape, dtype=array.dtype)
        self.Allgatherv([array, array.nbytes, "B"],
                        [out, ([array.nbytes] * self.size, None), "B"])
        return list(out)


# --------------------------------------------------------------- rendezvous
def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path``, which must belong to this user and be readable by no one else."""
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(f"the secret file {path} must belong to this user and have mode 0600 "
                                  f"(it has mode {stat.S_IMODE(info.st_mode):o})")
    secret = Path(path).read_bytes().strip()
    if len(secret) < 16:
        raise AuthenticationError(f"the secret in {path} is too short ({len(secret)} bytes, need >= 16)")
    return secret


def write_secret(path: str | os.PathLike[str]) -> bytes:
    """Write a new random secret to ``path`` (mode 0600) and return it."""
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    return secret


def _publish(path: Path, host: str, port: int) -> None:
    safeio.atomic_write(path, json.dumps({"host": host, "port": port}).encode(), durable=False)


def _wait_address(path: Path, deadline: float, rank: int) -> tuple[str, int]:
    while True:
        try:
            info = json.loads(path.read_text())
            return str(info["host"]), int(info["port"])
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {rank}: rank 0 did not publish its address in {path} in time") from None
            time.sleep(0.02)


def connect(rank: int, size: int, *, rendezvous: str | os.PathLike[str], secret: bytes, host: str = "127.0.0.1",
            timeout: float | None = 3600.0, connect_timeout: float = 120.0,
            on_failure: OnFailure = "exit") -> TcpComm:
    """Join the communicator of ``size`` ranks as ``rank`` (collective over all of them)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in 0..{size - 1}, got {rank}")
    if on_failure not in ("exit", "raise"):
        raise ValueError(f"on_failure must be 'exit' or 'raise', got {on_failure!r}")
    mesh = _Mesh(rank, size, timeout, on_failure)
    if size == 1:
        return TcpComm(mesh)
    deadline = time.monotonic() + connect_timeout
    listener = socket.create_server((host, 0), backlog=size)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    addresses: dict[int, tuple[str, int]] = {}
    expected = set(range(1, size)) if rank == 0 else set(range(rank + 1, size))
    try:
        if rank == 0:
            _publish(Path(rendezvous), host, port)
        else:
            root = _wait_address(Path(rendezvous), deadline, rank)
            peer = _dial(rank, 0, root, secret, deadline)
            peer.send(_HELLO, 0, 0, json.dumps({"rank": rank, "host": host, "port": port}).encode())
            mesh.peers[0] = peer
        if rank == 0:
            _accept(mesh, listener, secret, expected, deadline, addresses)
            table = json.dumps({str(r): list(a) for r, a in addresses.items()}).encode()
            for r in sorted(expected):
                mesh.peers[r].send(_HELLO, 0, 0, table)
        else:
            peer = mesh.peers[0]
            frame = peer.read(deadline)
            if frame is None or frame[0] != _HELLO:
                raise PeerLost(f"rank {rank}: rank 0 closed the rendezvous")
            addresses = {int(r): (str(a[0]), int(a[1])) for r, a in json.loads(bytes(frame[3])).items()}
            for r in range(1, rank):
                mesh.peers[r] = _dial(rank, r, addresses[r], secret, deadline)
                mesh.peers[r].send(_HELLO, 0, 0, json.dumps({"rank": rank}).encode())
            _accept(mesh, listener, secret, expected, deadline, addresses)
    except BaseException:
        for peer in mesh.peers.values():
            peer.sock.close()
        raise
    finally:
        listener.close()
    mesh.start()
    atexit.register(mesh.close)  # a normal exit without Free() says goodbye too (peers would take it for a death)
    log.debug("rank %d/%d connected to ranks %s", rank, size, sorted(mesh.peers))
    return TcpComm(mesh)


def _dial(rank: int, other: int, address: tuple[str, int], secret: bytes, deadline: float) -> _Peer:
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {rank}: could not connect to rank {other} at {address[0]}:{address[1]}: "
                                  f"{exc}") from exc
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_key, recv_key = _handshake(sock, secret, False, max(0.1, deadline - time.monotonic()))
    return _Peer(other, sock, send_key, recv_key)


def _accept(mesh: _Mesh, listener: socket.socket, secret: bytes, expected: set[int], deadline: float,
            addresses: dict[int, tuple[str, int]]) -> None:
    """Accept authenticated connections from the ranks in ``expected``; others are dropped."""
    missing = set(expected)
    while missing:
        if time.monotonic() > deadline:
            raise CommTimeout(f"rank {mesh.rank}: rank(s) {sorted(missing)} did not connect within the "
                              "rendezvous timeout")
        try:
            sock, where = listener.accept()
        except socket.timeout:
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            keys = _handshake(sock, secret, True, min(10.0, max(0.1, deadline - time.monotonic())))
            peer = _Peer(-1, sock, *keys)
            frame = peer.read(time.monotonic() + 10.0)
            if frame is None or frame[0] != _HELLO or len(frame[3]) > _HELLO_LIMIT:
                raise AuthenticationError("no greeting after the handshake")
            hello = json.loads(bytes(frame[3]))
            other = int(hello["rank"])
            if other not in missing:
                raise AuthenticationError(f"unexpected rank {other} (expecting {sorted(missing)})")
        except (OSError, ValueError, KeyError) as exc:
            log.warning("rank %d: refused a connection from %s: %s", mesh.rank, where, exc)
            sock.close()
            continue
        peer.rank = other
        mesh.peers[other] = peer
        missing.discard(other)
        if "port" in hello:
            addresses[other] = (str(hello["host"]), int(hello["port"]))

