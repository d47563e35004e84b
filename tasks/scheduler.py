"""The pilot's scheduler: a state machine without I/O.

State changes only through :meth:`Scheduler.handle_event`, which returns the
instructions the caller must carry out.  The same code drives the real pilot
(events from finished processes, wall-clock time) and the simulator (events
from a simulated clock).

Contract (kept stable for the orchestrator and the simulator):

* events: :class:`TaskSubmitted` (or several at once: :class:`TasksSubmitted`,
  which may also release the tasks whose end made them ready),
  :class:`TaskFinished`, :class:`TaskCancelled`, :class:`NodeLost`,
  :class:`Tick` — each carries ``time`` (seconds, any epoch, non-decreasing);
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
   GPUs, CPU requests pack cores), else fewest nodes, each (bar the last)
   holding at least ``span_fraction`` of the ranks an empty node fits, so a
   task spanning nodes waits for room rather than being scattered a rank or
   two per node over a fragmented pilot; nodes in ``preferred_nodes`` (where
   inputs are) win among those that fit, but are never waited for.
5. *Lost nodes*: after :class:`NodeLost` nothing is placed on that node again
   (it leaves any reservation), and a queued or later task that cannot fit on
   the nodes left is rejected with a reason naming the lost node(s).
6. *Walltime*: with ``pilot.walltime`` set, a task whose estimate cannot end
   before ``start_time + walltime``, or that would start inside the final
   ``drain`` seconds, is rejected with a reason (:class:`RejectTask` ``cause``).

Cost: tasks with the same request shape and group share a queue; a pass looks
at the head of each queue only.  What a pass learns cannot fit is carried to
the next pass (:mod:`~hetflow.tasks.scheduler_memo`) and dropped only for
nodes whose free capacity grew (or that left the reservation); a queue head
that cannot fit even on held nodes is *parked* out of the pass until a freed
node could let it fit, and a pass stops once no waiting shape can fit.

The parts: events, instructions and the request check are in
:mod:`~hetflow.tasks.scheduler_types` (re-exported here); node choice and
per-rank slots in :mod:`~hetflow.tasks.placement`; the EASY reservation and
the running tasks' estimated ends in :mod:`~hetflow.tasks.reservation`; the
free-capacity index in :mod:`~hetflow.tasks.node_index`.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
from dataclasses import dataclass, field

from .description import ResourceRequest
from .errors import UnsatisfiableRequest
from .node_index import INF, OPEN, RESERVED, NodeIndex
from .pilot import PilotDescription
from .placement import Placer
from .reservation import Ends, Reservation, earliest_start
from .scheduler_memo import PassMemo
from .scheduler_types import (NO_CAP, Event, Instruction, NodeLost, RankSlot, RejectCause, RejectTask, Shape,
                              StartTask, TaskCancelled, TaskFinished, TaskRecord, TasksSubmitted, TaskSubmitted,
                              Tick, check_request)

__all__ = ["Event", "Instruction", "NodeLost", "RankSlot", "RejectCause", "RejectTask", "Reservation", "Scheduler",
           "StartTask", "TaskCancelled", "TaskFinished", "TasksSubmitted", "TaskSubmitted", "Tick", "check_request"]

logger = logging.getLogger(__name__)

# a queue: (group, rank class = bit length of ranks-1, cores_per_rank, gpus_per_rank, memory, per_node)
_Key = tuple[str, int, int, int, int, int]
_REFRESH_NODES = 64     # more nodes freed than this since the last pass: start with a fresh memo
# A task spanning nodes uses only nodes with room for at least this fraction of an empty node's ranks:
# a spanning task then holds far fewer nodes, so a placement costs far fewer node takes, gives and
# end-index updates, for about the same utilisation (figures: docs/benchmarks.md, "Scheduler").
SPAN_FRACTION = 0.25


def check_span_fraction(value: float, name: str = "span_fraction") -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a fraction (0 to 1)."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be between 0 and 1, got {value!r}")


_Entry = tuple[float, int, str]  # (-priority, seq, task id): smallest first


@dataclass
class _Queue:
    """Queued tasks of one (group, shape), best first.

    Entries live in a heap, or in ``run``, a list sorted best-last that a big
    batch of submissions is settled into: popping a run costs nothing, while
    popping a large heap showed in saturated simulations (docs/benchmarks.md).
    """

    heap: list[_Entry] = field(default_factory=list)
    run: list[_Entry] = field(default_factory=list)
    filed: int = -1  # seq of this queue's entry in the scheduler's heads heap

    def peek(self) -> _Entry | None:
        heap, run = self.heap, self.run
        if run:
            return heap[0] if heap and heap[0] < run[-1] else run[-1]
        return heap[0] if heap else None

    def pop(self) -> None:
        heap, run = self.heap, self.run
        if run and (not heap or run[-1] < heap[0]):
            run.pop()
        else:
            heapq.heappop(heap)

    def settle(self) -> None:
        """Sort the heap into the run once it is large against it (amortised: each entry moves a few times)."""
        if len(self.heap) > 64 and 8 * len(self.heap) > len(self.run):
            self.run = sorted(self.run + self.heap, reverse=True)
            self.heap = []



class Scheduler:
    """Places ready tasks on the pilot's cores and GPUs; see the module docstring for the policy."""

    def __init__(self, pilot: PilotDescription, start_time: float = 0.0, *, fair_share: bool = True,
                 gpu_core_guard: bool = False, span_fraction: float = SPAN_FRACTION) -> None:
        """``gpu_core_guard``: while GPU work is queued or running, CPU-only tasks leave one core
        per free GPU on each node.  Off by default: in simulation it helped only when CPU work
        arrives long before GPU work, and cost utilisation in steady state.

        ``span_fraction``: a task spanning nodes puts at least this fraction of what an empty
        node fits on every node it uses but its last (0: any node with room for one rank)."""
        check_span_fraction(span_fraction)
        self.pilot = pilot.resolve()
        self.start_time = start_time
        self.end_time = INF if self.pilot.walltime is None else start_time + self.pilot.walltime
        self.fair_share = fair_share
        self.gpu_core_guard = gpu_core_guard
        gpus = self.pilot.gpus_per_node or 0
        self.index = NodeIndex(self.pilot.nodes, self.pilot.usable_cores(), gpus,
                               self.pilot.gpu_cores, self.pilot.memory_per_node, span_fraction)
        cores = self.index.max_cores
        self._gpu_weight = cores / gpus if gpus else 0.0  # a GPU counts as its share of cores
        self._capacity = self.pilot.nodes * (cores + gpus * self._gpu_weight)
        self._tasks: dict[str, TaskRecord] = {}      # queued
        self._running: dict[str, TaskRecord] = {}
        self._queues: dict[_Key, _Queue] = {}
        self._heads: list[tuple[float, int, _Key]] = []
        self._ends = Ends(self.pilot.nodes, start_time)  # running tasks by estimated end
        self._deadlines: list[tuple[float, int, str]] = []
        self._group_usage: dict[str, float] = {}
        self._group_queued: dict[str, int] = {}
        self._seq = 0
        self._fits: dict[tuple[object, ...], str | None] = {}  # request shape -> why it can never fit
        self._lost: dict[int, str] = {}  # lost node -> why (NodeLost.reason)
        self._left = self.pilot  # the pilot's shape with its lost nodes gone: what requests are checked against
        self._gpu_tasks = 0  # queued or running tasks that use GPUs (switches the index's core guard)
        self.reservation: Reservation | None = None
        self._dirty = True                  # resources freed / queue heads changed since the last pass
        self._first_blocked: str | None = None  # highest-priority task the last pass could not place
        self.now = start_time
        self.placements = 0
        self._memo = PassMemo()
        self._parked: dict[_Key, tuple[float, int, _Key]] = {}  # blocked queue heads, out of the heads heap
        self._parked_shape: dict[_Key, Shape] = {}  # the request shape of each parked head
        # parked heads of spanning shapes (ruled out by a capacity figure only), per capacity key:
        # (-ranks, seq, queue key), sorted so that the fewest ranks come last (popped first)
        self._parked_spans: dict[tuple[bool, int, int, int], list[tuple[int, int, _Key]]] = {}
        self._parked_seen = -1      # memo.dropped at the last look at the parked heads
        self._parked_stale = False  # a queued task was cancelled or expired (maybe a parked head)
        self._placer = Placer(self.index, self.pilot.usable_cores())
        self.walk_limit = 256   # running tasks a reservation walk may release (see reservation.earliest_start)
        self.walk_nodes = 4096  # ... and the nodes they held

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
            for tid in event.finished:
                self._release(tid)
            for submitted in event.tasks:
                self._submit(submitted, out)
            for queue in self._queues.values():
                queue.settle()
            self._dirty = True
        elif isinstance(event, TaskFinished):
            self._release(event.task_id)
        elif isinstance(event, Tick):
            self._dirty = True
        elif isinstance(event, NodeLost):
            self._lose(event, out)
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

    @property
    def lost(self) -> dict[int, str]:
        """The lost nodes and why (:class:`NodeLost`)."""
        return dict(self._lost)

    def utilization(self) -> tuple[float, float]:
        """Fractions of usable cores and of GPUs (of the nodes not lost) held by running tasks now."""
        index = self.index
        nodes = max(1, index.nodes - len(self._lost))
        cores = 1 - index.free_cores_total / (nodes * index.max_cores)
        gpus = 1 - index.free_gpus_total / (nodes * index.max_gpus) if index.max_gpus else 0.0
        return cores, gpus

    # ------------------------------------------------------------ lost nodes
    def _lose(self, event: NodeLost, out: list[Instruction]) -> None:
        """Take the node out of placement for good; reject the queued tasks the nodes left cannot hold."""
        node = event.node
        if node in self._lost or not 0 <= node < self.index.nodes:
            return
        self._lost[node] = event.reason or f"node {node} was lost"
        if self.reservation is not None and node in self.reservation.nodes:
            self._clear_reservation()  # recomputed without it by the next pass
        self.index.lose(node)
        self._left = dataclasses.replace(self.pilot, nodes=max(1, self.pilot.nodes - len(self._lost)))
        self._fits.clear()
        self._memo.reset(self.index.guard)
        self._dirty = True
        for tid, task in list(self._tasks.items()):
            problem = self._problem(task.event.request)
            if problem is not None:
                self._dequeue(tid)
                self._parked_stale = True
                out.append(RejectTask(tid, f"task {tid!r}: {problem}"))

    # ------------------------------------------------------------ submission
    def _submit(self, event: TaskSubmitted, out: list[Instruction]) -> bool:
        tid = event.task_id
        if tid in self._tasks or tid in self._running:
            out.append(RejectTask(tid, f"task {tid!r} is already queued or running"))
            return False
        request = event.request
        problem = self._problem(request)
        if problem is not None:
            out.append(RejectTask(tid, f"task {tid!r}: {problem}"))
            return False
        estimate = INF if request.duration is None else float(request.duration)
        latest = self._latest_start(estimate)
        if self.now > latest:
            out.append(self._walltime_reject(tid, estimate))
            return False
        per_node = request.ranks_per_node or NO_CAP
        shape = (request.ranks, request.cores_per_rank, request.gpus_per_rank, request.memory_per_rank or 0, per_node)
        weight = request.ranks * (request.cores_per_rank + request.gpus_per_rank * self._gpu_weight)
        task = TaskRecord(event, shape, self._seq, weight, estimate)
        self._seq += 1
        self._tasks[tid] = task
        if request.gpus_per_rank:
            self._gpu_tasks += 1
        key = (event.group, (request.ranks - 1).bit_length()) + shape[1:]
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        entry = (-event.priority, task.seq, tid)
        best = queue.peek()
        if best is None or entry < best:
            heapq.heappush(self._heads, (entry[0], entry[1], key))
            queue.filed = task.seq
            self._parked.pop(key, None)  # its parked head is no longer the queue's head
        heapq.heappush(queue.heap, entry)
        self._group_queued[event.group] = self._group_queued.get(event.group, 0) + 1
        if latest < INF:
            heapq.heappush(self._deadlines, (latest, task.seq, tid))
        return True

    def _problem(self, request: ResourceRequest) -> str | None:
        """Why ``request`` can never run on the pilot's nodes that are not lost (``None``: it can)."""
        if len(self._lost) >= self.index.nodes:
            return f"every node of {self.pilot.shape()} was lost: " + "; ".join(self._lost.values())
        shape_key = (request.ranks, request.cores_per_rank, request.gpus_per_rank, request.memory_per_rank,
                     request.ranks_per_node)
        if shape_key not in self._fits:
            try:
                check_request(request, self._left, what="request")
                self._fits[shape_key] = None
            except UnsatisfiableRequest as exc:
                problem = str(exc)
                if self._lost:
                    problem += f" ({len(self._lost)} node(s) lost: " + "; ".join(self._lost.values()) + ")"
                self._fits[shape_key] = problem
        return self._fits[shape_key]

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

    def _dequeue(self, tid: str) -> TaskRecord | None:
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
        give = self.index.give
        for node, ranks, cmask, gmask in task.alloc:  # whole-node bulk: one give per node
            give(node, cmask, gmask, ranks * cores, ranks * gpus, ranks * memory)
        self._ends.remove(task, self.now)
        self._group_usage[task.event.group] -= task.weight

    # ------------------------------------------------------------- the pass
    def _head(self, key: _Key) -> TaskRecord | None:
        """The first live task of a queue, dropping cancelled entries."""
        queue = self._queues[key]
        tasks = self._tasks
        while (best := queue.peek()) is not None:
            task = tasks.get(best[2])
            if task is not None and task.seq == best[1]:
                return task
            queue.pop()
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
        first_blocked: TaskRecord | None = None
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
                    self._park_span(key, entry, task.shape)
                else:
                    set_aside.append(entry)
                continue
            queue.pop()
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

    def _learn(self, task: TaskRecord, memo: PassMemo) -> None:
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

    def _park_span(self, key: _Key, entry: tuple[float, int, _Key], shape: Shape) -> None:
        ranks, cores, gpus, _, per_node = shape
        if ranks <= per_node or ranks == 1:
            return
        spans = self._parked_spans.setdefault((True, cores, gpus, per_node), [])
        bisect.insort(spans, (-ranks, entry[1], key))

    def _unpark(self, memo: PassMemo) -> None:
        """Put back into the heads the parked queues whose head the memo no longer rules out.

        A parked head of a spanning shape is ruled out by its capacity figure
        alone, so those wait per capacity key sorted by rank count, and a look
        at them costs one comparison per key unless some now fit; one-node
        shapes (a few per group) are asked one by one.
        """
        parked = self._parked
        if not parked or (memo.dropped == self._parked_seen and not self._parked_stale):
            return  # no verdict weakened and no parked head left its queue since the last look
        self._parked_seen = memo.dropped
        stale = self._parked_stale
        self._parked_stale = False
        shapes = self._parked_shape
        if stale or sum(map(len, self._parked_spans.values())) > 4 * len(parked) + 64:
            self._parked_spans = {}  # rebuilt below from the heads that stay parked
            stale = True
        verdicts: dict[Shape, bool] = {}  # parked heads of several groups often share a shape
        for key, entry in list(parked.items()):
            shape = shapes[key]
            spanning = shape[0] > shape[4] and shape[0] > 1
            if spanning and not stale:
                continue  # looked at below, per capacity key
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
            blocked = verdicts.get(shape)
            if blocked is None:
                blocked = verdicts[shape] = memo.blocked(shape, True)
            if not blocked:
                del parked[key]
                heapq.heappush(self._heads, entry)
            elif stale:
                self._park_span(key, entry, shape)
        capacity = memo.capacity
        for cap_key, spans in self._parked_spans.items():
            fit = capacity.get(cap_key)
            while spans and (fit is None or -spans[-1][0] <= fit):
                _, seq, key = spans.pop()
                held = parked.get(key)
                if held is None or held[1] != seq:
                    continue  # left the parked heads already
                del parked[key]
                queue = self._queues.get(key)
                if queue is not None and queue.filed == seq:
                    heapq.heappush(self._heads, held)

    def _parked_first(self, share: float) -> tuple[tuple[float, int, _Key], TaskRecord] | None:
        """The highest-priority parked head of a group within ``share`` (INF: any group)."""
        best: tuple[tuple[float, int, _Key], TaskRecord] | None = None
        usage = self._group_usage
        for key, entry in self._parked.items():
            if best is not None and best[0] < entry:
                continue
            queue = self._queues.get(key)
            head = queue.peek() if queue is not None else None
            task = self._tasks.get(head[2]) if head is not None else None
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

    def _memo_for_pass(self) -> PassMemo:
        """Last pass's verdicts minus what the nodes freed since then could satisfy."""
        self._catch_up()
        return self._memo

    def _all_blocked(self, memo: PassMemo, aside: set[_Key]) -> bool:
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

    def _top(self) -> TaskRecord | None:
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

    def _try_newcomer(self, task: TaskRecord, out: list[Instruction]) -> None:
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
        best = queue.peek()
        if best is None or best[2] != task.event.task_id:
            return  # an earlier task of its queue is waiting for the same resources
        ok = True
        blocked = self._tasks.get(self._first_blocked) if self._first_blocked is not None else None
        if blocked is not None and (-blocked.event.priority, blocked.seq) < (-task.event.priority, task.seq):
            self._reserve_for(blocked)
            reservation = self.reservation
            ok = reservation is not None and self.now + task.estimate <= reservation.start
        slots = self._place(task, ok, PassMemo())
        if slots is None:
            if blocked is None or (-task.event.priority, task.seq) < (-blocked.event.priority, blocked.seq):
                self._first_blocked = task.event.task_id
            return
        queue.pop()
        self._start(task, slots, out)
        nxt = self._head(key)
        if nxt is not None:
            heapq.heappush(self._heads, (-nxt.event.priority, nxt.seq, key))
            queue.filed = nxt.seq

    def _start(self, task: TaskRecord, slots: tuple[RankSlot, ...], out: list[Instruction]) -> None:
        tid = task.event.task_id
        self._dequeue(tid)
        if task.shape[2]:
            self._gpu_tasks += 1
        task.slots = slots
        task.end = self.now + task.estimate
        self._running[tid] = task
        self._ends.add(task)
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

    # ------------------------------------------------- placement, reservation
    def _place(self, task: TaskRecord, reserved_ok: bool, memo: PassMemo) -> tuple[RankSlot, ...] | None:
        slots = self._placer.place(task, reserved_ok, memo)
        if slots is not None and self.reservation is not None and self.reservation.task_id == task.event.task_id:
            self._clear_reservation()
        return slots

    def _clear_reservation(self) -> None:
        if self.reservation is not None:
            for node in self.reservation.nodes:
                self.index.set_pool(node, OPEN)
            self.reservation = None

    def _reserve_for(self, task: TaskRecord) -> None:
        """Hold nodes for ``task`` from the earliest time the running tasks' estimates free them.

        Running tasks are released in order of estimated end until the task
        fits; if that takes more than ``walk_limit`` tasks or ``walk_nodes`` of
        their nodes (a whole-node request on a busy pilot), the nodes that become
        entirely free first are held instead — a later but still valid start.
        """
        current = self.reservation
        if current is not None and self.now < current.start and current.task_id in self._tasks:
            return  # the holder keeps its reservation until it starts (or the estimate is overrun)
        self._clear_reservation()
        start, chosen = earliest_start(task, self.index, self._ends, self._running, self.now,
                                       self.walk_limit, self.walk_nodes)
        if not chosen:
            return
        for node in chosen:
            self.index.set_pool(node, RESERVED)
        self.reservation = Reservation(task.event.task_id, start, tuple(chosen))
        logger.debug("reserved %d node(s) for %s from t=%s", len(chosen), task.event.task_id, start)
