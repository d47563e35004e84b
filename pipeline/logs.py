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

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hetflow.operators.safeio import UnsafePath, open_regular
from hetflow.tasks.protocol import AttemptFiles
from sqlalchemy import select

from .errors import HetflowError, UnknownRun
from .mapping import chunk_dirs
from .states import State
from .store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord
from .terminal import visible


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
    by_stage: dict[str, list[list[AttemptLogs]]] = {}
    for name, number, directory, state in rows:
        if stage is None or name == stage:  # a map stage's attempt: each of its chunks' directories
            by_stage.setdefault(name, []).append([AttemptLogs(name, number, chunk, state)
                                                  for chunk in chunk_dirs(Path(directory))])
    if attempt is None:
        return run, [logs for attempts in by_stage.values() for logs in attempts[-1]]
    if stage is None:
        raise LogsError("--attempt needs a STAGE (attempts are numbered per stage)")
    chosen = [a for chunks in by_stage.get(stage, []) for a in chunks if a.attempt == attempt]
    if not chosen:
        have = [chunks[0].attempt for chunks in by_stage.get(stage, [])]
        raise LogsError(f"stage {stage!r} of run {run.id} has no attempt {attempt} (attempts: {have})")
    return run, chosen


READ_CHUNK = 1 << 20
"""Bytes read from a log file at a time: what a reader holds of a file, whatever its size."""

LINE_CAP = 64 << 10
"""The longest piece of one line shown as one labelled line (bytes): a longer line, or one without a
newline that keeps growing, is shown as several labelled lines of at most this many bytes, as it comes,
so a reader never holds more than a chunk and a cap of any file."""


def labelled(label: str, text: str) -> Iterator[str]:
    """``text``'s lines, each prefixed with ``label``, control characters made visible
    (:func:`~hetflow.terminal.visible`): a log line cannot move the cursor or retitle the terminal."""
    for line in text.splitlines():
        yield visible(f"{label} {line}", newlines=False)


def _cut(data: bytes, at: int) -> int:
    """``at`` moved back to the start of a UTF-8 character (a piece never splits one)."""
    for back in range(min(3, at - 1)):
        if data[at - back] & 0xC0 != 0x80:
            return at - back
    return at


@dataclass
class LogTail:
    """New lines of a set of growing files since the last :meth:`poll`, read a chunk at a time.  A
    partial last line waits for its end (:meth:`poll` with ``flush`` gives it too), but never past
    :data:`LINE_CAP` bytes: a longer one is given in pieces of that size as they come, each labelled."""

    offsets: dict[Path, int] = field(default_factory=dict)
    partial: dict[Path, bytes] = field(default_factory=dict)
    refused: set[Path] = field(default_factory=set)
    """Logs that are not regular files (a symlink, a FIFO): said once, never read."""

    def poll(self, sources: list[tuple[str, Path]], *, flush: bool = False) -> Iterator[str]:
        for label, path in sources:
            try:  # never through a symlink, never blocking on a FIFO planted in its place
                fh = os.fdopen(open_regular(path), "rb")
            except UnsafePath as exc:
                if path not in self.refused:
                    self.refused.add(path)
                    yield visible(f"{label} (not shown: {exc})", newlines=False)
                continue
            except OSError:  # a missing file is skipped
                continue
            with fh:
                fh.seek(self.offsets.get(path, 0))
                while chunk := fh.read(READ_CHUNK):
                    self.offsets[path] = fh.tell()
                    yield from self._lines(label, path, self.partial.pop(path, b"") + chunk)
            rest = self.partial.pop(path, b"") if flush else b""
            if rest:
                yield from labelled(label, rest.decode(errors="replace"))

    def _lines(self, label: str, path: Path, data: bytes) -> Iterator[str]:
        """The complete lines of ``data`` (and pieces of a line past the cap); keeps the rest for later."""
        complete, newline, rest = data.rpartition(b"\n")
        if not newline:
            complete, rest = b"", data
        if complete:
            yield from labelled(label, complete.decode(errors="replace"))
        while len(rest) > LINE_CAP:
            cut = _cut(rest, LINE_CAP)
            yield visible(f"{label} {rest[:cut].decode(errors='replace')}", newlines=False)
            rest = rest[cut:]
        if rest:
            self.partial[path] = rest


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
        ended = state != State.RUNNING
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
    seen: set[tuple[str, int]] = set()
    for last in latest:
        if (last.stage, last.attempt) in seen:
            continue  # one of a map stage's chunks: its attempts are listed with the first
        seen.add((last.stage, last.attempt))
        mapped = last.directory.name != f"attempt-{last.attempt}"  # attempt-<n>-c<k>: a map stage's chunk
        for number in range(1, last.attempt + 1):
            directory = last.directory.parent / (f"attempt-{number}-c0" if mapped else f"attempt-{number}")
            for chunk in chunk_dirs(directory) if mapped else [directory]:
                attempts.append(AttemptLogs(last.stage, number, chunk,
                                            last.state if number == last.attempt else "", numbered=True))
    return run, attempts
