"""torch.distributed over a stage's own ranks, with no extra launcher.

The stage's private MPI communicator is the rendezvous: rank 0 opens a
``TCPStore`` on a port the kernel picks (port 0, so no race for a "free"
port), hands the address to every rank over ``ctx.comm`` (:func:`handoff`), and
every rank joins the process group through that store.  NCCL when this rank was
given a GPU and torch sees one, Gloo otherwise — the same user code runs on both.

MPI and torch take turns on the same ranks, and MPICH over OFI's tcp provider
moves a message only while its sender is inside an MPI call: a rank that leaves
a ``bcast`` or ``Barrier`` and blocks in Gloo can leave a message (or the
connection it needs) undelivered, and the ranks still waiting for it wait for
ever.  MPICH's automatic progress threads would cure that, but they hung
``MPI_Init`` now and then on the lab cluster (docs/slurm.md, "MPICH from PyPI").
So every turn from MPI to torch goes through :func:`handoff`, built on
synchronous sends: no rank leaves it while a message of the turn is in flight.
"""

from __future__ import annotations

import datetime
import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal, Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistributedEnv:
    """What a training loop needs from the set-up: identity, device and collectives."""

    rank: int
    size: int
    backend: Backend
    device: "torch.device"

    def wrap(self, model: "torch.nn.Module") -> "torch.nn.Module":
        """Move ``model`` to this rank's device and wrap it for data-parallel training.

        ``DistributedDataParallel`` broadcasts rank 0's parameters at
        construction, so all ranks start from the same weights, and averages
        gradients over the ranks in ``backward``.
        """
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        ids = [self.device.index or 0] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def all_reduce(self, values: Sequence[float], op: Literal["sum", "max", "min"] = "sum") -> list[float]:
        """Reduce a few numbers over the ranks (float64, through the process group)."""
        import torch
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"unknown reduction {op!r} (known: {sorted(ops)})")
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=ops[op])
        return [float(v) for v in t.cpu()]

    def barrier(self) -> None:
        """Wait until every rank of the process group arrives (``torch.distributed.barrier``)."""
        import torch.distributed as dist

        dist.barrier()


HANDOFF_TAG = 32_001
"""Tag of :func:`handoff`'s messages (the MPI standard guarantees tags up to 32767)."""


def handoff(comm: Any, value: Any = None, root: int = 0) -> Any:
    """``root``'s ``value`` on every rank, returned once no message of this exchange is in flight.

    Call it where the ranks turn from MPI to something that blocks outside MPI
    (torch's Gloo or NCCL, a socket): the ranks first report to ``root`` with
    synchronous sends, then ``root`` sends ``value`` to each with synchronous
    sends, so every earlier message between them was delivered and ``root``
    leaves only after each rank holds the value.  What is left for a rank to
    send after it returns is the acknowledgement of a message it received, on
    a connection already open.
    """
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    if size == 1:
        return value
    if rank != root:
        comm.ssend(None, dest=root, tag=HANDOFF_TAG)
        return comm.recv(source=root, tag=HANDOFF_TAG)
    for peer in range(size):
        if peer != root:
            comm.recv(source=peer, tag=HANDOFF_TAG)
    for peer in range(size):
        if peer != root:
            comm.ssend(value, dest=peer, tag=HANDOFF_TAG)
    return value


def _rendezvous_host(comm: Any) -> str:
    hosts = comm.allgather(socket.gethostname())
    return "127.0.0.1" if len(set(hosts)) == 1 else str(hosts[0])


@contextmanager
def distributed(ctx: Any, *, backend: Backend | None = None,
                timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> Iterator[DistributedEnv]:
    """Initialise a torch process group over ``ctx.comm``'s ranks; destroy it on exit.

    ``ctx`` is a :class:`hetflow.tasks.context.StageContext` (anything with
    ``comm``, ``cores`` and ``device``).  Torch's intra-op threads are set to
    the number of cores the pilot gave this rank.
    """
    import torch
    import torch.distributed as dist

    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"unknown torch.distributed backend {backend!r} (known: {list(_BACKENDS)})")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process")
    comm = ctx.comm
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    torch.set_num_threads(max(1, len(getattr(ctx, "cores", ()) or ())))
    if ctx.device == "cuda":
        device = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES holds exactly this rank's GPUs
        torch.cuda.set_device(device)
        chosen: Backend = backend or "nccl"
    else:
        device = torch.device("cpu")
        chosen = backend or "gloo"
    host = _rendezvous_host(comm)
    store: Any = None
    port = None
    if rank == 0:
        store = dist.TCPStore(host, 0, size, is_master=True,  # type: ignore[attr-defined]
                              timeout=timeout, wait_for_workers=False)
        port = int(store.port)
    port = handoff(comm, port)  # rank 0 waits in its store next: nothing of MPI's may be left in flight
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    log.debug("rank %d/%d joining %s process group at %s:%d", rank, size, chosen, host, port)
    dist.init_process_group(chosen, store=store, rank=rank, world_size=size, timeout=timeout)
    try:
        yield DistributedEnv(rank=rank, size=size, backend=chosen, device=device)
    finally:
        dist.destroy_process_group()
    # on success only (a failed rank must not wait here): rank 0's store outlives every client
    comm.Barrier()
    del store
