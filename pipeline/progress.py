"""A live one-line progress display (stages done / running / waiting, slots in use)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Shows a rich status line on an interactive terminal; does nothing otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._live: Any = None
        self._started = time.time()

    def start(self, orchestrator: Any) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.live import Live

        self._started = time.time()
        self._live = Live(self._render(orchestrator, None), console=Console(file=sys.stderr),
                          refresh_per_second=4, transient=True)
        self._live.start()

    def update(self, orchestrator: Any, scheduler: Any) -> None:
        if self._live is not None:
            self._live.update(self._render(orchestrator, scheduler))

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _render(self, orchestrator: Any, scheduler: Any) -> Any:
        from rich.text import Text

        states = list(orchestrator.states.values())
        done = sum(s in ("DONE", "CACHED") for s in states)
        running = sum(s == "RUNNING" for s in states)
        failed = sum(s in ("FAILED", "TIMED_OUT", "SKIPPED", "CANCELLED") for s in states)
        waiting = len(states) - done - running - failed
        pilot = orchestrator.pilot
        total_cores = len(pilot.usable_cores()) * pilot.nodes
        total_gpus = (pilot.gpus_per_node or 0) * pilot.nodes
        used_cores = used_gpus = 0
        if scheduler is not None:
            for slots in scheduler.running.values():
                used_cores += sum(len(s.cores) for s in slots)
                used_gpus += sum(len(s.gpus) for s in slots)
        names = ", ".join(n for n, s in orchestrator.states.items() if s == "RUNNING")
        line = (f"{orchestrator.name} [{time.time() - self._started:6.1f}s] stages: {done} done, {running} running, "
                f"{waiting} waiting, {failed} failed | cores {used_cores}/{total_cores} gpus {used_gpus}/{total_gpus}")
        if names:
            line += f" | running: {names}"
        return Text(line)
