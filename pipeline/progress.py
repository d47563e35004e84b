"""What a run shows while it runs: a live table on a terminal, plain lines elsewhere, labelled output.

One row per stage: state, ranks, slots, elapsed time, progress (from the ranks'
``ctx.progress`` files, which ``hf.ml.fit`` writes once per epoch with the
loss) and the last line a rank printed.  Everything is read from the attempt
directories of the running stages (:class:`~hetflow.tasks.protocol.AttemptFiles`),
never from the state store, so a refresh costs a few small file reads.

Modes: ``live`` (a rich table redrawn in place, on a terminal), ``notebook`` (the
same table as HTML, one display of the cell updated in place, in a Jupyter kernel),
``plain`` (one line per stage state change and, every :data:`PLAIN_INTERVAL`
seconds, one per running stage: what a CI log can keep) and ``off``.  With ``stream_logs``
(``hetflow run -v``) every line the ranks and launchers write is printed as
it comes, labelled ``[stage rank r]`` (see :mod:`hetflow.logs`).
"""

from __future__ import annotations

import html
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from hetflow.tasks.protocol import AttemptFiles

from .errors import PipelineError
from .logs import AttemptLogs, LogTail
from .states import FINISHED, State
from .terminal import visible

log = logging.getLogger(__name__)

PLAIN_INTERVAL_ENV = "HETFLOW_PROGRESS_INTERVAL"
PLAIN_INTERVAL = 30.0
"""Seconds between the plain progress lines of running stages (``$HETFLOW_PROGRESS_INTERVAL``)."""

Mode = Literal["live", "notebook", "plain", "off"]
NOTEBOOK_REFRESH = 0.5
"""Seconds between two redraws of the notebook display (each one is a message to the notebook's front end)."""
_STYLE = {State.RUNNING: "bold blue", State.DONE: "green", State.CACHED: "green", State.FAILED: "bold red", State.TIMED_OUT: "bold red",
          State.CANCELLED: "yellow", State.SKIPPED: "yellow", State.INTERRUPTED: "yellow"}


@dataclass(frozen=True)
class StageRow:
    """One stage as the live view shows it."""

    name: str
    state: str
    ranks: int
    slots: str
    elapsed: float | None
    progress: str
    last_line: str


def progress_text(reports: Mapping[int, Mapping[str, Any]]) -> str:
    """``"epoch 3/10 loss=0.3121"`` from the ranks' progress reports: the slowest rank's count,
    rank 0's metrics (the first reporting rank's when rank 0 has not reported)."""
    if not reports:
        return ""
    slowest = min(reports.values(), key=lambda r: float(r.get("done") or 0.0))
    first = reports[min(reports)]
    done, total, unit = slowest.get("done"), slowest.get("total"), str(slowest.get("unit") or "")
    count = _number(done) if total is None else f"{_number(done)}/{_number(total)}"
    text = f"{unit} {count}".strip()
    if total:
        text += f" {100.0 * float(done or 0.0) / float(total):.0f}%"
    metrics = first.get("metrics") or {}
    if isinstance(metrics, Mapping):
        text += "".join(f" {k}={_number(v, 4)}" for k, v in metrics.items())
    return text


def _number(value: Any, digits: int = 6) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def last_line(files: AttemptFiles, limit: int = 2048) -> str:
    """The last non-empty line any rank of the attempt wrote (the most recently written log)."""
    logs = list(files.rank_logs().values())
    best: tuple[float, str] | None = None
    for path in logs:
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - limit))
                lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if lines and (best is None or mtime >= best[0]):
            best = (mtime, _LOG_PREFIX.sub("", lines[-1].strip()))
    return best[1] if best else ""


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s+(\[[^\]]* rank \d+/\d+\]\s+)?")
"""The time and ``[stage rank r/n]`` that ``ctx.log`` puts before a message: the row says both already."""


def slot_text(slots: Sequence[Any]) -> str:
    """``"2 cores"``, ``"4 cores, 2 GPUs"`` (``"3 nodes, ..."`` when the slots span nodes)."""
    cores = sum(len(s.cores) for s in slots)
    gpus = sum(len(s.gpus) for s in slots)
    nodes = len({s.node for s in slots})
    parts = ([f"{nodes} nodes"] if nodes > 1 else []) + [f"{cores} core{'s' * (cores != 1)}"]
    if gpus:
        parts.append(f"{gpus} GPU{'s' * (gpus != 1)}")
    return ", ".join(parts)


def elapsed_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def plain_interval(text: str | None) -> float:
    """``$HETFLOW_PROGRESS_INTERVAL`` as seconds (default :data:`PLAIN_INTERVAL`); anything else is refused."""
    if not text:
        return PLAIN_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise PipelineError(f"{PLAIN_INTERVAL_ENV}={text!r} is not a number of seconds above 0")
    return seconds


def choose_mode(requested: bool | None, stream: TextIO) -> Mode:
    """``False``: off; otherwise a live table on a terminal, a display updated in place in a notebook's cell
    (a Jupyter kernel, the run started from its main thread: a cell's code), and plain lines elsewhere."""
    if requested is False:
        return "off"
    if stream.isatty():
        return "live"
    return "notebook" if in_notebook() and threading.current_thread() is threading.main_thread() else "plain"


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython with a kernel: what shows rich displays)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Progress:
    """The display of one run, fed by the orchestrator's loop (:meth:`update` after every event)."""

    def __init__(self, *, enabled: bool | None, stream_logs: bool = False, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.mode: Mode = choose_mode(enabled, self.stream)
        self.stream_logs = stream_logs
        self.interval = plain_interval(os.environ.get(PLAIN_INTERVAL_ENV))
        self._live: Any = None
        self._console: Any = None
        self._started = time.time()
        self._last_plain = 0.0
        self._last_draw = 0.0
        self._seen: dict[str, str] = {}
        self._times: dict[str, list[float | None]] = {}
        self._rows: dict[str, StageRow] = {}
        self._changes_read = 0  # how much of the orchestrator's state_changes the rows include
        self._tail = LogTail()
        self._following: dict[str, AttemptLogs] = {}
        self._display: Any = None  # the notebook's display handle (mode "notebook")

    # ---------------------------------------------------------------- loop
    def start(self, orchestrator: Any) -> None:
        self._started = time.time()
        if self.mode == "off" and not self.stream_logs:
            return
        Console = _rich_console()
        self._console = Console(file=self.stream, highlight=False)
        self._observe(orchestrator, self._started)
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(self.render(orchestrator), console=self._console, refresh_per_second=4,
                              transient=False, redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        elif self.mode == "notebook":
            from IPython.display import HTML, display

            self._display = display(HTML(self.html(orchestrator)), display_id=True)
        elif self.mode == "plain":
            self._say(f"hetflow: run {orchestrator.run_id} started ({len(orchestrator.stages)} stages)")

    def update(self, orchestrator: Any, scheduler: Any) -> None:
        if self.mode == "off" and not self.stream_logs:
            return
        now = time.time()
        changed = self._observe(orchestrator, now)
        if self.stream_logs:
            self._stream(orchestrator)
        if self.mode == "live" and self._live is not None and (changed or now - self._last_draw >= 0.25):
            self._last_draw = now
            self._live.update(self.render(orchestrator, scheduler))
        elif self.mode == "notebook" and self._display is not None and now - self._last_draw >= NOTEBOOK_REFRESH:
            self._last_draw = now
            self._redraw(orchestrator, scheduler)
        elif self.mode == "plain":
            for name in changed:
                self._plain_change(name, now)
            if now - self._last_plain >= self.interval:
                self._last_plain = now
                for row in self._rows.values():
                    if row.state == State.RUNNING and row.name not in changed:
                        self._say(self.plain_line(row, now))

    def stop(self, orchestrator: Any = None) -> None:
        if orchestrator is not None:
            changed = self._observe(orchestrator, time.time())
            if self.stream_logs:
                self._stream(orchestrator, final=True)
            if self.mode == "plain":
                for name in changed:
                    self._plain_change(name, time.time())
            if self._live is not None:
                self._live.update(self.render(orchestrator, getattr(orchestrator, "scheduler", None)))
            if self._display is not None:
                self._redraw(orchestrator, getattr(orchestrator, "scheduler", None))
        self._display = None
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._notes(orchestrator)

    def _notes(self, orchestrator: Any) -> None:
        """The orchestrator's end-of-run lines (``notes``: what the user must change), below the display; as
        warnings to the log when the display is off."""
        for name, note in sorted(getattr(orchestrator, "notes", {}).items()):
            if self.mode == "off":
                log.warning("stage %s: %s", name, note)
            else:
                self._say(f"hetflow: stage {name}: {note}")

    # ------------------------------------------------------------- state
    def _observe(self, orchestrator: Any, now: float) -> list[str]:
        """Refresh the rows of the stages whose state changed since the last look and of the running ones
        (every row the first time); returns the stages whose state changed."""
        live_by_stage = {live.stage: live for live in orchestrator.live.values()}
        changes = getattr(orchestrator, "state_changes", None)
        if changes is None or not self._rows:
            names: Iterable[str] = orchestrator.stages
        else:  # what an event can have changed: a display of 10^4 stages costs per event what one of ten does
            names = dict.fromkeys([*changes[self._changes_read:], *live_by_stage])
        self._changes_read = len(changes) if changes is not None else 0
        changed = []
        for name in names:
            spec = orchestrator.stages[name]
            state = orchestrator.states.get(name, State.PENDING)
            times = self._times.setdefault(name, [None, None])
            if state == State.RUNNING and times[0] is None:
                times[0] = now
            if state in FINISHED and times[1] is None and times[0] is not None:
                times[1] = now
            if self._seen.get(name) != state:
                self._seen[name] = state
                changed.append(name)
            live = live_by_stage.get(name)
            old = self._rows.get(name)
            if live is not None:
                files = AttemptFiles(live.attempt_dir)
                progress = progress_text(files.read_progress()) or (old.progress if old else "")
                line = last_line(files) or (old.last_line if old else "")
                slots = slot_text(live.slots)
                ranks = len(live.slots)
            else:
                progress = old.progress if old else ""
                line = old.last_line if old else ""
                slots = old.slots if old else ""
                ranks = old.ranks if old else spec.request.ranks
            mapped = getattr(orchestrator, "maps", {}).get(name)
            if mapped is not None:  # a map stage: its items' count, not one chunk's report
                progress = mapped.progress_text()
            elapsed = None if times[0] is None else (times[1] or now) - times[0]
            self._rows[name] = StageRow(name, state, ranks, slots, elapsed, progress, line)
        return changed

    def rows(self) -> list[StageRow]:
        return list(self._rows.values())

    def _stream(self, orchestrator: Any, final: bool = False) -> None:
        for live in orchestrator.live.values():
            key = str(live.attempt_dir)
            if key not in self._following:
                self._following[key] = AttemptLogs(live.stage, live.task.attempt, Path(live.attempt_dir), State.RUNNING)
        running = {str(live.attempt_dir) for live in orchestrator.live.values()}
        for key, attempt in list(self._following.items()):
            ended = key not in running
            for line in self._tail.poll(attempt.sources(), flush=ended or final):
                self._say(line)
            if ended:
                del self._following[key]

    def _plain_change(self, name: str, now: float) -> None:
        row = self._rows[name]
        if row.state == State.RUNNING or row.state in FINISHED:  # not every PENDING and QUEUED
            self._say(self.plain_line(row, now))

    def _say(self, line: str) -> None:
        line = visible(line)  # a stage's name and output: nothing that moves the cursor or retitles the terminal
        if self._console is not None:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=self.stream, flush=True)

    # ------------------------------------------------------------ render
    def plain_line(self, row: StageRow, now: float) -> str:
        text = f"hetflow: [{now - self._started:7.1f}s] {row.name} {row.state}"
        if row.state == State.RUNNING:
            text += f" ({row.ranks} rank{'s' * (row.ranks != 1)}, {row.slots})" if row.slots else ""
            if row.progress:
                text += f" {row.progress}"
            if row.last_line:
                text += f" | {row.last_line[:120]}"
        elif row.elapsed is not None and row.state in FINISHED:
            text += f" in {elapsed_text(row.elapsed)}"
        return text

    def _redraw(self, orchestrator: Any, scheduler: Any) -> None:
        from IPython.display import HTML

        self._display.update(HTML(self.html(orchestrator, scheduler)))

    def _title(self, orchestrator: Any, scheduler: Any) -> str:
        pilot = orchestrator.pilot
        total_cores = len(pilot.usable_cores()) * pilot.nodes
        total_gpus = (pilot.gpus_per_node or 0) * pilot.nodes
        used_cores = used_gpus = 0
        if scheduler is not None:
            for slots in scheduler.running.values():
                used_cores += sum(len(s.cores) for s in slots)
                used_gpus += sum(len(s.gpus) for s in slots)
        return (f"hetflow run {orchestrator.run_id}  {elapsed_text(time.time() - self._started)}  "
                f"cores {used_cores}/{total_cores}" + (f"  GPUs {used_gpus}/{total_gpus}" if total_gpus else ""))

    def html(self, orchestrator: Any, scheduler: Any = None) -> str:
        """The live table as HTML, for a notebook's display; every text from the run escaped."""
        e = html.escape
        cells = ("stage", "state", "ranks", "slots", "elapsed", "progress", "last output")
        head = "".join(f'<th style="text-align:left">{name}</th>' for name in cells)
        rows = []
        for row in self.rows():
            values = (row.name, row.state, str(row.ranks), row.slots, elapsed_text(row.elapsed), row.progress,
                      row.last_line[:120])
            rows.append("<tr>" + "".join(f'<td style="text-align:left">{e(visible(v, newlines=False))}</td>'
                                         for v in values) + "</tr>")
        return (f'<div class="hetflow-live"><b>{e(self._title(orchestrator, scheduler))}</b>'
                f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")

    def render(self, orchestrator: Any, scheduler: Any = None) -> Any:
        """The live table (a rich renderable)."""
        from rich.table import Table
        from rich.text import Text

        title = self._title(orchestrator, scheduler)
        table = Table(title=Text(title, style="bold"), title_justify="left", expand=False, pad_edge=False)
        for column, kwargs in (("stage", {}), ("state", {}), ("ranks", {"justify": "right"}), ("slots", {}),
                               ("elapsed", {"justify": "right"}), ("progress", {}),
                               ("last output", {"max_width": 60, "no_wrap": True, "overflow": "ellipsis"})):
            table.add_column(column, **kwargs)
        for row in self.rows():
            shown = [visible(text, newlines=False) for text in (row.name, row.slots, row.progress, row.last_line)]
            table.add_row(Text(shown[0]), Text(row.state, style=_STYLE.get(row.state, "dim")), str(row.ranks),
                          Text(shown[1]), elapsed_text(row.elapsed), Text(shown[2]), Text(shown[3]))
        return table


def _rich_console() -> Any:
    """``rich.console.Console``, imported without moving the user's generator: rich's first import draws from
    Python's global ``random`` (``rich.style`` seeds its ids with ``getrandbits``), and a session that seeded
    ``random`` before ``pipe.run()`` must find it where it left it (its stages get that state)."""
    import random

    state = random.getstate()
    try:
        from rich.console import Console
    finally:
        random.setstate(state)
    return Console
