"""The pilot's scheduler: a state machine without I/O.

State changes only through :meth:`Scheduler.handle_event`, which returns the
instructions the caller must carry out.  The same code drives the real pilot
(events from finished processes, wall-clock time) and the simulator (events
from a simulated clock).

Contract (kept stable for the orchestrator and the simulator):

* events: :class:`TaskSubmitted` (or several at once: :class:`TasksSubmitted`),
  :class:`TaskFinished`, :class:`TaskCancelled`, :class:`Tick` — each carries
  ``time`` (seconds, any epoch, non-decreasing);
* instructions: :class:`StartTask` (with one :class:`RankSlot` per rank) and
  :class:`RejectTask` (with a reason naming the request and the pilot shape);
* :func:`check_request` raises :class:`UnsatisfiableRequest` for a request that
  can never fit the pilot, so callers can reject before anything runs.

Policy, in order:

1. *Priority*: higher ``priority`` first (the orchestrator passes the length
   of the task's critical path), then submission order.
2. *Fair share between branches*: tasks carry a ``group`` (an independent
   branch of the pipeline).  While more than one group is waiting, a group
   holding more than its equal share of the pilot is served only after the
   others in the same pass (work-conserving: it still gets what is left).
3. *EASY backfill*: the first task that does not fit gets a reservation — the
   earliest time it can start given the running tasks' estimated ends — and the
   nodes it will use are held.  Later tasks may use held nodes only if their
   duration estimate ends before that time; tasks without an estimate are
   treated as never ending.
4. *Placement*: one node when the ranks fit on one (best fit: GPU requests pack
   GPUs, CPU requests pack cores), else fewest nodes; nodes in
   ``preferred_nodes`` (where inputs are) win among those that fit, but are
   never waited for.
5. *Walltime*: with ``pilot.walltime`` set, a task whose estimate cannot end
   before ``start_time + walltime``, or that would start inside the final
   ``drain`` seconds, is rejected with a reason (:class:`RejectTask` ``cause``).

Cost: tasks with the same request shape and group share a queue; a pass looks
at the head of each queue only, and a node search is a few big-int operations
on the free-capacity buckets of :class:`~hetflow.tasks.node_index.NodeIndex`,
so a decision does not grow with the node count for single-node requests.
What a pass learns cannot fit is carried to the next pass and dropped only
for nodes whose free capacity grew (or that left the reservation); a queue
head that cannot fit even on held nodes is *parked* out of the pass until a
freed node could let it fit, and a pass stops once no waiting shape can fit.
A running task remembers what it holds per node (core and GPU masks), so
release and the reservation walk cost one step per node, not per rank, and
a many-rank take on a node is a memoised look-up (same free masks, same
choice).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Union

from .description import ResourceRequest
from .errors import UnsatisfiableRequest
from .node_index import INF, OPEN, RESERVED, NodeIndex
from .pilot import PilotDescription

logger = logging.getLogger(__name__)


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
    (submitting them one by one would place each as it arrives)."""

    tasks: tuple[TaskSubmitted, ...]
    time: float = 0.0


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


Event = Union[TaskSubmitted, TasksSubmitted, TaskFinished, TaskCancelled, Tick]


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
_Shape = tuple[int, int, int, int, int]
# a queue: (group, rank class = bit length of ranks-1, cores_per_rank, gpus_per_rank, memory, per_node)
_Key = tuple[str, int, int, int, int, int]
_NO_CAP = 1 << 30
# what a running task holds on one node: (node, ranks there, core mask, GPU mask)
_Held = tuple[int, int, int, int]
_REFRESH_NODES = 64     # more nodes freed than this since the last pass: start with a fresh memo
_CACHE_RANKS = 8        # takes of at least this many ranks on a node keep their RankSlots for reuse
_CACHE_SLOTS = 1 << 20  # ... up to this many RankSlots in all (then the cache restarts)


@dataclass(eq=False)
class _Task:
    event: TaskSubmitted
    shape: _Shape
    seq: int
    weight: float
    estimate: float  # seconds, INF when unknown
    slots: tuple[RankSlot, ...] = ()
    alloc: tuple[_Held, ...] = ()  # per node while running, so release and reservations skip ranks
    end: float = INF  # estimated end while running


@dataclass
class _Queue:
    """Queued tasks of one (group, shape): a heap of (-priority, seq, task id)."""

    heap: list[tuple[float, int, str]] = field(default_factory=list)
    filed: int = -1  # seq of this queue's entry in the scheduler's heads heap


class _PassMemo:
    """What the scheduler learnt cannot fit.

    Resources only shrink during a pass, so a verdict holds for the rest of
    it.  Between passes the memo is carried over: :meth:`refresh` drops the
    single-node verdicts that a node whose free capacity grew (or that
    returned to the open pool) could now satisfy, and all capacity figures.
    """

    __slots__ = ("fails", "capacity", "version", "dropped", "guard")

    def __init__(self, guard: int = 0) -> None:
        self.fails: dict[tuple[bool, int, int, int], None] = {}  # no single node had this much
        self.capacity: dict[tuple[bool, int, int, int], int] = {}  # ranks of a shape that fit at most
        self.version = 0  # bumped by every new verdict
        self.dropped = 0  # bumped whenever a verdict may have been weakened (parked heads need a look)
        self.guard = guard

    def reset(self, guard: int) -> None:
        self.fails = {}
        self.capacity = {}
        self.guard = guard
        self.version += 1
        self.dropped += 1

    def no_node(self, cores: int, gpus: int, memory: int, reserved_ok: bool) -> None:
        fail = (reserved_ok, cores, gpus, memory)
        if fail not in self.fails:
            self.fails[fail] = None
            self.version += 1

    def set_capacity(self, key: tuple[bool, int, int, int], ranks: int, index: NodeIndex) -> None:
        """Remember ``ranks`` (counted now) for ``key``, less what the next :meth:`refresh` will add
        for nodes that grew since the last one (they are already counted)."""
        self.capacity[key] = ranks - self._grown_delta(key, index, index.grown)
        self.version += 1

    @staticmethod
    def _grown_delta(key: tuple[bool, int, int, int], index: NodeIndex,
                     grown: dict[int, tuple[int, int, int]]) -> int:
        ok, cores, gpus, per_node = key
        fits = index.ranks_fitting
        delta = 0
        for node, (fc, fg, pool) in grown.items():
            if ok or index.pool[node] == OPEN:
                delta += fits(index.fc[node], index.fg[node], None, cores, gpus, 0, per_node)
            if ok or pool == OPEN:
                delta -= fits(fc, fg, None, cores, gpus, 0, per_node)
        return delta

    def refresh(self, index: NodeIndex, grown: dict[int, tuple[int, int, int]]) -> None:
        """Forget what the nodes in ``grown`` may now satisfy.

        Capacities stay upper bounds (a take only lowers the truth): each grown
        node adds what it fits now minus what it fitted before it grew.
        """
        for key in self.capacity:
            delta = self._grown_delta(key, index, grown)
            if delta:
                self.capacity[key] += delta
                self.dropped += 1
        fc, fg, pool, mem, guard = index.fc, index.fg, index.pool, index.mem, self.guard
        kept: dict[tuple[bool, int, int, int], None] = {}
        for fail in self.fails:
            ok, cores, gpus, memory = fail
            for node in grown:
                if ((ok or pool[node] == OPEN) and fg[node] >= gpus
                        and fc[node] - (0 if gpus else guard * fg[node]) >= cores
                        and (not memory or mem is None or mem[node] >= memory)):
                    break
            else:
                kept[fail] = None
        if len(kept) != len(self.fails):
            self.dropped += 1
        self.fails = kept
        self.version += 1

    def blocked(self, shape: _Shape, reserved_ok: bool) -> bool:
        ranks, cores, gpus, memory, per_node = shape
        if ranks <= per_node or ranks == 1:
            c, g, m = ranks * cores, ranks * gpus, ranks * memory
            for ok, fc, fg, fm in self.fails:
                if (ok or not reserved_ok) and c >= fc and g >= fg and m >= fm and (fg or not g):
                    if ranks == 1:
                        return True
                    break
            else:
                return False
        capacity = self.capacity.get((reserved_ok, cores, gpus, per_node))
        return capacity is not None and capacity < ranks


@dataclass
class Reservation:
    """The EASY reservation: ``task_id`` may start at ``start`` on ``nodes``."""

    task_id: str
    start: float
    nodes: tuple[int, ...]


class Scheduler:
    """Places ready tasks on the pilot's cores and GPUs; see the module docstring for the policy."""

    def __init__(self, pilot: PilotDescription, start_time: float = 0.0, *, fair_share: bool = True,
                 gpu_core_guard: bool = False) -> None:
        """``gpu_core_guard``: while GPU work is queued or running, CPU-only tasks leave one core
        per free GPU on each node.  Off by default: in simulation it helped only when CPU work
        arrives long before GPU work, and cost utilisation in steady state."""
        self.pilot = pilot.resolve()
        self.start_time = start_time
        self.end_time = INF if self.pilot.walltime is None else start_time + self.pilot.walltime
        self.fair_share = fair_share
        self.gpu_core_guard = gpu_core_guard
        gpus = self.pilot.gpus_per_node or 0
        self.index = NodeIndex(self.pilot.nodes, self.pilot.usable_cores(), gpus,
                               self.pilot.gpu_cores, self.pilot.memory_per_node)
        cores = self.index.max_cores
        self._gpu_weight = cores / gpus if gpus else 0.0  # a GPU counts as its share of cores
        self._capacity = self.pilot.nodes * (cores + gpus * self._gpu_weight)
        self._tasks: dict[str, _Task] = {}      # queued
        self._running: dict[str, _Task] = {}
        self._queues: dict[_Key, _Queue] = {}
        self._heads: list[tuple[float, int, _Key]] = []
        self._ends: list[tuple[float, int, str]] = []  # running tasks with an estimate, lazy heap
        self._unknown_end: dict[str, None] = {}        # running tasks without an estimate
        self._deadlines: list[tuple[float, int, str]] = []
        self._group_usage: dict[str, float] = {}
        self._group_queued: dict[str, int] = {}
        self._seq = 0
        self._fits: dict[tuple[object, ...], str | None] = {}  # request shape -> why it can never fit
        self._gpu_tasks = 0  # queued or running tasks that use GPUs (switches the index's core guard)
        self.reservation: Reservation | None = None
        self._dirty = True                  # resources freed / queue heads changed since the last pass
        self._first_blocked: str | None = None  # highest-priority task the last pass could not place
        self.now = start_time
        self.placements = 0
        self._memo = _PassMemo()
        self._parked: dict[_Key, tuple[float, int, _Key]] = {}  # blocked queue heads, out of the heads heap
        self._parked_shape: dict[_Key, _Shape] = {}  # the request shape of each parked head
        self._parked_seen = -1      # memo.dropped at the last look at the parked heads
        self._parked_stale = False  # a queued task was cancelled or expired (maybe a parked head)
        self._usable = self.pilot.usable_cores()
        self._core_slots: dict[int, dict[int, RankSlot]] = {}  # node -> core -> RankSlot(node, (core,))
        self._slot_cache: dict[tuple[int, ...], tuple[RankSlot, ...]] = {}
        self._cached_slots = 0
        self.walk_limit = 256
        nodes = self.pilot.nodes
        self._node_tasks: list[dict[str, float]] = [{} for _ in range(nodes)]
        self._node_end = [start_time] * nodes   # when each node's running tasks all end (estimates)
        self._free_at = [(start_time, node) for node in range(nodes)]  # lazy heap over _node_end

    # ---------------------------------------------------------------- public
    def handle_event(self, event: Event) -> list[Instruction]:
        self.now = max(self.now, event.time)
        out: list[Instruction] = []
        if isinstance(event, TaskSubmitted):
            if not self._submit(event, out):
                return out
            if not self._dirty:  # nothing freed since the last pass: only the newcomer is new
                self._try_newcomer(self._tasks[event.task_id], out)
                return out
        elif isinstance(event, TasksSubmitted):
            for submitted in event.tasks:
                self._submit(submitted, out)
            self._dirty = True
        elif isinstance(event, TaskFinished):
            self._release(event.task_id)
        elif isinstance(event, Tick):
            self._dirty = True
        elif isinstance(event, TaskCancelled):
            if self._dequeue(event.task_id) is not None:
                self._parked_stale = True
            self._release(event.task_id)
            self._dirty = True
        self._schedule(out)
        return out

    @property
    def running(self) -> dict[str, tuple[RankSlot, ...]]:
        return {tid: task.slots for tid, task in self._running.items()}

    @property
    def queued(self) -> list[str]:
        return [tid for _, _, tid in sorted((-t.event.priority, t.seq, tid) for tid, t in self._tasks.items())]

    def utilization(self) -> tuple[float, float]:
        """Fractions of usable cores and of GPUs held by running tasks now."""
        index = self.index
        cores = 1 - index.free_cores_total / (index.nodes * index.max_cores)
        gpus = 1 - index.free_gpus_total / (index.nodes * index.max_gpus) if index.max_gpus else 0.0
        return cores, gpus

    # ------------------------------------------------------------ submission
    def _submit(self, event: TaskSubmitted, out: list[Instruction]) -> bool:
        tid = event.task_id
        if tid in self._tasks or tid in self._running:
            out.append(RejectTask(tid, f"task {tid!r} is already queued or running"))
            return False
        request = event.request
        shape_key = (request.ranks, request.cores_per_rank, request.gpus_per_rank, request.memory_per_rank,
                     request.ranks_per_node)
        if shape_key not in self._fits:
            try:
                check_request(request, self.pilot, what="request")
                self._fits[shape_key] = None
            except UnsatisfiableRequest as exc:
                self._fits[shape_key] = str(exc)
        problem = self._fits[shape_key]
        if problem is not None:
            out.append(RejectTask(tid, f"task {tid!r}: {problem}"))
            return False
        estimate = INF if request.duration is None else float(request.duration)
        latest = self._latest_start(estimate)
        if self.now > latest:
            out.append(self._walltime_reject(tid, estimate))
            return False
        per_node = request.ranks_per_node or _NO_CAP
        shape = (request.ranks, request.cores_per_rank, request.gpus_per_rank, request.memory_per_rank or 0, per_node)
        weight = request.ranks * (request.cores_per_rank + request.gpus_per_rank * self._gpu_weight)
        task = _Task(event, shape, self._seq, weight, estimate)
        self._seq += 1
        self._tasks[tid] = task
        if request.gpus_per_rank:
            self._gpu_tasks += 1
        key = (event.group, (request.ranks - 1).bit_length()) + shape[1:]
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        entry = (-event.priority, task.seq, tid)
        if not queue.heap or entry < queue.heap[0]:
            heapq.heappush(self._heads, (entry[0], entry[1], key))
            queue.filed = task.seq
        heapq.heappush(queue.heap, entry)
        self._group_queued[event.group] = self._group_queued.get(event.group, 0) + 1
        if latest < INF:
            heapq.heappush(self._deadlines, (latest, task.seq, tid))
        return True

    def _latest_start(self, estimate: float) -> float:
        if self.end_time == INF:
            return INF
        if estimate == INF:  # no estimate: only the drain rule applies
            return self.end_time - self.pilot.drain
        return min(self.end_time - self.pilot.drain, self.end_time - estimate)

    def _walltime_reject(self, tid: str, estimate: float) -> RejectTask:
        left = self.end_time - self.now
        if self.now > self.end_time - self.pilot.drain:
            return RejectTask(tid, f"task {tid!r} cannot start at t={self.now:g}: the pilot ends at "
                              f"t={self.end_time:g} and no task starts in its last {self.pilot.drain:g} s "
                              f"(drain)", "drain")
        return RejectTask(tid, f"task {tid!r}: its duration estimate ({estimate:g} s) cannot finish before "
                          f"the pilot ends at t={self.end_time:g} ({left:g} s left)", "walltime")

    def _dequeue(self, tid: str) -> _Task | None:
        task = self._tasks.pop(tid, None)
        if task is not None:
            if task.shape[2]:
                self._gpu_tasks -= 1
            group = task.event.group
            self._group_queued[group] -= 1
            if not self._group_queued[group]:
                del self._group_queued[group]
            if self.reservation is not None and self.reservation.task_id == tid:
                self._clear_reservation()
        return task

    # --------------------------------------------------------------- release
    def _release(self, tid: str) -> None:
        task = self._running.pop(tid, None)
        if task is None:
            return
        self._dirty = True
        if task.shape[2]:
            self._gpu_tasks -= 1
        _, cores, gpus, memory, _ = task.shape
        for node, ranks, cmask, gmask in task.alloc:  # whole-node bulk: one give per node
            self.index.give(node, cmask, gmask, ranks * cores, ranks * gpus, ranks * memory)
            on_node = self._node_tasks[node]
            del on_node[tid]
            if on_node and task.end < self._node_end[node]:
                continue  # another task on the node ends last: nothing changes
            end = max(on_node.values(), default=self.now)
            if end != self._node_end[node]:
                self._node_end[node] = end
                heapq.heappush(self._free_at, (end, node))
        group = task.event.group
        self._group_usage[group] -= task.weight
        if task.end == INF:
            del self._unknown_end[tid]
        elif len(self._ends) > 64 and len(self._ends) > 2 * len(self._running):
            self._ends = [(t.end, t.seq, i) for i, t in self._running.items() if t.end < INF]
            heapq.heapify(self._ends)

    # ------------------------------------------------------------- the pass
    def _head(self, key: _Key) -> _Task | None:
        """The first live task of a queue, dropping cancelled entries."""
        queue = self._queues[key]
        heap = queue.heap
        while heap:
            task = self._tasks.get(heap[0][2])
            if task is not None and task.seq == heap[0][1]:
                return task
            heapq.heappop(heap)
        del self._queues[key]
        return None

    def _schedule(self, out: list[Instruction]) -> None:
        self._expire(out)
        index = self.index
        index.guard = 1 if self.gpu_core_guard and self._gpu_tasks and index.max_gpus else 0
        heads = self._heads
        parked = self._parked
        set_aside: list[tuple[float, int, _Key]] = []
        deferred: list[tuple[float, int, _Key]] = []
        first_blocked: _Task | None = None
        competing = self.fair_share and len(self._group_queued) > 1
        share = self._capacity / max(1, len(self._group_queued))
        memo = self._memo_for_pass()
        self._unpark(memo)
        # the parked head the pass would have met first (and failed): it outranks later heads
        park_first = self._parked_first(share if competing else INF)
        checked = -1
        aside: set[_Key] = set()  # queues whose head this pass already found blocked
        reserved = False
        while index.free_cores_total:
            if index.grown:  # a placed holder freed its held nodes
                self._catch_up()
            if memo.version != checked:  # something new is known not to fit: maybe nothing can now
                checked = memo.version
                if self._all_blocked(memo, aside):
                    break
            if not heads:
                if not deferred:
                    break
                heads.extend(deferred)
                heapq.heapify(heads)
                deferred = []
                competing = False
                if first_blocked is None:
                    park_first = self._parked_first(INF)
                continue
            entry = heapq.heappop(heads)
            key = entry[2]
            queue = self._queues.get(key)
            if queue is None or queue.filed != entry[1]:
                continue  # superseded entry
            task = self._head(key)
            if task is None:
                continue
            if task.seq != entry[1]:  # the filed head was cancelled: file the real one
                heapq.heappush(heads, (-task.event.priority, task.seq, key))
                queue.filed = task.seq
                continue
            if competing and self._group_usage.get(task.event.group, 0.0) >= share:
                deferred.append(entry)
                continue
            if first_blocked is None and park_first is not None and park_first[0] < entry:
                first_blocked = park_first[1]
            held = self.reservation
            if memo.blocked(task.shape, True):
                slots = None  # does not fit even on held nodes: no need for the reservation
            else:
                ok = True
                if first_blocked is not None:
                    if not reserved:  # computed only once a backfill is actually tried
                        self._reserve_for(first_blocked)
                        reserved = True
                        self._catch_up()  # nodes left the old reservation: open-pool verdicts change
                    reservation = self.reservation
                    ok = reservation is not None and (self.now + task.estimate <= reservation.start
                                                      or reservation.task_id == task.event.task_id)
                slots = None if memo.blocked(task.shape, ok) else self._place(task, ok, memo)
                if slots is None and not ok:  # would it fit on held nodes?  If not, it can be parked
                    self._learn(task, memo)
            if slots is None:
                aside.add(key)
                checked = -1
                if first_blocked is None:
                    first_blocked = task
                if memo.blocked(task.shape, True) and not task.event.preferred_nodes:
                    parked[key] = entry  # out of the heads until a freed node could fit it
                    self._parked_shape[key] = task.shape
                else:
                    set_aside.append(entry)
                continue
            heapq.heappop(queue.heap)
            self._start(task, slots, out)
            nxt = self._head(key)
            if nxt is not None:
                heapq.heappush(heads, (-nxt.event.priority, nxt.seq, key))
                queue.filed = nxt.seq
            if held is not None and self.reservation is None:
                # the holder started and let go of its held nodes: the heads set aside while they
                # were held get another look, and the next blocked head its own reservation
                for entry in set_aside:
                    heapq.heappush(heads, entry)
                set_aside = []
                aside.clear()
                first_blocked = None
                reserved = False
                checked = -1
        for entry in set_aside:
            heapq.heappush(heads, entry)
        for entry in deferred:
            heapq.heappush(heads, entry)
        if first_blocked is None and index.free_cores_total:  # stopped before meeting a blocked head
            first_blocked = self._top()
        self._dirty = False
        self._first_blocked = None if first_blocked is None else first_blocked.event.task_id

    def _learn(self, task: _Task, memo: _PassMemo) -> None:
        """Record in ``memo`` whether ``task`` fits even on held nodes (a cheap search, no placement)."""
        ranks, cores, gpus, memory, per_node = task.shape
        index = self.index
        pools = (OPEN, RESERVED)
        if ranks <= per_node or ranks == 1:
            if index.best_node(ranks * cores, ranks * gpus, ranks * memory, pools, gpu_first=gpus > 0) is not None:
                return
            memo.no_node(ranks * cores, ranks * gpus, ranks * memory, True)
            if ranks == 1:
                return
        key = (True, cores, gpus, per_node)
        if memo.capacity.get(key, ranks) >= ranks:
            memo.set_capacity(key, index.capacity(pools, cores, gpus, per_node), index)

    def _unpark(self, memo: _PassMemo) -> None:
        """Put back into the heads the parked queues whose head the memo no longer rules out."""
        parked = self._parked
        if not parked or (memo.dropped == self._parked_seen and not self._parked_stale):
            return  # no verdict weakened and no parked head left its queue since the last look
        self._parked_seen = memo.dropped
        stale = self._parked_stale
        self._parked_stale = False
        shapes = self._parked_shape
        verdicts: dict[_Shape, bool] = {}  # parked heads of several groups often share a shape
        for key, entry in list(parked.items()):
            queue = self._queues.get(key)
            if queue is None or queue.filed != entry[1]:
                del parked[key]  # superseded: the queue's current entry is in the heads
                continue
            if stale:  # a queued task left: the head may have changed
                task = self._head(key)
                if task is None:
                    del parked[key]
                    continue
                if task.seq != entry[1]:
                    del parked[key]
                    heapq.heappush(self._heads, entry)  # the pass files the real head
                    continue
            shape = shapes[key]
            blocked = verdicts.get(shape)
            if blocked is None:
                blocked = verdicts[shape] = memo.blocked(shape, True)
            if not blocked:
                del parked[key]
                heapq.heappush(self._heads, entry)

    def _parked_first(self, share: float) -> tuple[tuple[float, int, _Key], _Task] | None:
        """The highest-priority parked head of a group within ``share`` (INF: any group)."""
        best: tuple[tuple[float, int, _Key], _Task] | None = None
        usage = self._group_usage
        for key, entry in self._parked.items():
            if best is not None and best[0] < entry:
                continue
            queue = self._queues.get(key)
            task = self._tasks.get(queue.heap[0][2]) if queue is not None and queue.heap else None
            if task is not None and task.seq == entry[1] and (share == INF or usage.get(task.event.group, 0.0) < share):
                best = (entry, task)
        return best

    def _catch_up(self) -> None:
        """Bring the carried memo up to date with the nodes that grew (or reopened) since it was."""
        grown = self.index.grown
        if len(grown) > _REFRESH_NODES or self._memo.guard != self.index.guard:
            self._memo.reset(self.index.guard)
        elif grown:
            self._memo.refresh(self.index, grown)
        grown.clear()

    def _memo_for_pass(self) -> _PassMemo:
        """Last pass's verdicts minus what the nodes freed since then could satisfy."""
        self._catch_up()
        return self._memo

    def _all_blocked(self, memo: _PassMemo, aside: set[_Key]) -> bool:
        """Whether no queued task can fit: every queue's head was found blocked in this pass
        (``aside``; resources only shrink during a pass) or cannot fit even on held nodes.

        The memo is asked with the fewest ranks of each queue's rank class
        (fitting is monotone in the rank count), so one look per waiting shape
        ends a pass that would otherwise visit every blocked queue head.
        """
        if not memo.fails and not memo.capacity:
            return False
        for key in self._queues:
            if key in aside or key in self._parked:
                continue
            rank_class = key[1]
            fewest = 1 if rank_class == 0 else (1 << (rank_class - 1)) + 1
            if not memo.blocked((fewest,) + key[2:], True):
                return False
        return True

    def _top(self) -> _Task | None:
        """The highest-priority queued task (queue heads and parked heads), fixing stale head entries."""
        heads = self._heads
        parked = self._parked_first(INF)
        while heads:
            if parked is not None and parked[0] < heads[0]:
                return parked[1]
            _, seq, key = heads[0]
            queue = self._queues.get(key)
            if queue is None or queue.filed != seq:
                heapq.heappop(heads)
                continue
            task = self._head(key)
            if task is None:
                heapq.heappop(heads)
                continue
            if task.seq != seq:
                heapq.heapreplace(heads, (-task.event.priority, task.seq, key))
                queue.filed = task.seq
                continue
            return task
        return None if parked is None else parked[1]

    def _try_newcomer(self, task: _Task, out: list[Instruction]) -> None:
        """Place a just-submitted task, as the pass would, without revisiting the blocked queues.

        Valid because nothing was freed since the last pass: every task that
        pass left queued still does not fit, so only the newcomer can start —
        as a backfill behind the last pass's first blocked task unless it
        outranks it.
        """
        self._expire(out)
        self._catch_up()  # so a capacity counted below is not lowered for growth it already saw
        if not self.index.free_cores_total or task.event.task_id not in self._tasks:
            return
        guard = 1 if self.gpu_core_guard and self._gpu_tasks and self.index.max_gpus else 0
        if guard != self.index.guard:  # GPU work appeared or ended: the last pass's verdicts change
            self._dirty = True
            self._schedule(out)
            return
        key = (task.event.group, (task.shape[0] - 1).bit_length()) + task.shape[1:]
        queue = self._queues[key]
        if queue.heap[0][2] != task.event.task_id:
            return  # an earlier task of its queue is waiting for the same resources
        ok = True
        blocked = self._tasks.get(self._first_blocked) if self._first_blocked is not None else None
        if blocked is not None and (-blocked.event.priority, blocked.seq) < (-task.event.priority, task.seq):
            self._reserve_for(blocked)
            reservation = self.reservation
            ok = reservation is not None and self.now + task.estimate <= reservation.start
        slots = self._place(task, ok, _PassMemo())
        if slots is None:
            if blocked is None or (-task.event.priority, task.seq) < (-blocked.event.priority, blocked.seq):
                self._first_blocked = task.event.task_id
            return
        heapq.heappop(queue.heap)
        self._start(task, slots, out)
        nxt = self._head(key)
        if nxt is not None:
            heapq.heappush(self._heads, (-nxt.event.priority, nxt.seq, key))
            queue.filed = nxt.seq

    def _start(self, task: _Task, slots: tuple[RankSlot, ...], out: list[Instruction]) -> None:
        tid = task.event.task_id
        self._dequeue(tid)
        if task.shape[2]:
            self._gpu_tasks += 1
        task.slots = slots
        task.end = self.now + task.estimate
        self._running[tid] = task
        if task.end == INF:
            self._unknown_end[tid] = None
        else:
            heapq.heappush(self._ends, (task.end, task.seq, tid))
        for node, _, _, _ in task.alloc:
            self._node_tasks[node][tid] = task.end
            if task.end > self._node_end[node]:
                self._node_end[node] = task.end
                heapq.heappush(self._free_at, (task.end, node))
        group = task.event.group
        self._group_usage[group] = self._group_usage.get(group, 0.0) + task.weight
        self.placements += 1
        out.append(StartTask(tid, slots))

    def _expire(self, out: list[Instruction]) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] < self.now:
            _, seq, tid = heapq.heappop(deadlines)
            task = self._tasks.get(tid)
            if task is not None and task.seq == seq:
                self._dequeue(tid)
                self._parked_stale = True
                out.append(self._walltime_reject(tid, task.estimate))

    # ------------------------------------------------------------- placement
    def _place(self, task: _Task, reserved_ok: bool, memo: "_PassMemo") -> tuple[RankSlot, ...] | None:
        ranks, cores, gpus, memory, per_node = task.shape
        index = self.index
        pools = (OPEN, RESERVED) if reserved_ok else (OPEN,)
        preferred = task.event.preferred_nodes
        single = ranks <= per_node
        if preferred:
            near = self._place_preferred(task, pools)
            if near is not None:
                return near
        if single:
            node = index.best_node(ranks * cores, ranks * gpus, ranks * memory, pools, gpu_first=gpus > 0)
            if node is not None:
                return self._slots([(node, ranks)], task)
            memo.no_node(ranks * cores, ranks * gpus, ranks * memory, reserved_ok)
            if ranks == 1:
                return None
        capacity_key = (reserved_ok, cores, gpus, per_node)
        capacity = memo.capacity.get(capacity_key)
        if capacity is None or capacity >= ranks:  # a carried figure is an upper bound: count it again
            capacity = index.capacity(pools, cores, gpus, per_node)
            memo.set_capacity(capacity_key, capacity, index)
        if capacity < ranks:
            return None
        plan: list[tuple[int, int]] = []
        left = ranks
        keys = sorted(((fg, fc, pool) for pool in pools for fg, fc in index.keys(pool, cores, gpus)),
                      key=lambda k: -index.ranks_fitting(k[1], k[0], None, cores, gpus, 0, per_node))
        for fg, fc, pool in keys:
            for node in index.bucket(pool, fg, fc):
                fit = index.node_fit(node, cores, gpus, memory, per_node)
                if fit:
                    take = min(fit, left)
                    plan.append((node, take))
                    left -= take
                    if not left:
                        return self._slots(plan, task)
        return None

    def _place_preferred(self, task: _Task, pools: tuple[int, ...]) -> tuple[RankSlot, ...] | None:
        ranks, cores, gpus, memory, per_node = task.shape
        index = self.index
        fits = sorted((index.fc[n], index.fg[n], n, index.node_fit(n, cores, gpus, memory, per_node))
                      for n in task.event.preferred_nodes
                      if 0 <= n < index.nodes and index.pool[n] in pools)
        for fc, fg, node, fit in fits:  # one preferred node, best fit
            if fit >= ranks:
                return self._slots([(node, ranks)], task)
        if ranks == 1 or ranks <= per_node and index.best_node(
                ranks * cores, ranks * gpus, ranks * memory, pools, gpu_first=gpus > 0) is not None:
            return None  # the task fits on one node elsewhere; spanning would be worse
        if index.capacity(pools, cores, gpus, per_node) < ranks:
            return None
        plan: list[tuple[int, int]] = []
        left = ranks
        used = set()
        for _, _, node, fit in sorted(fits, key=lambda f: -f[3]):
            if fit and left:
                plan.append((node, min(fit, left)))
                left -= plan[-1][1]
                used.add(node)
        for pool in pools:
            for fg, fc in index.keys(pool, cores, gpus):
                for node in index.bucket(pool, fg, fc):
                    if left and node not in used:
                        fit = index.node_fit(node, cores, gpus, memory, per_node)
                        if fit:
                            plan.append((node, min(fit, left)))
                            left -= plan[-1][1]
                    if not left:
                        return self._slots(plan, task)
        return None

    def _slots(self, plan: list[tuple[int, int]], task: _Task) -> tuple[RankSlot, ...]:
        _, cores, gpus, memory, _ = task.shape
        slots: list[RankSlot] = []
        alloc: list[_Held] = []
        index = self.index
        cache = self._slot_cache
        single_core = cores == 1 and not gpus
        for node, count in plan:
            if single_core:  # one core per rank (MPI dataframe ranks): one shared RankSlot per node and core
                ranks, cmask, gmask = index.take(node, count, cores, gpus, memory)
                alloc.append((node, count, cmask, gmask))
                row = self._core_slots.get(node)
                if row is None:
                    row = self._core_slots[node] = {core: RankSlot(node, (core,)) for core in self._usable}
                slots += [row[core_ids[0]] for core_ids, _ in ranks]
                continue
            whole = not gpus and count * cores == index.fc[node]  # every free core: the GPU mask does not matter
            before = (node, index.cmask[node], -1 if whole else index.gmask[node], count, cores, gpus)
            ranks, cmask, gmask = index.take(node, count, cores, gpus, memory)
            alloc.append((node, count, cmask, gmask))
            if count < _CACHE_RANKS:
                slots += [RankSlot(node, core_ids, gpu_ids) for core_ids, gpu_ids in ranks]
                continue
            # many ranks on one node (an MPI task's whole node): the same free masks give the same
            # slots, so build them once per node and state
            cached = cache.get(before)
            if cached is None:
                self._cached_slots += count
                if self._cached_slots > _CACHE_SLOTS:
                    cache.clear()
                    self._cached_slots = count
                cached = cache[before] = tuple(RankSlot(node, core_ids, gpu_ids) for core_ids, gpu_ids in ranks)
            slots += cached
        task.alloc = tuple(alloc)
        if self.reservation is not None and self.reservation.task_id == task.event.task_id:
            self._clear_reservation()
        return tuple(slots)

    # ----------------------------------------------------------- reservation
    def _clear_reservation(self) -> None:
        if self.reservation is not None:
            for node in self.reservation.nodes:
                self.index.set_pool(node, OPEN)
            self.reservation = None

    def _ends_in_order(self) -> Iterator[_Task]:
        """Running tasks by estimated end (without copying the heap), unknown ends last."""
        heap = self._ends
        running = self._running
        while heap and (heap[0][2] not in running or running[heap[0][2]].seq != heap[0][1]):
            heapq.heappop(heap)  # finished tasks: drop them for good
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (end, seq, tid), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            task = self._running.get(tid)
            if task is not None and task.seq == seq:
                yield task
        for tid in self._unknown_end:
            yield self._running[tid]

    def _free_times(self) -> Iterator[tuple[float, int]]:
        """(time the node's running tasks are all estimated to end, node), earliest first."""
        heap = self._free_at
        if len(heap) > 4 * self.index.nodes + 1024:
            heap[:] = [(end, node) for node, end in enumerate(self._node_end)]
            heapq.heapify(heap)
        node_end = self._node_end
        while heap and node_end[heap[0][1]] != heap[0][0]:
            heapq.heappop(heap)  # superseded entries never become valid again (a change pushes anew)
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (end, node), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if self._node_end[node] == end:
                yield end, node

    def _reserve_for(self, task: _Task) -> None:
        """Hold nodes for ``task`` from the earliest time the running tasks' estimates free them.

        Running tasks are released in order of estimated end until the task
        fits; if that takes more than ``walk_limit`` tasks (a whole-node
        request on a busy pilot), the nodes that become entirely free first are
        held instead — a later but still valid start.
        """
        current = self.reservation
        if current is not None and self.now < current.start and current.task_id in self._tasks:
            return  # the holder keeps its reservation until it starts (or the estimate is overrun)
        self._clear_reservation()
        ranks, cores, gpus, memory, per_node = task.shape
        index = self.index
        single = ranks <= per_node
        extra: dict[int, list[int]] = {}
        total = 0 if single else index.capacity((OPEN,), cores, gpus, per_node)

        def fit(node: int) -> int:
            add = extra.get(node, (0, 0, 0))
            mem = None if index.mem is None else index.mem[node] + add[2]
            return index.ranks_fitting(index.fc[node] + add[0], index.fg[node] + add[1], mem,
                                       cores, gpus, memory, per_node)

        start = INF
        chosen: list[int] = []
        found = False
        for walked, running in enumerate(self._ends_in_order()):
            if walked >= self.walk_limit:
                break
            _, run_cores, run_gpus, run_memory, _ = running.shape
            for node, count, _, _ in running.alloc:  # per node, not per rank
                before = 0 if single else fit(node)
                add = extra.setdefault(node, [0, 0, 0])
                add[0] += count * run_cores
                add[1] += count * run_gpus
                add[2] += count * run_memory
                after = fit(node)
                total += after - before
                if single and after >= ranks:
                    chosen = [node]
                    break
            if chosen or (not single and total >= ranks):
                start = running.end
                found = True
                break
        if found and not single:
            left = ranks
            for node in sorted(extra, key=lambda n: -fit(n)):
                if left > 0 and fit(node):
                    chosen.append(node)
                    left -= fit(node)
            for fg, fc in sorted(index.keys(OPEN, cores, gpus), reverse=True):
                if left <= 0:
                    break
                for node in index.bucket(OPEN, fg, fc):
                    if left <= 0:
                        break
                    if node not in extra:
                        chosen.append(node)
                        left -= fit(node)
        elif not found:  # nodes that empty first
            empty = index.ranks_fitting(index.max_cores, index.max_gpus, self.pilot.memory_per_node,
                                        cores, gpus, memory, per_node)
            left = ranks
            for end, node in self._free_times():
                if node in extra and extra[node] == [-1]:
                    continue
                extra[node] = [-1]  # marks a node already chosen (the heap may repeat entries)
                chosen.append(node)
                left -= empty
                start = max(end, self.now)
                if left <= 0:
                    break
        if not chosen:
            return
        for node in chosen:
            index.set_pool(node, RESERVED)
        self.reservation = Reservation(task.event.task_id, start, tuple(chosen))
        logger.debug("reserved %d node(s) for %s from t=%s", len(chosen), task.event.task_id, start)
