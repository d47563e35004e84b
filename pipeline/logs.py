"""Where a run's output is, and reading it back labelled: ``hetflow logs`` and ``hetflow run -v``.

Each rank writes its own ``rank-<r>.log`` in the attempt directory (the worker
redirects its stdout and stderr there); the launcher's own output stays in the
attempt's ``stdout.log``/``stderr.log``.  Lines are shown as
``[stage rank r] text`` and ``[stage launcher] text`` (``stage/attempt-k`` for an
attempt after the first, the name of its directory), so a reader can tell ranks
and launcher apart and ``grep`` one of them.  ``hetflow logs --follow`` names the
attempt on every line, the first's too: it cannot know which stage a retry will
follow, and the lines of running stages interleave.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hetflow.tasks.protocol import AttemptFiles
from sqlalchemy import select

from .errors import HetflowError, UnknownRun
from .store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord


class LogsError(HetflowError, ValueError):
    """A ``hetflow logs`` request names a stage, attempt or rank the run does not have."""


@dataclass(frozen=True)
class AttemptLogs:
    """The log files of one attempt of one stage."""

    stage: str
    attempt: int
    directory: Path
    state: str
    numbered: bool = False
    """Label the first attempt's lines with its number too (``stage/attempt-1``), as later attempts' are."""

    @property
    def files(self) -> AttemptFiles:
        return AttemptFiles(self.directory)

    def label(self, rank: int | None) -> str:
        name = self.stage if self.attempt == 1 and not self.numbered else f"{self.stage}/attempt-{self.attempt}"
        return f"[{name} launcher]" if rank is None else f"[{name} rank {rank}]"

    def sources(self, rank: int | None = None) -> list[tuple[str, Path]]:
        """``(label, path)`` of every log of this attempt: each rank's, then the launcher's two
        (only rank ``rank``'s when given)."""
        files = self.files
        ranks = [(self.label(r), p) for r, p in files.rank_logs().items() if rank is None or r == rank]
        if rank is not None:
            return ranks
        return ranks + [(self.label(None), files.stdout), (self.label(None), files.stderr)]

    def to_json(self) -> dict[str, object]:
        files = self.files
        return {"attempt": self.attempt, "directory": str(self.directory), "state": self.state,
                "ranks": {str(r): str(p) for r, p in files.rank_logs().items()},
                "launcher": [str(files.stdout), str(files.stderr)]}


def logs_target(store: Store, first: str | None, second: str | None) -> tuple[str, str | None]:
    """``hetflow logs [RUN] [STAGE]`` as ``(run id, stage or None)``.

    Two words are a run and a stage; none is the latest run.  One word is read as a run id (or
    unique prefix) first, else as a stage of the latest run; a word that is both (a stage named
    like a prefix of a run id) is refused with the two commands that say which is meant, and a
    word that is neither names the runs and the latest run's stages.
    """
    if second is not None or first is None:
        return store.resolve_run(first).id, second
    try:
        run: RunRecord | None = store.resolve_run(first)
    except UnknownRun as exc:
        run, not_a_run = None, str(exc)
    if run is not None and run.id == first:
        return run.id, None  # a whole id is that run
    latest = store.resolve_run(None)
    stages = _stage_names(store, latest.id)
    if run is not None and first in stages:
        raise LogsError(f"{first!r} is both a prefix of run {run.id} and a stage of the latest run {latest.id}: "
                        f"say which with `hetflow logs {run.id}` or `hetflow logs {latest.id} {first}`")
    if run is not None:
        return run.id, None
    if first in stages:
        return latest.id, first
    raise LogsError(f"{first!r} is neither a run nor a stage of the latest run {latest.id} (stages: {stages}); "
                    f"{not_a_run}")


def _stage_names(store: Store, run_id: str) -> list[str]:
    with store.session() as session:
        return list(session.scalars(select(StageRecord.name).where(StageRecord.run_id == run_id)
                                    .order_by(StageRecord.order)))


def run_logs(store: Store, run_id: str | None, stage: str | None = None,
             attempt: int | None = None) -> tuple[RunRecord, list[AttemptLogs]]:
    """The run and the attempts asked for: every stage's latest attempt by default, or ``stage``'s
    (its ``attempt``-th when given), in stage order.  Names what is not there."""
    run = store.resolve_run(run_id)
    with store.session() as session:
        rows = session.execute(select(StageRecord.name, AttemptRecord.number, AttemptRecord.attempt_dir,
                                      AttemptRecord.state)
                               .join(TaskRecord, TaskRecord.stage_id == StageRecord.id)
                               .join(AttemptRecord, AttemptRecord.task_id == TaskRecord.id)
                               .where(StageRecord.run_id == run.id)
                               .order_by(StageRecord.order, AttemptRecord.number)).all()
        names = list(session.scalars(select(StageRecord.name).where(StageRecord.run_id == run.id)
                                     .order_by(StageRecord.order)))
    if stage is not None and stage not in names:
        raise LogsError(f"run {run.id} has no stage {stage!r} (stages: {names})")
    by_stage: dict[str, list[AttemptLogs]] = {}
    for name, number, directory, state in rows:
        if stage is None or name == stage:
            by_stage.setdefault(name, []).append(AttemptLogs(name, number, Path(directory), state))
    if attempt is None:
        return run, [attempts[-1] for attempts in by_stage.values()]
    if stage is None:
        raise LogsError("--attempt needs a STAGE (attempts are numbered per stage)")
    chosen = [a for a in by_stage.get(stage, []) if a.attempt == attempt]
    if not chosen:
        have = [a.attempt for a in by_stage.get(stage, [])]
        raise LogsError(f"stage {stage!r} of run {run.id} has no attempt {attempt} (attempts: {have})")
    return run, chosen


def labelled(label: str, text: str) -> Iterator[str]:
    """``text``'s lines, each prefixed with ``label``."""
    for line in text.splitlines():
        yield f"{label} {line}"


@dataclass
class LogTail:
    """New complete lines of a set of growing files since the last :meth:`poll` (a partial last
    line waits for its end; :meth:`poll` with ``flush`` returns it too)."""

    offsets: dict[Path, int] = field(default_factory=dict)
    partial: dict[Path, bytes] = field(default_factory=dict)

    def poll(self, sources: list[tuple[str, Path]], *, flush: bool = False) -> list[str]:
        lines: list[str] = []
        for label, path in sources:
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            self.offsets[path] = start + len(data)
            data = self.partial.pop(path, b"") + data
            complete, _, rest = data.rpartition(b"\n")
            if rest and not flush:
                self.partial[path] = rest
                text = complete.decode(errors="replace")
            else:
                text = data.decode(errors="replace")
            lines.extend(labelled(label, text))
        return lines


def follow(store: Store, run_id: str, stage: str | None, rank: int | None, emit: Callable[[str], None], *,
           interval: float = 0.5) -> str:
    """Print the run's logs as they grow (new attempts included) until the run is no longer
    RUNNING, then what is left; returns the run's final state."""
    tail = LogTail()
    while True:
        store.reconcile_dead_runs()
        run = store.find_run(run_id)
        state = run.state if run is not None else "GONE"
        _, attempts = _all_attempts(store, run_id, stage)
        sources = [s for a in attempts for s in a.sources(rank)]
        ended = state != "RUNNING"
        for line in tail.poll(sources, flush=ended):
            emit(line)
        if ended:
            return state
        time.sleep(interval)


def _all_attempts(store: Store, run_id: str, stage: str | None) -> tuple[RunRecord, list[AttemptLogs]]:
    """Every attempt of the run (of ``stage``), in stage and attempt order, each labelled with its number:
    a follower shows retries too."""
    run, latest = run_logs(store, run_id, stage)
    attempts: list[AttemptLogs] = []
    for last in latest:
        for number in range(1, last.attempt + 1):
            directory = last.directory.parent / f"attempt-{number}"
            attempts.append(AttemptLogs(last.stage, number, directory, last.state if number == last.attempt else "",
                                        numbered=True))
    return run, attempts
