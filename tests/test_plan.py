"""The run plan as a pure state machine: events in, instructions out, no processes."""

from __future__ import annotations

import random

import pytest

from hetflow.plan import (Abandon, AttemptEnded, Begin, CacheChecked, CancelTask, Drain, Enqueue, LookUpCache,
                          PlanError, RunEnded, RunPlan, StageChanged, StageNode, TaskId, TaskRejected, TaskStarted,
                          Withdraw)


def diamond(retries: int = 0) -> RunPlan:
    """a -> b, a -> c, (b, c) -> d"""
    return RunPlan("r1", [StageNode("a", retries=retries), StageNode("b", ("a",)), StageNode("c", ("a",)),
                          StageNode("d", ("b", "c"))])


def of(kind: type, out: list[object]) -> list[object]:
    return [i for i in out if isinstance(i, kind)]


def miss(plan: RunPlan, stage: str) -> TaskId:
    out = plan.handle_event(CacheChecked(stage, False, "first run"))
    (enqueue,) = of(Enqueue, out)
    assert enqueue.reason == "first run"
    return enqueue.task


def run_ok(plan: RunPlan, task: TaskId) -> list[object]:
    plan.handle_event(TaskStarted(task))
    return plan.handle_event(AttemptEnded(task, "DONE"))


def test_task_id_is_a_typed_value_with_the_scheduler_text():
    task = TaskId("run-1", "prep", 2)
    assert str(task) == "run-1/prep/2"
    assert (task.run_id, task.stage, task.attempt) == ("run-1", "prep", 2)
    plan = RunPlan("run-1", [StageNode("prep")])
    plan.handle_event(Begin())
    live = miss(plan, "prep")
    assert plan.task(str(live)) == live  # no parsing of the text


def test_sources_are_looked_up_first_then_what_their_success_makes_ready():
    plan = diamond()
    assert of(LookUpCache, plan.handle_event(Begin())) == [LookUpCache("a")]
    a = miss(plan, "a")
    assert plan.states["a"] == "QUEUED"
    out = run_ok(plan, a)
    assert sorted(i.stage for i in of(LookUpCache, out)) == ["b", "c"]
    b, c = miss(plan, "b"), miss(plan, "c")
    assert of(LookUpCache, run_ok(plan, b)) == []  # d still waits for c
    out = run_ok(plan, c)
    assert of(LookUpCache, out) == [LookUpCache("d")]
    d = miss(plan, "d")
    out = run_ok(plan, d)
    assert out[-1] == RunEnded("DONE")


def test_a_cache_hit_from_another_run_is_cached_and_from_this_run_is_done():
    plan = RunPlan("r2", [StageNode("a"), StageNode("b", ("a",))])
    plan.handle_event(Begin())
    out = plan.handle_event(CacheChecked("a", True, "key matches", from_run="r1"))
    assert plan.states["a"] == "CACHED"
    change = of(StageChanged, out)[0]
    assert change.detail["cache"] == {"hit": True, "from_run": "r1", "reason": "key matches"}
    assert of(LookUpCache, out) == [LookUpCache("b")]
    out = plan.handle_event(CacheChecked("b", True, "key matches", from_run=None))
    assert plan.states["b"] == "DONE"
    assert out[-1] == RunEnded("DONE")


def test_a_key_that_cannot_be_made_fails_the_stage_and_skips_downstream():
    plan = RunPlan("r", [StageNode("a"), StageNode("b", ("a",))])
    plan.handle_event(Begin())
    out = plan.handle_event(CacheChecked("a", False, "", error="declared file 'x.csv' does not exist"))
    assert plan.states == {"a": "FAILED", "b": "SKIPPED"} and out[-1] == RunEnded("FAILED")


def test_forced_stages_and_everything_downstream_skip_the_cache():
    plan = diamond()
    out = plan.handle_event(Begin(forced=frozenset({"b"})))
    assert of(LookUpCache, out) == [LookUpCache("a")]  # a is upstream of b: not forced
    plan.handle_event(CacheChecked("a", True, "key matches", from_run="r0"))
    assert plan.states["b"] == "QUEUED" and plan.states["c"] == "LOOKING"
    plan.handle_event(CacheChecked("c", True, "key matches", from_run="r0"))
    b = plan.tasks["b"]
    out = run_ok(plan, b)
    (enqueue,) = of(Enqueue, out)  # d is downstream of b: forced too
    assert enqueue.task.stage == "d" and enqueue.reason == "forced"


def test_a_forced_stage_runs_with_the_reason_begin_gives():
    plan = diamond()
    out = plan.handle_event(Begin(forced=frozenset({"a"}), reason="forced (--rerun of this run, kept by the resume)"))
    (enqueue,) = of(Enqueue, out)
    assert enqueue.task.stage == "a" and enqueue.reason == "forced (--rerun of this run, kept by the resume)"


def test_forcing_an_unknown_stage_names_the_stages():
    with pytest.raises(PlanError, match="no stage 'zz'.*'a'"):
        diamond().handle_event(Begin(forced=frozenset({"zz"})))


def test_a_failure_skips_downstream_naming_the_root_cause_and_ends_failed():
    plan = diamond()
    plan.handle_event(Begin())
    a = miss(plan, "a")
    plan.handle_event(TaskStarted(a))
    out = plan.handle_event(AttemptEnded(a, "FAILED", "rank 0 raised KeyError"))
    assert Withdraw("a") in out
    assert plan.states == {"a": "FAILED", "b": "SKIPPED", "c": "SKIPPED", "d": "SKIPPED"}
    assert plan.errors["b"] == "not run: upstream stage 'a' ended FAILED"
    assert plan.errors["d"] == "not run: upstream stage 'b' ended SKIPPED (root cause: stage 'a')"
    assert out[-1] == RunEnded("FAILED")


def test_retries_queue_a_new_attempt_until_they_are_spent():
    plan = diamond(retries=2)
    plan.handle_event(Begin())
    task = miss(plan, "a")
    for attempt in (1, 2):
        assert task.attempt == attempt
        plan.handle_event(TaskStarted(task))
        out = plan.handle_event(AttemptEnded(task, "FAILED", "boom"))
        (enqueue,) = of(Enqueue, out)
        assert enqueue.reason == f"retry {attempt} of 2 after: boom"
        task = enqueue.task
    plan.handle_event(TaskStarted(task))
    out = plan.handle_event(AttemptEnded(task, "FAILED", "boom"))
    assert of(Enqueue, out) == [] and plan.states["a"] == "FAILED"


def test_a_timeout_is_not_retried():
    plan = diamond(retries=3)
    plan.handle_event(Begin())
    a = miss(plan, "a")
    plan.handle_event(TaskStarted(a))
    out = plan.handle_event(AttemptEnded(a, "TIMED_OUT", "exceeded 5 s"))
    assert of(Enqueue, out) == [] and plan.states["a"] == "TIMED_OUT"


def test_attempt_numbers_continue_after_those_of_an_earlier_owner():
    plan = RunPlan("r1", [StageNode("a")], attempts={"a": 3})
    plan.handle_event(Begin())
    assert miss(plan, "a") == TaskId("r1", "a", 4)


def test_rejection_fails_the_stage_or_marks_walltime():
    plan = RunPlan("r1", [StageNode("a"), StageNode("b")])
    plan.handle_event(Begin())
    a, b = miss(plan, "a"), miss(plan, "b")
    plan.handle_event(TaskRejected(a, "needs 9 GPUs, the pilot has 0"))
    out = plan.handle_event(TaskRejected(b, "not enough walltime left", walltime=True))
    assert plan.states == {"a": "FAILED", "b": "WALLTIME"}
    assert out[-1] == RunEnded("FAILED")


def test_drain_withdraws_queued_tasks_and_the_run_stops_resumable():
    plan = RunPlan("r1", [StageNode("a"), StageNode("b"), StageNode("c", ("a",))])
    plan.handle_event(Begin())
    a, b = miss(plan, "a"), miss(plan, "b")
    plan.handle_event(TaskStarted(a))
    out = plan.handle_event(Drain("inside the walltime drain window"))
    assert out[0] == CancelTask(b, "inside the walltime drain window", running=False)
    assert plan.states["b"] == "PENDING"
    out = plan.handle_event(AttemptEnded(a, "DONE"))
    assert of(LookUpCache, out) == []  # nothing new starts while draining
    assert out[-1] == RunEnded("STOPPED")


def test_walltime_cut_off_ends_walltime_whatever_the_retries():
    plan = RunPlan("r1", [StageNode("a", retries=5)])
    plan.handle_event(Begin())
    a = miss(plan, "a")
    plan.handle_event(TaskStarted(a))
    out = plan.handle_event(AttemptEnded(a, "WALLTIME", "cut off"))
    assert plan.states["a"] == "WALLTIME" and out[-1] == RunEnded("STOPPED")


def test_abandon_cancels_running_tasks_and_the_run_ends_once_they_ended():
    plan = diamond()
    plan.handle_event(Begin())
    a = miss(plan, "a")
    plan.handle_event(TaskStarted(a))
    out = plan.handle_event(Abandon("interrupted (Ctrl-C)", state="INTERRUPTED"))
    assert out[0] == CancelTask(a, "interrupted (Ctrl-C)", running=True)
    assert {plan.states[s] for s in "bcd"} == {"CANCELLED"}
    assert not of(RunEnded, out)  # a is still running
    out = plan.handle_event(AttemptEnded(a, "CANCELLED", "stage 'a' was cancelled"))
    assert plan.states["a"] == "CANCELLED" and out[-1] == RunEnded("INTERRUPTED")


def test_events_that_do_not_fit_are_refused():
    plan = diamond()
    plan.handle_event(Begin())
    with pytest.raises(PlanError):
        plan.handle_event(CacheChecked("b", False, "x"))  # b is not being looked up
    a = miss(plan, "a")
    with pytest.raises(PlanError):
        plan.handle_event(AttemptEnded(a, "DONE"))  # never started
    with pytest.raises(PlanError, match="unknown stage"):
        RunPlan("r", [StageNode("x", ("nope",))])


def test_priorities_and_branches():
    plan = RunPlan("r", [StageNode("a", duration=5), StageNode("b", ("a",), duration=1), StageNode("x")])
    assert plan.priorities() == {"a": 6.0, "b": 1.0, "x": 1.0}
    assert plan.branches() == {"a": "a", "b": "a", "x": "x"}


@pytest.mark.parametrize("seed", range(30))
def test_random_outcomes_always_end_with_every_stage_terminal(seed):
    """Any DAG, any mix of hits, misses, failures and retries: the run ends, consistently."""
    rng = random.Random(seed)
    names = [f"s{i}" for i in range(rng.randint(1, 12))]
    nodes = [StageNode(n, tuple(rng.sample(names[:i], k=rng.randint(0, min(i, 3)))), retries=rng.randint(0, 2))
             for i, n in enumerate(names)]
    plan = RunPlan("r", nodes)
    pending = list(plan.handle_event(Begin(forced=frozenset(rng.sample(names, k=rng.randint(0, 2))))))
    ended = None
    for _ in range(1000):
        if not pending:
            break
        instruction = pending.pop(0)
        if isinstance(instruction, LookUpCache):
            pending += plan.handle_event(CacheChecked(instruction.stage, rng.random() < 0.3, "r", "old"))
        elif isinstance(instruction, Enqueue):
            pending += plan.handle_event(TaskStarted(instruction.task))
            state = rng.choice(["DONE", "DONE", "FAILED", "TIMED_OUT"])
            pending += plan.handle_event(AttemptEnded(instruction.task, state, None if state == "DONE" else "x"))
        elif isinstance(instruction, RunEnded):
            ended = instruction.state
    assert ended is not None, plan.states
    assert all(s in {"DONE", "CACHED", "FAILED", "TIMED_OUT", "SKIPPED"} for s in plan.states.values())
    for node in nodes:
        if plan.states[node.name] in ("DONE", "CACHED"):
            assert all(plan.states[u] in ("DONE", "CACHED") for u in node.upstream)
        if plan.states[node.name] == "SKIPPED":
            assert any(plan.states[u] not in ("DONE", "CACHED") for u in node.upstream)
    assert (ended == "DONE") == all(s in ("DONE", "CACHED") for s in plan.states.values())
    assert not plan.tasks


class _CountingStates(dict):  # type: ignore[type-arg]
    """The plan's states, counting the stages an event reads."""

    reads = 0

    def __getitem__(self, name: str) -> str:
        self.reads += 1
        return super().__getitem__(name)

    def get(self, name: str, default: object = None) -> object:  # type: ignore[override]
        self.reads += 1
        return super().get(name, default)

    def values(self):  # type: ignore[no-untyped-def]
        self.reads += len(self)
        return super().values()

    def items(self):  # type: ignore[no-untyped-def]
        self.reads += len(self)
        return super().items()


def test_an_event_reads_the_stages_it_can_change_not_every_stage_of_the_plan():
    """A plan of 10^4 stages: one stage's events read a handful of states (the stage, its neighbours), so
    an event costs what it costs in a plan of ten. Before, every event looked at every stage twice."""
    n = 10_000
    plan = RunPlan("r", [StageNode(f"s{i}") for i in range(n)] + [StageNode("last", ("s0", "s1"))])
    assert len(of(LookUpCache, plan.handle_event(Begin()))) == n
    plan.states = counted = _CountingStates(plan.states)
    task = miss(plan, "s0")
    plan.handle_event(TaskStarted(task))
    assert of(LookUpCache, plan.handle_event(AttemptEnded(task, "DONE"))) == []  # "last" waits for s1
    assert counted.reads < 50, f"{counted.reads} reads of stage states for three events of one stage"
    task = miss(plan, "s1")
    plan.handle_event(TaskStarted(task))
    assert of(LookUpCache, plan.handle_event(AttemptEnded(task, "DONE"))) == [LookUpCache("last")]
    for i in range(2, n):  # the rest end; the run ends when the last one does
        assert of(RunEnded, plan.handle_event(CacheChecked(f"s{i}", True, "unchanged"))) == []
    out = plan.handle_event(CacheChecked("last", True, "unchanged"))
    assert out[-1] == RunEnded("DONE")
