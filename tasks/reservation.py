"""The EASY reservation: when and where the first blocked task can start.

:class:`Ends` keeps the running tasks by estimated end, and every node's
latest estimated end.  :func:`earliest_start` releases the running tasks in
order of estimated end, on paper, until the blocked task fits, and returns
that time and the nodes it would use; the scheduler holds those nodes
(``RESERVED``) and lets later tasks use them only if their estimates end
before that time (backfill).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterator

from .node_index import INF, LOST, OPEN, NodeIndex
from .scheduler_types import TaskRecord


@dataclass
class Reservation:
    """The EASY reservation: ``task_id`` may start at ``start`` on ``nodes``."""

    task_id: str
    start: float
    nodes: tuple[int, ...]


class Ends:
    """Running tasks by estimated end, and when each node's running tasks all end.

    Estimated ends are filed in one-second buckets (a dict per whole second,
    found through a small lazy heap of the bucket seconds), so a task that
    finishes before its estimate leaves nothing behind: the walk in order of
    estimated end meets running tasks only.  (A lazy heap of all ends left
    several stale entries per live one ahead of the walk on a busy pilot,
    since most tasks end before their estimate.)
    """

    def __init__(self, nodes: int, start_time: float) -> None:
        self.nodes = nodes
        self._buckets: dict[int, dict[str, tuple[float, int]]] = {}  # whole second -> task id -> (end, seq)
        self._seconds: list[int] = []                  # lazy heap of bucket seconds
        self._unknown: dict[str, None] = {}            # running tasks without an estimate
        self._node_tasks: list[dict[str, float]] = [{} for _ in range(nodes)]
        self._node_end = [start_time] * nodes          # when each node's running tasks all end (estimates)
        self._free_at = [(start_time, node) for node in range(nodes)]  # lazy heap over _node_end

    def add(self, task: TaskRecord) -> None:
        tid, end = task.event.task_id, task.end
        if end == INF:
            self._unknown[tid] = None
        else:
            second = math.floor(end)
            bucket = self._buckets.get(second)
            if bucket is None:
                bucket = self._buckets[second] = {}
                heapq.heappush(self._seconds, second)
            bucket[tid] = (end, task.seq)
        node_end = self._node_end
        for node, _, _, _ in task.alloc:
            self._node_tasks[node][tid] = end
            if end > node_end[node]:
                node_end[node] = end
                heapq.heappush(self._free_at, (end, node))

    def remove(self, task: TaskRecord, now: float) -> None:
        tid = task.event.task_id
        node_end = self._node_end
        for node, _, _, _ in task.alloc:
            on_node = self._node_tasks[node]
            del on_node[tid]
            if on_node and task.end < node_end[node]:
                continue  # another task on the node ends last: nothing changes
            end = max(on_node.values(), default=now)
            if end != node_end[node]:
                node_end[node] = end
                heapq.heappush(self._free_at, (end, node))
        if task.end == INF:
            del self._unknown[tid]
            return
        second = math.floor(task.end)
        bucket = self._buckets[second]
        del bucket[tid]
        if not bucket:
            del self._buckets[second]  # its second stays in the heap until a walk or a rebuild drops it
            if len(self._seconds) > 64 and len(self._seconds) > 2 * len(self._buckets):
                self._seconds = list(self._buckets)
                heapq.heapify(self._seconds)

    def in_order(self, running: dict[str, TaskRecord]) -> Iterator[TaskRecord]:
        """Running tasks by estimated end (then submission order), unknown ends last."""
        heap, buckets = self._seconds, self._buckets
        while heap and heap[0] not in buckets:
            heapq.heappop(heap)  # emptied buckets
        seen: set[int] = set()  # a second emptied and filed again is in the heap twice
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            second, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            bucket = buckets.get(second)
            if bucket is None or second in seen:
                continue
            seen.add(second)
            for _, _, tid in sorted([(end, seq, tid) for tid, (end, seq) in bucket.items()]):
                yield running[tid]
        for tid in self._unknown:
            yield running[tid]

    def free_times(self) -> Iterator[tuple[float, int]]:
        """(time the node's running tasks are all estimated to end, node), earliest first."""
        heap = self._free_at
        node_end = self._node_end
        if len(heap) > 16 * self.nodes + 1024:
            heap[:] = [(end, node) for node, end in enumerate(node_end)]
            heapq.heapify(heap)
        while heap and node_end[heap[0][1]] != heap[0][0]:
            heapq.heappop(heap)  # superseded entries never become valid again (a change pushes anew)
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (end, node), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if node_end[node] == end:
                yield end, node


def earliest_start(task: TaskRecord, index: NodeIndex, ends: Ends, running: dict[str, TaskRecord], now: float,
                   walk_limit: int, walk_nodes: int) -> tuple[float, list[int]]:
    """When and on which nodes ``task`` can start if the running tasks end as estimated.

    Running tasks are released in order of estimated end until the task
    fits; if that takes more than ``walk_limit`` tasks or ``walk_nodes``
    node steps (one per node a released task held: an MPI task spread over
    hundreds of nodes costs hundreds), the nodes that become entirely free
    first are chosen instead — a later but still valid start.  No nodes:
    nothing running frees enough.

    The node budget bounds the cost of a walk on a fragmented pilot; a larger
    budget placed no better (docs/benchmarks.md, "Scheduler"): an exact but
    late-found start allows no more backfill than the emptied-first one.
    """
    ranks, cores, gpus, memory, per_node = task.shape
    if ranks <= per_node:
        found = _walk_single(task, index, ends, running, walk_limit, walk_nodes)
        if found is not None:
            return found
        return _emptied_first(task, index, ends, now)
    extra: dict[int, list[int]] = {}
    total = index.capacity((OPEN,), cores, gpus, per_node)
    least = index.least(cores, gpus, per_node)

    def fit(node: int) -> int:
        if index.pool[node] == LOST:
            return 0
        add = extra.get(node, (0, 0, 0))
        mem = None if index.mem is None else index.mem[node] + add[2]
        return index.span_fit(index.fc[node] + add[0], index.fg[node] + add[1], mem,
                              cores, gpus, memory, per_node, least)

    start = INF
    for ending in _walk(ends, running, walk_limit, walk_nodes):
        _, run_cores, run_gpus, run_memory, _ = ending.shape
        for node, count, _, _ in ending.alloc:  # per node, not per rank
            before = fit(node)
            add = extra.setdefault(node, [0, 0, 0])
            add[0] += count * run_cores
            add[1] += count * run_gpus
            add[2] += count * run_memory
            total += fit(node) - before
        if total >= ranks:
            start = ending.end
            break
    else:
        return _emptied_first(task, index, ends, now)
    chosen: list[int] = []
    left = ranks
    for node in sorted(extra, key=lambda n: -fit(n)):
        room = fit(node)
        if left > 0 and room:
            chosen.append(node)
            left -= room
    for fg, fc in sorted(index.keys(OPEN, cores, gpus), reverse=True):
        if left <= 0:
            break
        for node in index.bucket(OPEN, fg, fc):
            if left <= 0:
                break
            room = 0 if node in extra else fit(node)
            if room:  # too little room counts nothing (NodeIndex.least)
                chosen.append(node)
                left -= room
    return start, chosen


def _walk(ends: Ends, running: dict[str, TaskRecord], walk_limit: int, walk_nodes: int) -> Iterator[TaskRecord]:
    """Running tasks by estimated end, at most ``walk_limit`` of them holding ``walk_nodes`` nodes in all."""
    budget = walk_nodes
    for walked, ending in enumerate(ends.in_order(running)):
        budget -= len(ending.alloc)
        if walked >= walk_limit or budget < 0:
            return
        yield ending


def _walk_single(task: TaskRecord, index: NodeIndex, ends: Ends, running: dict[str, TaskRecord],
                 walk_limit: int, walk_nodes: int) -> tuple[float, list[int]] | None:
    """The first node, in order of estimated ends, where a one-node ``task`` fits.

    This is the hot loop of a busy pilot (a walk may meet MPI tasks spread over
    hundreds of nodes), so it keeps per-node additions in plain dicts and tests
    the fit inline: ``ranks`` fit on a node when its free GPUs, cores (less the
    GPU core guard for CPU requests) and memory cover ``ranks`` times the request.
    """
    ranks, cores, gpus, memory, _ = task.shape
    need_c, need_g, need_m = ranks * cores, ranks * gpus, ranks * memory
    guard = 0 if gpus else index.guard
    fc, fg = index.fc, index.fg
    mem = index.mem if memory else None
    add_c: dict[int, int] = {}
    add_g: dict[int, int] = {}
    add_m: dict[int, int] = {}
    for ending in _walk(ends, running, walk_limit, walk_nodes):
        _, run_cores, run_gpus, run_memory, _ = ending.shape
        for node, count, _, _ in ending.alloc:  # per node, not per rank
            c = add_c[node] = add_c.get(node, 0) + count * run_cores
            g = fg[node]
            if run_gpus:
                extra = add_g[node] = add_g.get(node, 0) + count * run_gpus
                g += extra
            elif node in add_g:
                g += add_g[node]
            if mem is not None and run_memory:
                add_m[node] = add_m.get(node, 0) + count * run_memory
            if g < need_g or fc[node] + c - guard * g < need_c:
                continue
            if mem is not None and mem[node] + add_m.get(node, 0) < need_m:
                continue
            if index.pool[node] == LOST:
                continue
            return ending.end, [node]
    return None


def _emptied_first(task: TaskRecord, index: NodeIndex, ends: Ends, now: float) -> tuple[float, list[int]]:
    """The nodes whose running tasks all end first, enough of them for ``task`` on empty nodes."""
    ranks, cores, gpus, memory, per_node = task.shape
    empty = index.ranks_fitting(index.max_cores, index.max_gpus, index.memory_per_node,
                                cores, gpus, memory, per_node)
    start = INF
    chosen: list[int] = []
    seen: set[int] = set()  # the heap may repeat entries
    left = ranks
    for end, node in ends.free_times():
        if node in seen or index.pool[node] == LOST:
            continue
        seen.add(node)
        chosen.append(node)
        left -= empty
        start = max(end, now)
        if left <= 0:
            break
    return start, chosen
