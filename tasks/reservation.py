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
from dataclasses import dataclass
from typing import Iterator

from .node_index import INF, OPEN, NodeIndex
from .scheduler_types import TaskRecord


@dataclass
class Reservation:
    """The EASY reservation: ``task_id`` may start at ``start`` on ``nodes``."""

    task_id: str
    start: float
    nodes: tuple[int, ...]


class Ends:
    """Running tasks by estimated end (a lazy heap) and when each node's running tasks all end."""

    def __init__(self, nodes: int, start_time: float) -> None:
        self.nodes = nodes
        self._heap: list[tuple[float, int, str]] = []  # running tasks with an estimate
        self._unknown: dict[str, None] = {}            # running tasks without an estimate
        self._node_tasks: list[dict[str, float]] = [{} for _ in range(nodes)]
        self._node_end = [start_time] * nodes          # when each node's running tasks all end (estimates)
        self._free_at = [(start_time, node) for node in range(nodes)]  # lazy heap over _node_end

    def add(self, task: TaskRecord) -> None:
        tid, end = task.event.task_id, task.end
        if end == INF:
            self._unknown[tid] = None
        else:
            heapq.heappush(self._heap, (end, task.seq, tid))
        node_end = self._node_end
        for node, _, _, _ in task.alloc:
            self._node_tasks[node][tid] = end
            if end > node_end[node]:
                node_end[node] = end
                heapq.heappush(self._free_at, (end, node))

    def remove(self, task: TaskRecord, now: float, running: dict[str, TaskRecord]) -> None:
        """Forget ``task`` (already out of ``running``, the tasks still running)."""
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
        elif len(self._heap) > 64 and len(self._heap) > 2 * len(running):
            self._heap = [(t.end, t.seq, i) for i, t in running.items() if t.end < INF]
            heapq.heapify(self._heap)

    def in_order(self, running: dict[str, TaskRecord]) -> Iterator[TaskRecord]:
        """Running tasks by estimated end (without copying the heap), unknown ends last."""
        heap = self._heap
        while heap and (heap[0][2] not in running or running[heap[0][2]].seq != heap[0][1]):
            heapq.heappop(heap)  # finished tasks: drop them for good
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (end, seq, tid), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            task = running.get(tid)
            if task is not None and task.seq == seq:
                yield task
        for tid in self._unknown:
            yield running[tid]

    def free_times(self) -> Iterator[tuple[float, int]]:
        """(time the node's running tasks are all estimated to end, node), earliest first."""
        heap = self._free_at
        node_end = self._node_end
        if len(heap) > 4 * self.nodes + 1024:
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
                   walk_limit: int) -> tuple[float, list[int]]:
    """When and on which nodes ``task`` can start if the running tasks end as estimated.

    Running tasks are released in order of estimated end until the task
    fits; if that takes more than ``walk_limit`` tasks (a whole-node request
    on a busy pilot), the nodes that become entirely free first are chosen
    instead — a later but still valid start.  No nodes: nothing running frees
    enough.
    """
    ranks, cores, gpus, memory, per_node = task.shape
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
    for walked, ending in enumerate(ends.in_order(running)):
        if walked >= walk_limit:
            break
        _, run_cores, run_gpus, run_memory, _ = ending.shape
        for node, count, _, _ in ending.alloc:  # per node, not per rank
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
            start = ending.end
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
        empty = index.ranks_fitting(index.max_cores, index.max_gpus, index.memory_per_node,
                                    cores, gpus, memory, per_node)
        left = ranks
        for end, node in ends.free_times():
            if node in extra and extra[node] == [-1]:
                continue
            extra[node] = [-1]  # marks a node already chosen (the heap may repeat entries)
            chosen.append(node)
            left -= empty
            start = max(end, now)
            if left <= 0:
                break
    return start, chosen
