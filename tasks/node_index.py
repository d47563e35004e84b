"""Free-capacity index of a pilot's nodes, used by :mod:`hetflow.tasks.scheduler`.

Per-node state lives in flat lists indexed by node number: a bitmask of free
core ids, a bitmask of free GPU ids, their counts, and free memory.  Nodes are
also filed in *buckets* keyed by ``(free GPUs, free cores)``; for every GPU
level a bitmask of the non-empty core levels lets a best-fit search jump to the
smallest bucket that fits with a shift and a lowest-set-bit, so finding a node
costs ``O(gpus_per_node)`` big-int operations whatever the node count.

There are three *pools*: ``OPEN``, ``RESERVED`` and ``LOST``.  Nodes held for
the scheduler's reservation (EASY backfill) sit in ``RESERVED``; searches say
which pools they may use, and none uses ``LOST``: a node lost by the pilot
(:meth:`NodeIndex.lose`) stays there, and its free capacity no longer counts.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterator

OPEN = 0
RESERVED = 1
LOST = 2
INF = float("inf")
TAKE_MEMO = 1 << 16  # remembered (free masks, request) -> choice entries before the memo restarts

# what a take chose: ((core ids, GPU ids) per rank, taken core mask, taken GPU mask)
Taken = tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], int, int]


def _bits(mask: int) -> Iterator[int]:
    """Set bit positions of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class NodeIndex:
    """Free cores/GPUs/memory of every node, indexed by free capacity."""

    def __init__(self, nodes: int, usable_cores: tuple[int, ...], gpus: int,
                 gpu_cores: tuple[tuple[int, ...], ...], memory: int | None, span_fraction: float = 0.0) -> None:
        self.nodes = nodes
        self.span_fraction = span_fraction
        self.max_cores = len(usable_cores)
        self.max_gpus = gpus
        full_cores = 0
        for core in usable_cores:
            full_cores |= 1 << core
        self.full_cores = full_cores
        self.full_gpus = (1 << gpus) - 1
        near = [0] * gpus
        for gpu, cores in enumerate(gpu_cores[:gpus]):
            for core in cores:
                near[gpu] |= 1 << core
            near[gpu] &= full_cores
        self.near = near
        # cores near any GPU in a GPU mask, for every mask (2**gpus entries; gpus <= 16)
        self._near_of: list[int] | None = None
        if gpus <= 12:
            table = [0] * (1 << gpus)
            for mask in range(1, 1 << gpus):
                low = mask & -mask
                table[mask] = table[mask ^ low] | near[low.bit_length() - 1]
            self._near_of = table
        self.cmask = [full_cores] * nodes
        self.gmask = [self.full_gpus] * nodes
        self.fc = [self.max_cores] * nodes
        self.fg = [gpus] * nodes
        self.memory_per_node = memory
        self.mem: list[int] | None = None if memory is None else [memory] * nodes
        self.pool = [OPEN] * nodes
        width = self.max_cores + 1
        self._width = width
        self._buckets: list[list[dict[int, None]]] = [
            [dict() for _ in range((gpus + 1) * width)] for _ in (OPEN, RESERVED, LOST)]
        self._levels: list[list[int]] = [[0] * (gpus + 1) for _ in (OPEN, RESERVED, LOST)]
        full = self._buckets[OPEN][gpus * width + self.max_cores]
        for node in range(nodes):
            full[node] = None
        self._levels[OPEN][gpus] = 1 << self.max_cores
        # cores a CPU-only request must leave on a node for each of its free GPUs (the
        # scheduler sets 1 while GPU work is queued or running, so GPUs are never stranded)
        self.guard = 0
        self.free_cores_total = nodes * self.max_cores
        self.free_gpus_total = nodes * gpus
        # nodes whose free capacity grew, or that returned to OPEN, since the scheduler last looked:
        # node -> (free cores, free GPUs, pool) before the first such change
        self.grown: dict[int, tuple[int, int, int]] = {}
        self._taken: dict[tuple[int, int, int, int, int], Taken] = {}
        self._least: dict[tuple[int, int, int, int], int] = {}  # (cores, GPUs, per node, guard) -> least

    # ------------------------------------------------------------- buckets
    def _unfile(self, node: int) -> None:
        pool, fg, fc = self.pool[node], self.fg[node], self.fc[node]
        bucket = self._buckets[pool][fg * self._width + fc]
        del bucket[node]
        if not bucket:
            self._levels[pool][fg] &= ~(1 << fc)

    def _file(self, node: int) -> None:
        pool, fg, fc = self.pool[node], self.fg[node], self.fc[node]
        bucket = self._buckets[pool][fg * self._width + fc]
        if not bucket:
            self._levels[pool][fg] |= 1 << fc
        bucket[node] = None

    def _move(self, node: int, cores: int, gpus: int) -> None:
        """Change ``node``'s free counts by ``cores`` and ``gpus`` and re-file it (the hot path of
        take and give: one bucket move, no separate unfile/file calls)."""
        pool, fg, fc = self.pool[node], self.fg[node], self.fc[node]
        width = self._width
        buckets, levels = self._buckets[pool], self._levels[pool]
        bucket = buckets[fg * width + fc]
        del bucket[node]
        if not bucket:
            levels[fg] &= ~(1 << fc)
        fc += cores
        fg += gpus
        self.fc[node] = fc
        self.fg[node] = fg
        if pool != LOST:
            self.free_cores_total += cores
            self.free_gpus_total += gpus
        bucket = buckets[fg * width + fc]
        if not bucket:
            levels[fg] |= 1 << fc
        bucket[node] = None

    def set_pool(self, node: int, pool: int) -> None:
        """Move ``node`` to ``pool`` (``OPEN`` or ``RESERVED``); a lost node stays lost."""
        if self.pool[node] != pool and self.pool[node] != LOST:
            if pool == OPEN and node not in self.grown:
                self.grown[node] = (self.fc[node], self.fg[node], self.pool[node])
            self._unfile(node)
            self.pool[node] = pool
            self._file(node)

    def lose(self, node: int) -> None:
        """Take ``node`` out of every search for good: what it has free, and gets back, counts nothing."""
        if self.pool[node] == LOST:
            return
        self.grown.pop(node, None)
        self._unfile(node)
        self.pool[node] = LOST
        self._file(node)
        self.free_cores_total -= self.fc[node]
        self.free_gpus_total -= self.fg[node]

    def near_of(self, gpu_mask: int) -> int:
        if self._near_of is not None:
            return self._near_of[gpu_mask]
        out = 0
        for gpu in _bits(gpu_mask):
            out |= self.near[gpu]
        return out

    # ------------------------------------------------------------- fitting
    def ranks_fitting(self, fc: int, fg: int, mem: int | None, cores: int, gpus: int,
                      memory: int, per_node: int) -> int:
        if not gpus and self.guard:
            fc -= self.guard * fg
            if fc <= 0:
                return 0
        fit = fc // cores
        if gpus and fg // gpus < fit:
            fit = fg // gpus
        if memory and mem is not None and mem // memory < fit:
            fit = mem // memory
        return fit if fit < per_node else per_node

    def least(self, cores: int, gpus: int, per_node: int) -> int:
        """Fewest ranks of this shape a task spanning nodes puts on a node (bar its last):
        ``span_fraction`` of what an empty node fits, at least 1.  Memory is not counted,
        so one figure serves every memory request of the shape."""
        key = (cores, gpus, per_node, self.guard)
        least = self._least.get(key)
        if least is None:
            empty = self.ranks_fitting(self.max_cores, self.max_gpus, None, cores, gpus, 0, per_node)
            least = self._least[key] = max(1, math.ceil(empty * self.span_fraction))
        return least

    def span_fit(self, fc: int, fg: int, mem: int | None, cores: int, gpus: int, memory: int,
                 per_node: int, least: int = 0) -> int:
        """Ranks a spanning task may put on a node with this much free: 0 unless at least
        :meth:`least` fit by cores and GPUs (memory then only lowers the count).  Loops over
        many nodes or buckets pass ``least``, looked up once."""
        fit = self.ranks_fitting(fc, fg, None, cores, gpus, 0, per_node)
        if fit < (least or self.least(cores, gpus, per_node)):
            return 0
        if memory and mem is not None and mem // memory < fit:
            fit = mem // memory
        return fit

    def node_span_fit(self, node: int, cores: int, gpus: int, memory: int, per_node: int) -> int:
        mem = None if self.mem is None else self.mem[node]
        return self.span_fit(self.fc[node], self.fg[node], mem, cores, gpus, memory, per_node)

    def node_fit(self, node: int, cores: int, gpus: int, memory: int, per_node: int) -> int:
        mem = None if self.mem is None else self.mem[node]
        return self.ranks_fitting(self.fc[node], self.fg[node], mem, cores, gpus, memory, per_node)

    def best_node(self, cores: int, gpus: int, memory: int, pools: tuple[int, ...],
                  gpu_first: bool, scan_limit: int = 64) -> int | None:
        """A node with at least ``cores`` free cores, ``gpus`` GPUs and ``memory``, best fit.

        Best fit means fewest free GPUs then cores when ``gpu_first`` (GPU
        requests pack GPUs), fewest free cores then GPUs otherwise.  With a
        memory request, at most ``scan_limit`` candidates are examined.
        """
        if cores > self.max_cores or gpus > self.max_gpus:
            return None
        found: list[tuple[int, int, int]] = []  # (fg, fc, pool) per pool, best first
        for pool in pools:
            levels = self._levels[pool]
            best: tuple[int, int] | None = None
            guard = 0 if gpus else self.guard
            for fg in range(gpus, self.max_gpus + 1):
                need = cores + guard * fg
                above = levels[fg] >> need
                if not above:
                    continue
                fc = need + ((above & -above).bit_length() - 1)
                if gpu_first:
                    best = (fg, fc)
                    break
                if best is None or fc < best[1]:
                    best = (fg, fc)
            if best is not None:
                found.append((best[0], best[1], pool))
        if not found:
            return None
        found.sort(key=(lambda f: (f[0], f[1], f[2])) if gpu_first else (lambda f: (f[1], f[0], f[2])))
        if not memory or self.mem is None:
            fg, fc, pool = found[0]
            return next(iter(self._buckets[pool][fg * self._width + fc]))
        mem = self.mem
        scanned = 0
        for _, _, pool in found:
            for key in self.keys(pool, cores, gpus):
                if not gpus and key[1] - self.guard * key[0] < cores:
                    continue
                for node in self._buckets[pool][key[0] * self._width + key[1]]:
                    if mem[node] >= memory:
                        return node
                    scanned += 1
                    if scanned >= scan_limit:
                        return None
        return None

    def keys(self, pool: int, cores: int, gpus: int) -> Iterator[tuple[int, int]]:
        """Non-empty ``(free GPUs, free cores)`` buckets of ``pool`` with at least the given free."""
        levels = self._levels[pool]
        for fg in range(gpus, self.max_gpus + 1):
            for fc in _bits(levels[fg] >> cores):
                yield fg, fc + cores

    def bucket(self, pool: int, fg: int, fc: int) -> dict[int, None]:
        return self._buckets[pool][fg * self._width + fc]

    def capacity(self, pools: tuple[int, ...], cores: int, gpus: int, per_node: int) -> int:
        """Ranks of this shape a spanning task could place on the given pools right now (memory
        not counted; nodes where fewer than :meth:`least` fit count nothing)."""
        least = self.least(cores, gpus, per_node)
        total = 0
        for pool in pools:
            for fg, fc in self.keys(pool, cores, gpus):
                total += self.span_fit(fc, fg, None, cores, gpus, 0, per_node, least) * len(self.bucket(pool, fg, fc))
        return total

    # ------------------------------------------------------------ allocate
    def take(self, node: int, ranks: int, cores: int, gpus: int, memory: int) -> Taken:
        """Take ``ranks`` × (``cores`` cores, ``gpus`` GPUs) on ``node``.

        Returns ``(ranks, taken core mask, taken GPU mask)`` where ``ranks`` is
        ``[(core ids, GPU ids)]`` per rank.  GPU ranks get the free GPUs with
        the most free nearby cores and those cores first; CPU ranks take cores
        away from free GPUs first, so a node can keep feeding its GPUs while it
        runs CPU work.  The choice depends only on the node's free masks and the
        request (every node has the same topology), so it is memoised: a
        many-rank task on whole nodes costs one dictionary look-up per node.
        """
        cmask, gmask = self.cmask[node], self.gmask[node]
        key = (cmask, gmask, ranks, cores, gpus)
        taken = self._taken.get(key)
        if taken is None:
            if len(self._taken) >= TAKE_MEMO:
                self._taken.clear()
            taken = self._taken[key] = self._choose(cmask, gmask, ranks, cores, gpus)
        self.cmask[node] = cmask & ~taken[1]
        self.gmask[node] = gmask & ~taken[2]
        self._move(node, -ranks * cores, -ranks * gpus)
        if memory and self.mem is not None:
            self.mem[node] -= ranks * memory
        return taken

    def take_cores(self, node: int, count: int, memory: int) -> tuple[list[int], int]:
        """Take ``count`` one-core CPU ranks on ``node``: their core ids, ascending, and the taken mask.

        The same choice as :meth:`take` (cores away from free GPUs first, then
        spread over the GPUs' regions) without the memo or per-rank tuples:
        the hot path of MPI ranks spread a few per node over a busy pilot,
        where free masks rarely repeat.
        """
        cmask = self.cmask[node]
        ids = self._cpu_cores(cmask, self.gmask[node], count)
        taken = 0
        for core in ids:
            taken |= 1 << core
        self.cmask[node] = cmask & ~taken
        self._move(node, -count, 0)
        if memory and self.mem is not None:
            self.mem[node] -= count * memory
        return ids, taken

    def _choose(self, cmask: int, gmask: int, ranks: int, cores: int, gpus: int) -> Taken:
        start_c, start_g = cmask, gmask
        out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        if not gpus:  # CPU ranks: pick all cores at once, then deal them out in order
            ids = self._cpu_cores(cmask, gmask, ranks * cores)
            for core in ids:
                cmask &= ~(1 << core)
            out = [(tuple(ids[r * cores:(r + 1) * cores]), ()) for r in range(ranks)]
            ranks_left = 0
        else:
            ranks_left = ranks
        for _ in range(ranks_left):
            chosen_g = 0
            if gpus:
                order = sorted(_bits(gmask), key=lambda g: -(self.near[g] & cmask).bit_count())
                for gpu in order[:gpus]:
                    chosen_g |= 1 << gpu
                gmask &= ~chosen_g
            tiers = (cmask & self.near_of(chosen_g), cmask & ~self.near_of(gmask), cmask)
            chosen_c = 0
            need = cores
            for tier in tiers:
                tier &= ~chosen_c
                while need and tier:
                    low = tier & -tier
                    chosen_c |= low
                    tier ^= low
                    need -= 1
                if not need:
                    break
            cmask &= ~chosen_c
            out.append((tuple(_bits(chosen_c)), tuple(_bits(chosen_g))))
        return tuple(out), start_c & ~cmask, start_g & ~gmask

    def _cpu_cores(self, cmask: int, gmask: int, count: int) -> list[int]:
        """``count`` free cores for CPU ranks, ascending: cores away from free GPUs first (lowest
        ids), then, if those run out, cores near free GPUs taken evenly, keeping some by each GPU."""
        away = cmask & ~self.near_of(gmask)
        ids: list[int] = []
        rest = away
        while rest and len(ids) < count:
            low = rest & -rest
            ids.append(low.bit_length() - 1)
            rest ^= low
        if len(ids) < count:
            ids += self._spread(cmask & ~away, count - len(ids), gmask)
            ids.sort()
        return ids

    def _spread(self, cmask: int, count: int, gmask: int) -> list[int]:
        """``count`` cores of ``cmask``, each from the free GPU whose nearby cores are most plentiful."""
        if count >= cmask.bit_count():
            return list(_bits(cmask))
        heap = [(-(self.near[g] & cmask).bit_count(), g, self.near[g] & cmask) for g in _bits(gmask)]
        heapq.heapify(heap)
        taken = 0
        out: list[int] = []
        while len(out) < count and heap:
            neg, gpu, region = heapq.heappop(heap)
            region &= ~taken
            if not region:
                continue
            if -neg != region.bit_count():  # another region shared a core: re-file with its true size
                heapq.heappush(heap, (-region.bit_count(), gpu, region))
                continue
            low = region & -region
            taken |= low
            out.append(low.bit_length() - 1)
            region ^= low
            if region:
                heapq.heappush(heap, (-region.bit_count(), gpu, region))
        if len(out) < count:
            out += list(_bits(cmask & ~taken))[:count - len(out)]
        return out

    def give(self, node: int, cores: int, gpus: int, core_count: int, gpu_count: int, memory: int) -> None:
        """Return cores and GPUs (bitmasks, with their counts) and memory to ``node``."""
        if node not in self.grown and self.pool[node] != LOST:
            self.grown[node] = (self.fc[node], self.fg[node], self.pool[node])
        self.cmask[node] |= cores
        self.gmask[node] |= gpus
        self._move(node, core_count, gpu_count)
        if memory and self.mem is not None:
            self.mem[node] += memory
