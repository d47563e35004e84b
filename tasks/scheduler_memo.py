"""What a scheduling pass learnt cannot fit, carried from pass to pass.

Resources only shrink during a pass, so a verdict ("no single node has this
much", "at most this many ranks of a shape fit") holds for the rest of it.
Between passes :meth:`PassMemo.refresh` drops the verdicts that the nodes
whose free capacity grew could now overturn, so a pass does not search again
for what it already knows is not there.
"""

from __future__ import annotations

from .node_index import OPEN, NodeIndex
from .scheduler_types import Shape


class PassMemo:
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
        fits = index.span_fit
        least = index.least(cores, gpus, per_node)
        delta = 0
        for node, (fc, fg, pool) in grown.items():
            if ok or index.pool[node] == OPEN:
                delta += fits(index.fc[node], index.fg[node], None, cores, gpus, 0, per_node, least)
            if ok or pool == OPEN:
                delta -= fits(fc, fg, None, cores, gpus, 0, per_node, least)
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

    def blocked(self, shape: Shape, reserved_ok: bool) -> bool:
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


