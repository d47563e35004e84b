"""The orchestrator's part for map stages: chunk tasks out, item results in, the outputs assembled.

The run plan gives a map stage one task per attempt (its retries are the
items', so the plan's are none).  When the plan enqueues it, the items are
looked up one by one (:func:`hetflow.mapping.reusable`); those left are split
into chunk tasks (``<task>/c<n>``) that the scheduler places like any task with
the stage's request.  The plan's task starts with the first chunk and ends
when the last has ended and no item has a retry left: DONE with the outputs
assembled from every succeeded item (when no more than ``max_failures`` failed),
else FAILED naming the failed items.  The items' records
(:class:`~hetflow.store.MapItemRecord`) are what later runs reuse and what
``hetflow status RUN STAGE --items`` lists.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetflow.operators import dataset as ds
from hetflow.operators.location import is_object_store
from hetflow.tasks.backends.base import LaunchSpec, TaskOutcome
from hetflow.tasks.protocol import AttemptFiles
from hetflow.tasks.scheduler import RejectTask, StartTask, TaskCancelled, TasksSubmitted, TaskSubmitted
from sqlalchemy import delete, func, insert, select

from . import cache, mapping, observed
from .declaration import StageSpec
from .mapping import MapRun
from .plan import AttemptEnded, CancelTask, TaskId, TaskRejected, TaskStarted
from .states import State
from .store import AttemptRecord, MapItemRecord, StageRecord, TaskRecord, insert_rows

log = logging.getLogger(__name__)

LOOK_UP_BATCH = 500
"""Item keys looked up in the store in one query."""

PROGRESS_FILE = "map-progress.json"
"""In the directory the attempt's record names (its first chunk's): the items' counts, replaced as chunks end,
for ``hetflow serve`` (:func:`hetflow.serve.stage_progress`), which reads no state held in the orchestrator."""


class MapShell:
    """Mixed into :class:`~hetflow.orchestrator.Orchestrator`; uses its store, scheduler, backend and records."""

    # ------------------------------------------------------------------ key
    def _map_material(self: Any, spec: StageSpec, material: cache.KeyMaterial, base: Path) -> cache.KeyMaterial:
        """The stage's key material without what its items split, plus one digest of the items' keys."""
        mapped = spec.map_over
        assert mapped is not None
        common = material
        if mapped.kind == "files":
            common = dataclasses.replace(common, files={})
        if mapped.input is not None:
            common = dataclasses.replace(common, inputs={name: ("mapped" if name == mapped.input else value)
                                                         for name, value in common.inputs.items()})
        try:
            items = mapping.list_items(spec, base=base, stage_key=common.to_json(), inputs=self.dataset_paths,
                                       items_dir=self.run_dir / "items" / spec.name)
        except (ds.DatasetError, OSError) as exc:
            raise ValueError(f"its items ({spec.map_over}) cannot be listed: {exc}") from None
        self.map_items[spec.name] = items
        return dataclasses.replace(material, items=mapping.items_digest(items))

    def _note_map_hit(self: Any, stage: str) -> None:
        """A map stage whose whole output was reused: its status line counts its items as cached.  A resume
        keeps the reason of a stage its earlier session reused, which says so already: not said twice."""
        count = len(self.map_items.get(stage, ()))
        with self.store.session() as session:
            record = self._stage_record(session, stage)
            if stage in self.kept and (record.cache_reason or "").startswith("map "):
                return
            record.cache_reason = f"map {count:,} items: {count:,} cached, 0 ran ({record.cache_reason})"

    # ---------------------------------------------------------------- start
    def _start_map(self: Any, task: TaskId, ready: list[MapRun]) -> tuple[TaskSubmitted, ...]:
        """The plan enqueued map stage ``task``: reuse what items can be, submit chunks for the rest."""
        spec = self.stages[task.stage]
        items = [item.again() for item in self.map_items.get(spec.name, ())]
        run = MapRun(spec, task, items)
        self.maps[spec.name] = run
        earlier: dict[str, list[Any]] = {}
        keys = [item.key for item in items]
        with self.store.session() as session:
            for start in range(0, len(keys), LOOK_UP_BATCH):
                # the columns reuse reads, not ORM records: a cached map of 100,000 items loaded as many
                for key, run_id, directory, outputs, cached_from in session.execute(select(
                        MapItemRecord.key, MapItemRecord.run_id, MapItemRecord.directory, MapItemRecord.outputs,
                        MapItemRecord.cached_from).where(MapItemRecord.key.in_(keys[start:start + LOOK_UP_BATCH]),
                                                         MapItemRecord.state.in_((State.DONE, State.CACHED)))):
                    earlier.setdefault(key, []).append(mapping.Earlier(
                        run_id, sys.intern(directory), mapping.shared_outputs(outputs), cached_from))
            run.row_watermark = session.scalar(select(func.max(MapItemRecord.id))) or 0
            run.row_counts = dict(session.execute(  # an earlier session's rows of this run (a resume's), if any
                select(MapItemRecord.state, func.count()).where(MapItemRecord.run_id == self.run_id,
                                                                MapItemRecord.stage == spec.name)
                .group_by(MapItemRecord.state)).tuples().all())
            run.before = self._labels_before(session, spec.name)
            run.stage_reason = self._stage_record(session, spec.name).cache_reason or ""
            run.observed, reads = self._drop_stale_items(session, spec, earlier)
            if run.row_counts:  # this run's rows of an earlier session stay until the map's end: their names too
                run.read(self._stage_record(session, spec.name).params_read)
        if spec.name not in self.rerun:  # --rerun: every item runs again, whatever the items' cache says
            for run_id in mapping.reusable(items, earlier, self.run_id):
                run.read(reads[run_id])
        run.recount()  # the items' directories are made by their ranks as they write (write_partition)
        submitted: tuple[TaskSubmitted, ...] = self._submit_chunks(run)
        if not submitted:
            ready.append(run)
        return submitted

    def _drop_stale_items(self: Any, session: Any, spec: StageSpec, earlier: dict[str, list[Any]]
                          ) -> tuple[dict[str, str], dict[str, list[str] | None]]:
        """Leave out of ``earlier`` the items of runs whose recorded observations no longer hold now (a helper
        module edited, a seed changed: :func:`hetflow.observed.stale`), or that recorded none (a hetflow before
        them): the items' keys do not cover what they depended on beyond them; and those of runs where a
        parameter the stage's items read had another value (:func:`hetflow.cache.params_match`: the items'
        keys hold no parameter).  Returns this run's own observations when its items are kept (a resume's):
        the map's record goes on from them; and the parameters each kept run's items read."""
        stage = spec.name
        runs = {record.run_id for records in earlier.values() for record in records}
        if not runs:
            return {}, {}
        records = {r.run_id: r for r in session.scalars(
            select(StageRecord).where(StageRecord.run_id.in_(sorted(runs)), StageRecord.name == stage))}
        recorded = {run_id: (r.cache_material or {}).get("observed") for run_id, r in records.items()}
        params = self.stage_params(spec)
        kept = set()
        for run_id in sorted(runs):
            seen, record = recorded.get(run_id), records.get(run_id)
            changed = [] if record is None else [f"param {name} changed" for name in cache.params_match(
                record.params_read, record.params or {}, params)]
            if not changed:
                changed = observed.stale(seen, self.observed_start, lambda: self._written_by_stages(session)) \
                    if seen is not None else ["no observations recorded"]
            if changed:
                log.info("stage %s: not reusing the items of run %s: %s", stage, run_id, "; ".join(changed[:3]))
            else:
                kept.add(run_id)
        for key in list(earlier):
            earlier[key] = [record for record in earlier[key] if record.run_id in kept]
        return (dict(recorded.get(self.run_id) or {}) if self.run_id in kept else {},
                {run_id: records[run_id].params_read for run_id in kept})

    def _labels_before(self: Any, session: Any, stage: str) -> dict[str, str]:
        """``{label: key}`` of the stage's items in its latest earlier execution (to say what changed)."""
        latest = session.scalars(select(MapItemRecord.run_id).where(MapItemRecord.stage == stage)
                                 .order_by(MapItemRecord.id.desc()).limit(1)).first()
        if latest is None:
            return {}
        return dict(session.execute(select(MapItemRecord.label, MapItemRecord.key).where(
            MapItemRecord.run_id == latest, MapItemRecord.stage == stage)).all())

    def _submit_chunks(self: Any, run: MapRun) -> tuple[TaskSubmitted, ...]:
        if self.plan.abandoned is not None or self.plan.draining:
            return ()
        spec = run.spec
        cores = self.pilot.nodes * (self.pilot.cores_per_node or 1)
        gpus = self.pilot.nodes * (self.pilot.gpus_per_node or 0)
        now = time.time()
        submitted = []
        for chunk_id, _ in run.split(mapping.capacity(spec, cores, gpus)):
            self.chunk_of[chunk_id] = run
            submitted.append(TaskSubmitted(chunk_id, spec.request, now, self.priority[spec.name],
                                           self._preferred_nodes(spec.name), self.branch[spec.name]))
        return tuple(submitted)

    # --------------------------------------------------------------- launch
    def _apply_chunk(self: Any, instruction: Any) -> tuple[Any, LaunchSpec] | None:
        """The scheduler placed (or rejected) a chunk: its spec written, the map's task RUNNING with the first."""
        chunk_id = instruction.task_id
        run = self.chunk_of[chunk_id]
        spec = run.spec
        if isinstance(instruction, RejectTask):
            if not run.started:  # the request never fits: the plan's task is rejected, as a plain stage's
                for other in list(run.chunks):
                    self.chunk_of.pop(other, None)
                    if other != chunk_id:
                        self.scheduler.handle_event(TaskCancelled(other, time.time()))
                run.chunks.clear()
                del self.maps[spec.name]
                self._end_task(str(run.task), State.REJECTED, instruction.reason)
                self._feed(TaskRejected(run.task, instruction.reason,
                                        walltime=instruction.cause in ("walltime", "drain")))
                return None
            self._chunk_gone(chunk_id, {}, instruction.reason, State.WALLTIME if instruction.cause in
                             ("walltime", "drain") else None)
            return None
        assert isinstance(instruction, StartTask)
        from .orchestrator import _Live

        indices = run.chunks[chunk_id]
        items = [run.items[i] for i in indices]
        for item in items:
            run.set_state(item, State.RUNNING)
        nodes = self.backend.node_names()
        files = self._write_spec(spec, run.task, instruction, nodes, chunk=chunk_id.rsplit("/", 1)[1],
                                 items=[item.to_spec(spec.outputs) for item in items],
                                 isolation="fork" if run.isolated is not None else spec.map_isolation)
        if not run.started:
            run.started = True
            run.progress_file = files.directory / PROGRESS_FILE
            now = time.time()
            with self.store.session() as session:
                record = session.get(TaskRecord, str(run.task))
                if record is not None:
                    record.state = State.RUNNING
                    record.slots = [{"node": s.node, "cores": list(s.cores), "gpus": list(s.gpus),
                                     "node_name": nodes[s.node]} for s in instruction.slots]
                    session.add(AttemptRecord(task_id=str(run.task), stage_id=record.stage_id,
                                              number=run.task.attempt, state=State.RUNNING, started=now,
                                              attempt_dir=str(files.directory)))
                self.store.event(session, self.run_id, "task", str(run.task), State.RUNNING, items=len(run.items))
            self._feed(TaskStarted(run.task))
        live = self.live[chunk_id] = _Live(run.task, files.directory, instruction.slots, chunk=chunk_id)
        # each one-rank item is ended at the stage's timeout by its task (hetflow.tasks.mapitems); the task's
        # own limit is a backstop, and the limit of a multi-rank task's items, which share their processes
        timeout = None if spec.timeout is None else spec.timeout * len(items) + 10.0
        launch = LaunchSpec(task_id=chunk_id, argv=(sys.executable, "-m", "hetflow.tasks.worker", str(files.spec)),
                            slots=instruction.slots, cwd=files.directory, timeout=timeout,
                            stdout=files.stdout, stderr=files.stderr, env=self.launch_env(spec))
        return live, launch

    # -------------------------------------------------------------- outcome
    def _finish_chunk(self: Any, live: Any, outcome: TaskOutcome) -> None:
        """A chunk task ended: its items' results into the map, retries or the map's end."""
        run = self.chunk_of.get(live.chunk)
        if run is None:
            return
        spec = run.spec
        files = AttemptFiles(live.attempt_dir)
        ranks = files.read_results(len(live.slots))
        failure = self._failure(spec, live, outcome, ranks)
        lines = _merge(files, len(live.slots))
        if failure is None:
            failure = self._observed_differently(spec, ranks)
            if failure is not None:  # computed from other helpers or files than the run started with: not kept
                lines = {}
            else:
                run.observed.update(self._observed_record(spec, ranks))
        final = failure.state if failure is not None and failure.state in (State.CANCELLED, State.WALLTIME) else None
        if failure is not None and final is None and run.stopped is not None:
            final = run.stopped[0]
        self._chunk_gone(live.chunk, lines, None if failure is None else failure.message, final)

    def _chunk_gone(self: Any, chunk_id: str, lines: Mapping[int, Mapping[str, Any]], failure: str | None,
                    final: str | None) -> None:
        run = self.chunk_of.pop(chunk_id, None)
        if run is None:
            return
        indices = list(run.chunks.get(chunk_id, ()))
        isolated = run.isolated
        run.chunk_ended(chunk_id, lines, failure, final)
        if run.isolated is not None and isolated is None:  # said once; the map's later chunks fork each item
            log.warning("stage %s: %s", run.spec.name, run.isolated)
        self._record_items_done(run, indices)
        _write_progress(run)
        more = () if run.stopped is not None else self._submit_chunks(run)
        if more or run.running():
            if self.scheduler is not None:
                self._apply(self.scheduler.handle_event(TasksSubmitted(more, time.time(), (chunk_id,))))
            return
        self._complete_map(run, finished=chunk_id)

    def _complete_map(self: Any, run: MapRun, finished: str | None = None) -> None:
        """Every chunk has ended: assemble the outputs (or fail, naming the items), record, tell the plan."""
        spec = run.spec
        self.maps.pop(spec.name, None)
        if not run.started:
            run.started = True
            self._feed(TaskStarted(run.task))
        state, error = State.DONE, None
        committed: dict[str, ds.Manifest] = {}
        failed = run.failed()
        if run.stopped is not None:
            state, error = run.stopped
        elif len(failed) > mapping.allowed_failures(spec, len(run.items)):
            state, error = State.FAILED, f"stage {spec.name!r}: {run.failure_text()}"
        else:
            try:
                for name in spec.outputs:
                    where = self.datasets.path(name)
                    target = where if is_object_store(where) else str(self._private_dir(Path(where)))
                    self._refuse_if_reused(spec.name, name, target)
                    ds.uncommit(target)
                producer = {"run": self.run_id, "stage": spec.name, "attempt": run.task.attempt,
                            "items": len(run.items)}
                committed = mapping.assemble(spec, run.items, self.datasets.root, producer)
            except (ds.DatasetError, ValueError, OSError) as exc:
                state, error = State.FAILED, f"{type(exc).__name__}: {exc}"
        self._record_map(run, state, error, committed)
        if state != State.DONE:
            log.warning("stage %s: %s", spec.name, error)
        self._feed(AttemptEnded(run.task, state, error), finished=finished)

    def _record_map(self: Any, run: MapRun, state: str, error: str | None,
                    committed: Mapping[str, ds.Manifest]) -> None:
        spec = run.spec
        now = time.time()
        summary = run.summary(mapping.describe_changes(run.before, run.items, stage_reason=run.stage_reason))
        if state == State.DONE and run.failed():
            summary += f"; {run.failure_text()} (accepted: max_failures={spec.max_failures})"
        with self.store.session() as session:
            task = session.get(TaskRecord, str(run.task))
            if task is not None:
                task.state = state
                if task.attempt is not None:
                    task.attempt.state, task.attempt.ended, task.attempt.error = state, now, error
            for name, manifest in committed.items():
                self._record_dataset(session, name, manifest)
            record = self._stage_record(session, spec.name)
            record.cache_reason = summary
            run.row_counts = run.counts()  # the rows now: one per item, as it ended
            record.item_counts = dict(run.row_counts)
            material = self.material.get(spec.name)
            if state == State.DONE and not run.failed() and material is not None:
                # the whole map's key only when every item is in its output: else a rerun runs the failed ones
                record.cache_key, record.cache_material = material.key(), material.to_json()
            record.params_read = run.reads()  # what its items' rows, and its whole key, are matched on
            _record_observed(record, run, material)
            # the rows written as chunks ended are final (DONE items): kept; an earlier execution's are replaced
            session.execute(delete(MapItemRecord).where(MapItemRecord.run_id == self.run_id,
                                                        MapItemRecord.stage == spec.name,
                                                        MapItemRecord.id <= run.row_watermark))
            insert_rows(session, MapItemRecord, (_row(self.run_id, spec.name, item) for item in run.items
                                                 if item.index not in run.recorded))
            self.store.event(session, self.run_id, "task", str(run.task), state, error=error,
                             items=run.counts())

    def _record_items_done(self: Any, run: MapRun, indices: list[int]) -> None:
        """The items of a chunk that succeeded, recorded as it ends (with the loop step's transaction): an
        orchestrator killed before the map's end leaves them reusable, so its resume runs only the rest."""
        done = [run.items[i] for i in indices if run.items[i].state == State.DONE]
        if not done:
            return
        run.row_counts[State.DONE] = run.row_counts.get(State.DONE, 0) + len(done)
        with self.store.session() as session:
            session.execute(insert(MapItemRecord), [_row(self.run_id, run.spec.name, item) for item in done])
            record = self._stage_record(session, run.spec.name)
            record.item_counts = dict(run.row_counts)
            record.params_read = run.reads()  # with the rows it covers: a resume or a later run matches them
            _record_observed(record, run, self.material.get(run.spec.name))
        run.recorded.update(item.index for item in done)  # with this step's commit: the map's end leaves them

    # --------------------------------------------------------------- cancel
    def _cancel_map(self: Any, run: MapRun, cancel: CancelTask) -> None:
        """Stop a map: queued chunks withdrawn, running ones cancelled; it ends when they have."""
        reason_state = State.CANCELLED
        if run.stopped is None:
            run.stopped = (reason_state, cancel.reason)
        for chunk_id in list(run.chunks):
            if chunk_id in self.live:
                if self.backend is not None:
                    self.backend.cancel(chunk_id)
            else:
                if self.scheduler is not None:
                    self.scheduler.handle_event(TaskCancelled(chunk_id, time.time()))
                self.chunk_of.pop(chunk_id, None)
                run.chunk_ended(chunk_id, {}, cancel.reason, reason_state)
        if cancel.running and not run.running():  # nothing left to wait for: it ends now
            self._complete_map(run)
            return
        if not cancel.running:  # the plan has dropped the task: record its end, nothing more to tell it
            self.maps.pop(run.spec.name, None)
            self._end_task(str(run.task), State.CANCELLED, cancel.reason)


def _record_observed(record: StageRecord, run: MapRun, material: cache.KeyMaterial | None) -> None:
    """What the map's ranks observed so far (an earlier session's of the run too, when its items are reused),
    with the stage's record and its key's material: what its items, reused one by one, are checked against
    (:meth:`MapShell._drop_stale_items`)."""
    base = material.to_json() if material is not None else dict(record.cache_material or {})
    record.cache_material = {**base, "observed": dict(run.observed)}


def _row(run_id: str, stage: str, item: Any) -> dict[str, Any]:
    """``item`` as a :class:`MapItemRecord`'s columns."""
    return {"run_id": run_id, "stage": stage, "index": item.index, "key": item.key, "label": item.label,
            "state": item.state, "tries": item.tries, "error": item.error, "directory": item.directory,
            "outputs": item.outputs or None, "cached_from": item.cached_from, "started": item.started,
            "ended": item.ended, "log": item.log}


def _write_progress(run: MapRun) -> None:
    path = run.progress_file
    if path is None:
        return
    try:
        ds.write_json_atomic(path, {"text": run.progress_text(), "items": run.counts(), "total": len(run.items),
                                    "time": time.time()}, durable=False)
    except OSError as exc:  # only the display misses it
        log.warning("stage %s: map progress not recorded (%s)", run.spec.name, exc)


def _merge(files: AttemptFiles, ranks: int) -> dict[int, dict[str, Any]]:
    """Each item's result from every rank's lines: ``ok`` with every rank's partitions when every rank's
    line is ``ok``, else the first error; items a rank has no line for are left out."""
    per_rank = [files.read_item_results(rank) for rank in range(ranks)]
    merged: dict[int, dict[str, Any]] = {}
    for index, first in per_rank[0].items():
        lines = [lines.get(index) for lines in per_rank]
        if any(line is None for line in lines):
            errors = [line for line in lines if line is not None and line["status"] != "ok"]
            if errors:
                merged[index] = dict(errors[0])
            continue
        bad = [line for line in lines if line is not None and line["status"] != "ok"]
        if bad:
            merged[index] = dict(bad[0])
            continue
        outputs: dict[str, list[dict[str, Any]]] = {}
        read = first.get("params_read")  # the parameters any rank read; a rank that did not say read them all
        for line in lines[1:]:
            assert line is not None
            names = line.get("params_read")
            read = None if read is None or names is None else sorted({*read, *names})
        for line in lines:
            assert line is not None
            for name, part in (line.get("outputs") or {}).items():
                outputs.setdefault(name, [])
                if part is not None:
                    entry = {**part["partition"], "schema": part["schema"]}
                    outputs[name].append(mapping.shared(entry, "schema", "node"))
        merged[index] = mapping.shared({**first, "outputs": outputs, "params_read": read}, "log")
    return merged

