"""Randomised invariant and differential checks of the scheduler (seeded; the seed is printed).

Random pilots (nodes, cores, reserved cores, GPUs and their nearby cores,
memory) and random task mixes are driven through the real scheduler with
simulated time.  After every event the test checks, against its own shadow
copy of what each running rank holds:

* no core or GPU is held twice, reserved cores are never handed out;
* every RankSlot matches its request (ranks, cores and GPUs per rank,
  ranks_per_node, memory per node) and names real, distinct ids;
* topology: a GPU rank gets the free cores near its GPUs before any other,
  a CPU task takes cores away from free GPUs before cores next to them;
* a task spanning nodes has at most one node with fewer than its ``least``
  ranks (``SPAN_FRACTION`` of an empty node's fit);
* differential against a brute-force fit: once a pass is over, no queue head
  could start on the nodes it may use (open nodes, plus the held ones when its
  estimate ends before the reservation) — so parked or memoised verdicts never
  leave work waiting that fits;
* EASY: with exact estimates and no later arrival outranking the queue, the
  reservation holder starts no later than its reservation said;
* at the end every task started or was rejected with a reason naming it.
"""

from __future__ import annotations

import math
import os
import random
from collections import defaultdict

import pytest

from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import (SPAN_FRACTION, RejectTask, Scheduler, StartTask, TaskCancelled, TaskFinished,
                                     TasksSubmitted, TaskSubmitted)

pytestmark = pytest.mark.timeout(120)

GiB = 2**30


def random_pilot(rng: random.Random) -> PilotDescription:
    cores = rng.choice([4, 8, 12, 16, 24])
    reserved = tuple(sorted(rng.sample(range(cores), rng.choice([0, 0, 1, 2]))))
    gpus = rng.choice([0, 0, 1, 2, 4])
    usable = [c for c in range(cores) if c not in reserved]
    gpu_cores: tuple[tuple[int, ...], ...] = ()
    if gpus:
        per = max(1, len(usable) // gpus)
        gpu_cores = tuple(tuple(usable[g * per:(g + 1) * per]) or (usable[-1],) for g in range(gpus))
    return PilotDescription(name="random", backend="radical", nodes=rng.randint(1, 10), cores_per_node=cores,
                            gpus_per_node=gpus, memory_per_node=rng.choice([64 * GiB, 512 * GiB]),
                            reserved_cores=reserved, gpu_cores=gpu_cores)


def random_request(rng: random.Random, pilot: PilotDescription, duration: float) -> ResourceRequest:
    usable = pilot.cores_per_node - len(pilot.reserved_cores)  # type: ignore[operator]
    gpus = pilot.gpus_per_node or 0
    kind = rng.choice(["cpu", "cpu", "mpi", "gpu", "multigpu", "big"] if gpus else ["cpu", "cpu", "mpi", "big"])
    memory = rng.choice([None, None, 4 * GiB, 20 * GiB]) if pilot.memory_per_node else None
    if kind == "cpu":
        return ResourceRequest(cores_per_rank=rng.randint(1, max(1, usable // 2)), memory_per_rank=memory,
                               duration=duration)
    if kind == "mpi":
        return ResourceRequest(ranks=rng.randint(2, 3 * usable), cores_per_rank=1,
                               ranks_per_node=rng.choice([None, usable, max(1, usable // 2)]), duration=duration)
    if kind == "gpu":
        return ResourceRequest(cores_per_rank=rng.randint(1, 3), gpus_per_rank=1, memory_per_rank=memory,
                               duration=duration)
    if kind == "multigpu":
        return ResourceRequest(ranks=rng.randint(2, 2 * gpus), cores_per_rank=1,
                               gpus_per_rank=rng.choice([1, min(2, gpus)]), duration=duration)
    # sometimes more than the pilot has: must be rejected at submission
    return ResourceRequest(ranks=rng.randint(1, 4 * pilot.nodes * usable), cores_per_rank=rng.randint(1, usable + 1),
                           gpus_per_rank=rng.choice([0, gpus + 1]) if rng.random() < 0.3 else 0, duration=duration)


class Shadow:
    """What the test itself believes each node has free, from the instructions alone."""

    def __init__(self, pilot: PilotDescription) -> None:
        self.pilot = pilot.resolve()
        usable = set(self.pilot.usable_cores())
        gpus = self.pilot.gpus_per_node or 0
        self.near = [set(c) & usable for c in self.pilot.gpu_cores[:gpus]]
        self.cores = [set(usable) for _ in range(self.pilot.nodes)]
        self.gpus = [set(range(gpus)) for _ in range(self.pilot.nodes)]
        self.memory = [self.pilot.memory_per_node or 0 for _ in range(self.pilot.nodes)]
        self.held: dict[str, tuple[list[tuple[int, tuple[int, ...], tuple[int, ...]]], ResourceRequest]] = {}

    def near_of(self, gpus: set[int] | tuple[int, ...]) -> set[int]:
        out: set[int] = set()
        for g in gpus:
            out |= self.near[g]
        return out

    def start(self, ins: StartTask, request: ResourceRequest) -> None:
        slots = ins.slots
        assert len(slots) == request.ranks, (ins.task_id, len(slots), request)
        per_node: dict[int, list] = defaultdict(list)
        for slot in slots:
            assert 0 <= slot.node < self.pilot.nodes
            assert len(slot.cores) == request.cores_per_rank == len(set(slot.cores)), (ins.task_id, slot)
            assert len(slot.gpus) == request.gpus_per_rank == len(set(slot.gpus)), (ins.task_id, slot)
            per_node[slot.node].append(slot)
        if len(per_node) > 1 and not request.memory_per_rank:  # spanning: at most one node below `least`
            thin = [node for node, node_slots in per_node.items() if len(node_slots) < self.least(request)]
            assert len(thin) <= 1, (ins.task_id, "scattered over nodes with little room", thin)
        for node, node_slots in per_node.items():
            if request.ranks_per_node is not None:
                assert len(node_slots) <= request.ranks_per_node
            free_c, free_g = self.cores[node], self.gpus[node]
            if not request.gpus_per_rank:
                taken = {c for slot in node_slots for c in slot.cores}
                away = free_c - self.near_of(free_g)
                if not taken <= away:  # took cores by a free GPU: only once the others were gone
                    assert away <= taken, (ins.task_id, node, sorted(away - taken))
            for slot in node_slots:
                assert set(slot.cores) <= free_c, (ins.task_id, "core held twice or reserved", slot)
                assert set(slot.gpus) <= free_g, (ins.task_id, "GPU held twice", slot)
                if slot.gpus:  # the free cores near its GPUs come first
                    near_free = self.near_of(slot.gpus) & free_c
                    got = len(set(slot.cores) & near_free)
                    assert got >= min(len(slot.cores), len(near_free)), (ins.task_id, slot, sorted(near_free))
                free_c -= set(slot.cores)
                free_g -= set(slot.gpus)
            if request.memory_per_rank and self.pilot.memory_per_node:
                self.memory[node] -= len(node_slots) * request.memory_per_rank
                assert self.memory[node] >= 0
        self.held[ins.task_id] = ([(s.node, s.cores, s.gpus) for s in slots], request)

    def finish(self, tid: str) -> None:
        slots, request = self.held.pop(tid)
        for node, cores, gpus in slots:
            assert not set(cores) & self.cores[node] and not set(gpus) & self.gpus[node]
            self.cores[node] |= set(cores)
            self.gpus[node] |= set(gpus)
            if request.memory_per_rank and self.pilot.memory_per_node:
                self.memory[node] += request.memory_per_rank

    def least(self, request: ResourceRequest) -> int:
        """The fewest ranks a spanning task may put on a node: SPAN_FRACTION of an empty node's fit."""
        empty = len(self.pilot.usable_cores()) // request.cores_per_rank
        if request.gpus_per_rank:
            empty = min(empty, (self.pilot.gpus_per_node or 0) // request.gpus_per_rank)
        empty = min(empty, request.ranks_per_node or 1 << 30)
        return max(1, math.ceil(empty * SPAN_FRACTION))

    def fits(self, request: ResourceRequest, nodes: list[int]) -> bool:
        """Brute force: could ``request`` start now on ``nodes`` (all on one node, or spread over
        nodes that each have room for at least ``least`` ranks by cores and GPUs)?"""
        per_cap = request.ranks_per_node or 1 << 30
        least = self.least(request)
        total = 0
        for node in nodes:
            n = len(self.cores[node]) // request.cores_per_rank
            if request.gpus_per_rank:
                n = min(n, len(self.gpus[node]) // request.gpus_per_rank)
            n = min(n, per_cap)
            spread = n >= least
            if request.memory_per_rank and self.pilot.memory_per_node:
                n = min(n, self.memory[node] // request.memory_per_rank)
            if request.ranks <= per_cap and n >= request.ranks:
                return True
            total += n if spread else 0
        return total >= request.ranks


def queue_heads(s: Scheduler, requests: dict[str, ResourceRequest], groups: dict[str, str]) -> list[str]:
    """The first queued task of each (group, rank class, per-rank shape): the others wait behind it."""
    seen = set()
    heads = []
    for tid in s.queued:
        r = requests[tid]
        key = (groups[tid], (r.ranks - 1).bit_length(), r.cores_per_rank, r.gpus_per_rank, r.memory_per_rank or 0,
               r.ranks_per_node)
        if key not in seen:
            seen.add(key)
            heads.append(tid)
    return heads


def run_random(seed: int, *, events: int, fair_share: bool) -> None:
    rng = random.Random(seed)
    pilot = random_pilot(rng)
    s = Scheduler(pilot, fair_share=fair_share)
    shadow = Shadow(pilot)
    requests: dict[str, ResourceRequest] = {}
    groups: dict[str, str] = {}
    outcome: dict[str, str] = {}
    ends: list[tuple[float, str]] = []
    promised: dict[str, float] = {}  # reservation holder -> the start it was first promised
    now = 0.0
    next_id = 0
    priority = 1e9
    single_group = not fair_share

    def handle(event: object) -> None:
        for ins in s.handle_event(event):  # type: ignore[arg-type]
            if isinstance(ins, StartTask):
                assert ins.task_id not in outcome
                shadow.start(ins, requests[ins.task_id])
                outcome[ins.task_id] = "started"
                ends.append((now + requests[ins.task_id].duration, ins.task_id))  # type: ignore[operator]
                if ins.task_id in promised:
                    assert now <= promised.pop(ins.task_id) + 1e-9, f"seed {seed}: {ins.task_id} started after its reservation"
            else:
                assert isinstance(ins, RejectTask) and ins.task_id in ins.reason and ins.reason
                assert ins.task_id not in outcome
                outcome[ins.task_id] = "rejected"
        check()

    def check() -> None:
        res = s.reservation
        if res is not None and single_group and res.task_id not in promised and res.task_id in s.queued:
            promised[res.task_id] = res.start
        if not s.queued:
            return
        held = set(res.nodes) if res is not None else set()
        open_nodes = [n for n in range(pilot.nodes) if n not in held]
        for tid in queue_heads(s, requests, groups):
            request = requests[tid]
            allowed = open_nodes
            if res is not None and now + request.duration <= res.start:  # type: ignore[operator]
                allowed = list(range(pilot.nodes))
            if res is not None and tid == res.task_id:
                allowed = list(range(pilot.nodes))
            assert not shadow.fits(request, allowed), (
                f"seed {seed}: {tid} ({request}) fits on nodes {allowed} but was left queued at t={now}")

    def submit_batch(count: int) -> None:
        nonlocal next_id, priority
        batch = []
        for _ in range(count):
            tid = f"t{next_id}"
            next_id += 1
            request = random_request(rng, pilot, duration=round(rng.uniform(1, 40), 3))
            requests[tid] = request
            groups[tid] = "" if single_group else rng.choice("ab")
            priority -= rng.uniform(0, 1) if single_group else rng.uniform(-5, 5)
            batch.append(TaskSubmitted(tid, request, time=now, priority=priority, group=groups[tid]))
        if count == 1:
            handle(batch[0])
        else:
            handle(TasksSubmitted(tuple(batch), time=now))

    submit_batch(rng.randint(5, 30))
    for _ in range(events):
        roll = rng.random()
        if roll < 0.35:
            submit_batch(rng.choice([1, 1, 2, 5]))
        elif roll < 0.38 and s.queued and not single_group:
            victim = rng.choice(s.queued)
            outcome[victim] = "cancelled"
            handle(TaskCancelled(victim, time=now))
        elif ends:
            ends.sort()
            now, tid = ends.pop(0)
            shadow.finish(tid)
            handle(TaskFinished(tid, time=now))
    while ends:
        ends.sort()
        now, tid = ends.pop(0)
        shadow.finish(tid)
        handle(TaskFinished(tid, time=now))
    assert s.queued == [] and s.running == {}
    assert set(outcome) == set(requests), f"seed {seed}: neither started nor rejected: {set(requests) - set(outcome)}"


def seeds(count: int) -> list[int]:
    base = int(os.environ.get("HETFLOW_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"randomised scheduler seeds start at {base} (HETFLOW_TEST_SEED={base} repeats them)")
    return [base + i for i in range(count)]


def test_random_pilots_and_mixes_keep_every_invariant() -> None:
    for seed in seeds(25):
        print("seed", seed)
        run_random(seed, events=300, fair_share=True)


def test_reservation_holder_is_never_delayed_by_backfill() -> None:
    for seed in seeds(25):
        print("seed", seed)
        run_random(seed, events=300, fair_share=False)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_fixed_seeds(seed: int) -> None:
    run_random(seed, events=300, fair_share=seed % 2 == 0)
