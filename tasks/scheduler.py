"""The pilot's scheduler: a state machine without I/O.

State changes only through :meth:`Scheduler.handle_event`, which returns the
instructions the caller must carry out.  The same code drives the real pilot
(events from finished processes, wall-clock time) and the simulator (events
from a simulated clock).

Contract (kept stable for the orchestrator and the simulator):

* events: :class:`TaskSubmitted`, :class:`TaskFinished`, :class:`TaskCancelled`,
  :class:`Tick` — each carries ``time`` (seconds, any epoch, non-decreasing);
* instructions: :class:`StartTask` (with one :class:`RankSlot` per rank) and
  :class:`RejectTask` (with a reason naming the request and the pilot shape);
* :func:`check_request` raises :class:`UnsatisfiableRequest` for a request that
  can never fit the pilot, so callers can reject before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from .description import ResourceRequest
from .errors import UnsatisfiableRequest
from .pilot import PilotDescription


@dataclass(frozen=True)
class RankSlot:
    """What one rank holds: a node index, core ids and GPU ids on that node."""

    node: int
    cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskSubmitted:
    task_id: str
    request: ResourceRequest
    time: float = 0.0
    priority: float = 0.0
    preferred_nodes: frozenset[int] = frozenset()


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


Event = Union[TaskSubmitted, TaskFinished, TaskCancelled, Tick]


@dataclass(frozen=True)
class StartTask:
    task_id: str
    slots: tuple[RankSlot, ...]


@dataclass(frozen=True)
class RejectTask:
    task_id: str
    reason: str


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


@dataclass
class _Node:
    free_cores: list[int]
    free_gpus: list[int]
    free_memory: int | None


@dataclass
class _Queued:
    event: TaskSubmitted
    order: int


class Scheduler:
    """First-fit with backfill: every event re-scans the queue in priority order."""

    def __init__(self, pilot: PilotDescription) -> None:
        self.pilot = pilot.resolve()
        cores = list(self.pilot.usable_cores())
        gpus = list(range(self.pilot.gpus_per_node or 0))
        self._nodes = [_Node(list(cores), list(gpus), self.pilot.memory_per_node) for _ in range(self.pilot.nodes)]
        self._queue: list[_Queued] = []
        self._running: dict[str, tuple[ResourceRequest, tuple[RankSlot, ...]]] = {}
        self._order = 0
        self.now = 0.0

    # ---------------------------------------------------------------- public
    def handle_event(self, event: Event) -> list[Instruction]:
        self.now = max(self.now, event.time)
        out: list[Instruction] = []
        if isinstance(event, TaskSubmitted):
            try:
                check_request(event.request, self.pilot, what=f"task {event.task_id!r}")
            except UnsatisfiableRequest as exc:
                return [RejectTask(event.task_id, str(exc))]
            self._queue.append(_Queued(event, self._order))
            self._order += 1
        elif isinstance(event, TaskFinished):
            self._release(event.task_id)
        elif isinstance(event, TaskCancelled):
            self._queue = [q for q in self._queue if q.event.task_id != event.task_id]
            self._release(event.task_id)
        out.extend(self._schedule())
        return out

    @property
    def running(self) -> dict[str, tuple[RankSlot, ...]]:
        return {tid: slots for tid, (_, slots) in self._running.items()}

    @property
    def queued(self) -> list[str]:
        return [q.event.task_id for q in self._queue]

    # --------------------------------------------------------------- private
    def _release(self, task_id: str) -> None:
        entry = self._running.pop(task_id, None)
        if entry is None:
            return
        request, slots = entry
        for slot in slots:
            node = self._nodes[slot.node]
            node.free_cores.extend(slot.cores)
            node.free_cores.sort()
            node.free_gpus.extend(slot.gpus)
            node.free_gpus.sort()
            if node.free_memory is not None and request.memory_per_rank:
                node.free_memory += request.memory_per_rank

    def _schedule(self) -> list[Instruction]:
        out: list[Instruction] = []
        self._queue.sort(key=lambda q: (-q.event.priority, q.order))
        waiting: list[_Queued] = []
        for queued in self._queue:
            slots = self._place(queued.event)
            if slots is None:
                waiting.append(queued)
                continue
            self._running[queued.event.task_id] = (queued.event.request, slots)
            out.append(StartTask(queued.event.task_id, slots))
        self._queue = waiting
        return out

    def _place(self, event: TaskSubmitted) -> tuple[RankSlot, ...] | None:
        request = event.request
        order = sorted(range(len(self._nodes)), key=lambda i: (i not in event.preferred_nodes, i))
        plan: list[tuple[int, int]] = []  # (node, ranks on it)
        remaining = request.ranks
        for index in order:
            fit = self._ranks_fitting(self._nodes[index], request)
            if fit:
                take = min(fit, remaining)
                plan.append((index, take))
                remaining -= take
                if remaining == 0:
                    break
        if remaining:
            return None
        slots: list[RankSlot] = []
        for index, count in plan:
            node = self._nodes[index]
            for _ in range(count):
                gpus = tuple(node.free_gpus[: request.gpus_per_rank])
                del node.free_gpus[: request.gpus_per_rank]
                cores = self._take_cores(node, request.cores_per_rank, gpus)
                if node.free_memory is not None and request.memory_per_rank:
                    node.free_memory -= request.memory_per_rank
                slots.append(RankSlot(index, cores, gpus))
        return tuple(slots)

    def _take_cores(self, node: _Node, count: int, gpus: tuple[int, ...]) -> tuple[int, ...]:
        near: list[int] = []
        for gpu in gpus:
            if gpu < len(self.pilot.gpu_cores):
                near.extend(c for c in self.pilot.gpu_cores[gpu] if c in node.free_cores and c not in near)
        chosen = near[:count]
        for core in node.free_cores:
            if len(chosen) == count:
                break
            if core not in chosen:
                chosen.append(core)
        for core in chosen:
            node.free_cores.remove(core)
        return tuple(sorted(chosen))

    @staticmethod
    def _ranks_fitting(node: _Node, request: ResourceRequest) -> int:
        fit = len(node.free_cores) // request.cores_per_rank
        if request.gpus_per_rank:
            fit = min(fit, len(node.free_gpus) // request.gpus_per_rank)
        if request.memory_per_rank and node.free_memory is not None:
            fit = min(fit, node.free_memory // request.memory_per_rank)
        if request.ranks_per_node is not None:
            fit = min(fit, request.ranks_per_node)
        return fit
