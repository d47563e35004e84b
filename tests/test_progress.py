"""The run's display (pipeline/progress.py) on a plan of many stages: what one event costs it."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

from hetflow.progress import Progress
from hetflow.plan import Begin, CacheChecked, RunPlan, StageNode


class _CountingStages(dict):  # type: ignore[type-arg]
    """The orchestrator's stages, counting the ones the display looks up."""

    reads = 0

    def __getitem__(self, name: str) -> Any:
        self.reads += 1
        return super().__getitem__(name)

    def items(self) -> Any:
        self.reads += len(self)
        return super().items()

    def __iter__(self) -> Any:
        self.reads += len(self)
        return super().__iter__()


def test_the_plain_display_refreshes_the_stages_an_event_changed_not_every_stage():
    """A run of 10^4 stages printing plain lines (a batch job's log): after one stage ends, the display looks
    at that stage, not at all 10^4 (before, every event rebuilt every row)."""
    n = 10_000
    plan = RunPlan("r", [StageNode(f"s{i}") for i in range(n)])
    plan.handle_event(Begin())
    stages = _CountingStages({f"s{i}": SimpleNamespace(request=SimpleNamespace(ranks=1)) for i in range(n)})
    orchestrator = SimpleNamespace(run_id="r", stages=stages, live={}, maps={}, notes={}, states=plan.states,
                                   state_changes=plan.changes)
    stream = io.StringIO()
    progress = Progress(enabled=True, stream=stream)
    assert progress.mode == "plain"
    progress.start(orchestrator)
    assert len(progress.rows()) == n
    stages.reads = 0
    plan.handle_event(CacheChecked("s7", True, "unchanged"))
    progress.update(orchestrator, None)
    assert stages.reads <= 2, f"the display looked at {stages.reads} stages after one stage's event"
    assert "s7 DONE" in stream.getvalue()
    assert {row.name: row.state for row in progress.rows()}["s7"] == "DONE"
    assert sum(row.state == "LOOKING" for row in progress.rows()) == n - 1
