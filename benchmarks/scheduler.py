"""Scheduler decision cost against pilot size.

Runs the simulator on Frontier-shaped pilots of several sizes with the same
load per node (``--tasks-per-node``), and prints placements per second of
scheduler CPU time, the mean cost of a placement once the pilot is at least
90% full, and utilisation.  If the cost per decision does not grow with the
node count, the scheduler is sub-linear in pilot size for this workload.

    .venv/bin/python benchmarks/scheduler.py                       # 64, 512, 4096, 9408 nodes
    .venv/bin/python benchmarks/scheduler.py --nodes 64 512 --json-out /tmp/sched.json
    make compiled && PYTHONPATH=build/compiled .venv/bin/python benchmarks/scheduler.py   # the mypyc build
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from hetflow.tasks.pilot import load_pilot
from hetflow.tasks.scheduler import SPAN_FRACTION, check_span_fraction
from hetflow.tasks.simulator import scheduler_build, simulate
from hetflow.tasks.workload import generate


def run(nodes: int, tasks_per_node: int, workload: str, seed: int, span_fraction: float) -> dict[str, float]:
    pilot = dataclasses.replace(load_pilot("ornl-frontier"), nodes=nodes)
    result = simulate(pilot, generate(workload, tasks=tasks_per_node * nodes, seed=seed), span_fraction=span_fraction)
    full = [row for row in result.decision_cost if row["fill_from"] >= 0.9]
    placed = sum(row["placements"] for row in full)
    cost = sum(row["us_per_placement"] * row["placements"] for row in full) / placed if placed else 0.0
    return {"nodes": nodes, "tasks": result.tasks, "placements": result.placements,
            "placements_per_second": result.placements_per_second,
            "us_per_placement_when_90pct_full": cost,
            "us_per_placement_overall": 1e6 * result.scheduler_seconds / max(result.placements, 1),
            "core_utilization": result.core_utilization, "gpu_utilization": result.gpu_utilization,
            "makespan_s": result.makespan_s, "makespan_lower_bound_s": result.makespan_lower_bound_s,
            "nodes_per_spanning_task": result.nodes_per_spanning_task}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 512, 4096, 9408])
    parser.add_argument("--tasks-per-node", type=int, default=10)
    parser.add_argument("--workload", default="saturating")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--span-fraction", type=float, default=SPAN_FRACTION,
                        help=f"the scheduler's span_fraction (default {SPAN_FRACTION}; 0: scatter freely)")
    parser.add_argument("--json-out", type=Path, default=Path("benchmarks/results/scheduler.json"))
    args = parser.parse_args(argv)
    try:
        check_span_fraction(args.span_fraction, "--span-fraction")
    except ValueError as exc:
        parser.error(str(exc))
    rows = []
    print(f"scheduler build: {scheduler_build()}; span fraction {args.span_fraction:g}")
    print(f"{'nodes':>6} {'tasks':>8} {'placements/s':>13} {'us/placement':>13} {'us/pl. >=90% full':>18}"
          f" {'cores':>7} {'GPUs':>7} {'makespan/LB':>12}")
    for nodes in args.nodes:
        row = run(nodes, args.tasks_per_node, args.workload, args.seed, args.span_fraction)
        rows.append(row)
        print(f"{nodes:>6} {row['tasks']:>8} {row['placements_per_second']:>13,.0f} "
              f"{row['us_per_placement_overall']:>13.1f} {row['us_per_placement_when_90pct_full']:>18.1f} "
              f"{100 * row['core_utilization']:>6.1f}% {100 * row['gpu_utilization']:>6.1f}% "
              f"{row['makespan_s'] / row['makespan_lower_bound_s']:>12.3f}", flush=True)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    args.json_out.write_text(json.dumps({"workload": args.workload, "tasks_per_node": args.tasks_per_node,
                                         "scheduler_build": scheduler_build(),
                                         "span_fraction": args.span_fraction,
                                         "load_average_1min": load, "cpu_count": os.cpu_count(),
                                         "rows": rows}, indent=2))
    print(f"written {args.json_out} (1-min load average {load:.1f} on {os.cpu_count()} CPUs; "
          "times are CPU time inside the scheduler)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
