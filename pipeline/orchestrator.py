"""The orchestrator: the I/O shell around one run's plan and the pilot's scheduler.

Both decisions-makers are pure state machines: the run plan
(:mod:`hetflow.plan`: stage states, cache look-ups, retries, skips, the run's
end) and the scheduler (:mod:`hetflow.tasks.scheduler`: which ranks go on
which cores and GPUs).  This module carries out what they decide — the state
store, the cache (:mod:`hetflow.cache`), attempt directories, the backend —
and feeds them what happened.  It is the single writer of the state store;
backend futures only post outcomes into a queue that one loop reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetflow.operators import dataset as ds
from hetflow.operators import safeio
from hetflow.operators.location import StorageError
from hetflow.tasks import shipping
from hetflow.tasks.backends.base import Backend, LaunchSpec, TaskOutcome, node_indices
from hetflow.tasks.paths import UnsafePath, private_dir
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.protocol import (
    MPI_PACKAGES,
    WITHOUT_MPI,
    AttemptFiles,
    Failure,
    RankResult,
    StageFunction,
    WorkerSpec,
    diagnose,
    env_digest,
    reap_orphans,
)
from hetflow.tasks.scheduler import (
    NodeLost,
    RejectTask,
    Scheduler,
    StartTask,
    TaskCancelled,
    TaskFinished,
    TasksSubmitted,
    TaskSubmitted,
    Tick,
)
from sqlalchemy import inspect, select

from . import __version__, cache, observed
from . import started as started_file
from .datadir import RunDatasets
from .declaration import StageSpec
from .errors import HetflowError, PipelineError, ResumeRefused, interruption
from .fingerprint import (
    ANY_GLOBAL_SET,
    UNCACHEABLE,
    _local_installs,
    file_digests,
    late_components,
    resolve_files,
    sources_changed,
    uncacheable,
)
from .plan import (
    Abandon,
    AttemptEnded,
    Begin,
    CacheChecked,
    CancelTask,
    Drain,
    Enqueue,
    Event,
    LookUpCache,
    RunEnded,
    RunPlan,
    StageChanged,
    StageNode,
    TaskId,
    TaskRejected,
    TaskStarted,
    Withdraw,
)
from .mapping import Item, MapRun, chunk_dirs
from .mapshell import MapShell
from .progress import Progress
from .states import SUCCESS, TERMINAL, State
from .store import (
    AttemptRecord,
    DatasetRecord,
    PartitionRecord,
    RunRecord,
    StageRecord,
    Store,
    TaskRecord,
    insert_rows,
    owner_id,
)
from .terminal import visible

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0

LONE_DEATH_GRACE = 10.0
"""Seconds a task may run on after one of its ranks ended by itself (a witness record, see
:mod:`hetflow.tasks.witness`) before the orchestrator ends it: Hydra can miss a rank's death
(its own reviewers call the check racy, pmodels/mpich#4862), and ``srun`` ends the other
ranks only with ``--kill-on-bad-exit``."""

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals whose handlers wait while the loop records a step (:meth:`Orchestrator._batch`)."""

BATCH_MAX = 256
"""Ended attempts recorded in one transaction at most (:meth:`Orchestrator._batch`)."""

RECHECK_AFTER = 1.0
"""Seconds a stage may wait between its cache look-up and its start before its code and declared files are
checked again (:meth:`Orchestrator._unchanged_since_look_up`)."""

STOP_GRACE = 10.0
"""Seconds an interrupted run waits for its cancelled tasks to end before it records them cancelled."""


class DatasetInUse(ds.DatasetError):
    """A resume would rewrite a committed dataset that other runs reuse."""


class ChangedSinceLookUp(HetflowError, RuntimeError):
    """What a stage's key was made from changed before the stage started."""


class LeaseLost(HetflowError, RuntimeError):
    """Another orchestrator took this run over (its lease lapsed): stop without writing anything more."""


class CancelRequested(HetflowError, RuntimeError):
    """``hetflow cancel`` asked (through the store), or :meth:`Orchestrator.ask_stop` (a run handle, the end
    of the process that started the run in the background), to stop this run: it ends ``state``, resumable."""

    def __init__(self, reason: str, state: str = State.CANCELLED) -> None:
        super().__init__(reason)
        self.state = state


@dataclass
class _Live:
    """What the loop knows about one running attempt."""

    task: TaskId
    attempt_dir: Path
    slots: tuple[Any, ...]
    lone_death_seen: float | None = None
    ended_by_us: bool = False
    """The orchestrator cancelled the task because a rank had died alone and the launcher did not react."""
    chunk: str | None = None
    """A map stage's chunk task (:mod:`hetflow.mapping`): its id, which the scheduler and the backend know."""

    @property
    def stage(self) -> str:
        return self.task.stage

    @property
    def id(self) -> str:
        """The id the scheduler and the backend know this running task by."""
        return self.chunk or str(self.task)


def where(exc: BaseException) -> str:
    """One line naming what failed and the path at fault (for OSErrors such as a full disk)."""
    if isinstance(exc, OSError) and exc.strerror:
        path = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{path}" if exc.strerror not in str(exc) or not path else str(exc)
    return f"{type(exc).__name__}: {exc}"


def other_value_note(names: Sequence[str]) -> str:
    """Why a stage whose ranks computed globals of the key (``names``) otherwise than the
    orchestrator did runs every time: its result is kept for this run and never served (:func:`observed.stale`)."""
    shown = ", ".join(visible(name, newlines=False) for name in names[:3]) + (" ..." if len(names) > 3 else "")
    return (f"{shown} differs in its ranks from the value the script's top computed where the key was made (a value "
            "each process makes anew: the CPU affinity, __name__, which is not '__main__' in a rank, the host, the "
            "time; or one changed after the run started), so its result is never served from the cache and the "
            "stage runs every time: compute it inside the stage, or pass it as a param")


class Orchestrator(MapShell):
    def __init__(self, *, name: str, stages: Mapping[str, StageSpec], pilot: PilotDescription, run_id: str,
                 run_dir: Path, store: Store, params: Mapping[str, Any], script: str | None,
                 progress: bool | None, datasets: RunDatasets, verify: str = "checksum", rerun: Sequence[str] = (),
                 stream_logs: bool = False, base_dir: Path | None = None) -> None:
        self.name = name
        self.base_dir = Path.cwd() if base_dir is None else base_dir
        """Where the files and local modules of stages without a script file are looked up: the working
        directory when the run was made (a kernel running other cells may change it meanwhile)."""
        self.stages = dict(stages)
        self.pilot = pilot
        self.run_id = run_id
        self.run_dir = run_dir
        self.datasets = datasets
        """Where this run's datasets live (:mod:`hetflow.datadir`): the one place that says it."""
        self.store = store
        self.params = dict(params)
        self.script = script
        self.script_digests = _script_digests(self.stages.values())
        self.shipped = shipping.pickled(self.stages.values())
        self.verify = verify
        self.progress = Progress(enabled=progress, stream_logs=stream_logs)
        self.notes: dict[str, str] = {}
        """Per stage, what the user must change for it to be cached (:meth:`Progress.stop` prints them)."""
        self.producer = {out: s.name for s in self.stages.values() for out in s.outputs}
        # a map stage's retries are its items' (hetflow.mapping): the plan runs its one task once
        self.nodes = [StageNode(s.name, tuple(dict.fromkeys(self.producer[d] for d in s.inputs)),
                                0 if s.map_over is not None else s.retries, s.request.duration)
                      for s in self.stages.values()]
        self.plan = RunPlan(run_id, self.nodes)
        unknown = sorted(set(rerun) - set(self.stages) - {"all"})
        if unknown:
            raise PipelineError(f"pipeline {name!r}: --rerun {unknown[0]!r} is not a stage "
                                f"(stages: {list(self.stages)}, or 'all')")
        self.rerun = frozenset(self.stages) if "all" in rerun else frozenset(rerun)
        self.rerun_reason = "forced"
        self.priority = self.plan.priorities()
        self.branch = self.plan.branches()
        self.outcomes: queue.Queue[tuple[_Live, TaskOutcome]] = queue.Queue()
        self.live: dict[str, _Live] = {}
        self.dataset_paths: dict[str, str] = {}
        self.fingerprints: dict[str, str] = {}
        self.material: dict[str, cache.KeyMaterial] = {}
        self.code: dict[str, dict[str, str]] = {}
        self.env: dict[str, dict[str, str | None]] = {}
        self.deadline: float | None = None
        self.cut_off: set[str] = set()
        self.kept: set[str] = set()
        """Stages whose commit from an earlier session of this run is reused: their record keeps its times."""
        self.scheduler: Scheduler | None = None
        self.backend: Backend | None = None
        self.final: str | None = None
        self.owner = owner_id()
        self.stage_ids: dict[str, int] = {}
        self.stage_records: dict[str, StageRecord] = {}
        """Each stage's record as last used, for :meth:`_stage_record` (a run has few: all are kept)."""
        self.waiting_on: dict[str, int] = {}
        """Per stage, how many of its upstream stages (in order) are known to have succeeded
        (:meth:`_can_start_after`)."""
        self.task_records: dict[str, tuple[TaskRecord, AttemptRecord | None]] = {}
        """The records of each plain stage's task from its enqueueing to its end, taken back by the batches
        that record its start and its end without a query (:meth:`Store.get`)."""
        self.late_values: dict[str, frozenset[str]] = {}
        self.resuming_done = False
        """This session resumes a DONE run and has changed nothing of it yet (:meth:`_refuse_resume`)."""
        self.looked: dict[str, tuple[float, dict[str, tuple[int, int] | str]]] = {}
        """When each stage's key was made, and its declared files' sizes and times then."""
        self.observed_start: Mapping[str, str] = observed.latest()
        """What the script's top level left when the run started (:mod:`hetflow.observed`)."""
        self.generators = (observed.shipped_generators(False), observed.shipped_generators(True))
        """The generators' states a script's stage and a stage shipped by value restore in their ranks, and
        those they record only if they drew from them (:func:`observed.shipped_generators`)."""
        self.stage_wrote: set[str] = set()
        """The files this session's stages opened for writing (:func:`observed.stage_written`)."""
        self.wrote_before: frozenset[str] | None = None
        """The files the stages of the pipeline's latest runs wrote (:func:`cache.written_by_stages`), once asked."""
        self.recorded: set[str] = set()
        """The datasets this run has a record of (its own or copied from the run it reused them from)."""
        self.committed_before: frozenset[str] = frozenset()
        """The datasets this run had committed when this session of it began (a resume's)."""
        self.maps: dict[str, MapRun] = {}
        """The map stages executing now, by stage (:mod:`hetflow.mapping`)."""
        self.chunk_of: dict[str, MapRun] = {}
        self.map_items: dict[str, list[Item]] = {}
        """Each map stage's items as its key was made."""
        self.committed: bool | None = None
        """Whether the store held a committed stage execution when the current loop step first looked one
        up (:func:`cache.any_committed`); None outside a step, and in a step before its first look-up.
        Decision: asked once per step, not per stage: a first run's look-ups then make no query each.
        Within a step nothing of this run becomes committed unless something was already (a hit needs a
        committed record; a stage that ends has another key and name than those looked up after it), and a
        run of another process that commits meanwhile is one whose commit came after these look-ups."""
        self.made_dirs: set[Path] = set()
        """Directories of this run this orchestrator has made (or checked) already: made once, not per attempt."""
        self.stop_asked: tuple[str, str] | None = None
        """``(state, reason)`` once :meth:`ask_stop` was called: the loop stops the run so."""

    def ask_stop(self, state: str, reason: str) -> None:
        """Ask the loop (running in another thread) to stop the run, recorded ``state`` (CANCELLED,
        INTERRUPTED) with ``reason``: its tasks are cancelled as for ``hetflow cancel``; it can be resumed.
        Nothing happens to a run that has ended."""
        self.stop_asked = (state, reason)

    def fix_code(self) -> None:
        """Make every stage's code fingerprint now, from what its function reaches now.

        A run started in the background (``pipe.run(wait=False)``) makes its keys while the kernel runs
        other cells, which may rebind the helpers and values a stage reads; the functions were pickled
        when the run started (``shipped``), and the keys must be made from the same versions.  A stage
        whose fingerprint cannot be made is left to :meth:`_material`, which fails it in its place."""
        from .fingerprint import code_fingerprint

        for spec in self.stages.values():
            try:
                code = code_fingerprint(spec.func)
                self._check_values_workers_see(spec, code)
            except Exception:  # noqa: BLE001 - raised again where the key is made, failing that stage
                continue
            self.code[spec.name] = code

    @property
    def states(self) -> Mapping[str, str]:
        return self.plan.states

    @property
    def state_changes(self) -> Sequence[str]:
        """Every stage whose state was set, in order (the display refreshes only these)."""
        return self.plan.changes

    def stage_env(self, spec: StageSpec) -> dict[str, str | None]:
        """The declared environment variables' values, read once per run: the key and the stage get the same."""
        if spec.name not in self.env:
            self.env[spec.name] = {name: os.environ.get(name) for name in spec.env}
        return self.env[spec.name]

    def launch_env(self, spec: StageSpec) -> dict[str, str]:
        """The declared variables that are set, for the environment of the stage's processes (``LaunchSpec.env``):
        the one place their values go, never a file (the worker spec holds their digests)."""
        return {name: value for name, value in self.stage_env(spec).items() if value is not None}

    def stage_params(self, spec: StageSpec) -> dict[str, Any]:
        merged = dict(spec.params)
        merged.update(self.params)
        return merged

    # ----------------------------------------------------------------- setup
    def prepare(self, *, resume: bool) -> None:
        """Take the run — create it, or take over from an owner that is gone — in one atomic step
        (:meth:`Store.claim_run`), then set its stages up for planning.  A live owner is never
        touched: the claim is refused naming it."""
        private_dir(self.run_dir)
        pilot, argv = self.pilot.to_mapping(), sys.argv[1:]
        if not resume:  # what `hetflow resume` will take from the store, kept where only this user writes
            started_file.write(self.run_dir, self.run_id,
                               started_file.values(script=self.script, params=self.params, argv=argv, pilot=pilot))
        claim = self.store.claim_run(self.run_id, self.owner, lease_seconds=LEASE_SECONDS, create=lambda: RunRecord(
            id=self.run_id, pipeline=self.name, created=time.time(), run_dir=str(self.run_dir), script=self.script,
            pilot=pilot, params=self.params, hetflow_version=__version__, argv=argv),
            detail={"resume": resume})
        self.resuming_done = claim.previous_state == State.DONE  # refused resumes leave it DONE (_refuse_resume)
        if claim.previous_reason:
            log.warning("run %s: taking over from %s (%s)", self.run_id, claim.previous_owner, claim.previous_reason)
        with self.store.session() as session:
            self._keep_rerun(session)
            self._stage_records(session)

    def _keep_rerun(self, session: Any) -> None:
        """Record what ``--rerun`` forces in this run; a resume forces again what that has not run yet.

        A forced run that stopped early (Ctrl-C, a failure, the walltime) has stages that it had not
        re-run: without this, the resume would find their older outputs in the cache, undoing the
        ``--rerun``.  A stage that ran in this run (``DONE``, or reused from this run) is not forced again.
        """
        run = session.get(RunRecord, self.run_id)
        asked = self.plan.closure(self.rerun)
        kept = self.plan.closure(name for name in run.rerun or () if name in self.stages)
        ran = {s.name for s in run.stages if s.state in SUCCESS and s.cached_from is None}
        if kept - ran - asked:
            self.rerun_reason = "forced (--rerun of this run, kept by the resume)"
        self.rerun = frozenset(asked | (kept - ran))
        run.rerun = sorted(asked | kept) or None

    def _stage_records(self, session: Any) -> None:
        existing = {s.name: s for s in session.scalars(select(StageRecord).where(StageRecord.run_id == self.run_id))}
        attempts = {}
        new = []
        for order, spec in enumerate(self.stages.values()):
            record = existing.get(spec.name)
            if record is None:
                record = StageRecord(run_id=self.run_id, name=spec.name, order=order,
                                     function=f"{spec.module}:{spec.qualname}")
                session.add(record)
                new.append(record)
            record.inputs, record.outputs = list(spec.inputs), list(spec.outputs)
            record.request = {k: v for k, v in vars(spec.request).items()}
            record.retries, record.timeout = spec.retries, spec.timeout
            if record.state not in SUCCESS:  # a committed stage keeps the parameters it ran with: its key
                record.params = self.stage_params(spec)  # is matched against them
                self._reconcile(session, record)
                record.state, record.error, record.started, record.ended = State.PENDING, None, None, None
            attempts[spec.name] = len(record.tasks) if record not in new else 0
        session.flush()
        # a new stage's record, whose tasks were never loaded, is taken back by its first batch without a query
        # (Store.get); an existing one's tasks are loaded above, so it is queried once as before
        self.stage_records.update((record.name, record) for record in new)
        self.stage_ids = {record.name: record.id for record in
                          session.scalars(select(StageRecord).where(StageRecord.run_id == self.run_id))}
        self.recorded = set(session.scalars(select(DatasetRecord.name).where(DatasetRecord.run_id == self.run_id)))
        self.committed_before = frozenset(self.recorded)
        # committed stages stay DONE in the store; the plan starts every stage PENDING and finds
        # them again by their cache key, so changed code, files, parameters or inputs re-run them
        self.plan = RunPlan(self.run_id, self.nodes, attempts=attempts)

    def _reconcile(self, session: Any, record: StageRecord) -> None:
        for task in record.tasks:
            if task.attempt is not None and task.state == State.RUNNING:
                for directory in chunk_dirs(Path(task.attempt.attempt_dir)):  # a map stage's: every chunk's
                    reap_orphans(AttemptFiles(directory))
            if task.state in (State.RUNNING, State.QUEUED):
                task.state = State.FAILED
                task.reason = "the orchestrator that owned this task ended without recording its outcome"
                if task.attempt is not None and task.attempt.state == State.RUNNING:
                    task.attempt.state, task.attempt.ended = State.FAILED, time.time()
                    task.attempt.error = task.reason
                self.store.event(session, self.run_id, "task", task.id, State.FAILED, reason=task.reason)

    # ------------------------------------------------------------------ loop
    def execute(self, backend: Backend) -> str:
        started = time.time()
        self.scheduler = scheduler = Scheduler(self.pilot, start_time=started)
        self.backend = backend
        if self.pilot.walltime:
            self.deadline = started + self.pilot.walltime
        self.progress.start(self)
        last_lease = last_look = 0.0
        try:
            with self._batch():
                self._feed(Begin(forced=self.rerun, reason=self.rerun_reason))
            while self.final is None:
                if self.stop_asked is not None:
                    raise CancelRequested(self.stop_asked[1], self.stop_asked[0])
                self._watch_walltime()
                if time.time() - last_look >= 1.0:
                    self._watch_lone_deaths()
                    self._watch_cancel()
                    last_look = time.time()
                try:
                    live, outcome = self.outcomes.get(timeout=0.5)
                except queue.Empty:
                    with self._batch():
                        self._apply(scheduler.handle_event(Tick(time.time())))
                else:
                    with self._batch():  # with whatever else has ended meanwhile: one transaction
                        self._finish(live, outcome)
                        for _ in range(BATCH_MAX - 1):
                            try:
                                live, outcome = self.outcomes.get_nowait()
                            except queue.Empty:
                                break
                            self._finish(live, outcome)
                if time.time() - last_lease > LEASE_SECONDS / 3:
                    self._renew_lease()
                    last_lease = time.time()
                self.progress.update(self, scheduler)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (Terminated)
            self.stop(interruption(interrupt), State.INTERRUPTED)
            raise
        except CancelRequested as cancel:
            self.stop(str(cancel), cancel.state)
            return cancel.state
        except ResumeRefused:  # nothing of the run was changed: it ends as it was
            self._close(State.DONE)
            raise
        except LeaseLost:
            for live in list(self.live.values()):  # ours to stop; the record is the new owner's now
                backend.cancel(live.id)
            self.final = State.LOST
            raise
        except BaseException as exc:
            self.stop(f"the orchestrator stopped: {where(exc)}", State.FAILED)
            raise
        finally:
            self.progress.stop(self)
        return self._close()

    @contextmanager
    def _batch(self) -> Iterator[None]:
        """One transaction for what the loop records in one step (:meth:`Store.batch`), with Ctrl-C and
        SIGTERM held back until it is committed: a half-recorded step would leave the store behind what
        happened.  A held signal's own handler runs then (it raises the interruption)."""
        held: dict[int, Any] = {}
        arrived: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in HELD_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):  # Python's Ctrl-C, hetflow's SIGTERM: both raise
                    held[sig] = handler
                    signal.signal(sig, lambda number, _frame: arrived.append(number))
        self.committed = None
        try:
            with self.store.batch():
                yield
        finally:
            self.committed = None
            for sig, handler in held.items():
                signal.signal(sig, handler)
        if arrived:
            held[arrived[0]](arrived[0], None)

    def stop(self, reason: str, state: str) -> None:
        """End the run ``state`` (Ctrl-C, an error): cancel what runs, wait briefly, record everything.

        Safe to call at any point, before the loop too; what cannot be recorded (a full disk under
        the store) is logged, and the run's lease lapses so it shows as ended with its owner gone.
        """
        try:
            self._feed(Abandon(reason, state))
            deadline = time.time() + STOP_GRACE
            while self.live and time.time() < deadline:
                try:
                    live, outcome = self.outcomes.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._finish(live, outcome)
            for live in list(self.live.values()):  # did not end in time: recorded as cancelled anyway
                del self.live[live.id]
                if live.chunk is not None:
                    self._chunk_gone(live.chunk, {}, reason, State.CANCELLED)
                else:
                    self._feed(AttemptEnded(live.task, State.CANCELLED, reason))
            self._close(state, reason)
        except Exception as exc:  # noqa: BLE001 - already failing; say what could not be recorded
            log.error("run %s: could not record its end (%s)", self.run_id, where(exc))

    def _feed(self, event: Event, finished: str | None = None) -> None:
        """Hand ``event`` to the plan and carry out its instructions (and what they lead to).

        ``finished``: the task whose end ``event`` reports; the scheduler releases it in the same
        step that submits what its end made ready, so those tasks can go where its outputs are."""
        events: deque[Event] = deque([event])
        batch: list[Enqueue] = []
        while events:
            for instruction in self.plan.handle_event(events.popleft()):
                if isinstance(instruction, LookUpCache):
                    checked = self._look_up(self.stages[instruction.stage])
                    if checked.hit and self.stages[instruction.stage].map_over is not None:
                        self._note_map_hit(instruction.stage)
                    events.append(checked)
                elif isinstance(instruction, Enqueue):
                    self._record_task(instruction)
                    batch.append(instruction)
                elif isinstance(instruction, StageChanged):
                    self._record_stage(instruction)
                elif isinstance(instruction, CancelTask):
                    self._cancel(instruction)
                elif isinstance(instruction, Withdraw):
                    self._withdraw(instruction.stage)
                elif isinstance(instruction, RunEnded):
                    self.final = instruction.state
        if (batch or finished) and self.scheduler is not None:
            # one scheduler event for all of them: it orders them by priority before placing any
            now = time.time()
            tasks = tuple(TaskSubmitted(str(e.task), self.stages[e.task.stage].request, now,
                                        self.priority[e.task.stage], self._preferred_nodes(e.task.stage),
                                        self.branch[e.task.stage]) for e in batch
                          if self.stages[e.task.stage].map_over is None)
            ready: list[MapRun] = []
            for e in batch:
                if self.stages[e.task.stage].map_over is not None:
                    tasks += self._start_map(e.task, ready)
            released = () if finished is None else (finished,)
            self._apply(self.scheduler.handle_event(TasksSubmitted(tasks, now, released)))
            for run in ready:  # every item reused: nothing to place
                self._complete_map(run)

    def _withdraw(self, stage: str) -> None:
        for name in self.stages[stage].outputs:
            target = self.datasets.path(name)
            if self._reused_by(name, target):
                continue  # never rewritten (the stage was refused): what other runs read stays
            try:
                ds.uncommit(target)
            except (UnsafePath, ds.UnsafeDatasetPath, StorageError) as exc:  # refused: nothing is deleted through a
                # link; or the object store is unreachable (the stage's record is withdrawn all the same)
                log.warning("stage %s: output %r not withdrawn: %s", stage, name, exc)

    def _apply(self, instructions: list[Any]) -> None:
        """Carry out the scheduler's instructions; the tasks it starts are recorded RUNNING, committed
        together, then handed to the backend (a resume reaps what the store says was running)."""
        assert self.scheduler is not None
        launches: list[tuple[_Live, LaunchSpec]] = []
        for instruction in instructions:
            if instruction.task_id in self.chunk_of:
                chunk = self._apply_chunk(instruction)
                if chunk is not None:
                    launches.append(chunk)
                continue
            task = self.plan.task(instruction.task_id)
            if isinstance(instruction, StartTask):
                try:
                    launches.append(self._launch(task, instruction))
                except (UnsafePath, ds.DatasetError, ChangedSinceLookUp, StorageError) as exc:  # a planted symlink, a damaged
                    # output dir, what the stage reads edited while it waited, an unreachable object store
                    self._feed(TaskStarted(task))
                    self._end_task(str(task), State.FAILED, str(exc))
                    self._feed(AttemptEnded(task, State.FAILED, f"stage {task.stage!r} not started: {exc}"))
                    self._apply(self.scheduler.handle_event(TaskFinished(str(task), time.time())))
                    continue
                self._feed(TaskStarted(task))
            elif isinstance(instruction, RejectTask):
                self._end_task(instruction.task_id, State.REJECTED, instruction.reason)
                self._feed(TaskRejected(task, instruction.reason, walltime=instruction.cause in ("walltime", "drain")))
        if launches:
            self.store.commit()
            assert self.backend is not None
            for live, launch in launches:
                future = self.backend.launch(launch)
                future.add_done_callback(lambda f, live=live: self.outcomes.put((live, f.result())))

    def _watch_walltime(self) -> None:
        """Stop starting work inside the drain window; cut running work off at the deadline."""
        if self.deadline is None:
            return
        now = time.time()
        if not self.plan.draining and now >= self.deadline - self.pilot.drain:
            log.warning("pilot walltime drain window reached: no new tasks start")
            self._feed(Drain("not started before the pilot's walltime ran out"))
        if now >= self.deadline:
            for live in list(self.live.values()):
                text = live.id
                if text not in self.cut_off and self.backend is not None:
                    self.cut_off.add(text)
                    self.backend.cancel(text)

    def _watch_lone_deaths(self) -> None:
        """End a task whose rank died by itself when its launcher has not ended the others in time."""
        now = time.time()
        for live in list(self.live.values()):
            if live.ended_by_us:
                continue
            if live.lone_death_seen is None:
                if AttemptFiles(live.attempt_dir).any_ended_alone():
                    live.lone_death_seen = now
            elif now - live.lone_death_seen > LONE_DEATH_GRACE and self.backend is not None:
                log.warning("stage %s: a rank ended by itself %.0f s ago and the launcher has not ended the "
                            "others; ending the task", live.stage, now - live.lone_death_seen)
                live.ended_by_us = True
                self.backend.cancel(live.id)

    def _watch_cancel(self) -> None:
        who = self.store.cancel_request(self.run_id)
        if who is not None:
            raise CancelRequested(f"cancelled with `hetflow cancel` by {who}")

    def _renew_lease(self) -> None:
        if not self.store.renew_lease(self.run_id, self.owner, LEASE_SECONDS):
            raise LeaseLost(f"run {self.run_id} was taken over by another orchestrator while this one ran "
                            f"(its lease of {LEASE_SECONDS:g} s lapsed); this one stops")

    # ----------------------------------------------------------------- cache
    def _material(self, spec: StageSpec) -> cache.KeyMaterial:
        from .fingerprint import code_fingerprint, file_fingerprint

        if spec.name not in self.code:
            self.code[spec.name] = code_fingerprint(spec.func)
            self._check_values_workers_see(spec, self.code[spec.name])
        base = Path(spec.path).parent if spec.path else self.base_dir
        self.looked[spec.name] = (time.time(), _file_stats(spec.files, base))
        material = cache.KeyMaterial(
            code=self.code[spec.name], files=file_fingerprint(spec.files, base) if spec.files else {},
            env=cache.env_digests(self.stage_env(spec)),
            inputs={name: self.fingerprints[name] for name in spec.inputs},
            schemas={name: ds.schema_to_text(schema) for name, schema in sorted(spec.schemas.items())},
            outputs=tuple(spec.outputs), ranks=spec.request.ranks)
        return material if spec.map_over is None else self._map_material(spec, material, base)

    def _check_values_workers_see(self, spec: StageSpec, code: Mapping[str, str]) -> None:
        """Refuse a stage that reads a global its script sets only where its ranks never execute it (the
        ``__main__`` block, after the first ``pipe.run()``): the key would have one value and the stage
        compute with another."""
        from .fingerprint import values_set_after_declaring

        if spec.module != "__main__" or not spec.path:
            return
        if spec.path not in self.late_values:
            from .pipeline import Pipeline

            namespace = getattr(spec.func, "__globals__", {})
            pipelines = frozenset(name for name, value in namespace.items() if isinstance(value, Pipeline))
            try:
                self.late_values[spec.path] = values_set_after_declaring(Path(spec.path).read_bytes(), spec.path,
                                                                         pipelines)
            except OSError:
                self.late_values[spec.path] = frozenset()
        setting = late_components(self.late_values[spec.path], getattr(spec.func, "__globals__", {}))
        late = sorted(name for name in code if name in setting)
        anything = sorted(n[1:-1] for n in self.late_values[spec.path] if n.startswith(ANY_GLOBAL_SET))
        own = {f"{getattr(spec.func, '__qualname__', '')}()", "stage"}
        read = sorted(k for k in code if k not in own and _script_global(k))
        if anything and read:  # exec(...), globals().update(...): any global may be set there
            raise ValueError(f"it reads {', '.join(read)} from the script, whose `if __name__ == \"__main__\":` "
                             f"block or code after its first pipe.run() may set any global ({'; '.join(anything)}), "
                             "where the stage's ranks never execute it (they would compute with the values set at "
                             "the top while the cache key holds others); set values at the script's top, or give "
                             "them to the stage as parameters")
        if late:
            raise ValueError(f"it reads {', '.join(late)}, which the script sets in its `if __name__ == "
                             "\"__main__\":` block or after its first pipe.run(), where the stage's ranks never "
                             "execute it (they would compute with the value set at the top while the cache key "
                             "holds this one); set it at the script's top, or give it to the stage as a parameter")

    def _look_up(self, spec: StageSpec) -> CacheChecked:
        """Find an intact committed output of ``spec`` under its key; say why there is none."""
        try:
            material = self.material[spec.name] = self._material(spec)
        except ValueError as exc:  # a declared file that is not there
            return CacheChecked(spec.name, False, "", error=f"stage {spec.name!r}: {exc}")
        refused = uncacheable(material.code)
        if refused is not None:  # never served from the cache, and (see _record_attempt) never stored in it
            log.warning("stage %s: %s", spec.name, refused)
            with self.store.session() as session:
                record = self._stage_record(session, spec.name)
                record.cache_reason, record.cache_hit = refused, False
            return CacheChecked(spec.name, False, refused)
        key, params = material.key(), self.stage_params(spec)
        # shared with other look-ups, exclusive of rm/gc: the hit is verified and its reuse recorded (and
        # committed, inside a batch too) before any removal can read what kept runs use (Store.datasets_lock).
        # A miss reuses nothing a removal could take: why it missed is committed with the rest of the batch
        with self.store.datasets_lock(exclusive=False):
            checked = self._look_up_locked(spec, material, key, params)
            if checked.hit:
                self.store.commit()
        return checked

    def _look_up_locked(self, spec: StageSpec, material: cache.KeyMaterial, key: str,
                        params: dict[str, Any]) -> CacheChecked:
        with self.store.session() as session:
            if self.committed is None:
                self.committed = cache.any_committed(session)
            if self.committed:
                hit, found, damaged = cache.look_up(session, run_id=self.run_id, stage=spec.name, key=key,
                                                    params=params, outputs=spec.outputs, now=self.observed_start,
                                                    observed=True, written=lambda: self._written_by_stages(session),
                                                    data_dir=self.datasets.data_dir)
            else:  # nothing committed in the store: no candidate, no earlier execution to compare with
                hit, found, damaged = None, {}, []
            for problem in damaged:
                log.warning("stage %s: not reusing a cached output: %s", spec.name, problem)
            if hit is None:
                self._refuse_resume(spec)
            record = self._stage_record(session, spec.name)
            if hit is None:
                reason = cache.why_run(session, pipeline=self.name, run_id=self.run_id, stage=spec.name,
                                       material=material, params=params, damaged=damaged) \
                    if self.committed else cache.NO_EARLIER
                record.cache_reason, record.cache_hit = reason, False
                return CacheChecked(spec.name, False, reason)
            # a resume finds what this run committed earlier: the record stays as it was (its times, attempts,
            # and the run it was reused from when it was CACHED), so status shows the earlier session's work
            own = hit.run_id == self.run_id
            from_run = hit.cached_from if own else (hit.cached_from or hit.run_id)  # who computed it
            for name, source in found.items():
                self.dataset_paths[name], self.fingerprints[name] = source.path, source.fingerprint
                if not own:
                    self._copy_dataset_record(session, source)
            if own:
                self.kept.add(spec.name)
                reason = record.cache_reason if from_run is not None and record.cache_reason else \
                    "committed earlier in this run, unchanged"
            else:
                reason = f"unchanged since run {from_run}"
                record.cached_from, record.params = from_run, params
            seen = (hit.cache_material or {}).get("observed")  # before: on a resume, hit is this record
            record.cache_key, record.cache_material = key, material.to_json()
            if seen is not None:  # a later run served from this record checks it too
                record.cache_material = {**record.cache_material, "observed": seen}
            record.params_read, record.cache_reason, record.cache_hit = hit.params_read, reason, True
        return CacheChecked(spec.name, True, reason, from_run)

    def _copy_dataset_record(self, session: Any, source: DatasetRecord) -> None:
        self._forget(session, [source.name])
        copy = DatasetRecord(run_id=self.run_id, name=source.name, path=source.path,
                             producer_stage=source.producer_stage, producer_attempt=source.producer_attempt,
                             num_rows=source.num_rows, num_bytes=source.num_bytes, schema=source.schema,
                             fingerprint=source.fingerprint, committed=source.committed)
        copy.partitions = [PartitionRecord(index=p.index, file=p.file, rows=p.rows, bytes=p.bytes,
                                           checksum=p.checksum, node=p.node, rank=p.rank) for p in source.partitions]
        session.add(copy)
        self.recorded.add(source.name)

    def _preferred_nodes(self, stage: str) -> frozenset[int]:
        """The pilot's node indices holding ``stage``'s input partitions: the names the partitions
        recorded (the pilot's own, :meth:`Backend.node_names`) looked up in the same list."""
        names = self.backend.node_names() if self.backend is not None else []
        if len(set(names)) < 2:
            return frozenset()  # one node (or one host): nothing to choose between
        held: set[str] = set()
        for dataset in self.stages[stage].inputs:
            try:
                manifest = ds.read_manifest(self.dataset_paths[dataset])
            except (ds.DatasetError, StorageError):
                continue
            held.update(p.node for p in manifest.partitions)
        found: frozenset[int] = node_indices(names, held)
        return found

    # ----------------------------------------------------------------- tasks
    def _record_task(self, enqueue: Enqueue) -> None:
        """A new attempt: its task record, and the stage's key withdrawn until its outputs commit."""
        spec = self.stages[enqueue.task.stage]
        self._refuse_resume(spec)
        self.resuming_done = False  # from here on this session changes the run
        if spec.name not in self.material:  # forced: never looked up
            try:
                self.material[spec.name] = self._material(spec)
            except ValueError as exc:  # a declared file is missing: the stage runs and meets it itself
                log.warning("stage %s: %s", spec.name, exc)
        with self.store.session() as session:
            record = self._stage_record(session, spec.name)
            seen = (record.cache_material or {}).get("observed") if spec.map_over is not None else None
            record.cache_key = record.cache_material = record.cached_from = None
            if seen is not None:  # what the items recorded so far were computed with: a resume checks it
                record.cache_material = {"observed": seen}
            record.params = self.stage_params(spec)
            if not enqueue.reason.startswith("retry"):
                record.cache_reason, record.cache_hit = enqueue.reason, False
            self._forget(session, spec.outputs)
            task = TaskRecord(id=str(enqueue.task), stage_id=record.id, state=State.QUEUED,
                              priority=self.priority[spec.name], submitted=time.time())
            session.add(task)
            if spec.map_over is None:  # a map's tasks are its chunks', recorded by MapShell
                self.task_records[task.id] = (task, None)
            self.store.event(session, self.run_id, "task", str(enqueue.task), State.QUEUED, reason=enqueue.reason)

    def _cancel(self, cancel: CancelTask) -> None:
        if cancel.task.stage in self.maps:
            self._cancel_map(self.maps[cancel.task.stage], cancel)
            return
        text = str(cancel.task)
        if cancel.running:
            if self.backend is not None:
                self.backend.cancel(text)
            return
        if self.scheduler is not None:
            self.scheduler.handle_event(TaskCancelled(text, time.time()))
        self._end_task(text, State.CANCELLED, cancel.reason)

    def _end_task(self, task_id: str, state: str, reason: str) -> None:
        self.task_records.pop(task_id, None)
        with self.store.session() as session:
            task = session.get(TaskRecord, task_id)
            if task is not None:
                task.state, task.reason = state, reason
            self.store.event(session, self.run_id, "task", task_id, state, reason=reason)

    def _unchanged_since_look_up(self, spec: StageSpec) -> None:
        """A stage that waited for its slot since its key was made: the code it reaches and its declared files
        must be what the key was made from, or its result would be stored under a key it was not made with."""
        from .fingerprint import code_fingerprint

        looked = self.looked.get(spec.name)
        if looked is None or time.time() - looked[0] < RECHECK_AFTER or spec.name not in self.code:
            return
        base = Path(spec.path).parent if spec.path else self.base_dir
        what = None
        if _file_stats(spec.files, base) != looked[1]:  # touched: its content decides
            from .fingerprint import file_fingerprint

            material = self.material.get(spec.name)
            try:
                if material is None or file_fingerprint(spec.files, base) != dict(material.files):
                    what = "a file it declares"
            except ValueError:
                what = "a file it declares"
        if what is None:
            now = code_fingerprint(spec.func)
            if now != self.code[spec.name]:
                from .fingerprint import describe_change

                what = f"the code it reaches ({describe_change(self.code[spec.name], now)})"
        if what is not None:
            raise ChangedSinceLookUp(f"stage {spec.name!r}: {what} changed while it waited for its slot, after its "
                                     "cache key was made; it was not started (its result would be stored under "
                                     "the earlier version's key): run the script again")

    def _launch(self, task: TaskId, start: StartTask) -> tuple[_Live, LaunchSpec]:
        """Write the attempt's spec and record it RUNNING; :meth:`_apply` hands it to the backend."""
        assert self.backend is not None
        spec = self.stages[task.stage]
        self._unchanged_since_look_up(spec)
        nodes = self.backend.node_names()
        files = self._write_spec(spec, task, start, nodes)
        now = time.time()
        with self.store.session() as session:
            held = self.task_records.get(str(task))
            record = self.store.get(session, TaskRecord, str(task), None if held is None else held[0])
            assert record is not None
            record.state = State.RUNNING
            record.slots = [{"node": s.node, "cores": list(s.cores), "gpus": list(s.gpus), "node_name": nodes[s.node]}
                            for s in start.slots]
            attempt = AttemptRecord(task_id=str(task), stage_id=record.stage_id, number=task.attempt,
                                    state=State.RUNNING, started=now, attempt_dir=str(files.directory))
            session.add(attempt)
            self.task_records[str(task)] = (record, attempt)
            self.store.event(session, self.run_id, "task", str(task), State.RUNNING, slots=record.slots)
        live = self.live[str(task)] = _Live(task, files.directory, start.slots)
        launch = LaunchSpec(task_id=str(task), argv=(sys.executable, "-m", "hetflow.tasks.worker", str(files.spec)),
                            slots=start.slots, cwd=files.directory, timeout=spec.timeout,
                            stdout=files.stdout, stderr=files.stderr, env=self.launch_env(spec))
        return live, launch

    def _checkpoints_of_this_key(self, spec: StageSpec, directory: Path) -> None:
        """Leave in ``ctx.checkpoint_dir`` only checkpoints written under the stage's current key.

        A resumed run keeps its stages' checkpoint directories, so a training stage picks up where an
        interrupted attempt stopped; but after an edit of what the key covers (its code, a value it
        reads, a parameter), continuing from those checkpoints would finish the old computation and
        store it under the new key.  The key is written beside them (``KEY``); checkpoints under
        another key are moved aside (``checkpoints-stale-<time>``), and the stage starts afresh."""
        material = self.material.get(spec.name)
        if material is None:
            return
        key = material.key()
        marker = directory / "KEY"
        try:
            held: str | None = marker.read_text()
        except FileNotFoundError:
            held = None
        if held is not None and held != key and any(p.name != "KEY" for p in directory.iterdir()):
            aside = directory.with_name(f"checkpoints-stale-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            directory.rename(aside)
            private_dir(directory)
            log.warning("stage %s: the checkpoints in %s were written before what its cache key covers changed "
                        "(its code, a value it reads, a parameter); set aside in %s, the stage starts afresh",
                        spec.name, directory, aside)
        if held != key:
            safeio.atomic_write(marker, key.encode(), durable=False)  # private (0600), never through a symlink

    def _write_spec(self, spec: StageSpec, task: TaskId, start: StartTask, nodes: Sequence[str], *,
                    chunk: str | None = None, items: Sequence[Mapping[str, Any]] = (),
                    isolation: str = "checked") -> AttemptFiles:
        """The attempt's directory and spec; its outputs' directories emptied (nothing through a symlink).

        ``chunk`` (a map stage's chunk task, ``c<n>``) with its ``items``: the items write to their own
        directories, and the outputs are left as they are until the map's end assembles them; ``isolation``
        is how a one-rank chunk keeps its items apart (:attr:`WorkerSpec.item_isolation`)."""
        stage_dir = self._private_dir(self.run_dir / "stages" / spec.name)
        name = f"attempt-{task.attempt}" if chunk is None else f"attempt-{task.attempt}-{chunk}"
        files = AttemptFiles(private_dir(stage_dir / name, base=stage_dir))
        self._checkpoints_of_this_key(spec, self._private_dir(stage_dir / "checkpoints"))
        outputs = {}
        for name in spec.outputs:
            target = self.datasets.path(name)
            if not self.datasets.remote:
                self._private_dir(Path(target))
            if chunk is None:
                self._refuse_if_reused(spec.name, name, target)
                ds.uncommit(target)
            outputs[name] = target
        base = Path(spec.path).parent if spec.path else self.base_dir
        shipped = self.shipped.get(spec.name)
        if shipped is not None:  # no script file to execute: the function as the run started, pickled
            shipping.write(files.function, shipped)
        keyed = self.material.get(spec.name)  # the rank digests the values it names again (hetflow.observed)
        WorkerSpec(
            run_id=self.run_id, stage=spec.name, attempt=task.attempt,
            function=StageFunction(module=spec.module, path=spec.path, name=spec.qualname, pipeline=self.name),
            sys_path=_worker_sys_path(spec, base) if spec.path or shipped is not None else (),
            params=self.stage_params(spec),
            inputs=tuple((name, self.dataset_paths[name]) for name in spec.inputs), outputs=outputs,
            attempt_dir=files.directory, checkpoint_dir=stage_dir / "checkpoints", slots=tuple(start.slots),
            nodes=tuple(nodes), verify=self.verify,  # type: ignore[arg-type]
            schemas={name: ds.schema_to_text(schema) for name, schema in spec.schemas.items()},
            files=tuple(str(p) for p in resolve_files(spec.files, base)) if spec.files else (),
            gpu_vendor=self.pilot.vendor, memory_per_rank=spec.request.memory_per_rank,
            node_local_dir=self.pilot.node_local_dir, argv=tuple(sys.argv),
            env={name: env_digest(value) for name, value in self.stage_env(spec).items()},  # values: launch_env
            script_sha256=self.script_digests.get(spec.path or "") if spec.module == "__main__" else None,
            items=tuple(items), map_input=spec.map_over.input if spec.map_over is not None else None,
            item_timeout=spec.timeout if chunk is not None else None, item_isolation=isolation,
            values=observed.value_labels(keyed.code) if keyed is not None else (),
            local_installs=_local_installs(),
            generators=self.generators[shipped is not None][0],
            generators_if_drawn=self.generators[shipped is not None][1],
            mpi_named=keyed is None or _may_use_mpi(keyed.code),
        ).write(files.spec, durable=False)  # read at once by the worker; after a crash the attempt is redone
        return files

    def _reused_by(self, name: str, target: str) -> list[str]:
        """The other runs whose records point at this run's committed dataset ``name`` (at ``target``);
        only a dataset committed before this session of the run can have any."""
        if name not in self.committed_before:
            return []
        with self.store.session() as session:
            return sorted(set(session.scalars(select(DatasetRecord.run_id).where(
                DatasetRecord.path == target, DatasetRecord.run_id != self.run_id))))

    def _refuse_resume(self, spec: StageSpec) -> None:
        """A resume of a DONE run that must re-run ``spec``, whose committed outputs other runs reuse, is refused
        before it changes anything (the first stage it re-runs): the run stays DONE, not FAILED."""
        if not self.resuming_done:
            return
        for name in spec.outputs:
            users = self._reused_by(name, self.datasets.path(name))
            if users:
                raise ResumeRefused(f"resume of run {self.run_id} refused: stage {spec.name!r} would have to run "
                                    f"again and rewrite its output {name!r}, which run(s) {', '.join(users)} reuse; a "
                                    "resume never changes what another run has read, and the run stays DONE as it "
                                    "was: run the script again for a new run instead (it reuses what is unchanged)")

    def _refuse_if_reused(self, stage: str, name: str, target: str) -> None:
        """A resume re-runs ``stage``, whose committed output ``name`` other runs reuse (their records point
        at ``target``): writing over it would change what those runs read, so the stage is not started."""
        users = self._reused_by(name, target)
        if users:
            raise DatasetInUse(f"stage {stage!r} would rewrite its output {name!r} ({target}), which run(s) "
                               f"{', '.join(users)} reuse: a resume never changes what another run has read; run "
                               "the script again for a new run instead (it reuses what is unchanged)")

    def _forget(self, session: Any, names: Sequence[str]) -> None:
        """:func:`_forget_datasets` for the names this run has a record of (known since :meth:`prepare`)."""
        known = [name for name in names if name in self.recorded]
        if known:
            _forget_datasets(session, self.run_id, known)
            self.recorded.difference_update(known)

    def _private_dir(self, path: Path) -> Path:
        """:func:`private_dir`, once per run for each directory (this run's directories are 0700: nobody
        else can replace one by a link afterwards)."""
        if path not in self.made_dirs:
            # walked from the run's directory when below it (made and checked by prepare(), 0700 since)
            private_dir(path, base=self.run_dir if self.run_dir in path.parents else None)
            self.made_dirs.add(path)
        return path

    # --------------------------------------------------------------- outcome
    def _finish(self, live: _Live, outcome: TaskOutcome) -> None:
        """An attempt ended: diagnose it, commit its outputs, record it, and tell the plan and scheduler."""
        text = live.id
        if self.live.pop(text, None) is None:
            return  # already recorded as cancelled by stop()
        if live.chunk is not None:
            self._finish_chunk(live, outcome)
            return
        if outcome.lost_nodes:  # before the retry is queued: it must not go back there
            self._lose_nodes(outcome.lost_nodes)
        released = self._release_early(live)
        spec = self.stages[live.stage]
        ranks = AttemptFiles(live.attempt_dir).read_results(len(live.slots))
        failure = self._failure(spec, live, outcome, ranks)
        if failure is None:
            failure = self._changed_while_running(spec)
        if failure is None:
            failure = self._observed_differently(spec, ranks)
        committed: dict[str, ds.Manifest] = {}
        if failure is None:
            try:
                committed = self._commit_outputs(spec, live, ranks)
            except (ds.DatasetError, ValueError, StorageError) as exc:
                failure = Failure(State.FAILED, f"{type(exc).__name__}: {exc}")
        self._record_attempt(live, outcome, failure, committed, ranks)
        if failure is not None and failure.state not in (State.WALLTIME, State.TIMED_OUT, State.CANCELLED):
            log.warning("stage %s attempt %d failed (%s)", spec.name, live.task.attempt, failure.message)
        # its slots (unless released early) go back once its end is recorded, together with what that end made ready
        self._feed(AttemptEnded(live.task, State.DONE if failure is None else failure.state,
                                None if failure is None else failure.message), finished=None if released else text)

    def _release_early(self, live: _Live) -> bool:
        """Give an ended task's slots to the tasks already queued before its end is checked and recorded, when
        that end cannot make a stage ready: its slots would otherwise stand idle while it is (docs/benchmarks.md,
        "Slot turnaround").  When it can, they are released with what it made ready, in one scheduler step, so a
        dependent of higher priority, or one that prefers the node of its input, is placed first."""
        if self.scheduler is None or any(self._can_start_after(down, live.stage)
                                         for down in self.plan.downstream[live.stage]):
            return False
        self._apply(self.scheduler.handle_event(TaskFinished(live.id, time.time())))
        return True

    def _can_start_after(self, stage: str, ending: str) -> bool:
        """Whether every stage ``stage`` reads from but ``ending`` has succeeded.  The stages before
        :attr:`waiting_on` have (a stage does not go back from success in a run), so a gather of N stages,
        which succeed in about the order they were declared, costs O(N) in all, not per end."""
        upstream = self.plan.nodes[stage].upstream
        first = self.waiting_on.get(stage, 0)
        while first < len(upstream) and self.plan.states[upstream[first]] in SUCCESS:
            first += 1
        self.waiting_on[stage] = first
        return all(name == ending or self.plan.states[name] in SUCCESS for name in upstream[first:])

    def _changed_while_running(self, spec: StageSpec) -> Failure | None:
        """A stage whose declared files or local modules changed between its key and its end fails: its result
        may come from the old content, the new, or both (a file read while it was rewritten), so it is neither
        committed nor stored under a key; a retry (if it has retries) is keyed by what is there now."""
        material = self.material.get(spec.name)
        code = self.code.get(spec.name)
        looked = self.looked.get(spec.name)
        if material is None or code is None or looked is None:
            return None
        base = Path(spec.path).parent if spec.path else self.base_dir
        changed: list[str] = []
        if spec.files and _file_stats(spec.files, base) != looked[1]:  # touched: its content decides
            from .fingerprint import file_fingerprint

            try:
                now = file_fingerprint(spec.files, base)
            except ValueError as exc:
                changed.append(str(exc))
            else:
                changed += [f"declared file {k}" for k in sorted(now.keys() | material.files.keys())
                            if now.get(k) != material.files.get(k)]
        changed += [f"local module {path}" for path in sources_changed(code)]
        if not changed:
            return None
        self.code.pop(spec.name, None)  # a retry is keyed by what is there when it is queued (_record_task)
        self.material.pop(spec.name, None)
        return Failure(State.FAILED, f"stage {spec.name!r}: {', '.join(changed)} changed while the stage ran; its result "
                       "may come from the earlier content, so it was not committed: run the script again (or "
                       "resume the run) to compute it from what is there now")

    def _observed_differently(self, spec: StageSpec, ranks: list[RankResult | None]) -> Failure | None:
        """A rank that executed a helper module or read a file at the script's top other than the one this run's
        key was made from (it changed after the run started, while the stage waited) computed something the key
        does not describe: it is not committed."""
        self.stage_wrote.update(key[len("wrote "):] for r in ranks if r is not None and r.observed
                                for key in r.observed if key.startswith("wrote "))
        changed = sorted({what for r in ranks if r is not None and r.observed
                          for what in observed.refused(r.observed, self.observed_start, self.stage_wrote)})
        if not changed and spec.name in self.shipped:
            return self._session_values_unseen(spec, ranks)
        if not changed:
            return None
        # file names are the user's bytes: not UTF-8 (the store could not record them) or holding a newline
        changed = [visible(what.encode("utf-8", "backslashreplace").decode("utf-8"), newlines=False)
                   for what in changed]
        return Failure(State.FAILED, f"stage {spec.name!r}: {', '.join(changed)} changed after the run started, so the "
                       "stage computed from other content than its cache key was made from; it was not committed: "
                       "run the script again (or resume the run) to compute it from what is there now")

    def _session_values_unseen(self, spec: StageSpec, ranks: list[RankResult | None]) -> Failure | None:
        """A stage declared in a session (a notebook, ``python -``) is shipped by value with the session's own
        globals, but the modules it imports are imported afresh in its ranks: a value the session set on one
        (``import mylib; mylib.K = 2``) is in the key and not in the ranks, which computed with the module's
        own.  That result is not the key's and is not committed."""
        material = self.material.get(spec.name)
        code = material.code if material is not None else {}
        other = sorted({name for r in ranks if r is not None and r.observed
                        for name in observed.differed(r.observed, code) if "." in name})
        if not other:
            return None
        shown = ", ".join(visible(name, newlines=False) for name in other[:3]) + (" ..." if len(other) > 3 else "")
        return Failure(State.FAILED, f"stage {spec.name!r}: it reads {shown}, which this session set on an imported "
                       "module: a stage declared in a session takes the session's own globals with it, but its "
                       "ranks import modules afresh, so they computed with the module's own value; it was not "
                       "committed: set the value in the module's source, or give it to the stage as a parameter")

    def _written_by_stages(self, session: Any) -> set[str]:
        """The files the pipeline's stages write, this session's and its latest runs' (asked of the store once,
        when a file read at the script's top or a folder listed changed since a commit): a change they made is
        the pipeline's own, not one the cache must follow (:func:`observed.stale`)."""
        if self.wrote_before is None:
            self.wrote_before = cache.written_by_stages(session, self.name)
        return self.stage_wrote | self.wrote_before

    def _observed_record(self, spec: StageSpec, ranks: list[RankResult | None]) -> dict[str, str]:
        """What is recorded with a committed stage and must still hold when it is served (:func:`observed.stale`)."""
        editable, installed = _local_installs()  # counted by the key as it reaches them
        material = self.material.get(spec.name)
        code = material.code if material is not None else {}
        found: dict[str, str] = {}
        for rank in ranks:
            if rank is not None and rank.observed:
                found.update(observed.to_record(rank.observed, self.observed_start, editable + installed, code,
                                                self.stage_wrote))
        other = [key[len("value "):] for key in found if key.startswith("value ")]
        if other:
            self.notes[spec.name] = other_value_note(other)
            log.info("stage %s: %s", spec.name, self.notes[spec.name])  # the display prints it at the run's end
        return found

    def _lose_nodes(self, lost: Mapping[str, str]) -> None:
        """Nodes the backend found lost: recorded once each, and out of the scheduler's placement."""
        if self.scheduler is None or self.backend is None:
            return
        names = self.backend.node_names()
        for node in sorted(node_indices(names, frozenset(lost))):
            if node in self.scheduler.lost:
                continue
            reason = lost[names[node]]
            log.error("run %s: %s; no more tasks are placed there", self.run_id, reason)
            with self.store.session() as session:
                self.store.event(session, self.run_id, "node", names[node], State.LOST, index=node, reason=reason)
            self._apply(self.scheduler.handle_event(NodeLost(node, time.time(), reason)))

    def _failure(self, spec: StageSpec, live: _Live, outcome: TaskOutcome,
                 ranks: list[RankResult | None]) -> Failure | None:
        if live.id in self.cut_off:
            return Failure(State.WALLTIME, f"stage {spec.name!r} was cut off by the pilot's walltime "
                           f"({self.pilot.walltime}s); resume the run in a new allocation")
        failure = diagnose(spec.name, spec.timeout, outcome, ranks, AttemptFiles(live.attempt_dir),
                           ended_by_us=live.ended_by_us, grace=LONE_DEATH_GRACE)
        if failure is not None and failure.traceback is None and _disk_full(live.attempt_dir):
            # the rank could not even write its log: say what the log would have said
            failure = dataclasses.replace(failure, message=f"{failure.message}; No space left on device: "
                                          f"the file system of {live.attempt_dir} is full")
        return failure

    def _record_attempt(self, live: _Live, outcome: TaskOutcome, failure: Failure | None,
                        committed: Mapping[str, ds.Manifest], ranks: list[RankResult | None]) -> None:
        state = State.DONE if failure is None else failure.state
        with self.store.session() as session:
            held_task, held_attempt = self.task_records.pop(str(live.task), (None, None))
            task = self.store.get(session, TaskRecord, str(live.task), held_task)
            assert task is not None
            key = None if held_attempt is None else inspect(held_attempt).identity
            attempt = task.attempt if key is None else self.store.get(session, AttemptRecord, key, held_attempt)
            assert attempt is not None
            attempt.ended, attempt.returncode = outcome.ended or time.time(), outcome.returncode
            attempt.state = task.state = state
            if failure is not None:
                attempt.failed_rank, attempt.error, attempt.traceback = failure.rank, failure.message, failure.traceback
                attempt.signal = failure.signal
            for name, manifest in committed.items():
                self._record_dataset(session, name, manifest)
            material = self.material.get(live.stage)
            if failure is None and material is not None:  # the key goes onto outputs produced under it only
                record = self._stage_record(session, live.stage)
                record.cache_key = material.key() if uncacheable(material.code) is None else None
                record.cache_material, record.params_read = material.to_json(), _params_read(ranks)
                # outside the key's material: it cannot be known before the stage ran
                record.cache_material = {**record.cache_material,
                                         "observed": self._observed_record(self.stages[live.stage], ranks)}
                if live.stage in self.notes:  # status and the run's summary say why it will run again
                    record.cache_reason = f"not cached: {self.notes[live.stage]}"
            self.store.event(session, self.run_id, "task", str(live.task), state,
                             returncode=outcome.returncode, signal=None if failure is None else failure.signal,
                             error=None if failure is None else failure.message)

    def _commit_outputs(self, spec: StageSpec, live: _Live, ranks: list[RankResult | None]) -> dict[str, ds.Manifest]:
        committed = {}
        producer = {"run": self.run_id, "stage": spec.name, "attempt": live.task.attempt, "ranks": len(live.slots)}
        for name in spec.outputs:
            parts = [part for r in ranks if r is not None and (part := r.outputs.get(name)) is not None]
            if not parts:
                raise ValueError(f"stage {spec.name!r}, output {name!r}: no rank returned a table "
                                 "(every rank returned None)")
            schema = ds.schema_from_text(parts[0].schema)
            infos = [ds.PartitionInfo.from_json(dict(p.partition)) for p in parts]
            committed[name] = ds.commit(self.datasets.path(name), name, schema, infos, producer=producer)
        return committed

    def _record_dataset(self, session: Any, name: str, manifest: ds.Manifest) -> None:
        path = self.datasets.path(name)
        self._forget(session, [name])
        record = DatasetRecord(run_id=self.run_id, name=name, path=path, producer_stage=manifest.producer["stage"],
                               producer_attempt=manifest.producer["attempt"], num_rows=manifest.num_rows,
                               num_bytes=manifest.num_bytes, schema=str(manifest.schema),
                               fingerprint=manifest.fingerprint(), committed=time.time())
        session.add(record)
        session.flush()  # its id, for its partitions' rows: one executemany, not an ORM object each (a map
        # stage's output has a partition per item)
        insert_rows(session, PartitionRecord, (
            {"dataset_id": record.id, "index": i, "file": p.file, "rows": p.rows, "bytes": p.bytes,
             "checksum": p.checksum, "node": p.node, "rank": p.rank} for i, p in enumerate(manifest.partitions)))
        self.recorded.add(name)
        self.dataset_paths[name], self.fingerprints[name] = path, record.fingerprint

    # ----------------------------------------------------------------- state
    def _stage_record(self, session: Any, name: str) -> StageRecord:
        # from the session, or the record an earlier batch loaded, taken back without a query (Store.get)
        record = self.stage_records[name] = self.store.get(session, StageRecord, self.stage_ids[name],
                                                           self.stage_records.get(name))
        assert record is not None
        return record

    def _record_stage(self, change: StageChanged) -> None:
        now = time.time()
        with self.store.session() as session:
            record = self._stage_record(session, change.stage)
            if change.state == State.QUEUED and record.state in SUCCESS:  # committed earlier, run again now
                record.started = record.ended = None
            record.state = change.state
            if change.error is not None or change.state in (State.QUEUED, State.DONE, State.CACHED):
                record.error = change.error
            if change.state == State.RUNNING and record.started is None:
                record.started = now
            if change.state in TERMINAL and change.stage not in self.kept:
                record.ended = now
            self.store.event(session, self.run_id, "stage", change.stage, change.state, error=change.error,
                             **dict(change.detail))
        if change.state in TERMINAL - SUCCESS and change.error:
            # a stage's own failure is an error; one stopped by Ctrl-C, a cancel or the walltime is not
            level = logging.ERROR if change.state in (State.FAILED, State.TIMED_OUT) else \
                logging.INFO if change.state == State.CANCELLED else logging.WARNING
            log.log(level, "stage %s %s: %s", change.stage, change.state, change.error.splitlines()[0])

    def _close(self, state: str | None = None, error: str | None = None) -> str:
        final = self.final = state or self.final or State.FAILED
        if not self.store.release_run(self.run_id, self.owner, final, error=error):
            log.error("run %s: another orchestrator took it over; its outcome %s was not recorded", self.run_id, final)
        return final


def _may_use_mpi(code: Mapping[str, str]) -> bool:
    """Whether a stage with this code fingerprint may call MPI other than through ``ctx.comm``: its key names
    a package that uses MPI (:data:`~hetflow.tasks.protocol.MPI_PACKAGES`), or an installed package (counted by
    its version) not known to be without it (:data:`~hetflow.tasks.protocol.WITHOUT_MPI`)."""
    for key, digest in code.items():
        top = key.removeprefix("module ").partition(".")[0]
        if top in MPI_PACKAGES:
            return True
        if key.startswith("module ") and len(digest) != 64 and top not in WITHOUT_MPI:  # a version: installed
            return True
    return False


def _worker_sys_path(spec: StageSpec, base: Path) -> tuple[str, ...]:
    """Where a stage's rank imports from, as Python would for the script: the folder that holds the top of the
    stage's package (``lib/flow.py`` declaring ``lib.flow``'s stages is imported as ``lib.flow``), the
    running script's folder (``sys.path[0]`` of ``python p.py``), then the stage file's own folder."""
    found = []
    if spec.path and spec.module not in ("__main__", ""):
        top = Path(spec.path).parent
        for _ in range(spec.module.count(".") + (Path(spec.path).name == "__init__.py")):
            top = top.parent
        found.append(str(top))
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main, str) and spec.module != "__main__":
        found.append(str(Path(main).resolve().parent))
    found.append(str(base))
    return tuple(dict.fromkeys(found))


def _file_stats(patterns: Sequence[str], base: Path) -> dict[str, tuple[int, int] | str]:
    """``{path: (size, mtime_ns)}`` of the files ``patterns`` name (what changes when one is edited); of an
    object on a store, ``{URI: its ETag and size}`` (its modification time has whole seconds only)."""
    stats: dict[str, tuple[int, int] | str] = {}
    try:
        paths = resolve_files(patterns, base) if patterns else ()
        objects = [p for p in paths if isinstance(p, str)]
        stats.update(zip(objects, file_digests(objects)))
    except ValueError:
        return {}
    for path in paths:
        if isinstance(path, str):
            continue
        try:
            info = path.stat()
        except OSError:
            continue
        stats[str(path)] = (info.st_size, info.st_mtime_ns)
    return stats


def _script_global(component: str) -> bool:
    """Whether a code fingerprint's component is a global of the stage's own script (``SCALE``, ``helper()``,
    ``class Model``), not a module's (``mylib.K``, ``module mylib``)."""
    name = component.removeprefix("class ").removesuffix("()")
    return name.isidentifier() and not component.startswith(("module ", UNCACHEABLE))


def _script_digests(stages: Any) -> dict[str, str]:
    """The sha256 of each script that declares stages in ``__main__``, as the run starts: the version
    whose code the stages' cache keys were made from, and the only one their workers may execute."""
    digests = {}
    for spec in stages:
        if spec.module == "__main__" and spec.path and spec.path not in digests:
            try:
                digests[spec.path] = hashlib.sha256(Path(spec.path).read_bytes()).hexdigest()
            except OSError:
                continue  # the worker meets it
    return digests


def _disk_full(path: Path) -> bool:
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _forget_datasets(session: Any, run_id: str, names: Sequence[str]) -> None:
    """Drop this run's records of ``names`` (with their partitions) before they are produced again."""
    for old in session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == run_id,
                                                           DatasetRecord.name.in_(list(names)))):
        session.delete(old)
    session.flush()


def _params_read(ranks: list[RankResult | None]) -> list[str] | None:
    """The parameters the ranks read (``None``: all of them, or a rank did not say)."""
    names: set[str] = set()
    for rank in ranks:
        if rank is None or rank.params_read is None:
            return None
        names.update(rank.params_read)
    return sorted(names)
