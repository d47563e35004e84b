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

    def Get_rank(self) -> int:
        """This process's rank (0 .. size - 1)."""

    def Get_size(self) -> int:
        """The number of ranks."""

    def Barrier(self) -> None:
        """Wait until every rank has called it."""

    # object collectives and point-to-point (small metadata: counts, schemas, errors)
    def allgather(self, sendobj: Any, /) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""

    def allreduce(self, sendobj: Any, /) -> Any:
        """The sum of every rank's object, on every rank."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s object on every rank."""

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's object on ``root`` (rank order), ``None`` elsewhere."""

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send an object to rank ``dest``."""

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any:
        """Receive an object from rank ``source``."""

    # buffer collectives and point-to-point (table bytes)
    def Alltoall(self, sendbuf: Any, recvbuf: Any, /) -> None:
        """Block ``j`` of ``sendbuf`` to rank ``j``, equal blocks."""

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, /) -> None:
        """Block ``j`` of ``sendbuf`` to rank ``j``, counts and displacements per rank."""

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, /) -> None:
        """Every rank's buffer, concatenated in rank order, on every rank."""

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's buffer, concatenated in rank order, on ``root``."""

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """``root``'s buffer into ``buf`` on every rank."""

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Send a buffer to rank ``dest``."""

    def Recv(self, buf: Any, source: int = 0, tag: int = 0) -> None:
        """Receive a buffer from rank ``source``."""

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = 0,
                 recvtag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once (no deadlock in pairwise exchanges)."""


if TYPE_CHECKING:  # mypy checks here that both implementations satisfy the protocol
    from mpi4py import MPI

    from .tcpcomm import TcpComm

    def _conforms(mpi: MPI.Intracomm, tcp: TcpComm) -> tuple[Communicator, Communicator]:
        return mpi, tcp
