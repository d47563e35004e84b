"""The communicator the operators need: the part of mpi4py's ``Comm`` they call (layer 0).

Both an mpi4py communicator (``MPI.Comm`` and its subclasses) and
:class:`~hetflow.operators.tcpcomm.TcpComm` satisfy :class:`Communicator`
structurally; the operators are typed against it, never against either.
Buffer arguments are mpi4py buffer specifications (``[array, count, MPI.BYTE]``,
``[array, (counts, displacements), MPI.BYTE]``), typed ``Any`` as mpi4py's own
stubs make them unions that no other implementation spells the same way.
The keyword names (``root``, ``dest``, ``source``, ``tag``) are mpi4py's, since
the operators pass them by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks: object collectives (pickled small metadata) and buffer collectives (bytes)."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Barrier(self) -> None: ...

    # object collectives and point-to-point (small metadata: counts, schemas, errors)
    def allgather(self, sendobj: Any, /) -> list[Any]: ...

    def allreduce(self, sendobj: Any, /) -> Any: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None: ...

    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...

    # buffer collectives and point-to-point (table bytes)
    def Alltoall(self, sendbuf: Any, recvbuf: Any, /) -> None: ...

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, /) -> None: ...

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, /) -> None: ...

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None: ...

    def Bcast(self, buf: Any, root: int = 0) -> None: ...

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None: ...

    def Recv(self, buf: Any, source: int = 0, tag: int = 0) -> None: ...

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = 0,
                 recvtag: int = 0) -> None: ...


if TYPE_CHECKING:  # mypy checks here that both implementations satisfy the protocol
    from mpi4py import MPI

    from .tcpcomm import TcpComm

    def _conforms(mpi: MPI.Intracomm, tcp: TcpComm) -> tuple[Communicator, Communicator]:
        return mpi, tcp
