"""The scheduler's contract and the records its parts share.

Events go in (:class:`TaskSubmitted`, :class:`TasksSubmitted`,
:class:`TaskFinished`, :class:`TaskCancelled`, :class:`NodeLost`, :class:`Tick`), instructions
come out (:class:`StartTask` with one :class:`RankSlot` per rank,
:class:`RejectTask`), and :func:`check_request` rejects a request that can
never fit a pilot.  :class:`TaskRecord` is what the scheduler, its placement
and its reservation keep about one task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from .description import ResourceRequest
from .errors import UnsatisfiableRequest
from .node_index import INF
from .pilot import PilotDescription


@dataclass(frozen=True, slots=True)
class RankSlot:
    """What one rank holds: a node index, core ids and GPU ids on that node."""

    node: int
    cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskSubmitted:
    """A task whose inputs are ready.  ``group`` names its independent branch (fair share)."""

    task_id: str
    request: ResourceRequest
    time: float = 0.0
    priority: float = 0.0
    preferred_nodes: frozenset[int] = frozenset()
    group: str = ""


@dataclass(frozen=True)
class TasksSubmitted:
    """Several tasks ready at once: one scheduling pass considers them all in priority order
    (submitting them one by one would place each as it arrives).  ``finished`` are tasks that
    ended and made them ready: released first, so the new tasks can use their nodes (their
    inputs' nodes, for locality) in the same pass."""

    tasks: tuple[TaskSubmitted, ...]
    time: float = 0.0
    finished: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskFinished:
    task_id: str
    time: float = 0.0


@dataclass(frozen=True)
class TaskCancelled:
    task_id: str
    time: float = 0.0


@dataclass(frozen=True)
class Tick:
    time: float = 0.0


@dataclass(frozen=True)
class NodeLost:
    """Node ``node`` (an index, like :attr:`RankSlot.node`) is gone: nothing is placed on it again.

    Tasks running there still end with their own :class:`TaskFinished`; queued tasks that can no
    longer fit on the nodes left are rejected, ``reason`` (e.g. ``"node n2 was lost: ..."``) in
    their reason.
    """

    node: int
    time: float = 0.0
    reason: str = ""


Event = Union[TaskSubmitted, TasksSubmitted, TaskFinished, TaskCancelled, NodeLost, Tick]


@dataclass(frozen=True)
class StartTask:
    task_id: str
    slots: tuple[RankSlot, ...]


RejectCause = Literal["unsatisfiable", "walltime", "drain"]


@dataclass(frozen=True)
class RejectTask:
    """Do not run ``task_id``; ``reason`` is for the task's record, ``cause`` for code."""

    task_id: str
    reason: str
    cause: RejectCause = "unsatisfiable"


Instruction = Union[StartTask, RejectTask]


def check_request(request: ResourceRequest, pilot: PilotDescription, *, what: str = "request") -> None:
    """Raise :class:`UnsatisfiableRequest` if ``request`` can never fit ``pilot`` (resolved)."""
    cores = len(pilot.usable_cores())
    gpus = pilot.gpus_per_node or 0
    problems = []
    if request.cores_per_rank > cores:
        problems.append(f"{request.cores_per_rank} cores per rank but nodes have {cores} usable cores")
    if request.gpus_per_rank > gpus:
        problems.append(f"{request.gpus_per_rank} GPUs per rank but nodes have {gpus} GPUs")
    if request.memory_per_rank and pilot.memory_per_node and request.memory_per_rank > pilot.memory_per_node:
        problems.append(f"{request.memory_per_rank} bytes per rank but nodes have {pilot.memory_per_node}")
    if not problems:
        per_node = cores // request.cores_per_rank
        if request.gpus_per_rank:
            per_node = min(per_node, gpus // request.gpus_per_rank)
        if request.memory_per_rank and pilot.memory_per_node:
            per_node = min(per_node, pilot.memory_per_node // request.memory_per_rank)
        if request.ranks_per_node is not None:
            per_node = min(per_node, request.ranks_per_node)
        if request.ranks > per_node * pilot.nodes:
            problems.append(f"{request.ranks} ranks but at most {per_node * pilot.nodes} fit")
    if problems:
        raise UnsatisfiableRequest(f"{what} ({request}) can never run on {pilot.shape()}: " + "; ".join(problems))


# (ranks, cores_per_rank, gpus_per_rank, memory_per_rank or 0, ranks_per_node or huge)
Shape = tuple[int, int, int, int, int]
NO_CAP = 1 << 30
# what a running task holds on one node: (node, ranks there, core mask, GPU mask)
Held = tuple[int, int, int, int]


@dataclass(eq=False)
class TaskRecord:
    """A queued or running task as the scheduler keeps it."""

    event: TaskSubmitted
    shape: Shape
    seq: int
    weight: float
    estimate: float  # seconds, INF when unknown
    slots: tuple[RankSlot, ...] = ()
    alloc: tuple[Held, ...] = ()  # per node while running, so release and reservations skip ranks
    end: float = INF  # estimated end while running
