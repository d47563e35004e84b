"""The orchestrator: drives one run of a pipeline on a pilot.

It is the single writer of the state store.  One loop owns the scheduler (a
pure state machine) and the store; backend futures only post outcomes into a
queue.  A stage is submitted when all its inputs are committed; it is skipped
(reusing committed outputs) when an identical earlier execution exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import psutil
from sqlalchemy import select

from hetflow.operators import dataset as ds
from hetflow.tasks.backends.base import Backend, LaunchSpec, TaskOutcome
from hetflow.tasks.paths import private_dir
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.protocol import AttemptFiles, Failure, RankResult, StageFunction, WorkerSpec, diagnose, reap_orphans
from hetflow.tasks.scheduler import (RejectTask, Scheduler, StartTask, TaskCancelled, TaskFinished, TasksSubmitted,
                                     TaskSubmitted, Tick)

from . import __version__
from .declaration import StageSpec
from .errors import RunLocked
from .progress import Progress
from .store import (SUCCESS, TERMINAL, AttemptRecord, DatasetRecord, PartitionRecord, RunRecord, StageRecord, Store,
                    TaskRecord)

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0

LONE_DEATH_GRACE = 10.0
"""Seconds a task may run on after one of its ranks ended by itself (a witness record, see
:mod:`hetflow.tasks.witness`) before the orchestrator ends it: Hydra can miss a rank's death
(its own reviewers call the check racy, pmodels/mpich#4862), and ``srun`` ends the other
ranks only with ``--kill-on-bad-exit``."""


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(owner: str | None, lease_until: float | None) -> bool:
    """Is the orchestrator that recorded itself as ``owner`` still running?"""
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname():
        return pid.isdigit() and psutil.pid_exists(int(pid)) and int(pid) != os.getpid()
    return lease_until is not None and lease_until > time.time()


@dataclass
class _Live:
    """What the loop knows about one running attempt."""

    stage: str
    task_id: str
    number: int
    attempt_dir: Path
    slots: tuple[Any, ...]
    lone_death_seen: float | None = None
    ended_by_us: bool = False
    """The orchestrator cancelled the task because a rank had died alone and the launcher did not react."""


class Orchestrator:
    def __init__(self, *, name: str, stages: Mapping[str, StageSpec], pilot: PilotDescription, run_id: str,
                 run_dir: Path, store: Store, params: Mapping[str, Any], script: str | None,
                 progress: bool, verify: str = "checksum") -> None:
        self.name = name
        self.stages = dict(stages)
        self.pilot = pilot
        self.run_id = run_id
        self.run_dir = run_dir
        self.store = store
        self.params = dict(params)
        self.script = script
        self.verify = verify
        self.progress = Progress(enabled=progress)
        self.producer = {out: s.name for s in self.stages.values() for out in s.outputs}
        self.consumers: dict[str, list[str]] = {n: [] for n in self.stages}
        for spec in self.stages.values():
            for dataset in spec.inputs:
                self.consumers[self.producer[dataset]].append(spec.name)
        self.priority = self._critical_path()
        self.branch = self._branches()
        self.outcomes: "queue.Queue[tuple[_Live, TaskOutcome]]" = queue.Queue()
        self.live: dict[str, _Live] = {}
        self.states: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.tries: dict[str, int] = {name: 0 for name in self.stages}
        self.dataset_paths: dict[str, str] = {}
        self.fingerprints: dict[str, str] = {}
        self.deadline: float | None = None
        self.draining = False
        self.cut_off: set[str] = set()

    # ------------------------------------------------------------------ plan
    def _critical_path(self) -> dict[str, float]:
        """Length of the longest chain from each stage to a sink (durations, else 1 per stage)."""
        memo: dict[str, float] = {}

        def length(name: str) -> float:
            if name not in memo:
                own = self.stages[name].request.duration or 1.0
                memo[name] = own + max((length(c) for c in self.consumers[name]), default=0.0)
            return memo[name]

        return {name: length(name) for name in self.stages}

    def _branches(self) -> dict[str, str]:
        """The scheduler's fair-share group of each stage: the source stages it descends from.

        Stages fed by the same sources (stages without inputs) form one branch; two
        independent chains in one pipeline get different groups, so neither can take the
        whole pilot while the other waits.
        """
        memo: dict[str, frozenset[str]] = {}

        def roots(name: str) -> frozenset[str]:
            if name not in memo:
                spec = self.stages[name]
                memo[name] = frozenset([name]) if not spec.inputs else \
                    frozenset().union(*(roots(self.producer[d]) for d in spec.inputs))
            return memo[name]

        return {name: ",".join(sorted(roots(name))) for name in self.stages}

    def stage_params(self, spec: StageSpec) -> dict[str, Any]:
        merged = dict(spec.params)
        merged.update({k: v for k, v in self.params.items()})
        return merged

    def cache_key(self, spec: StageSpec) -> str:
        material = {
            "hetflow": __version__,
            "code": spec.code_hash(),
            "params": self.stage_params(spec),
            "inputs": {name: self.fingerprints[name] for name in spec.inputs},
            "outputs": list(spec.outputs),
            "ranks": spec.request.ranks,
            "schemas": {name: ds.schema_to_text(schema) for name, schema in sorted(spec.schemas.items())},
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()

    # ----------------------------------------------------------------- setup
    def prepare(self, *, resume: bool) -> None:
        """Create or take over the run record; reconcile what a dead orchestrator left RUNNING."""
        private_dir(self.run_dir)
        now = time.time()
        with self.store.session() as session:
            run = session.get(RunRecord, self.run_id)
            if run is not None and owner_alive(run.owner, run.lease_until):
                raise RunLocked(f"run {self.run_id} is being run by another orchestrator ({run.owner}); "
                                "wait for it to finish or stop it first")
            if run is None:
                run = RunRecord(id=self.run_id, pipeline=self.name, created=now, run_dir=str(self.run_dir),
                                script=self.script, pilot=self.pilot.to_mapping(), params=self.params,
                                hetflow_version=__version__)
                session.add(run)
                session.flush()
            run.owner, run.lease_until, run.state, run.started, run.ended = owner_id(), now + LEASE_SECONDS, \
                "RUNNING", run.started or now, None
            self.store.event(session, self.run_id, "run", self.name, "RUNNING", resume=resume, owner=run.owner)
            existing = {s.name: s for s in session.scalars(select(StageRecord).where(StageRecord.run_id == self.run_id))}
            for order, spec in enumerate(self.stages.values()):
                record = existing.get(spec.name)
                if record is None:
                    record = StageRecord(run_id=self.run_id, name=spec.name, order=order,
                                         function=f"{spec.module}:{spec.qualname}")
                    session.add(record)
                record.inputs, record.outputs = list(spec.inputs), list(spec.outputs)
                record.request = {k: v for k, v in vars(spec.request).items()}
                record.params, record.retries, record.timeout = self.stage_params(spec), spec.retries, spec.timeout
                if record.state not in SUCCESS:
                    self._reconcile(session, record)
                    record.state, record.error, record.started, record.ended = "PENDING", None, None, None
                self.attempts[spec.name] = len(record.tasks)
                # committed stages stay DONE in the store; in memory every stage starts PENDING and
                # is found again by its cache key, so changed code or inputs re-run it
                self.states[spec.name] = "PENDING"
            previous = {d.name: d for d in session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == self.run_id))}
            for name, dataset in previous.items():
                self.dataset_paths[name], self.fingerprints[name] = dataset.path, dataset.fingerprint

    def _reconcile(self, session: Any, record: StageRecord) -> None:
        for task in record.tasks:
            if task.attempt is not None and task.state == "RUNNING":
                reap_orphans(AttemptFiles(Path(task.attempt.attempt_dir)))
            if task.state in ("RUNNING", "QUEUED"):
                task.state = "FAILED"
                task.reason = "the orchestrator that owned this task ended without recording its outcome"
                if task.attempt is not None and task.attempt.state == "RUNNING":
                    task.attempt.state, task.attempt.ended = "FAILED", time.time()
                    task.attempt.error = task.reason
                self.store.event(session, self.run_id, "task", task.id, "FAILED", reason=task.reason)

    # ------------------------------------------------------------------ loop
    def execute(self, backend: Backend) -> str:
        started = time.time()
        scheduler = Scheduler(self.pilot, start_time=started)
        if self.pilot.walltime:
            self.deadline = started + self.pilot.walltime
        self.progress.start(self)
        last_lease = last_look = 0.0
        try:
            while True:
                self._watch_walltime(scheduler, backend)
                if time.time() - last_look >= 1.0:
                    self._watch_lone_deaths(backend)
                    last_look = time.time()
                self._submit_ready(scheduler, backend)
                if not self.live and not scheduler.queued:
                    break
                try:
                    live, outcome = self.outcomes.get(timeout=0.5)
                except queue.Empty:
                    self._apply(scheduler.handle_event(Tick(time.time())), backend)
                else:
                    self._finish(live, outcome)
                    self._apply(scheduler.handle_event(TaskFinished(live.task_id, time.time())), backend)
                if time.time() - last_lease > LEASE_SECONDS / 3:
                    self._renew_lease()
                    last_lease = time.time()
                self.progress.update(self, scheduler)
        except BaseException:
            for live in list(self.live.values()):
                backend.cancel(live.task_id)
            self._abandon("the orchestrator was interrupted")
            raise
        finally:
            self.progress.stop()
        return self._close()

    def _watch_walltime(self, scheduler: Scheduler, backend: Backend) -> None:
        """Stop starting work inside the drain window; cut running work off at the deadline."""
        if self.deadline is None:
            return
        now = time.time()
        if not self.draining and now >= self.deadline - self.pilot.drain:
            self.draining = True
            log.warning("pilot walltime drain window reached: no new tasks start")
            for task_id in list(scheduler.queued):
                scheduler.handle_event(TaskCancelled(task_id, now))
                stage = task_id.rsplit("/", 2)[-2]
                self._end_task(task_id, "CANCELLED", "not started: inside the pilot's walltime drain window")
                self._set_stage(stage, "PENDING", error="not started before the pilot's walltime ran out")
        if now >= self.deadline:
            for live in list(self.live.values()):
                if live.task_id not in self.cut_off:
                    self.cut_off.add(live.task_id)
                    backend.cancel(live.task_id)

    def _watch_lone_deaths(self, backend: Backend) -> None:
        """End a task whose rank died by itself when its launcher has not ended the others in time."""
        now = time.time()
        for live in list(self.live.values()):
            if live.ended_by_us:
                continue
            if live.lone_death_seen is None:
                if AttemptFiles(live.attempt_dir).any_ended_alone():
                    live.lone_death_seen = now
            elif now - live.lone_death_seen > LONE_DEATH_GRACE:
                log.warning("stage %s: a rank ended by itself %.0f s ago and the launcher has not ended the "
                            "others; ending the task", live.stage, now - live.lone_death_seen)
                live.ended_by_us = True
                backend.cancel(live.task_id)

    def _end_task(self, task_id: str, state: str, reason: str) -> None:
        with self.store.session() as session:
            task = session.get(TaskRecord, task_id)
            if task is not None:
                task.state, task.reason = state, reason
            self.store.event(session, self.run_id, "task", task_id, state, reason=reason)

    def _renew_lease(self) -> None:
        with self.store.session() as session:
            run = session.get(RunRecord, self.run_id)
            if run is not None:
                run.lease_until = time.time() + LEASE_SECONDS

    def _submit_ready(self, scheduler: Scheduler, backend: Backend) -> None:
        """Submit every stage whose inputs are ready, in ONE scheduler event.

        One event lets the scheduler order all of them by priority (critical path)
        before placing any; submitting them one by one would place each as it came.
        """
        ready: list[StageSpec] = []
        changed = True
        while changed:
            changed = False
            for spec in self.stages.values():
                if self.states[spec.name] != "PENDING" or self.draining:
                    continue
                upstream = [self.producer[d] for d in spec.inputs]
                failed = [u for u in upstream if self.states[u] in TERMINAL - SUCCESS]
                if failed:
                    self._skip(spec, failed[0])
                    changed = True
                elif all(self.states[u] in SUCCESS for u in upstream):
                    if self._try_cache(spec):
                        changed = True
                        continue
                    self._enqueue(spec)
                    ready.append(spec)
        if ready:
            now = time.time()
            batch = tuple(TaskSubmitted(self._task_id(spec), spec.request, now, self.priority[spec.name],
                                        self._preferred_nodes(spec), self.branch[spec.name]) for spec in ready)
            self._apply(scheduler.handle_event(TasksSubmitted(batch, now)), backend)

    def _skip(self, spec: StageSpec, upstream: str) -> None:
        root = self._root_cause(upstream)
        reason = f"not run: upstream stage {upstream!r} ended {self.states[upstream]}" + \
            (f" (root cause: stage {root!r})" if root != upstream else "")
        self._set_stage(spec.name, "SKIPPED", error=reason)

    def _root_cause(self, name: str) -> str:
        spec = self.stages[name]
        for dataset in spec.inputs:
            upstream = self.producer[dataset]
            if self.states[upstream] in TERMINAL - SUCCESS:
                return self._root_cause(upstream)
        return name

    def _try_cache(self, spec: StageSpec) -> bool:
        key = self.cache_key(spec)
        with self.store.session() as session:
            record = session.scalars(select(StageRecord).where(StageRecord.run_id == self.run_id,
                                                               StageRecord.name == spec.name)).one()
            record.cache_key = key
            candidates = session.scalars(select(StageRecord).where(StageRecord.cache_key == key,
                                                                   StageRecord.state.in_(SUCCESS))
                                         .order_by(StageRecord.ended.desc()))
            for hit in candidates:
                found = {d.name: d for d in session.scalars(select(DatasetRecord).where(
                    DatasetRecord.run_id == hit.run_id, DatasetRecord.name.in_(spec.outputs)))}
                if set(found) != set(spec.outputs) or not all(_still_committed(d) for d in found.values()):
                    continue
                for name, source in found.items():
                    self.dataset_paths[name], self.fingerprints[name] = source.path, source.fingerprint
                    if hit.run_id != self.run_id:
                        self._copy_dataset_record(session, source)
                record.cached_from = None if hit.run_id == self.run_id else hit.run_id
                break
            else:
                return False
        if record.cached_from is None:  # committed earlier in this same run (resume)
            self._set_stage(spec.name, "DONE", detail={"reused": True})
        else:
            self._set_stage(spec.name, "CACHED", detail={"from_run": record.cached_from})
        return True

    def _copy_dataset_record(self, session: Any, source: DatasetRecord) -> None:
        old = session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == self.run_id,
                                                          DatasetRecord.name == source.name)).first()
        if old is not None:
            session.delete(old)
            session.flush()
        copy = DatasetRecord(run_id=self.run_id, name=source.name, path=source.path,
                             producer_stage=source.producer_stage, producer_attempt=source.producer_attempt,
                             num_rows=source.num_rows, num_bytes=source.num_bytes, schema=source.schema,
                             fingerprint=source.fingerprint, committed=source.committed)
        copy.partitions = [PartitionRecord(index=p.index, file=p.file, rows=p.rows, bytes=p.bytes,
                                           checksum=p.checksum, node=p.node, rank=p.rank) for p in source.partitions]
        session.add(copy)

    def _task_id(self, spec: StageSpec) -> str:
        return f"{self.run_id}/{spec.name}/{self.attempts[spec.name]}"

    def _enqueue(self, spec: StageSpec) -> None:
        """Record a new attempt of ``spec`` as QUEUED (the caller hands it to the scheduler)."""
        self.attempts[spec.name] += 1
        self.tries[spec.name] += 1
        task_id = self._task_id(spec)
        with self.store.session() as session:
            record = self._stage_record(session, spec.name)
            session.add(TaskRecord(id=task_id, stage_id=record.id, state="QUEUED", priority=self.priority[spec.name],
                                   submitted=time.time()))
            self.store.event(session, self.run_id, "task", task_id, "QUEUED")
        self._set_stage(spec.name, "QUEUED")

    def _preferred_nodes(self, spec: StageSpec) -> frozenset[int]:
        names = [] if self.pilot.nodes == 1 else [f"node{i}" for i in range(self.pilot.nodes)]
        nodes: set[int] = set()
        for dataset in spec.inputs:
            try:
                manifest = ds.read_manifest(self.dataset_paths[dataset])
            except ds.DatasetError:
                continue
            nodes.update(names.index(p.node) for p in manifest.partitions if p.node in names)
        return frozenset(nodes)

    def _apply(self, instructions: list[Any], backend: Backend) -> None:
        for instruction in instructions:
            stage = instruction.task_id.rsplit("/", 2)[-2]
            if isinstance(instruction, StartTask):
                self._launch(self.stages[stage], instruction, backend)
            elif isinstance(instruction, RejectTask):
                with self.store.session() as session:
                    task = session.get(TaskRecord, instruction.task_id)
                    if task is not None:
                        task.state, task.reason = "REJECTED", instruction.reason
                    self.store.event(session, self.run_id, "task", instruction.task_id, "REJECTED",
                                     reason=instruction.reason)
                if getattr(instruction, "cause", "unsatisfiable") in ("walltime", "drain"):
                    self._set_stage(stage, "WALLTIME", error=instruction.reason)
                else:
                    self._set_stage(stage, "FAILED", error=instruction.reason)

    def _launch(self, spec: StageSpec, start: StartTask, backend: Backend) -> None:
        number = int(start.task_id.rsplit("/", 1)[1])
        stage_dir = private_dir(self.run_dir / "stages" / spec.name)
        attempt_dir = private_dir(stage_dir / f"attempt-{number}")
        private_dir(stage_dir / "checkpoints")
        outputs = {}
        for name in spec.outputs:
            target = private_dir(self.run_dir / "datasets" / name)
            ds.uncommit(target)
            outputs[name] = str(target)
        nodes = backend.node_names()
        slots = [{"node": s.node, "cores": list(s.cores), "gpus": list(s.gpus)} for s in start.slots]
        files = AttemptFiles(attempt_dir)
        worker_spec = WorkerSpec(
            run_id=self.run_id, stage=spec.name, attempt=number,
            function=StageFunction(module=spec.module, path=spec.path, name=spec.qualname),
            sys_path=(str(Path(spec.path).parent),) if spec.path else (),
            params=self.stage_params(spec),
            inputs=tuple((name, self.dataset_paths[name]) for name in spec.inputs),
            outputs=outputs, attempt_dir=attempt_dir,
            checkpoint_dir=stage_dir / "checkpoints", slots=tuple(start.slots), nodes=tuple(nodes),
            verify=self.verify,
            schemas={name: ds.schema_to_text(schema) for name, schema in spec.schemas.items()},
        )
        spec_path = files.spec
        worker_spec.write(spec_path)
        live = _Live(spec.name, start.task_id, number, attempt_dir, start.slots)
        now = time.time()
        with self.store.session() as session:
            task = session.get(TaskRecord, start.task_id)
            assert task is not None
            task.state, task.slots = "RUNNING", [dict(s, node_name=nodes[s["node"]]) for s in slots]
            session.add(AttemptRecord(task_id=start.task_id, stage_id=task.stage_id, number=number, state="RUNNING",
                                      started=now, attempt_dir=str(attempt_dir)))
            self.store.event(session, self.run_id, "task", start.task_id, "RUNNING", slots=task.slots)
        self._set_stage(spec.name, "RUNNING", started=now)
        self.live[start.task_id] = live
        launch = LaunchSpec(task_id=start.task_id, argv=(sys.executable, "-m", "hetflow.tasks.worker", str(spec_path)),
                            slots=start.slots, cwd=attempt_dir, timeout=spec.timeout,
                            stdout=files.stdout, stderr=files.stderr)
        future = backend.launch(launch)
        future.add_done_callback(lambda f, live=live: self.outcomes.put((live, f.result())))

    # --------------------------------------------------------------- outcome
    def _finish(self, live: _Live, outcome: TaskOutcome) -> None:
        del self.live[live.task_id]
        spec = self.stages[live.stage]
        files = AttemptFiles(live.attempt_dir)
        ranks = files.read_results(len(live.slots))
        failure = diagnose(spec.name, spec.timeout, outcome, ranks, files, ended_by_us=live.ended_by_us,
                           grace=LONE_DEATH_GRACE)
        if live.task_id in self.cut_off:
            failure = Failure("WALLTIME", f"stage {spec.name!r} was cut off by the pilot's walltime "
                              f"({self.pilot.walltime}s); resume the run in a new allocation")
        committed: dict[str, ds.Manifest] = {}
        if failure is None:
            try:
                committed = self._commit_outputs(spec, live, ranks)
            except (ds.DatasetError, ValueError) as exc:
                failure = Failure("FAILED", f"{type(exc).__name__}: {exc}")
        state = "DONE" if failure is None else failure.state
        with self.store.session() as session:
            task = session.get(TaskRecord, live.task_id)
            assert task is not None and task.attempt is not None
            attempt = task.attempt
            attempt.ended, attempt.returncode = outcome.ended or time.time(), outcome.returncode
            attempt.state = task.state = state
            if failure is not None:
                attempt.failed_rank, attempt.error, attempt.traceback = failure.rank, failure.message, failure.traceback
                attempt.signal = failure.signal
            for name, manifest in committed.items():
                self._record_dataset(session, name, manifest)
            self.store.event(session, self.run_id, "task", live.task_id, state,
                             returncode=outcome.returncode, signal=None if failure is None else failure.signal,
                             error=None if failure is None else failure.message)
        if failure is None:
            self._set_stage(spec.name, "DONE", ended=time.time())
        elif failure.state == "WALLTIME" or self.tries[spec.name] > spec.retries or failure.state == "TIMED_OUT":
            for name in spec.outputs:
                ds.uncommit(self.run_dir / "datasets" / name)
            self._set_stage(spec.name, failure.state, ended=time.time(), error=failure.message)
        else:
            log.warning("stage %s attempt %d failed (%s); retrying", spec.name, live.number, failure.message)
            self._set_stage(spec.name, "PENDING", error=failure.message)

    def _commit_outputs(self, spec: StageSpec, live: _Live, ranks: list[RankResult | None]) -> dict[str, ds.Manifest]:
        committed = {}
        producer = {"run": self.run_id, "stage": spec.name, "attempt": live.number, "ranks": len(live.slots)}
        for name in spec.outputs:
            parts = [part for r in ranks if r is not None and (part := r.outputs.get(name)) is not None]
            if not parts:
                raise ValueError(f"stage {spec.name!r}, output {name!r}: no rank returned a table "
                                 "(every rank returned None)")
            schema = ds.schema_from_text(parts[0].schema)
            infos = [ds.PartitionInfo.from_json(dict(p.partition)) for p in parts]
            committed[name] = ds.commit(self.run_dir / "datasets" / name, name, schema, infos, producer=producer)
        return committed

    def _record_dataset(self, session: Any, name: str, manifest: ds.Manifest) -> None:
        path = str(self.run_dir / "datasets" / name)
        old = session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == self.run_id,
                                                          DatasetRecord.name == name)).first()
        if old is not None:
            session.delete(old)
            session.flush()
        record = DatasetRecord(run_id=self.run_id, name=name, path=path, producer_stage=manifest.producer["stage"],
                               producer_attempt=manifest.producer["attempt"], num_rows=manifest.num_rows,
                               num_bytes=manifest.num_bytes, schema=str(manifest.schema),
                               fingerprint=manifest.fingerprint(), committed=time.time())
        record.partitions = [PartitionRecord(index=i, file=p.file, rows=p.rows, bytes=p.bytes, checksum=p.checksum,
                                             node=p.node, rank=p.rank) for i, p in enumerate(manifest.partitions)]
        session.add(record)
        self.dataset_paths[name], self.fingerprints[name] = path, record.fingerprint

    # ----------------------------------------------------------------- state
    def _stage_record(self, session: Any, name: str) -> StageRecord:
        return session.scalars(select(StageRecord).where(StageRecord.run_id == self.run_id,
                                                         StageRecord.name == name)).one()

    def _set_stage(self, name: str, state: str, *, error: str | None = None, started: float | None = None,
                   ended: float | None = None, detail: Mapping[str, Any] | None = None) -> None:
        self.states[name] = state
        with self.store.session() as session:
            record = self._stage_record(session, name)
            record.state = state
            if error is not None:
                record.error = error
            if started is not None and record.started is None:
                record.started = started
            if ended is not None:
                record.ended = ended
            self.store.event(session, self.run_id, "stage", name, state, error=error, **(detail or {}))
        if state in TERMINAL - SUCCESS and error:
            log.error("stage %s %s: %s", name, state, error.splitlines()[0] if error else "")

    def _abandon(self, reason: str) -> None:
        for name, state in self.states.items():
            if state in ("QUEUED", "RUNNING", "PENDING"):
                self._set_stage(name, "CANCELLED", error=reason)
        self._close()

    def _close(self) -> str:
        states = set(self.states.values())
        if states <= SUCCESS:
            final = "DONE"
        elif states & {"FAILED", "TIMED_OUT", "CANCELLED"}:
            final = "FAILED"
        else:  # only work the walltime stopped or never started: resume in the next allocation
            final = "STOPPED"
        with self.store.session() as session:
            run = session.get(RunRecord, self.run_id)
            assert run is not None
            run.state, run.ended, run.owner, run.lease_until = final, time.time(), None, None
            self.store.event(session, self.run_id, "run", self.name, final)
        return final


def _still_committed(record: DatasetRecord) -> bool:
    try:
        return ds.read_manifest(record.path).fingerprint() == record.fingerprint
    except ds.DatasetError:
        return False
