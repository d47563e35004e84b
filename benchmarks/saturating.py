"""The simulator's saturating workload, scaled to this machine, placed by the simulator and run for real.

    python benchmarks/saturating.py [--tasks 10000] [--repeats 1] [--out FILE.json]
    python benchmarks/throughput.py --saturating 10000      # the same, as part of the throughput benchmark

``hetflow simulate --workload saturating`` measures the scheduler alone: the
placements it decides per second of its own time, on a model of Frontier. This
benchmark puts the same workload (the builtin ``saturating`` spec, same seed)
through the real runtime: every task a plain hetflow stage on the local pilot,
placed by the same scheduler, started, recorded and finished, start-up
included. Beside it, the simulator on the same scaled workload and pilot.

The workload is scaled from a Frontier node (56 cores, 8 GPUs) to this
machine's pilot (``--cores`` cores, ``--gpus`` GPUs, default 2 and 2): a
task keeps its kind and its GPUs per rank, and its ranks are capped at the
node's cores (the dataframe tasks, 2-20 Frontier nodes each, take the whole
node: 2 ranks; the 4-rank training tasks 2 ranks with a GPU each; the rest
one rank). No task spans nodes, as the pilot has one. The GPUs are declared on
the pilot, not probed: the tasks are zero-length (a stage that returns no
output), so none touches a device; what is measured is the runtime's cost of
placing, starting and recording each task.

Reported, medians with min-max over ``--repeats``: real tasks per second end
to end (``N / T``, from before ``python script.py`` starts to all stages
ended), real tasks per second in ``pipe.run()``, the CPU seconds of all the
run's processes per task, the script's (the orchestrator's) peak RSS, the
store's size on disk, and the simulator's placements per second of
scheduler time with its wall time for the whole workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.simulator import simulate
from hetflow.tasks.workload import Workload, generate

SCRIPT = '''
import json, resource, time
import hetflow as hf

pipe = hf.Pipeline("saturating", pilot=hf.PilotDescription(
    name="saturating", cores_per_node={cores}, gpus_per_node={gpus}, memory_per_node=2**33))
REQUESTS = json.loads({requests!r})


def make(i):
    def body(ctx):
        return {{}}
    return body


for i, (ranks, gpus_per_rank) in enumerate(REQUESTS):
    pipe.stage(make(i), name=f"t{{i}}", ranks=ranks, gpus_per_rank=gpus_per_rank)

if __name__ == "__main__":
    started = time.perf_counter()
    run = pipe.run(progress=False)
    print("RESULTS_AT", time.time(), flush=True)
    print("RSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, flush=True)
    print("SECONDS", time.perf_counter() - started, run.state)
'''


def scaled(tasks: int, cores: int, gpus: int, seed: int = 1) -> Workload:
    """The ``saturating`` workload of ``tasks`` tasks with each request fitted to one node of ``cores`` cores
    and ``gpus`` GPUs (ranks capped at the cores; GPU kinds kept only if the node has GPUs), each lasting a
    microsecond in the simulator (a request's duration must be positive) and nothing in the real run."""
    workload = generate("saturating", tasks=tasks, seed=seed)
    requests = []
    for request in workload.requests:
        ranks = min(request.ranks, cores)
        gpus_per_rank = request.gpus_per_rank if ranks * request.gpus_per_rank <= gpus else 0
        requests.append(ResourceRequest(ranks=ranks, cores_per_rank=1, gpus_per_rank=gpus_per_rank))
    instant = np.full(len(workload), 1e-6, dtype=np.float64)
    return dataclasses.replace(workload, requests=tuple(requests), duration=instant, estimate=instant)


def pilot(cores: int, gpus: int) -> PilotDescription:
    return PilotDescription(name="saturating", cores_per_node=cores, gpus_per_node=gpus, memory_per_node=2**33)


def real_run(workload: Workload, cores: int, gpus: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """One run of the workload as plain stages in a fresh ``python script.py`` and work directory."""
    per_task = [[workload.requests[r].ranks, workload.requests[r].gpus_per_rank]
                for r in workload.request_of.tolist()]
    with tempfile.TemporaryDirectory(prefix="hf-saturating-") as tmp:
        path = Path(tmp) / "pipeline.py"
        path.write_text(SCRIPT.format(cores=cores, gpus=gpus, requests=json.dumps(per_task)))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.time()
        done = subprocess.run([sys.executable, str(path)], cwd=tmp, capture_output=True, text=True, timeout=7200,
                              check=False, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        marks = {}
        for line in done.stdout.splitlines():
            name, _, value = line.partition(" ")
            if name in ("RESULTS_AT", "SECONDS", "RSS_MB"):
                marks[name] = float(value.split()[0])
        if done.returncode != 0 or "RESULTS_AT" not in marks or not done.stdout.rstrip().endswith("DONE"):
            raise RuntimeError(f"saturating x{len(workload)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
        store = sum(p.stat().st_size for p in (Path(tmp) / ".hetflow").glob("hetflow.db*"))
        return {"total": marks["RESULTS_AT"] - started, "in_run": marks["SECONDS"], "cpu": cpu,
                "rss_mb": marks["RSS_MB"], "store_mb": store / 2**20}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(values: list[float], digits: int = 1) -> str:
    s = _summary(values)
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


def run(tasks: int, repeats: int = 1, cores: int = 2, gpus: int = 2, seed: int = 1,
        env: dict[str, str] | None = None) -> dict[str, Any]:
    """Simulator and real runs of the scaled workload, alternated; prints a table, returns the figures."""
    workload = scaled(tasks, cores, gpus, seed)
    n = len(workload)
    kinds: dict[str, int] = {}
    for k in workload.kind_of.tolist():
        kinds[workload.kinds[k]] = kinds.get(workload.kinds[k], 0) + 1
    shapes = {workload.kinds[int(workload.kind_of[i])]: dataclasses.asdict(workload.requests[int(r)])
              for i, r in enumerate(workload.request_of.tolist())}
    figures: dict[str, list[float]] = {"sim_placements_per_s": [], "sim_wall_s": [], "end_to_end": [],
                                       "in_run": [], "cpu_ms_per_task": [], "orchestrator_rss_mb": [],
                                       "store_mb": []}
    loads = []
    for repeat in range(repeats):
        result = simulate(pilot(cores, gpus), workload)
        figures["sim_placements_per_s"].append(result.placements_per_second)
        figures["sim_wall_s"].append(result.wall_seconds)
        loads.append(os.getloadavg()[0])
        got = real_run(workload, cores, gpus, env)
        figures["end_to_end"].append(n / got["total"])
        figures["in_run"].append(n / got["in_run"])
        figures["cpu_ms_per_task"].append(1000 * got["cpu"] / n)
        figures["orchestrator_rss_mb"].append(got["rss_mb"])
        figures["store_mb"].append(got["store_mb"])
        print(f"repeat {repeat + 1}: simulator {result.placements_per_second:,.0f} placements/s; real "
              f"{n / got['total']:.1f} tasks/s end to end ({got['total']:.1f} s), load {loads[-1]:.1f}",
              file=sys.stderr, flush=True)
    print(f"saturating workload, {n} zero-length tasks scaled to one node of {cores} cores and {gpus} GPUs "
          f"({', '.join(f'{k} {v}' for k, v in kinds.items())}); {repeats} repeat(s), load average {_fmt(loads)}")
    print(f"  simulator: {_fmt(figures['sim_placements_per_s'], 0)} placements/s of scheduler time, "
          f"{_fmt(figures['sim_wall_s'], 2)} s wall for the workload")
    print(f"  real, local pilot: {_fmt(figures['end_to_end'])} tasks/s end to end, {_fmt(figures['in_run'])} in "
          f"pipe.run(); CPU of all processes {_fmt(figures['cpu_ms_per_task'])} ms per task")
    print(f"  the script's process (the orchestrator) peaked at {_fmt(figures['orchestrator_rss_mb'])} MB; the "
          f"store holds {_fmt(figures['store_mb'], 2)} MB")
    ratio = statistics.median(figures["sim_placements_per_s"]) / statistics.median(figures["end_to_end"])
    print(f"  the simulator's scheduler places {ratio:,.0f}x faster than the runtime runs the tasks end to end")
    return {"tasks": n, "kinds": kinds, "requests": shapes, "cores": cores, "gpus": gpus, "repeats": repeats,
            "load_average": _summary(loads), **{key: _summary(v) for key, v in figures.items()},
            "simulator_over_real": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cores", type=int, default=2, help="the pilot's cores (default 2)")
    parser.add_argument("--gpus", type=int, default=2, help="the pilot's declared GPUs (default 2; none is probed)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.repeats < 1 or args.cores < 1 or args.gpus < 0:
        parser.error("--tasks, --repeats and --cores must be >= 1, --gpus >= 0")
    figures = run(args.tasks, args.repeats, args.cores, args.gpus, args.seed)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
