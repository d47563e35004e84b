"""The scheduler state machine: feed events, check the instructions it returns."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.errors import UnsatisfiableRequest
from hetflow.tasks.pilot import PilotDescription, load_pilot
from hetflow.tasks.scheduler import (NodeLost, RejectTask, Scheduler, StartTask, TaskCancelled, TaskFinished,
                                     TaskSubmitted, TasksSubmitted, Tick, check_request)

pytestmark = pytest.mark.timeout(60)


def pilot(nodes: int = 4, cores: int = 16, gpus: int = 0, **kw: object) -> PilotDescription:
    return PilotDescription(name="test", backend="radical", nodes=nodes, cores_per_node=cores,
                            gpus_per_node=gpus, memory_per_node=kw.pop("memory", 64 * 2**30), **kw)  # type: ignore[arg-type]


def frontier(nodes: int = 4) -> PilotDescription:
    return dataclasses.replace(load_pilot("ornl-frontier"), nodes=nodes)


def submit(s: Scheduler, tid: str, t: float = 0.0, priority: float = 0.0, group: str = "",
           preferred: frozenset[int] = frozenset(), **req: object) -> list:
    return s.handle_event(TaskSubmitted(tid, ResourceRequest(**req), time=t, priority=priority,  # type: ignore[arg-type]
                                        preferred_nodes=preferred, group=group))


def started(out: list) -> dict[str, StartTask]:
    return {i.task_id: i for i in out if isinstance(i, StartTask)}


def assert_disjoint(s: Scheduler) -> None:
    """No core or GPU of a node is held by two running ranks; reserved cores are never held."""
    held: Counter[tuple[int, str, int]] = Counter()
    reserved = set(s.pilot.reserved_cores)
    for slots in s.running.values():
        for slot in slots:
            assert not reserved & set(slot.cores)
            held.update((slot.node, "c", c) for c in slot.cores)
            held.update((slot.node, "g", g) for g in slot.gpus)
    assert not [k for k, n in held.items() if n > 1]


# ---------------------------------------------------------------- placement
def test_mpi_task_spans_nodes_and_honours_ranks_per_node() -> None:
    s = Scheduler(pilot(nodes=4, cores=16))
    out = started(submit(s, "mpi", ranks=40, cores_per_rank=1))
    slots = out["mpi"].slots
    assert len(slots) == 40
    per_node = Counter(slot.node for slot in slots)
    assert len(per_node) == 3 and max(per_node.values()) == 16
    assert_disjoint(s)
    s = Scheduler(pilot(nodes=4, cores=16))
    out = started(submit(s, "spread", ranks=4, cores_per_rank=2, ranks_per_node=1))
    assert len({slot.node for slot in out["spread"].slots}) == 4


def test_spanning_task_waits_for_room_instead_of_scattering_over_a_fragmented_pilot() -> None:
    """8 nodes of 16 cores, each with 2 cores free: a 16-rank MPI task could be scattered 2 ranks
    per node over all 8, but ``span_fraction`` (default a quarter: 4 ranks of 16) makes it wait,
    take the reservation, and start on one node once that node empties; other work still fits."""
    for fraction, waits in ((0.25, True), (0.0, False)):
        s = Scheduler(pilot(nodes=8, cores=16), span_fraction=fraction)
        for node in range(8):
            assert started(submit(s, f"fill{node}", ranks=14, cores_per_rank=1, duration=10.0 + node))
        out = started(submit(s, "mpi", ranks=16, cores_per_rank=1, ranks_per_node=16, duration=5.0))
        if not waits:
            assert len({slot.node for slot in out["mpi"].slots}) == 8
            continue
        assert not out and s.queued == ["mpi"]
        assert started(submit(s, "small", ranks=2, cores_per_rank=1, duration=1.0))  # backfills a hole
        assert s.reservation is not None and s.reservation.task_id == "mpi" and s.reservation.start == 10.0
        out = started(s.handle_event(TaskFinished("fill0", time=10.0)))
        assert {slot.node for slot in out["mpi"].slots} == {0}  # all 16 ranks on the emptied node
        assert_disjoint(s)
    with pytest.raises(ValueError, match="span_fraction"):
        Scheduler(pilot(), span_fraction=1.5)


def test_small_tasks_pack_onto_one_node() -> None:
    s = Scheduler(pilot(nodes=8, cores=16))
    nodes = set()
    for i in range(16):
        out = started(submit(s, f"t{i}", cores_per_rank=1))
        nodes |= {slot.node for slot in out[f"t{i}"].slots}
    assert len(nodes) == 1
    assert_disjoint(s)
    # a multi-rank task that fits one node stays on one node
    out = started(submit(s, "four", ranks=4, cores_per_rank=2))
    assert len({slot.node for slot in out["four"].slots}) == 1


def test_gpu_ranks_get_their_gpus_and_the_cores_near_them() -> None:
    p = frontier(nodes=1)
    s = Scheduler(p)
    out = started(submit(s, "train", ranks=2, cores_per_rank=7, gpus_per_rank=1))
    for slot in out["train"].slots:
        assert len(slot.gpus) == 1
        assert set(slot.cores) == set(p.gpu_cores[slot.gpus[0]])
    assert len({slot.gpus for slot in out["train"].slots}) == 2


def test_mpi_on_cores_and_training_on_gpus_share_a_node() -> None:
    p = frontier(nodes=1)
    s = Scheduler(p)
    mpi = started(submit(s, "mpi", ranks=40, cores_per_rank=1))["mpi"]
    train = started(submit(s, "train", ranks=8, cores_per_rank=2, gpus_per_rank=1))["train"]
    assert {slot.node for slot in mpi.slots} == {slot.node for slot in train.slots} == {0}
    assert sorted(g for slot in train.slots for g in slot.gpus) == list(range(8))
    # the CPU task left two cores next to every GPU, and the GPU ranks got them
    for slot in train.slots:
        assert set(slot.cores) <= set(p.gpu_cores[slot.gpus[0]])
    assert_disjoint(s)


def test_reserved_cores_are_never_assigned() -> None:
    p = frontier(nodes=2)
    s = Scheduler(p)
    out = started(submit(s, "all", ranks=112, cores_per_rank=1))
    used = {c for slot in out["all"].slots for c in slot.cores}
    assert used == set(p.usable_cores()) and not used & set(p.reserved_cores)
    assert started(submit(s, "more", cores_per_rank=1)) == {}
    assert s.queued == ["more"]


def test_unsatisfiable_requests_are_rejected_naming_request_and_shape() -> None:
    p = frontier(nodes=2)
    s = Scheduler(p)
    out = submit(s, "huge", ranks=3, cores_per_rank=1, gpus_per_rank=8)
    assert isinstance(out[0], RejectTask) and out[0].cause == "unsatisfiable"
    assert "huge" in out[0].reason and "gpus_per_rank=8" in out[0].reason and "2 node(s) x 56 usable cores" in out[0].reason
    with pytest.raises(UnsatisfiableRequest, match="57 cores per rank"):
        check_request(ResourceRequest(cores_per_rank=57), p)
    assert s.queued == [] and s.running == {}


# ------------------------------------------------------------------ policy
def test_higher_priority_starts_first() -> None:
    s = Scheduler(pilot(nodes=1, cores=4))
    submit(s, "blocker", cores_per_rank=4, duration=10)
    submit(s, "low", cores_per_rank=2, priority=1.0, duration=5)
    submit(s, "high", cores_per_rank=2, priority=9.0, duration=5)
    out = started(s.handle_event(TaskFinished("blocker", time=10)))
    assert set(out) == {"low", "high"}
    s2 = Scheduler(pilot(nodes=1, cores=4))
    submit(s2, "blocker", cores_per_rank=4, duration=10)
    submit(s2, "low", cores_per_rank=3, priority=1.0, duration=5)
    submit(s2, "high", cores_per_rank=3, priority=9.0, duration=5)
    assert set(started(s2.handle_event(TaskFinished("blocker", time=10)))) == {"high"}


def test_backfill_never_delays_the_head_beyond_its_reservation() -> None:
    s = Scheduler(pilot(nodes=2, cores=8))
    assert started(submit(s, "a", ranks=8, cores_per_rank=1, duration=100))       # node 0 full until t=100
    assert started(submit(s, "b", ranks=4, cores_per_rank=1, duration=50))        # half of node 1 until t=50
    out = submit(s, "head", ranks=16, cores_per_rank=1, priority=10, duration=30)  # needs everything
    assert not started(out)
    # ends before t=100: may use the free half of node 1
    assert "short" in started(submit(s, "short", cores_per_rank=2, duration=40, t=1))
    assert s.reservation is not None and s.reservation.task_id == "head" and s.reservation.start == 100
    # would run past t=100 on nodes the head needs: must wait
    assert not started(submit(s, "long", cores_per_rank=2, duration=500, t=1))
    assert not started(submit(s, "unknown", cores_per_rank=1, t=1))           # no estimate: conservative
    s.handle_event(TaskFinished("b", time=50))
    s.handle_event(TaskFinished("short", time=41))
    out = started(s.handle_event(TaskFinished("a", time=100)))
    assert set(out) == {"head"}
    assert_disjoint(s)


def test_long_backfill_allowed_on_nodes_the_head_does_not_need() -> None:
    s = Scheduler(pilot(nodes=3, cores=8))
    submit(s, "a", ranks=8, cores_per_rank=1, duration=100)
    submit(s, "head", ranks=2, cores_per_rank=8, ranks_per_node=1, priority=5, duration=10)  # 2 full nodes
    # the head got one free node now? It needs two, so both free nodes are held or it waits on 'a'
    res = s.reservation
    if res is None:  # the head started on the two free nodes
        assert "head" in s.running
        return
    free_now = {n for n in range(3) if n not in res.nodes}
    out = started(submit(s, "long", cores_per_rank=8, duration=1000, t=1))
    if free_now - {slot.node for slots in s.running.values() for slot in slots}:
        assert "long" in out and {slot.node for slot in out["long"].slots} <= free_now


def test_fair_share_between_independent_branches() -> None:
    s = Scheduler(pilot(nodes=1, cores=8))
    # branch A has the longer critical path (higher priority) and many tasks
    for i in range(32):
        submit(s, f"A{i}", cores_per_rank=1, priority=100.0 - i, group="A", duration=10)
    for i in range(32):
        submit(s, f"B{i}", cores_per_rank=1, priority=10.0 - i, group="B", duration=10)
    # after the first wave, the pilot is split between the branches, not all given to A
    for t in range(10, 40, 10):
        for tid in list(s.running):
            s.handle_event(TaskFinished(tid, time=t))
        groups = Counter(tid[0] for tid in s.running)
        assert groups["A"] >= 3 and groups["B"] >= 3
    # without fair share, critical path first gives everything to A
    unfair = Scheduler(pilot(nodes=1, cores=8), fair_share=False)
    submit(unfair, "X", cores_per_rank=8, group="X", duration=5)
    for i in range(16):
        submit(unfair, f"A{i}", cores_per_rank=1, priority=100.0 - i, group="A", duration=10)
        submit(unfair, f"B{i}", cores_per_rank=1, priority=10.0 - i, group="B", duration=10)
    unfair.handle_event(TaskFinished("X", time=5))
    assert {tid[0] for tid in unfair.running} == {"A"}


def test_locality_prefers_nodes_holding_inputs_but_never_waits_for_them() -> None:
    s = Scheduler(pilot(nodes=4, cores=8))
    out = started(submit(s, "near", cores_per_rank=2, preferred=frozenset({2})))
    assert {slot.node for slot in out["near"].slots} == {2}
    submit(s, "fill", cores_per_rank=6, preferred=frozenset({2}))
    out = started(submit(s, "elsewhere", cores_per_rank=4, preferred=frozenset({2})))
    assert "elsewhere" in out and {slot.node for slot in out["elsewhere"].slots} != {2}
    # multi-node tasks take the preferred nodes first
    out = started(submit(s, "mpi", ranks=16, cores_per_rank=1, preferred=frozenset({3})))
    assert 3 in {slot.node for slot in out["mpi"].slots}


def test_a_consumer_submitted_with_its_finished_producer_can_take_the_producers_node() -> None:
    s = Scheduler(pilot(nodes=2, cores=4))
    prod = started(submit(s, "prod", cores_per_rank=4))["prod"]
    node = prod.slots[0].node
    consumer = TaskSubmitted("cons", ResourceRequest(cores_per_rank=4), preferred_nodes=frozenset({node}))
    out = started(s.handle_event(TasksSubmitted((consumer,), finished=("prod",))))
    assert {slot.node for slot in out["cons"].slots} == {node} and "prod" not in s.running


def test_a_lost_node_is_never_placed_on_again_and_what_no_longer_fits_is_rejected() -> None:
    s = Scheduler(pilot(nodes=3, cores=4))
    first = started(submit(s, "on-1", ranks=2, cores_per_rank=1, ranks_per_node=1, preferred=frozenset({1})))
    assert 1 in {slot.node for slot in first["on-1"].slots}
    submit(s, "wide", ranks=3, cores_per_rank=4, ranks_per_node=1)  # waits: needs every node whole
    out = s.handle_event(NodeLost(1, reason="node n2 was lost: DOWN"))
    rejected = [i for i in out if isinstance(i, RejectTask)]
    assert [r.task_id for r in rejected] == ["wide"] and "node n2 was lost: DOWN" in rejected[0].reason
    assert "at most 2 fit" in rejected[0].reason
    s.handle_event(TaskFinished("on-1"))  # its cores on node 1 come back, but not for placement
    # the preferred node is gone: the retry, and every task after it, runs on the nodes left
    out = started(submit(s, "retry", ranks=2, cores_per_rank=1, ranks_per_node=1, preferred=frozenset({1})))
    assert {slot.node for slot in out["retry"].slots} == {0, 2}
    fill = started(submit(s, "fill", ranks=6, cores_per_rank=1))
    assert 1 not in {slot.node for slot in fill["fill"].slots} and len(fill["fill"].slots) == 6
    assert not started(submit(s, "more", cores_per_rank=1))  # node 1's four free cores are not used
    later = submit(s, "too-wide", ranks=3, cores_per_rank=1, ranks_per_node=1)
    assert isinstance(later[0], RejectTask) and "1 node(s) lost" in later[0].reason
    assert s.lost == {1: "node n2 was lost: DOWN"}
    assert_disjoint(s)
    assert s.utilization()[0] == 1.0  # of the two nodes left, every core is held


def test_walltime_rejects_tasks_that_cannot_finish_and_says_why() -> None:
    p = pilot(nodes=1, cores=4, walltime=1000, drain=100)
    s = Scheduler(p, start_time=5000.0)
    out = submit(s, "too-long", cores_per_rank=1, duration=2000, t=5000)
    assert isinstance(out[0], RejectTask) and out[0].cause == "walltime"
    assert "2000" in out[0].reason and "6000" in out[0].reason
    assert started(submit(s, "ok", cores_per_rank=4, duration=500, t=5000))
    # queued while the pilot is busy; by the time it could start, its estimate no longer fits
    assert not submit(s, "late", cores_per_rank=1, duration=400, t=5000)
    out = s.handle_event(TaskFinished("ok", time=5700))
    assert [(i.task_id, i.cause) for i in out] == [("late", "walltime")]
    out = submit(s, "draining", cores_per_rank=1, t=5950)
    assert isinstance(out[0], RejectTask) and out[0].cause == "drain"


def test_cancel_removes_queued_and_frees_running() -> None:
    s = Scheduler(pilot(nodes=1, cores=2))
    submit(s, "r", cores_per_rank=2)
    submit(s, "q", cores_per_rank=2)
    s.handle_event(TaskCancelled("q", time=1))
    assert s.queued == []
    out = started(submit(s, "next", cores_per_rank=2, t=2))
    assert not out
    out = started(s.handle_event(TaskCancelled("r", time=3)))
    assert set(out) == {"next"}
    assert s.handle_event(Tick(time=4)) == []


# ------------------------------------------------------------ fake GPUs
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_never_shares_a_core_or_gpu(seed: int) -> None:
    """Pilot with GPUs that do not exist: concurrent tasks never share one, every rank has its own."""
    rng = random.Random(seed)
    p = frontier(nodes=6)
    s = Scheduler(p)
    now = 0.0
    ends: list[tuple[float, str]] = []
    requests = {}
    for i in range(400):
        kind = rng.choice(["cpu", "gpu", "multigpu", "mpi"])
        req = {"cpu": dict(cores_per_rank=rng.randint(1, 4)),
               "gpu": dict(cores_per_rank=rng.randint(1, 7), gpus_per_rank=1),
               "multigpu": dict(ranks=rng.randint(2, 8), cores_per_rank=1, gpus_per_rank=rng.choice([1, 2])),
               "mpi": dict(ranks=rng.randint(10, 150), cores_per_rank=1, ranks_per_node=rng.choice([None, 56]))}[kind]
        duration = rng.uniform(1, 50)
        requests[str(i)] = (req, duration)
        outs = submit(s, str(i), t=now, priority=rng.random(), group=rng.choice("ab"), duration=duration, **req)
        if rng.random() < 0.5 and ends:
            ends.sort()
            now, tid = ends.pop(0)
            outs += s.handle_event(TaskFinished(tid, time=now))
        for ins in outs:
            if isinstance(ins, StartTask):
                req, duration = requests[ins.task_id]
                assert len(ins.slots) == req.get("ranks", 1)
                for slot in ins.slots:
                    assert len(slot.gpus) == req.get("gpus_per_rank", 0) == len(set(slot.gpus))
                    assert len(slot.cores) == req["cores_per_rank"]
                ends.append((now + duration * rng.uniform(0.5, 1.0), ins.task_id))
        assert_disjoint(s)
    while ends or s.queued:
        ends.sort()
        now, tid = ends.pop(0)
        for ins in s.handle_event(TaskFinished(tid, time=now)):
            assert isinstance(ins, StartTask)
            ends.append((now + requests[ins.task_id][1], ins.task_id))
        assert_disjoint(s)
    assert s.running == {} and s.utilization() == (0.0, 0.0)


def test_a_batch_of_ready_tasks_is_placed_in_priority_order() -> None:
    s = Scheduler(pilot(nodes=1, cores=4))
    batch = tuple(TaskSubmitted(tid, ResourceRequest(cores_per_rank=4), priority=prio)
                  for tid, prio in (("low", 1.0), ("high", 9.0), ("mid", 5.0)))
    out = s.handle_event(TasksSubmitted(batch, time=0.0))
    assert list(started(out)) == ["high"] and s.queued == ["mid", "low"]


def test_gpu_core_guard_keeps_a_core_for_every_free_gpu() -> None:
    p = pilot(nodes=1, cores=8, gpus=2, gpu_cores=((0, 1, 2, 3), (4, 5, 6, 7)))
    guarded = Scheduler(p, gpu_core_guard=True)
    submit(guarded, "gpu-blocker", cores_per_rank=8, duration=10)
    submit(guarded, "train", ranks=2, cores_per_rank=1, gpus_per_rank=1, duration=10)   # queued GPU work
    guarded.handle_event(TaskFinished("gpu-blocker", time=10))
    assert "train" in guarded.running
    s = Scheduler(p, gpu_core_guard=True)
    submit(s, "train", cores_per_rank=1, gpus_per_rank=1, duration=100)
    out = started(submit(s, "cpu", cores_per_rank=7, duration=100))
    assert not out                                 # 7 free cores, but one must stay for the free GPU
    assert "cpu6" in started(submit(s, "cpu6", cores_per_rank=6, duration=100))
    assert "train2" in started(submit(s, "train2", cores_per_rank=1, gpus_per_rank=1, duration=100))
