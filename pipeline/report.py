"""``hetflow report RUN``: the timeline of a real run, from the state store."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import select

from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.timeline import Interval, StageRow, render_timeline

from .store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord


def run_intervals(store: Store, run_id: str | None) -> tuple[RunRecord, list[Interval]]:
    """One interval per attempt per node it held; dependencies follow the datasets."""
    found = store.resolve_run(run_id)
    intervals: list[Interval] = []
    with store.session() as session:
        stages = list(session.scalars(select(StageRecord).where(StageRecord.run_id == found.id)))
        producer = {out: s.name for s in stages for out in s.outputs}
        last_task: dict[str, str] = {}
        rows = session.execute(select(StageRecord, TaskRecord, AttemptRecord)
                               .join(TaskRecord, TaskRecord.stage_id == StageRecord.id)
                               .join(AttemptRecord, AttemptRecord.task_id == TaskRecord.id)
                               .where(StageRecord.run_id == found.id)
                               .order_by(AttemptRecord.started)).all()
        for stage, task, _ in rows:
            last_task[stage.name] = task.id
        for stage, task, attempt in rows:
            deps = tuple(last_task[producer[d]] for d in stage.inputs if producer.get(d) in last_task)
            by_node: dict[str, tuple[list[int], list[int]]] = {}
            for slot in task.slots:
                cores, gpus = by_node.setdefault(slot.get("node_name", str(slot["node"])), ([], []))
                cores.extend(slot["cores"])
                gpus.extend(slot["gpus"])
            for node, (cores, gpus) in by_node.items():
                intervals.append(Interval(task_id=task.id, name=f"{stage.name}#{attempt.number}", node=node,
                                          cores=tuple(sorted(cores)), gpus=tuple(sorted(gpus)),
                                          start=attempt.started, end=attempt.ended or time.time(),
                                          state=attempt.state.lower(), deps=deps))
    return found, intervals


def stage_rows(store: Store, run_id: str) -> list[StageRow]:
    """The report's table: one row per stage; a map stage's row counts its items by state."""
    from .status import run_status

    rows = []
    for stage in run_status(store, run_id).stages:
        seconds = f"{stage.ended - stage.started:.2f}" if stage.started and stage.ended else ""
        items = ""
        if stage.items:
            total = sum(stage.items.values())
            items = f"{total:,} items: " + ", ".join(f"{n:,} {state.lower()}" for state, n in sorted(stage.items.items()))
        rows.append(StageRow(stage.name, stage.state, str(stage.attempts), seconds, items, stage.cache_reason or ""))
    return rows


def write_report(store: Store, run_id: str | None, html_path: Path | None = None) -> tuple[Path, Path | None]:
    """Write ``report.html`` (and ``.png``) 0600, never through a symlink.

    The default goes into the run directory, checked from the work directory
    down (``runs/<id>`` must not be a symlink); a path the user gives is taken
    as given up to its nearest existing directory.
    """
    run, intervals = run_intervals(store, run_id)
    run_dir = Path(run.run_dir)
    html = html_path or run_dir / "report.html"
    png = html.with_suffix(".png")
    base = run_dir.parent.parent if html_path is None else None
    pilot = PilotDescription.from_mapping(run.pilot, source=f"run {run.id}")
    render_timeline(intervals, pilot, html, png, title=f"hetflow run {run.id} ({run.state})", base=base,
                    stages=stage_rows(store, run.id))
    return html, png if png.exists() else None
