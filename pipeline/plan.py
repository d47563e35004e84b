"""The run plan: a pure state machine over one run's stages.

The plan knows the DAG, each stage's state, attempts and retries; it decides
what is ready, what to look up in the cache, what to queue, retry, skip (and
why: the root cause) and how the run ends.  It does no I/O: the orchestrator
(the shell around it) feeds it events — a cache answer, a task that started,
an attempt that ended, a rejection, the walltime's drain, an interruption —
and carries out the instructions it returns, exactly as the scheduler is
driven (:mod:`hetflow.tasks.scheduler`).  Tests drive it without processes.

Stage states::

    PENDING ─► LOOKING ─► QUEUED ─► RUNNING ─► DONE
                  │          │         ├─► PENDING (a retry) ─► ...
                  │          │         └─► FAILED | TIMED_OUT | WALLTIME | CANCELLED
                  │          └─► PENDING (drained before it started) | FAILED (rejected)
                  └─► CACHED | DONE (its committed output was reused)
    PENDING ─► SKIPPED (an upstream stage did not succeed)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hetflow.tasks.errors import HetflowError

from .states import ACTIVE, FAILURE, FINAL_RETRYLESS, SUCCESS, TERMINAL, State


@dataclass(frozen=True, order=True)
class TaskId:
    """One attempt of one stage of one run: the id the scheduler and the store know it by."""

    run_id: str
    stage: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.run_id}/{self.stage}/{self.attempt}"


@dataclass(frozen=True)
class StageNode:
    """What the plan needs of a stage: its name, the stages it reads from, its retries."""

    name: str
    upstream: tuple[str, ...] = ()
    retries: int = 0
    duration: float | None = None


# ------------------------------------------------------------------ events
@dataclass(frozen=True)
class Begin:
    """Start planning.  ``forced`` stages (and everything downstream of them) re-run uncached, ``reason`` saying why."""

    forced: frozenset[str] = frozenset()
    reason: str = "forced"


@dataclass(frozen=True)
class CacheChecked:
    """The shell's answer to :class:`LookUpCache`: reuse (``hit``) or run, and why."""

    stage: str
    hit: bool
    reason: str
    from_run: str | None = None
    """The run whose output is reused; ``None`` when it is this run's own (a resume)."""
    error: str | None = None
    """The key could not be made (a declared file is missing): the stage fails with this."""


@dataclass(frozen=True)
class TaskStarted:
    task: TaskId


@dataclass(frozen=True)
class AttemptEnded:
    """An attempt ended: ``state`` is ``DONE`` (outputs committed) or how it failed."""

    task: TaskId
    state: str
    error: str | None = None


@dataclass(frozen=True)
class TaskRejected:
    """The scheduler will never place this task (``walltime``: not in the time left)."""

    task: TaskId
    reason: str
    walltime: bool = False


@dataclass(frozen=True)
class Drain:
    """The pilot's walltime drain window began: queued tasks are withdrawn, nothing new starts."""

    reason: str


@dataclass(frozen=True)
class Abandon:
    """Stop everything (Ctrl-C, an error in the shell): the run ends ``state``."""

    reason: str
    state: str = State.FAILED


Event = Begin | CacheChecked | TaskStarted | AttemptEnded | TaskRejected | Drain | Abandon


# ------------------------------------------------------------ instructions
@dataclass(frozen=True)
class LookUpCache:
    """Compute ``stage``'s cache key and look for an intact committed output under it."""

    stage: str


@dataclass(frozen=True)
class Enqueue:
    """Record a new attempt and hand it to the scheduler (all of one answer in one batch)."""

    task: TaskId
    reason: str
    """Why the stage runs: the cache's reason, ``forced``, or a retry's cause."""


@dataclass(frozen=True)
class CancelTask:
    """Withdraw a queued task from the scheduler or stop a running one."""

    task: TaskId
    reason: str
    running: bool


@dataclass(frozen=True)
class StageChanged:
    """Record a stage's new state (with its error and any detail for the event)."""

    stage: str
    state: str
    error: str | None = None
    detail: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Withdraw:
    """Uncommit the outputs of a stage that failed for good (nothing half-done stays visible)."""

    stage: str


@dataclass(frozen=True)
class RunEnded:
    state: str


Instruction = LookUpCache | Enqueue | CancelTask | StageChanged | Withdraw | RunEnded


class PlanError(HetflowError, ValueError):
    """An event that does not fit the plan's state (a bug in the shell)."""


class RunPlan:
    """The state of one run's stages; change it only through :meth:`handle_event`."""

    def __init__(self, run_id: str, stages: Sequence[StageNode], *, attempts: Mapping[str, int] | None = None) -> None:
        self.run_id = run_id
        self.nodes = {s.name: s for s in stages}
        for node in stages:
            for up in node.upstream:
                if up not in self.nodes:
                    raise PlanError(f"stage {node.name!r} reads from unknown stage {up!r}")
        self.downstream: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in stages:
            for up in node.upstream:
                self.downstream[up].append(node.name)
        self.states: dict[str, str] = {n: State.PENDING for n in self.nodes}
        """Each stage's state; written only through :meth:`_put`, which keeps the counts and marks below."""
        self.changes: list[str] = []
        """Every stage whose state was set, in order: what a display reads to refresh only those."""
        self._counts: Counter[str] = Counter(self.states.values())
        self._order = {n: i for i, n in enumerate(self.nodes)}
        self._recheck: set[str] = set(self.nodes)
        """PENDING stages to look at in :meth:`_advance`: an upstream stage ended, or they became PENDING.
        Each event looks at these, not at every stage: a plan of 10^4 stages costs per event what a
        plan of ten does."""
        self.errors: dict[str, str | None] = {n: None for n in self.nodes}
        self.attempts: dict[str, int] = {n: (attempts or {}).get(n, 0) for n in self.nodes}
        self.tries: dict[str, int] = {n: 0 for n in self.nodes}
        self.tasks: dict[str, TaskId] = {}
        """The live task of each stage (queued or running)."""
        self.forced: frozenset[str] = frozenset()
        self.forced_reason = "forced"
        self.draining = False
        self.abandoned: str | None = None
        self.ended: str | None = None

    # ---------------------------------------------------------------- views
    def task(self, text: str) -> TaskId:
        """The live task whose id is ``text`` (what the scheduler hands back)."""
        stage = text[len(self.run_id) + 1:].rpartition("/")[0] if text.startswith(f"{self.run_id}/") else None
        task = self.tasks.get(stage) if stage is not None else None
        if task is not None and str(task) == text:  # found by its stage: a scan of every live task per start made
            return task  # a wide plan's starts quadratic
        for task in self.tasks.values():
            if str(task) == text:
                return task
        raise PlanError(f"no live task {text!r}")

    def priorities(self) -> dict[str, float]:
        """Each stage's critical path: the longest chain of durations (else 1 each) to a sink."""
        memo: dict[str, float] = {}

        def length(name: str) -> float:
            if name not in memo:
                own = self.nodes[name].duration or 1.0
                memo[name] = own + max((length(c) for c in self.downstream[name]), default=0.0)
            return memo[name]

        return {name: length(name) for name in self.nodes}

    def branches(self) -> dict[str, str]:
        """The scheduler's fair-share group of each stage: the source stages it descends from.

        Two independent chains in one pipeline get different groups, so neither can
        take the whole pilot while the other waits.
        """
        memo: dict[str, frozenset[str]] = {}

        def roots(name: str) -> frozenset[str]:
            if name not in memo:
                up = self.nodes[name].upstream
                memo[name] = frozenset([name]) if not up else frozenset().union(*(roots(u) for u in up))
            return memo[name]

        return {name: ",".join(sorted(roots(name))) for name in self.nodes}

    def closure(self, names: Iterable[str]) -> frozenset[str]:
        """``names`` and every stage downstream of them."""
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            if name not in self.nodes:
                raise PlanError(f"no stage {name!r} (stages: {sorted(self.nodes)})")
            seen.add(name)
            todo.extend(self.downstream[name])
        return frozenset(seen)

    def root_cause(self, name: str) -> str:
        """The first stage upstream of (or at) ``name`` that did not succeed by itself."""
        for up in self.nodes[name].upstream:
            if self.states[up] in FAILURE:
                return self.root_cause(up)
        return name

    # --------------------------------------------------------------- events
    def handle_event(self, event: Event) -> list[Instruction]:
        if self.ended is not None:
            return []
        out: list[Instruction] = []
        if isinstance(event, Begin):
            self.forced, self.forced_reason = self.closure(event.forced), event.reason
        elif isinstance(event, CacheChecked):
            self._cache_checked(event, out)
        elif isinstance(event, TaskStarted):
            self._expect(event.task, State.QUEUED)
            self._set(event.task.stage, State.RUNNING, out)
        elif isinstance(event, AttemptEnded):
            self._attempt_ended(event, out)
        elif isinstance(event, TaskRejected):
            self._expect(event.task, State.QUEUED)
            del self.tasks[event.task.stage]
            self._set(event.task.stage, State.WALLTIME if event.walltime else State.FAILED, out, error=event.reason)
        elif isinstance(event, Drain):
            self._drain(event, out)
        elif isinstance(event, Abandon):
            self._abandon(event, out)
        else:
            raise PlanError(f"unknown event {event!r}")
        self._advance(out)
        return out

    def _expect(self, task: TaskId, state: str) -> None:
        live = self.tasks.get(task.stage)
        if live != task or self.states[task.stage] != state:
            raise PlanError(f"task {task} is not {state} (stage {task.stage!r} is {self.states[task.stage]}, "
                            f"live task {live})")

    def _set(self, name: str, state: str, out: list[Instruction], *, error: str | None = None,
             detail: Mapping[str, object] | None = None) -> None:
        self._put(name, state)
        self.errors[name] = error
        out.append(StageChanged(name, state, error, dict(detail or {})))

    def _put(self, name: str, state: str) -> None:
        old = self.states[name]
        self.states[name] = state
        self._counts[old] -= 1
        self._counts[state] += 1
        self.changes.append(name)
        if state == State.PENDING:
            self._recheck.add(name)
        elif state in TERMINAL:
            self._recheck.update(self.downstream[name])

    def _cache_checked(self, event: CacheChecked, out: list[Instruction]) -> None:
        if self.states.get(event.stage) != State.LOOKING:
            raise PlanError(f"stage {event.stage!r} is {self.states.get(event.stage)}, not LOOKING")
        cache = {"hit": event.hit, "from_run": event.from_run, "reason": event.reason}
        if event.error is not None:
            self._set(event.stage, State.FAILED, out, error=event.error)
        elif event.hit:
            self._set(event.stage, State.DONE if event.from_run is None else State.CACHED, out, detail={"cache": cache})
        elif self.draining or self.abandoned:
            self._set(event.stage, State.PENDING, out)
        else:
            self._enqueue(event.stage, event.reason, out)

    def _enqueue(self, name: str, reason: str, out: list[Instruction]) -> None:
        self.attempts[name] += 1
        self.tries[name] += 1
        task = TaskId(self.run_id, name, self.attempts[name])
        self.tasks[name] = task
        out.append(Enqueue(task, reason))
        self._set(name, State.QUEUED, out)

    def _attempt_ended(self, event: AttemptEnded, out: list[Instruction]) -> None:
        self._expect(event.task, State.RUNNING)
        name = event.task.stage
        del self.tasks[name]
        if event.state == State.DONE:
            self._set(name, State.DONE, out)
            return
        final = (event.state in FINAL_RETRYLESS or self.tries[name] > self.nodes[name].retries
                 or self.draining or self.abandoned is not None)
        if final:
            out.append(Withdraw(name))
            self._set(name, event.state, out, error=event.error)
        elif event.state not in FAILURE:
            raise PlanError(f"attempt {event.task} ended in unknown state {event.state!r}")
        else:
            self._enqueue(name, f"retry {self.tries[name]} of {self.nodes[name].retries} after: {event.error}", out)

    def _drain(self, event: Drain, out: list[Instruction]) -> None:
        self.draining = True
        for name, task in list(self.tasks.items()):
            if self.states[name] == State.QUEUED:
                del self.tasks[name]
                out.append(CancelTask(task, event.reason, running=False))
                self._set(name, State.PENDING, out, error=event.reason)

    def _abandon(self, event: Abandon, out: list[Instruction]) -> None:
        self.abandoned = event.state
        for name, task in list(self.tasks.items()):
            running = self.states[name] == State.RUNNING
            out.append(CancelTask(task, event.reason, running=running))
            if not running:
                del self.tasks[name]
        for name, state in self.states.items():
            if state not in TERMINAL and name not in self.tasks:
                self._set(name, State.CANCELLED, out, error=event.reason)

    def _advance(self, out: list[Instruction]) -> None:
        """Skip what cannot run, look up what is ready, and end the run when nothing is left."""
        if self.abandoned is None and not self.draining:
            while self._recheck:  # a skipped stage marks its downstream stages: the next round looks at them
                names = sorted(self._recheck, key=self._order.__getitem__)  # in the order they were declared
                self._recheck.clear()
                for name in names:
                    if self.states[name] != State.PENDING:
                        continue
                    node = self.nodes[name]
                    failed = [u for u in node.upstream if self.states[u] in FAILURE]
                    if failed:
                        root = self.root_cause(failed[0])
                        reason = f"not run: upstream stage {failed[0]!r} ended {self.states[failed[0]]}" + \
                            (f" (root cause: stage {root!r})" if root != failed[0] else "")
                        self._set(name, State.SKIPPED, out, error=reason)
                    elif all(self.states[u] in SUCCESS for u in node.upstream):
                        if name in self.forced:
                            self._enqueue(name, self.forced_reason, out)
                        else:
                            self._put(name, State.LOOKING)
                            out.append(LookUpCache(name))
        if any(self._counts[state] for state in ACTIVE):
            return
        if self.abandoned is None and not self.draining and self._counts[State.PENDING]:
            return  # cannot happen in a DAG; kept so a bug shows as a hang in tests, not a wrong state
        self.ended = self._final()
        out.append(RunEnded(self.ended))

    def _final(self) -> str:
        states = {state for state, count in self._counts.items() if count}
        if self.abandoned is not None:
            return self.abandoned
        if states <= SUCCESS:
            return State.DONE
        if states & {State.FAILED, State.TIMED_OUT, State.CANCELLED}:
            return State.FAILED
        return State.STOPPED  # only work the walltime stopped or never started: resume in the next allocation
