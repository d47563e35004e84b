"""The simulator: the real scheduler driven by simulated time over generated workloads."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import pytest

import hetflow.tasks.scheduler
from hetflow.tasks.errors import ConfigError
from hetflow.tasks.pilot import load_pilot
from hetflow.tasks.scheduler import SPAN_FRACTION
from hetflow.tasks.simulator import cli_main, simulate
from hetflow.tasks.workload import generate, load_spec

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]

# small single-node tasks, balanced 7 cores per GPU like a Frontier node, all ready at t=0
PACKING = {
    "name": "packing", "independent": True, "groups": 2, "estimate_slack": 0.2,
    "kinds": {
        "train": {"per_pipeline": 1, "ranks": [1, 2], "cores_per_rank": 1, "gpus_per_rank": 1,
                  "duration": {"median": 300, "sigma": 0.25}},
        "analysis": {"per_pipeline": 4, "ranks": 1, "cores_per_rank": [1, 6], "duration": {"median": 200, "sigma": 0.25}},
    },
}


def frontier(nodes: int):
    return dataclasses.replace(load_pilot("ornl-frontier"), nodes=nodes)


def test_cli_json_reports_the_required_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "sim.html"
    code = cli_main(["--pilot", str(ROOT / "pilot-configs" / "frontier.yaml"), "--nodes", "24",
                     "--workload", str(ROOT / "examples" / "workloads" / "frontier-mixed.yaml"),
                     "--tasks", "400", "--seed", "2", "--json", "--report", str(report)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("placements_per_second", "core_utilization", "gpu_utilization", "makespan_s",
                "makespan_lower_bound_s"):
        assert isinstance(data[key], float), key
    assert data["placements"] == data["tasks"] and data["rejected"] == 0
    assert 0 < data["core_utilization"] <= 1 and 0 < data["gpu_utilization"] <= 1
    assert data["makespan_s"] >= data["makespan_lower_bound_s"] * (1 - 1e-12) > 0
    assert sum(row["placements"] for row in data["decision_cost"]) == data["placements"]
    assert data["span_fraction"] == SPAN_FRACTION and data["nodes_per_spanning_task"] >= 2
    assert report.exists() and report.with_suffix(".png").exists()
    # which scheduler made the figures: the compiled one only when it is the one imported
    compiled = not hetflow.tasks.scheduler.__file__.endswith(".py")
    assert data["scheduler_build"] == ("mypyc" if compiled else "python")


def test_simulated_run_respects_dependencies_and_never_double_books() -> None:
    pilot = frontier(24)
    workload = generate("mixed", tasks=500, seed=5)
    result = simulate(pilot, workload, record_nodes=pilot.nodes)
    spans: dict[str, tuple[float, float]] = {}
    held: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for iv in result.intervals:
        spans[iv.task_id] = (iv.start, iv.end)
        for core in iv.cores:
            held[(iv.node, "core", core)].append((iv.start, iv.end))
        for gpu in iv.gpus:
            held[(iv.node, "gpu", gpu)].append((iv.start, iv.end))
        assert not set(iv.cores) & set(pilot.reserved_cores)
    assert len(spans) == len(workload) == result.placements
    for task in range(len(workload)):
        for parent in workload.parents(task).tolist():
            assert spans[str(task)][0] >= spans[str(parent)][1]
    for periods in held.values():
        periods.sort()
        for (_, end), (start, _) in zip(periods, periods[1:]):
            assert start >= end
    assert result.makespan_s >= result.makespan_lower_bound_s * (1 - 1e-12)  # equal when the chain binds


def test_saturating_small_tasks_keep_cores_and_gpus_busy() -> None:
    result = simulate(frontier(8), generate(PACKING, tasks=3000, seed=1))
    assert result.placements == result.tasks
    # each resource within 5% of the best any schedule could do (its work over the makespan bound)
    bound = result.makespan_lower_bound_s
    assert result.core_utilization > 0.95 * result.lower_bounds["core_work_s"] / bound, result.summary()
    assert result.gpu_utilization > 0.95 * result.lower_bounds["gpu_work_s"] / bound, result.summary()
    assert result.makespan_s < 1.05 * bound


def test_requests_bigger_than_the_pilot_are_rejected_not_queued() -> None:
    result = simulate(frontier(4), generate("mixed", tasks=200, seed=1))
    assert result.rejected > 0                       # 2..20-node dataframe tasks on a 4-node pilot
    assert result.placements + result.rejected <= result.tasks


def test_workload_specs_are_validated_and_seeded() -> None:
    a, b = generate("mixed", tasks=300, seed=4), generate("mixed", tasks=300, seed=4)
    assert (a.duration == b.duration).all() and (a.deps == b.deps).all()
    assert len(generate("mixed", tasks=300, seed=5)) > 250
    with pytest.raises(ConfigError, match="unknown key 'durations'"):
        load_spec({"kinds": {"x": {"durations": 3}}})
    with pytest.raises(ConfigError, match="unknown workload 'nope'"):
        load_spec("nope")
    spec = load_spec(ROOT / "examples" / "workloads" / "frontier-mixed.yaml")
    assert spec["tasks"] == 100000 and set(spec["kinds"]) == {"dataframe", "train", "train-node", "analysis"}


def test_spanning_tasks_use_few_nodes_on_a_saturated_pilot_without_idling_it() -> None:
    """The span fraction keeps MPI tasks on fewer nodes of a fragmented pilot than scattering freely
    (same workload, ~100 tasks per node so the pilot stays saturated), and the pilot stays as busy.
    (Short runs pay for it in the tail: see docs/benchmarks.md, "Scheduler".)"""
    workload = generate("saturating", tasks=25000, seed=2)
    free = simulate(frontier(256), workload, span_fraction=0.0)
    kept = simulate(frontier(256), workload)
    assert kept.span_fraction == SPAN_FRACTION > 0 and free.placements == kept.placements == len(workload)
    # dataframe tasks of 112-1,120 ranks, 56 per node at most: 2-20 nodes when packed
    assert kept.nodes_per_spanning_task < 0.8 * free.nodes_per_spanning_task, (kept.summary(), free.summary())
    assert kept.core_utilization > 0.99 * free.core_utilization, (kept.summary(), free.summary())
    assert kept.gpu_utilization > 0.99 * free.gpu_utilization, (kept.summary(), free.summary())


def test_span_fraction_outside_0_1_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--nodes", "4", "--tasks", "10", "--span-fraction", "1.5"])
    assert exit_info.value.code == 2 and "--span-fraction must be between 0 and 1, got 1.5" in capsys.readouterr().err
