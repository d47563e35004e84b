"""Read-only views of a run from the state store: what ``run()`` returns and ``status`` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from .errors import RunFailed
from .store import AttemptRecord, DatasetRecord, MapItemRecord, RunRecord, StageRecord, Store, TaskRecord, iso
from .terminal import visible

if TYPE_CHECKING:
    from hetflow.operators.dataset import Dataset


@dataclass(frozen=True)
class SlotView:
    node: str
    cores: tuple[int, ...]
    gpus: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "cores": list(self.cores), "gpus": list(self.gpus)}


@dataclass(frozen=True)
class StageStatus:
    name: str
    state: str
    attempts: int
    started: float | None
    ended: float | None
    slots: tuple[SlotView, ...]
    error: str | None = None
    traceback: str | None = None
    failed_rank: int | None = None
    signal: int | None = None
    cached_from: str | None = None
    outputs: tuple[str, ...] = ()
    cache_hit: bool | None = None
    """Whether this run reused a committed output (``None``: the stage never got that far)."""
    cache_reason: str | None = None
    log_dir: str | None = None
    """The directory of the latest attempt: ``rank-<r>.log`` per rank, the launcher's ``stdout.log``/``stderr.log``."""
    items: dict[str, int] | None = None
    """A map stage's items by state (``{"DONE": 997, "CACHED": 3}``); ``None`` for a plain stage."""

    def logs(self) -> dict[str, Any] | None:
        """The latest attempt's log files (``None``: the stage never started)."""
        if self.log_dir is None:
            return None
        from hetflow.tasks.protocol import AttemptFiles

        files = AttemptFiles(Path(self.log_dir))
        return {"directory": self.log_dir, "ranks": {str(r): str(p) for r, p in files.rank_logs().items()},
                "launcher": [str(files.stdout), str(files.stderr)]}

    def to_json(self) -> dict[str, Any]:
        """This stage's record as JSON-ready values (what ``hetflow status --json`` prints per stage)."""
        return {"name": self.name, "state": self.state, "attempts": self.attempts,
                "started": iso(self.started), "ended": iso(self.ended),
                "slots": [s.to_json() for s in self.slots], "error": self.error,
                "failed_rank": self.failed_rank, "signal": self.signal, "traceback": self.traceback,
                "cached_from": self.cached_from, "outputs": list(self.outputs),
                "cache": {"hit": self.cache_hit, "from_run": self.cached_from, "reason": self.cache_reason},
                **({} if self.items is None else {"items": dict(self.items)}),
                "logs": self.logs()}


@dataclass(frozen=True, repr=False)
class RunStatus:
    """A run as recorded: ``id``, ``state`` and one :class:`StageStatus` per stage.

    Its ``repr`` is a line per stage; in a notebook it shows as a table (:mod:`hetflow.display`)."""

    id: str
    pipeline: str
    state: str
    created: float
    started: float | None
    ended: float | None
    run_dir: str
    stages: tuple[StageStatus, ...]
    datasets: dict[str, str] = field(default_factory=dict)
    script: str | None = None
    """The script ``hetflow resume`` re-executes (``None``: started from Python code)."""
    error: str | None = None
    """Why the run ended FAILED, INTERRUPTED or CANCELLED when no stage says (Ctrl-C, a cancel, no launcher)."""
    rerun: tuple[str, ...] = ()
    """The stages ``--rerun`` forced in this run (and downstream of them); every resume keeps forcing those
    that have not run in it yet."""
    store_url: str | None = None
    """The state store it was read from (a ``hetflow serve`` of that store is linked where it is shown)."""

    def __repr__(self) -> str:
        from .display import run_text

        return run_text(self)

    def _repr_html_(self) -> str:
        from .display import run_html, serve_link

        link = None
        if self.store_url is not None:
            link = serve_link(Path(self.run_dir).parent.parent, self.store_url, self.id)
        return run_html(self, link=link)

    @property
    def ok(self) -> bool:
        """Whether the run ended ``DONE``."""
        return self.state == "DONE"

    def stage(self, name: str) -> StageStatus:
        """The record of stage ``name``; ``KeyError`` naming the run's stages when there is none."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"run {self.id} has no stage {name!r} (stages: {[s.name for s in self.stages]})")

    def dataset(self, name: str) -> Dataset:
        """The committed output ``name`` as a :class:`~hetflow.operators.dataset.Dataset`
        (``.to_table()``, ``.partitions()``); ``KeyError`` if the run committed no such dataset."""
        if name not in self.datasets:
            raise KeyError(f"run {self.id} has no committed dataset {name!r} (datasets: {sorted(self.datasets)})")
        from hetflow.operators.dataset import Dataset   # pyarrow: not loaded by `hetflow status`

        return Dataset(self.datasets[name])

    def raise_for_state(self, where: Sequence[str] = ()) -> None:
        """Raise :class:`~hetflow.RunFailed` (carrying this status) unless the run is DONE; ``where``:
        the ``--workdir``/``--db`` arguments its resume command needs (:func:`hetflow.errors.store_argv`)."""
        if not self.ok:
            raise RunFailed(self, where)

    def for_terminal(self) -> RunStatus:
        """This status with every text from the run passed through :func:`~hetflow.terminal.visible`, as
        ``status`` and the run's summary print it: names, paths and reasons on one line, errors and
        tracebacks keeping their lines."""
        def one(text: str | None) -> Any:
            return None if text is None else visible(text, newlines=False)

        def lines(text: str | None) -> str | None:
            return None if text is None else visible(text)

        stages = tuple(replace(s, name=one(s.name), state=one(s.state), error=lines(s.error),
                               traceback=lines(s.traceback), cached_from=one(s.cached_from),
                               outputs=tuple(one(o) for o in s.outputs), cache_reason=one(s.cache_reason),
                               log_dir=one(s.log_dir),
                               slots=tuple(replace(sl, node=one(sl.node)) for sl in s.slots))
                       for s in self.stages)
        return replace(self, id=one(self.id), pipeline=one(self.pipeline), state=one(self.state),
                       run_dir=one(self.run_dir), stages=stages, script=one(self.script), error=lines(self.error),
                       datasets={one(k): one(v) for k, v in self.datasets.items()})

    def to_json(self) -> dict[str, Any]:
        """The run as JSON-ready values: what ``hetflow status --json`` prints."""
        return {"id": self.id, "pipeline": self.pipeline, "state": self.state, "created": iso(self.created),
                "started": iso(self.started), "ended": iso(self.ended), "run_dir": self.run_dir,
                "script": self.script, "error": self.error, "rerun": list(self.rerun), "stages": [s.to_json() for s in self.stages], "datasets": dict(self.datasets)}


def run_status(store: Store, run_id: str | None) -> RunStatus:
    """The status of run ``run_id`` (a unique prefix will do; ``None``: the latest run) read from
    ``store``; :class:`~hetflow.UnknownRun` naming what exists when there is no such run or the
    prefix is ambiguous."""
    found = store.resolve_run(run_id)
    with store.session() as session:
        run = session.get(RunRecord, found.id)
        assert run is not None
        stages = []
        records = list(session.scalars(select(StageRecord).where(StageRecord.run_id == run.id)
                                       .order_by(StageRecord.order)))
        # a map stage's items by state: kept with its record as they are recorded (read whatever the map's
        # size); counted from the rows only for stages without (plain stages: an index look-up finds none)
        counted = {r.name: dict(r.item_counts) for r in records if r.item_counts}
        uncounted = [r.name for r in records if r.item_counts is None]
        if uncounted:
            for stage_name, state, count in session.execute(
                    select(MapItemRecord.stage, MapItemRecord.state, func.count())
                    .where(MapItemRecord.run_id == run.id, MapItemRecord.stage.in_(uncounted))
                    .group_by(MapItemRecord.stage, MapItemRecord.state)):
                counted.setdefault(stage_name, {})[state] = count
        # per stage: how many of its tasks were launched and the last of them, in two statements (a map
        # stage has a task per chunk: loading them all, and each one's attempt, made status O(items))
        launched = dict(session.execute(
            select(AttemptRecord.stage_id, func.count()).join(StageRecord, StageRecord.id == AttemptRecord.stage_id)
            .where(StageRecord.run_id == run.id).group_by(AttemptRecord.stage_id)).all())
        for record in records:
            last = session.scalars(select(TaskRecord).join(AttemptRecord, AttemptRecord.task_id == TaskRecord.id)
                                   .where(TaskRecord.stage_id == record.id)
                                   .order_by(TaskRecord.submitted.desc(), AttemptRecord.id.desc()).limit(1)).first()
            slots = tuple(SlotView(s.get("node_name", str(s["node"])), tuple(s["cores"]), tuple(s["gpus"]))
                          for s in (last.slots if last else []))
            attempt = last.attempt if last else None
            stages.append(StageStatus(
                name=record.name, state=record.state, attempts=launched.get(record.id, 0), started=record.started,
                ended=record.ended, slots=slots, error=record.error,
                traceback=attempt.traceback if attempt else None,
                failed_rank=attempt.failed_rank if attempt else None,
                signal=attempt.signal if attempt else None, cached_from=record.cached_from,
                outputs=tuple(record.outputs), cache_reason=record.cache_reason,
                cache_hit=record.cache_hit, log_dir=attempt.attempt_dir if attempt else None,
                items=counted.get(record.name)))
        datasets = {d.name: d.path for d in session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == run.id))}
        return RunStatus(id=run.id, pipeline=run.pipeline, state=run.state, created=run.created, started=run.started,
                         ended=run.ended, run_dir=run.run_dir, stages=tuple(stages), datasets=datasets,
                         script=run.script, error=run.error, rerun=tuple(run.rerun or ()), store_url=str(store.url))


def map_items(store: Store, run_id: str | None, stage: str, *, offset: int = 0,
              limit: int | None = None) -> dict[str, Any]:
    """The items of map stage ``stage`` of run ``run_id`` (``hetflow status RUN STAGE --items``): each item's
    index, label, state, tries and error, in index order from item ``offset`` on, at most ``limit`` of them
    (``None``: all); ``counts`` by state and ``total`` cover every item; ``summary``, the stage's line (``map
    1,000 items: ...``, and why its items ran in a process each when one changed state,
    :mod:`hetflow.tasks.mapitems`).  A stage reused whole from another run lists that run's items.
    ``KeyError`` when the run has no such stage, ``ValueError`` when it is not a map stage with items.

    A page reads only its rows (the ``run_id, stage, index`` index) and the counts come from the stage's
    record, so a page costs the same whatever the map's size."""
    found = store.resolve_run(run_id)
    with store.session() as session:
        record = session.scalars(select(StageRecord).where(StageRecord.run_id == found.id,
                                                           StageRecord.name == stage)).first()
        if record is None:
            names = list(session.scalars(select(StageRecord.name).where(StageRecord.run_id == found.id)
                                         .order_by(StageRecord.order)))
            raise KeyError(f"run {found.id} has no stage {stage!r} (stages: {names})")

        def has_rows(run: str) -> bool:
            return session.scalar(select(MapItemRecord.id).where(MapItemRecord.run_id == run,
                                                                 MapItemRecord.stage == stage).limit(1)) is not None

        source, counted = found.id, record
        if not has_rows(source) and record.cached_from:
            source = record.cached_from
            counted = session.scalars(select(StageRecord).where(StageRecord.run_id == source,
                                                                StageRecord.name == stage)).first() or record
        if not has_rows(source):
            raise ValueError(f"stage {stage!r} of run {found.id} has no items recorded (a plain stage, or a map "
                             "stage that has not run)")
        counts = dict(counted.item_counts or {}) if counted.run_id == source else {}
        if not counts:  # a store written before the counts were kept with the stage
            counts = dict(session.execute(select(MapItemRecord.state, func.count()).where(
                MapItemRecord.run_id == source, MapItemRecord.stage == stage)
                .group_by(MapItemRecord.state)).tuples().all())
        query = select(MapItemRecord.index, MapItemRecord.label, MapItemRecord.state, MapItemRecord.tries,
                       MapItemRecord.error, MapItemRecord.cached_from, MapItemRecord.started,
                       MapItemRecord.ended).where(MapItemRecord.run_id == source, MapItemRecord.stage == stage) \
            .order_by(MapItemRecord.index).offset(max(0, offset))
        if limit is not None:
            query = query.limit(max(0, limit))
        items = [{"index": index, "label": label, "state": state, "tries": tries, "error": error,
                  "cached_from": cached_from, "started": iso(started), "ended": iso(ended)}
                 for index, label, state, tries, error, cached_from, started, ended in session.execute(query)]
        return {"run": found.id, "stage": stage, "items_of_run": source, "counts": counts,
                "total": sum(counts.values()), "offset": max(0, offset), "summary": record.cache_reason,
                "items": items}


def item_log(store: Store, run_id: str | None, stage: str, index: int) -> tuple[str, str]:
    """``(what, text)``: what item ``index`` of map stage ``stage`` printed (``hetflow logs RUN STAGE --item K``).

    A reused item's output is the one it printed when it ran, in the run that ran it.  ``KeyError`` names
    what is missing (the stage, the item, its output)."""
    view = map_items(store, run_id, stage, limit=0)  # which run's items, and how many
    with store.session() as session:
        record = session.scalars(select(MapItemRecord).where(MapItemRecord.run_id == view["items_of_run"],
                                                             MapItemRecord.stage == stage,
                                                             MapItemRecord.index == index)
                                 .order_by(MapItemRecord.id.desc()).limit(1)).first()
        if record is None:
            raise KeyError(f"stage {stage!r} of run {view['run']} has no item {index} "
                           f"(items 0 to {view['total'] - 1})")
        ran: MapItemRecord | None = record
        if record.log is None:  # reused: the run that ran it has its output
            ran = session.scalars(select(MapItemRecord).where(MapItemRecord.key == record.key,
                                                              MapItemRecord.log.is_not(None))
                                  .order_by(MapItemRecord.id.desc()).limit(1)).first()
        if ran is None or not ran.log:
            raise KeyError(f"item {index} ({record.label}) of stage {stage!r} has no recorded output")
        path, start, end = ran.log
        what = f"item {index} ({record.label}) of stage {stage!r}, run {ran.run_id}: {path}"
    try:
        with open(path, "rb") as fh:
            fh.seek(int(start))
            data = fh.read(max(0, int(end) - int(start)))
    except OSError as exc:
        raise KeyError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    return what, data.decode(errors="replace")
