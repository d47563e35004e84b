"""Read-only views of a run from the state store: what ``run()`` returns and ``status`` prints."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import RunFailed
from .states import State
from .storefile import Rows, iso, running_gone, sqlite_rows, unique_run
from .terminal import visible

if TYPE_CHECKING:
    from hetflow.operators.dataset import Dataset

    from .store import Store


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
        return self.state == State.DONE

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
        from hetflow.operators.dataset import (
            Dataset,  # pyarrow: not loaded by `hetflow status`
        )

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


def _json(value: Any) -> Any:
    """A JSON column's value: SQLite holds its text, other databases' drivers give it decoded."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def _in(name: str, values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``(:name0, :name1, ...)`` and its parameters, for ``IN``."""
    params = {f"{name}{i}": value for i, value in enumerate(values)}
    return "(" + ", ".join(f":{key}" for key in params) + ")", params


def _read_status(rows: Rows, run_id: str, store_url: str) -> RunStatus:
    """Run ``run_id`` (an existing id) as ``rows`` reads it, in a fixed number of statements whatever the number of
    its stages and the size of its maps (their items are counted on their stages' records)."""
    ((_, pipeline, state, created, started, ended, run_dir, script, error, rerun),) = rows(
        "SELECT id, pipeline, state, created, started, ended, run_dir, script, error, rerun FROM runs "
        "WHERE id = :run", {"run": run_id})
    records = rows('SELECT id, name, state, started, ended, error, cached_from, outputs, cache_reason, cache_hit, '
                   'item_counts FROM stages WHERE run_id = :run ORDER BY "order"', {"run": run_id})
    # a map stage's items by state: kept with its record as they are recorded (read whatever the map's
    # size); counted from the rows only for stages without (plain stages: an index look-up finds none)
    counted = {r[1]: dict(_json(r[10])) for r in records if _json(r[10])}
    uncounted = [r[1] for r in records if _json(r[10]) is None]
    if uncounted:
        names, params = _in("stage", uncounted)
        for stage_name, item_state, count in rows(
                f"SELECT stage, state, count(*) FROM map_items WHERE run_id = :run AND stage IN {names} "
                "GROUP BY stage, state", {"run": run_id, **params}):
            counted.setdefault(stage_name, {})[item_state] = count
    # per stage: how many of its tasks were launched and the last of them, in two statements (a map
    # stage has a task per chunk: loading them all, and each one's attempt, made status O(items))
    launched: dict[int, int] = dict(rows(
        "SELECT attempts.stage_id, count(*) FROM attempts JOIN stages ON stages.id = attempts.stage_id "
        "WHERE stages.run_id = :run GROUP BY attempts.stage_id", {"run": run_id}))
    # and each stage's last attempt, all in one statement (one a stage made a 1,000-stage run's status take a
    # thousand round trips)
    last = {row[0]: row[1:] for row in rows(
        "SELECT stage_id, slots, traceback, failed_rank, signal, attempt_dir FROM ("
        "SELECT tasks.stage_id AS stage_id, tasks.slots AS slots, attempts.traceback AS traceback, "
        "attempts.failed_rank AS failed_rank, attempts.signal AS signal, attempts.attempt_dir AS attempt_dir, "
        "row_number() OVER (PARTITION BY tasks.stage_id ORDER BY tasks.submitted DESC, attempts.id DESC) AS n "
        "FROM tasks JOIN attempts ON attempts.task_id = tasks.id JOIN stages ON stages.id = tasks.stage_id "
        "WHERE stages.run_id = :run) AS ranked WHERE n = 1", {"run": run_id})}
    stages = []
    for (stage_id, name, stage_state, stage_started, stage_ended, stage_error, cached_from, outputs, cache_reason,
         cache_hit, _) in records:
        slots_json, traceback, failed_rank, signal, attempt_dir = last.get(stage_id, ([], None, None, None, None))
        slots = tuple(SlotView(s.get("node_name", str(s["node"])), tuple(s["cores"]), tuple(s["gpus"]))
                      for s in (_json(slots_json) or []))
        stages.append(StageStatus(
            name=name, state=stage_state, attempts=launched.get(stage_id, 0), started=stage_started,
            ended=stage_ended, slots=slots, error=stage_error, traceback=traceback, failed_rank=failed_rank,
            signal=signal, cached_from=cached_from, outputs=tuple(_json(outputs) or ()), cache_reason=cache_reason,
            cache_hit=None if cache_hit is None else bool(cache_hit), log_dir=attempt_dir,
            items=counted.get(name)))
    datasets: dict[str, str] = dict(rows("SELECT name, path FROM datasets WHERE run_id = :run", {"run": run_id}))
    return RunStatus(id=run_id, pipeline=pipeline, state=state, created=created, started=started, ended=ended,
                     run_dir=run_dir, stages=tuple(stages), datasets=datasets, script=script, error=error,
                     rerun=tuple(_json(rerun) or ()), store_url=store_url)


def _session_rows(session: Any) -> Rows:
    """A :data:`~hetflow.storefile.Rows` reader through a :class:`~hetflow.store.Store` session."""
    from sqlalchemy import text

    return lambda sql, params: [tuple(row) for row in session.execute(text(sql), dict(params))]


def run_status(store: Store, run_id: str | None) -> RunStatus:
    """The status of run ``run_id`` (a unique prefix will do; ``None``: the latest run) read from
    ``store``; :class:`~hetflow.UnknownRun` naming what exists when there is no such run or the
    prefix is ambiguous."""
    found = store.resolve_run(run_id)
    with store.session() as session:
        return _read_status(_session_rows(session), found.id, str(store.url))


def quick_status(url: str, run_id: str | None) -> RunStatus | None:
    """:func:`run_status` of the SQLite store ``url`` read without SQLAlchemy (:mod:`hetflow.storefile`), as
    ``hetflow status`` answers; ``None`` where :class:`~hetflow.store.Store` must answer instead (not a SQLite
    file, no run or several that ``run_id`` names, a dead run to record FAILED, a store it cannot read)."""
    try:
        with sqlite_rows(url) as rows:
            if rows is None or running_gone(rows):
                return None
            found = unique_run(rows, run_id)
            return None if found is None else _read_status(rows, found, url)
    except sqlite3.Error:
        return None


EVERY_ROW = 2**62
"""``LIMIT`` for no limit: SQLite takes no ``OFFSET`` without one, and this is one every database takes."""


def _read_items(rows: Rows, run_id: str, stage: str, offset: int, limit: int | None) -> dict[str, Any]:
    """:func:`map_items` of run ``run_id`` (an existing id) as ``rows`` reads it."""
    def record_of(run: str) -> tuple[Any, ...] | None:
        found = rows("SELECT run_id, cached_from, cache_reason, item_counts FROM stages WHERE run_id = :run "
                     "AND name = :stage", {"run": run, "stage": stage})
        return found[0] if found else None

    record = record_of(run_id)
    if record is None:
        names = [name for (name,) in rows('SELECT name FROM stages WHERE run_id = :run ORDER BY "order"',
                                          {"run": run_id})]
        raise KeyError(f"run {run_id} has no stage {stage!r} (stages: {names})")

    def has_rows(run: str) -> bool:
        return bool(rows("SELECT id FROM map_items WHERE run_id = :run AND stage = :stage LIMIT 1",
                         {"run": run, "stage": stage}))

    source, counted = run_id, record
    if not has_rows(source) and record[1]:
        source = record[1]
        counted = record_of(source) or record
    if not has_rows(source):
        raise ValueError(f"stage {stage!r} of run {run_id} has no items recorded (a plain stage, or a map "
                         "stage that has not run)")
    counts = dict(_json(counted[3]) or {}) if counted[0] == source else {}
    if not counts:  # a store written before the counts were kept with the stage
        counts = dict(rows("SELECT state, count(*) FROM map_items WHERE run_id = :run AND stage = :stage "
                           "GROUP BY state", {"run": source, "stage": stage}))
    items = [{"index": index, "label": label, "state": state, "tries": tries, "error": error,
              "cached_from": cached_from, "started": iso(started), "ended": iso(ended)}
             for index, label, state, tries, error, cached_from, started, ended in rows(
                 'SELECT "index", label, state, tries, error, cached_from, started, ended FROM map_items '
                 'WHERE run_id = :run AND stage = :stage ORDER BY "index" LIMIT :limit OFFSET :offset',
                 {"run": source, "stage": stage, "offset": max(0, offset),
                  "limit": EVERY_ROW if limit is None else max(0, limit)})]
    return {"run": run_id, "stage": stage, "items_of_run": source, "counts": counts,
            "total": sum(counts.values()), "offset": max(0, offset), "summary": record[2], "items": items}


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
        return _read_items(_session_rows(session), found.id, stage, offset, limit)


ITEMS_INDEX = "ix_map_items_run_stage_index"
"""The index a page of items is read by; a store an older hetflow wrote gains it when a Store opens it."""


def quick_map_items(url: str, run_id: str | None, stage: str, *, offset: int = 0,
                    limit: int | None = None) -> dict[str, Any] | None:
    """:func:`map_items` of the SQLite store ``url`` read without SQLAlchemy, as ``hetflow status RUN STAGE
    --items`` answers; ``None`` where :class:`~hetflow.store.Store` must answer instead (as
    :func:`quick_status`, and a store without the items' index)."""
    try:
        with sqlite_rows(url) as rows:
            if rows is None or running_gone(rows) or not rows(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND name = :name", {"name": ITEMS_INDEX}):
                return None
            found = unique_run(rows, run_id)
            return None if found is None else _read_items(rows, found, stage, offset, limit)
    except sqlite3.Error:
        return None


def item_log(store: Store, run_id: str | None, stage: str, index: int) -> tuple[str, str]:
    """``(what, text)``: what item ``index`` of map stage ``stage`` printed (``hetflow logs RUN STAGE --item K``).

    A reused item's output is the one it printed when it ran, in the run that ran it.  ``KeyError`` names
    what is missing (the stage, the item, its output)."""
    from sqlalchemy import select

    from .store import MapItemRecord

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
