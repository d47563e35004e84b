"""Drive the real :class:`~hetflow.tasks.scheduler.Scheduler` with simulated time.

The driver plays the orchestrator's part: it submits a task when its parents
have finished (priority = the task's critical path over duration estimates,
group = its fair-share group), carries out ``StartTask`` by scheduling a
``TaskFinished`` at ``now + actual duration``, and measures

* placement decisions per second of CPU time spent inside ``handle_event``
  (the scheduler's own throughput; the driver's bookkeeping is not counted,
  and CPU time keeps the figure meaningful on a shared machine);
* core and GPU utilisation over the run (time-weighted, usable cores only);
* makespan against a lower bound: max(core-seconds / cores, GPU-seconds / GPUs,
  longest chain of actual durations);
* the cost of a decision as the pilot fills up (mean µs per event and per
  placement, binned by the core fill at the time of the event).

``hetflow simulate`` calls :func:`cli_main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .pilot import PilotDescription, load_pilot
from . import scheduler as _scheduler_module
from .scheduler import SPAN_FRACTION, RejectTask, Scheduler, StartTask, TaskFinished, TasksSubmitted, TaskSubmitted, check_span_fraction
from .timeline import Interval
from .workload import Workload, generate

logger = logging.getLogger(__name__)

FILL_BINS = 10


@dataclass
class SimulationResult:
    pilot: str
    nodes: int
    workload: str
    tasks: int
    placements: int
    rejected: int
    events: int
    scheduler_seconds: float
    wall_seconds: float
    placements_per_second: float
    core_utilization: float
    gpu_utilization: float
    makespan_s: float
    makespan_lower_bound_s: float
    lower_bounds: dict[str, float]
    decision_cost: list[dict[str, float]]
    span_fraction: float = 0.0
    nodes_per_spanning_task: float = 0.0  # mean nodes held by a task placed over several nodes
    scheduler_build: str = "python"  # or "mypyc": the compiled scheduler (see setup.py)
    intervals: list[Interval] = field(default_factory=list, repr=False)
    utilization_curve: list[tuple[float, float, float]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-task intervals and curve, as JSON-ready values."""
        data = dataclasses.asdict(self)
        data.pop("intervals")
        data.pop("utilization_curve")
        return data


def simulate(pilot: PilotDescription, workload: Workload, *, record_nodes: int = 0,
             curve_points: int = 400, span_fraction: float = SPAN_FRACTION) -> SimulationResult:
    """Run ``workload`` on ``pilot`` from t=0; keep intervals for the first ``record_nodes`` nodes."""
    pilot = pilot.resolve()
    scheduler = Scheduler(pilot, start_time=0.0, span_fraction=span_fraction)
    n = len(workload)
    priority = workload.critical_path()
    requests = workload.requests
    request_of = workload.request_of.tolist()
    estimate = workload.estimate.tolist()
    duration = workload.duration.tolist()
    group_names = [f"g{g}" for g in range(int(workload.group_of.max()) + 1 if n else 1)]
    group_of = workload.group_of.tolist()
    missing = np.diff(workload.dep_ptr).tolist()
    children: list[list[int]] = [[] for _ in range(n)]
    for task in range(n):
        for parent in workload.parents(task).tolist():
            children[parent].append(task)
    task_requests = [dataclasses.replace(r, duration=None) for r in requests]
    cores_of = [r.ranks * r.cores_per_rank for r in requests]
    gpus_of = [r.ranks * r.gpus_per_rank for r in requests]
    total_cores = pilot.nodes * len(pilot.usable_cores())
    total_gpus = pilot.nodes * (pilot.gpus_per_node or 0)

    finish: list[tuple[float, int]] = []
    started = [0.0] * n
    placements = rejected = events = 0
    spanning = spanning_nodes = 0
    sched_time = 0.0
    used_cores = used_gpus = 0
    core_area = gpu_area = 0.0
    last_t = 0.0
    bin_time = [0.0] * FILL_BINS
    bin_events = [0] * FILL_BINS
    bin_placements = [0] * FILL_BINS
    curve: list[tuple[float, float, float]] = []
    intervals: list[Interval] = []
    slots_of: dict[int, Any] = {}
    clock = time.thread_time  # CPU time of this thread: the scheduler's cost even on a busy machine
    wall0 = time.perf_counter()

    def run(event: Any) -> None:
        nonlocal placements, rejected, events, sched_time, used_cores, used_gpus, spanning, spanning_nodes
        fill = min(FILL_BINS - 1, int(FILL_BINS * used_cores / total_cores))
        t0 = clock()
        out = scheduler.handle_event(event)
        dt = clock() - t0
        sched_time += dt
        events += 1
        bin_time[fill] += dt
        bin_events[fill] += 1
        now = event.time
        for ins in out:
            task = int(ins.task_id)
            if isinstance(ins, StartTask):
                placements += 1
                bin_placements[fill] += 1
                started[task] = now
                used_cores += cores_of[request_of[task]]
                used_gpus += gpus_of[request_of[task]]
                heapq.heappush(finish, (now + duration[task], task))
                slots = ins.slots
                if len(slots) > 1 and slots[0].node != slots[-1].node:
                    spanning += 1
                    spanning_nodes += len({slot.node for slot in slots})
                if record_nodes and any(slot.node < record_nodes for slot in slots):
                    slots_of[task] = slots
            elif isinstance(ins, RejectTask):
                rejected += 1
                logger.info("rejected %s: %s", ins.task_id, ins.reason)

    def submit(tasks: list[int], now: float) -> None:
        """Tasks that became ready together go in as one batch, like the orchestrator's."""
        run(TasksSubmitted(tuple(
            TaskSubmitted(str(task), dataclasses.replace(task_requests[request_of[task]], duration=estimate[task]),
                          time=now, priority=float(priority[task]), group=group_names[group_of[task]])
            for task in tasks), time=now))

    submit([task for task in range(n) if missing[task] == 0], 0.0)
    curve.append((0.0, used_cores / total_cores, used_gpus / total_gpus if total_gpus else 0.0))
    now = 0.0
    while finish:
        now, task = heapq.heappop(finish)
        core_area += used_cores * (now - last_t)
        gpu_area += used_gpus * (now - last_t)
        last_t = now
        used_cores -= cores_of[request_of[task]]
        used_gpus -= gpus_of[request_of[task]]
        if task in slots_of:
            _record(intervals, task, workload, slots_of.pop(task), started[task], now, record_nodes)
        run(TaskFinished(str(task), time=now))
        ready = []
        for child in children[task]:
            missing[child] -= 1
            if missing[child] == 0:
                ready.append(child)
        if ready:
            submit(ready, now)
        curve.append((now, used_cores / total_cores, used_gpus / total_gpus if total_gpus else 0.0))
    makespan = now
    core_work, gpu_work = workload.work()
    chain = float(workload.critical_path(workload.duration).max()) if n else 0.0
    bounds = {"core_work_s": core_work / total_cores,
              "gpu_work_s": gpu_work / total_gpus if total_gpus else 0.0,
              "longest_chain_s": chain}
    cost = [{"fill_from": b / FILL_BINS, "fill_to": (b + 1) / FILL_BINS, "events": bin_events[b],
             "placements": bin_placements[b],
             "us_per_event": 1e6 * bin_time[b] / bin_events[b] if bin_events[b] else 0.0,
             "us_per_placement": 1e6 * bin_time[b] / bin_placements[b] if bin_placements[b] else 0.0}
            for b in range(FILL_BINS)]
    return SimulationResult(
        pilot=pilot.name, nodes=pilot.nodes, workload=workload.name, tasks=n, placements=placements,
        rejected=rejected, events=events, scheduler_seconds=sched_time, wall_seconds=time.perf_counter() - wall0,
        placements_per_second=placements / sched_time if sched_time else 0.0,
        core_utilization=core_area / (total_cores * makespan) if makespan else 0.0,
        gpu_utilization=gpu_area / (total_gpus * makespan) if makespan and total_gpus else 0.0,
        makespan_s=makespan, makespan_lower_bound_s=max(bounds.values()), lower_bounds=bounds,
        decision_cost=cost, span_fraction=span_fraction,
        nodes_per_spanning_task=spanning_nodes / spanning if spanning else 0.0,
        scheduler_build=scheduler_build(), intervals=intervals,
        utilization_curve=_downsample(curve, curve_points))


def scheduler_build() -> str:
    """``"mypyc"`` when the scheduler in use is the compiled build (``setup.py``), else ``"python"``."""
    return "python" if (_scheduler_module.__file__ or "").endswith(".py") else "mypyc"


def _record(intervals: list[Interval], task: int, workload: Workload, slots: Any, start: float,
            end: float, record_nodes: int) -> None:
    name = workload.kinds[int(workload.kind_of[task])]
    deps = tuple(str(p) for p in workload.parents(task).tolist())
    for slot in slots:
        if slot.node < record_nodes:
            intervals.append(Interval(str(task), name, f"node{slot.node:05d}", slot.cores, slot.gpus,
                                      start, end, "done", deps))


def _downsample(curve: list[tuple[float, float, float]], points: int) -> list[tuple[float, float, float]]:
    """Step curve → at most ``points`` samples (time-weighted mean over equal time bins)."""
    if len(curve) <= points or not curve:
        return curve
    end = curve[-1][0]
    if end <= 0:
        return curve[:points]
    times = np.array([c[0] for c in curve])
    cores = np.array([c[1] for c in curve])
    gpus = np.array([c[2] for c in curve])
    edges = np.linspace(0.0, end, points + 1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        # value at a time t is the last sample at or before t; integrate over [lo, hi)
        grid = np.linspace(lo, hi, 9)[:-1]
        idx = np.searchsorted(times, grid, side="right") - 1
        out.append((float(lo), float(cores[idx].mean()), float(gpus[idx].mean())))
    return out


# ------------------------------------------------------------------------ CLI
def cli_main(argv: list[str]) -> int:
    """``hetflow simulate``: run a workload on a pilot in simulated time and report."""
    parser = argparse.ArgumentParser(prog="hetflow simulate", description=cli_main.__doc__)
    parser.add_argument("--pilot", default="frontier", help="pilot config name or .yaml path (default: frontier)")
    parser.add_argument("--workload", default="mixed", help="builtin mix (mixed, saturating) or a .yaml/.json spec")
    parser.add_argument("--tasks", type=int, default=None, help="number of tasks (default: the spec's, else 10000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the spec's, else 1)")
    parser.add_argument("--nodes", type=int, default=None, help="override the pilot's node count")
    parser.add_argument("--span-fraction", type=float, default=SPAN_FRACTION,
                        help="a task spanning nodes uses only nodes with room for this fraction of an empty "
                             f"node's ranks (default {SPAN_FRACTION}; 0: any node with room for one rank)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--report", type=Path, default=None, help="write a timeline HTML here (and a .png beside)")
    parser.add_argument("--report-nodes", type=int, default=16, help="nodes drawn in the report's Gantt chart")
    args = parser.parse_args(argv)
    pilot = load_pilot(args.pilot)
    if args.nodes is not None:
        pilot = dataclasses.replace(pilot, nodes=args.nodes)
    workload = generate(args.workload, tasks=args.tasks, seed=args.seed)
    try:
        check_span_fraction(args.span_fraction, "--span-fraction")
    except ValueError as exc:
        parser.error(str(exc))
    result = simulate(pilot, workload, record_nodes=args.report_nodes if args.report else 0,
                      span_fraction=args.span_fraction)
    if args.report is not None:
        from .timeline import render_timeline
        render_timeline(result.intervals, pilot, args.report, args.report.with_suffix(".png"),
                        title=f"simulated: {workload.name} on {pilot.name} ({pilot.nodes} nodes)",
                        utilization=result.utilization_curve)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        _print_summary(result, sys.stdout)
    return 0


def _print_summary(result: SimulationResult, stream: Any) -> None:
    w = stream.write
    w(f"{result.workload}: {result.tasks} tasks on {result.pilot} ({result.nodes} nodes;"
      f" {result.scheduler_build} scheduler)\n")
    w(f"  placements/s (scheduler time): {result.placements_per_second:,.0f}"
      f"  ({result.placements} placements, {result.events} events, {result.scheduler_seconds:.2f} s;"
      f" wall {result.wall_seconds:.1f} s)\n")
    w(f"  utilisation: cores {100 * result.core_utilization:.1f}%  GPUs {100 * result.gpu_utilization:.1f}%\n")
    w(f"  makespan {result.makespan_s:,.0f} s, lower bound {result.makespan_lower_bound_s:,.0f} s "
      f"(ratio {result.makespan_s / max(result.makespan_lower_bound_s, 1e-9):.3f}; "
      + ", ".join(f"{k} {v:,.0f}" for k, v in result.lower_bounds.items()) + ")\n")
    if result.nodes_per_spanning_task:
        w(f"  tasks over several nodes hold {result.nodes_per_spanning_task:,.1f} nodes on average"
          f" (span fraction {result.span_fraction:g})\n")
    if result.rejected:
        w(f"  rejected: {result.rejected}\n")
    w("  decision cost by core fill:  fill      events  placements  us/event  us/placement\n")
    for row in result.decision_cost:
        if row["events"]:
            w(f"  {'':28}{row['fill_from']:.1f}-{row['fill_to']:.1f}  {row['events']:>8}  {row['placements']:>10}"
              f"  {row['us_per_event']:>8.1f}  {row['us_per_placement']:>12.1f}\n")
