"""torch.distributed over a stage's own ranks, with no extra launcher.

The stage's private MPI communicator is the rendezvous: rank 0 opens a
``TCPStore`` on a port the kernel picks (port 0, so no race for a "free"
port), broadcasts the address over ``ctx.comm``, and every rank joins the
process group through that store.  NCCL when this rank was given a GPU and
torch sees one, Gloo otherwise — the same user code runs on both.

MPI and torch take turns on the same ranks, and MPICH over OFI's tcp provider
moves a message only while its sender is inside an MPI call: a rank that leaves
a ``bcast`` or ``Barrier`` and blocks in Gloo leaves its message (or the
connection it needs) undelivered, and the ranks waiting for it wait for ever.
MPICH's automatic progress threads would cure that, but they hung ``MPI_Init``
now and then on the lab cluster (docs/slurm.md, "MPICH from PyPI").  So
:func:`distributed` keeps MPI progressing from a thread of its own while it is
open (:func:`mpi_progress`), and stage code that turns from ``ctx.comm`` to
something else that blocks can do the same.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
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


PROGRESS_TAG = 32_001
"""The tag :func:`mpi_progress` probes for (no message carries it: the probe is only a call into MPI)."""


@contextmanager
def mpi_progress(comm: Any, interval: float = 0.005) -> Iterator[None]:
    """Keep ``comm``'s MPI progressing from a thread while the body waits outside MPI.

    Without MPICH's automatic progress (see the module docstring), a message a
    rank sent just before it blocked in torch (a broadcast's, a barrier's, the
    connection it opened) waits for that rank's next MPI call, and the ranks
    waiting for it wait for ever.  The thread makes that call: a non-blocking
    probe every ``interval`` seconds, until the body returns.  MPI runs with
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default), so the probe may run beside the
    body's own MPI calls.
    """
    if int(comm.Get_size()) == 1 or not hasattr(comm, "Iprobe"):  # hetflow's TcpComm: its own threads
        yield
        return
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        log.warning("MPI was initialised without MPI_THREAD_MULTIPLE: no progress thread; across nodes "
                    "a rank waiting outside MPI may wait for ever")
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            comm.Iprobe(tag=PROGRESS_TAG)

    thread = threading.Thread(target=poll, name="hetflow-mpi-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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
    store: Any = None
    with mpi_progress(comm):  # from here MPI and torch take turns (see the module docstring)
        host = _rendezvous_host(comm)
        port = None
        if rank == 0:
            store = dist.TCPStore(host, 0, size, is_master=True,  # type: ignore[attr-defined]
                                  timeout=timeout, wait_for_workers=False)
            port = int(store.port)
        port = comm.bcast(port, root=0)
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
