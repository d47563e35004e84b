"""Where a task's ranks go: node choice and the per-rank slots.

One node when the ranks fit on one (best fit: GPU requests pack GPUs, CPU
requests pack cores), else fewest nodes, taking the nodes with the most room
first and only nodes with room for at least
:meth:`~hetflow.tasks.node_index.NodeIndex.least` ranks (a quarter of an empty
node by default), so an MPI task is not scattered a rank or two per node over a
fragmented pilot: it waits, gets the reservation, and starts on few nodes; nodes
in ``preferred_nodes`` (where the task's inputs are) win among those that fit
but are never waited for.  The search is a few big-int
operations on the free-capacity buckets of
:class:`~hetflow.tasks.node_index.NodeIndex`, so it does not grow with the
node count for single-node requests.  A placement records what the task holds
per node (:attr:`TaskRecord.alloc`), so release and the reservation walk cost
one step per node, not per rank, and a many-rank take on a node is a memoised
look-up (same free masks, same choice).
"""

from __future__ import annotations

from .node_index import OPEN, RESERVED, NodeIndex
from .scheduler_memo import PassMemo
from .scheduler_types import Held, RankSlot, TaskRecord

CACHE_RANKS = 8        # takes of at least this many ranks on a node keep their RankSlots for reuse
CACHE_SLOTS = 1 << 20  # ... up to this many RankSlots in all (then the cache restarts)


def _first(item: tuple[int, int, int, int]) -> int:
    return item[0]


class Placer:
    """Chooses nodes and cores for a task and takes them from the index."""

    def __init__(self, index: NodeIndex, usable_cores: tuple[int, ...]) -> None:
        self.index = index
        self._usable = usable_cores
        self._core_slots: dict[int, dict[int, RankSlot]] = {}  # node -> core -> RankSlot(node, (core,))
        self._slot_cache: dict[tuple[int, ...], tuple[RankSlot, ...]] = {}
        self._cached_slots = 0

    def place(self, task: TaskRecord, reserved_ok: bool, memo: PassMemo) -> tuple[RankSlot, ...] | None:
        ranks, cores, gpus, memory, per_node = task.shape
        index = self.index
        pools = (OPEN, RESERVED) if reserved_ok else (OPEN,)
        preferred = task.event.preferred_nodes
        single = ranks <= per_node
        if preferred:
            near = self._preferred(task, pools)
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
        # every node of a bucket has the same free cores and GPUs: one fit for all (memory aside);
        # buckets with room for fewer than `least` ranks count nothing (NodeIndex.span_fit)
        least = index.least(cores, gpus, per_node)
        buckets: list[tuple[int, int, int, int]] = []
        for pool in pools:
            for fg, fc in index.keys(pool, cores, gpus):
                fit = index.span_fit(fc, fg, None, cores, gpus, 0, per_node, least)
                if fit:
                    buckets.append((-fit, fg, fc, pool))
        buckets.sort(key=_first)  # most room first; stable, so pool and bucket order break ties
        check_memory = bool(memory) and index.mem is not None
        for neg_fit, fg, fc, pool in buckets:
            bucket_fit = -neg_fit
            for node in index.bucket(pool, fg, fc):
                fit = index.node_span_fit(node, cores, gpus, memory, per_node) if check_memory else bucket_fit
                if fit:
                    take = fit if fit < left else left
                    plan.append((node, take))
                    left -= take
                    if not left:
                        return self._slots(plan, task)
        return None

    def _preferred(self, task: TaskRecord, pools: tuple[int, ...]) -> tuple[RankSlot, ...] | None:
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
        spans = [(index.node_span_fit(node, cores, gpus, memory, per_node), node) for _, _, node, _ in fits]
        for fit, node in sorted(spans, key=lambda f: -f[0]):
            if fit and left:
                plan.append((node, min(fit, left)))
                left -= plan[-1][1]
                used.add(node)
        for pool in pools:
            for fg, fc in index.keys(pool, cores, gpus):
                for node in index.bucket(pool, fg, fc):
                    if left and node not in used:
                        fit = index.node_span_fit(node, cores, gpus, memory, per_node)
                        if fit:
                            plan.append((node, min(fit, left)))
                            left -= plan[-1][1]
                    if not left:
                        return self._slots(plan, task)
        return None

    def _slots(self, plan: list[tuple[int, int]], task: TaskRecord) -> tuple[RankSlot, ...]:
        _, cores, gpus, memory, _ = task.shape
        slots: list[RankSlot] = []
        alloc: list[Held] = []
        index = self.index
        cache = self._slot_cache
        single_core = cores == 1 and not gpus
        for node, count in plan:
            if single_core:  # one core per rank (MPI dataframe ranks): one shared RankSlot per node and core
                row = self._core_slots.get(node)
                if row is None:
                    row = self._core_slots[node] = {core: RankSlot(node, (core,)) for core in self._usable}
                if count < CACHE_RANKS or index.cmask[node] != index.full_cores:
                    # a node some cores of which are busy: its free mask rarely repeats, so no take memo
                    # and no per-rank tuples (an idle node's masks repeat: below, the memo hits)
                    ids, cmask = index.take_cores(node, count, memory)
                    alloc.append((node, count, cmask, 0))
                    for core in ids:
                        slots.append(row[core])
                    continue
                ranks, cmask, gmask = index.take(node, count, cores, gpus, memory)
                alloc.append((node, count, cmask, gmask))
                for core_ids, _ in ranks:
                    slots.append(row[core_ids[0]])
                continue
            whole = not gpus and count * cores == index.fc[node]  # every free core: the GPU mask does not matter
            before = (node, index.cmask[node], -1 if whole else index.gmask[node], count, cores, gpus)
            ranks, cmask, gmask = index.take(node, count, cores, gpus, memory)
            alloc.append((node, count, cmask, gmask))
            if count < CACHE_RANKS:
                for core_ids, gpu_ids in ranks:
                    slots.append(RankSlot(node, core_ids, gpu_ids))
                continue
            # many ranks on one node (an MPI task's whole node): the same free masks give the same
            # slots, so build them once per node and state
            cached = cache.get(before)
            if cached is None:
                self._cached_slots += count
                if self._cached_slots > CACHE_SLOTS:
                    cache.clear()
                    self._cached_slots = count
                cached = cache[before] = tuple(RankSlot(node, core_ids, gpu_ids) for core_ids, gpu_ids in ranks)
            slots += cached
        task.alloc = tuple(alloc)
        return tuple(slots)

