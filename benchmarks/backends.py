"""Start-up time and per-task overhead of each backend on this machine.

    python benchmarks/backends.py [--backends local,dask,parsl,radical] [--tasks 20] [--out FILE.json]

For each backend: the time to start it (``Backend.start()``: a Dask scheduler
and worker, Parsl's interchange and worker pool, an RP session and pilot), the
latency of a one-rank task that does nothing (``python -c pass`` under the
pilot's launcher) launched one after another, its overhead over running the
same launcher argv directly with ``subprocess`` here, the throughput of the
same tasks launched all at once on a 2-core pilot, and the shutdown time.
Prints a table and writes the figures as JSON.

``radical-raptor`` is the radical backend with ``options.radical.raptor: true``.
Raptor runs only hetflow stages (not arbitrary programs), so its row times a
one-rank no-op *stage* (``python -m hetflow.tasks.worker SPEC`` with a stage
function that returns nothing) instead of ``python -c pass``: start-up includes
the Raptor master and worker, the latency is the stage as a Raptor function
task, and the overhead is over the same stage run directly with ``mpiexec``
here.  The row also times the same stage as a normal RP task on the same pilot
(Raptor switched off for those launches), which is what Raptor saves.

Lab-cluster mode, against the Slurm lab cluster (scripts/slurm-cluster.sh; its
SLURM_CONF in the environment)::

    eval "$(scripts/slurm-cluster.sh env)"
    python benchmarks/backends.py --lab [--backends slurm,radical,parsl,dask] [--tasks 10] [--rounds 3]

Every backend gets a two-node pilot of the lab's whole nodes and the same tasks
(one-rank ``python -c pass`` on alternate nodes, one after another, then all at
once).  Start-up is from asking for the allocation to the backend started:
``salloc`` to ``SlurmBackend.start()`` returning inside it for ``slurm``; the
engine's own batch job (Parsl's block, dask-jobqueue's worker jobs, RP's pilot)
until its workers or agent are up for the others.  A task's overhead is its
latency over the same one-rank command as a bare ``srun`` job step in an
allocation.  Rounds alternate the order of the backends; the table gives the
median of the rounds and their range.  The lab's nodes share this machine's
cores, so this measures overhead, not compute.

With ``--stages`` the tasks are one-rank no-op hetflow *stages* (``python -m
hetflow.tasks.worker SPEC``, the stage :func:`noop`), what a pipeline's
tasks are, and the burst keeps the pilot's slots full (as many tasks at once
as the two nodes have CPUs, the next one launched as one ends) instead of
launching all at once, so no engine runs more than its pilot's cores.  Then
``slurm`` starts them through its per-node agents and ``slurm-steps``
(``options.slurm.warm_start: false``: one ``srun`` job step per task, what
every task cost before the agents) is the row to compare it with::

    python benchmarks/backends.py --lab --stages --backends slurm,slurm-steps,radical,parsl,dask --tasks 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetflow.tasks.backends import get_backend
from hetflow.tasks.backends.base import LaunchSpec
from hetflow.tasks.backends.ranks import find_executable
from hetflow.tasks.launchers.mpiexec import launcher_for
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot

COMMAND = (sys.executable, "-c", "pass")
RAPTOR = "radical-raptor"


def noop(ctx: Any) -> None:
    """The stage the radical-raptor row times: imported by the worker as ``backends.noop``."""
    return None


def stage_spec(run_dir: Path, index: int, core: int) -> LaunchSpec:
    """A one-rank no-op stage on ``core``, as the orchestrator would launch it (worker spec + argv)."""
    attempt = run_dir / "stages" / f"noop-{index}"
    attempt.mkdir(parents=True, mode=0o700)
    spec = {"run_id": "bench", "stage": "noop", "attempt": 1,
            "function": {"module": "backends", "path": None, "name": "noop"},
            "sys_path": [str(Path(__file__).resolve().parent)], "params": {}, "inputs": [], "outputs": {},
            "attempt_dir": str(attempt), "checkpoint_dir": str(attempt), "nodes": ["localhost"],
            "slots": [{"node": 0, "cores": [core], "gpus": []}], "verify": "checksum", "schemas": {}}
    (attempt / "spec.json").write_text(json.dumps(spec))
    return LaunchSpec(task_id=f"noop-{index}", argv=(sys.executable, "-m", "hetflow.tasks.worker",
                                                     str(attempt / "spec.json")),
                      slots=(RankSlot(0, (core,)),), cwd=attempt)


def direct_stage_latency(tasks: int, root: Path) -> list[float]:
    """Seconds for the no-op stage under ``mpiexec -n 1`` run here with subprocess."""
    times = []
    for i in range(tasks):
        spec = stage_spec(root / "direct", i, 0)
        argv = launcher_for("mpiexec", find_executable("mpiexec")).argv(spec.argv, list(spec.slots), ["localhost"])
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=spec.cwd)
        times.append(time.perf_counter() - started)
    return times


def _sequential(backend: Any, specs: list[LaunchSpec]) -> list[float]:
    latencies = []
    for spec in specs:
        t0 = time.perf_counter()
        outcome = backend.launch(spec).result(timeout=300)
        latencies.append(time.perf_counter() - t0)
        if not outcome.ok:
            raise RuntimeError(f"task {spec.task_id} failed: {outcome}")
    return latencies


def measure_raptor(tasks: int, root: Path) -> dict[str, Any]:
    """The radical backend with Raptor on, timing no-op stages (see the module docstring)."""
    pilot = PilotDescription(name="bench", backend="radical", cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**33, options={"radical": {"raptor": True}})
    run_dir = root / RAPTOR
    run_dir.mkdir(mode=0o700)
    floor = statistics.median(direct_stage_latency(tasks, root))
    started = time.perf_counter()
    backend = get_backend("radical")(pilot, run_dir)
    backend.start()
    startup = time.perf_counter() - started
    try:
        latencies = _sequential(backend, [stage_spec(run_dir, i, i % 2) for i in range(tasks)])
        t0 = time.perf_counter()
        futures = [backend.launch(stage_spec(run_dir, tasks + i, i % 2)) for i in range(tasks)]
        outcomes = [f.result(timeout=600) for f in futures]
        burst = time.perf_counter() - t0
        if not all(o.ok for o in outcomes):
            raise RuntimeError(f"{RAPTOR}: a burst task failed: {[o for o in outcomes if not o.ok][:1]}")
        backend._raptor = False  # the same stage as normal RP tasks on the same pilot, for comparison
        normal = _sequential(backend, [stage_spec(run_dir, 2 * tasks + i, i % 2) for i in range(tasks)])
    finally:
        t0 = time.perf_counter()
        backend.shutdown()
        shutdown = time.perf_counter() - t0
    return {"backend": RAPTOR, "startup_s": startup, "task_latency_median_s": statistics.median(latencies),
            "task_latency_min_s": min(latencies), "task_latency_max_s": max(latencies),
            "burst_tasks_per_s": tasks / burst, "shutdown_s": shutdown, "tasks": tasks,
            "task_overhead_s": statistics.median(latencies) - floor, "task": "no-op hetflow stage",
            "stage_direct_mpiexec_median_s": floor,
            "stage_as_normal_rp_task_median_s": statistics.median(normal)}


def direct_latency(tasks: int) -> list[float]:
    """Seconds for the launcher argv itself, run with subprocess (the floor every backend pays)."""
    argv = launcher_for("mpiexec", find_executable("mpiexec")).argv(COMMAND, [RankSlot(0, (0,))], ["localhost"])
    times = []
    for _ in range(tasks):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return times


def measure(name: str, tasks: int, root: Path) -> dict[str, Any]:
    pilot = PilotDescription(name="bench", backend=name,  # type: ignore[arg-type]
                             cores_per_node=2, gpus_per_node=0, memory_per_node=2**33)
    run_dir = root / name
    run_dir.mkdir(mode=0o700)
    started = time.perf_counter()
    backend = get_backend(name)(pilot, run_dir)
    backend.start()
    startup = time.perf_counter() - started
    try:
        latencies = []
        for i in range(tasks):
            spec = LaunchSpec(task_id=f"seq-{i}", argv=COMMAND, slots=(RankSlot(0, (i % 2,)),), cwd=run_dir)
            t0 = time.perf_counter()
            outcome = backend.launch(spec).result(timeout=300)
            latencies.append(time.perf_counter() - t0)
            if not outcome.ok:
                raise RuntimeError(f"{name}: task {spec.task_id} failed: {outcome}")
        burst = _burst(name, backend, [LaunchSpec(task_id=f"par-{i}", argv=COMMAND, slots=(RankSlot(0, (i % 2,)),),
                                                  cwd=run_dir) for i in range(tasks)])
    finally:
        t0 = time.perf_counter()
        backend.shutdown()
        shutdown = time.perf_counter() - t0
    return {"backend": name, "startup_s": startup, "task_latency_median_s": statistics.median(latencies),
            "task_latency_min_s": min(latencies), "task_latency_max_s": max(latencies),
            "burst_tasks_per_s": tasks / burst, "shutdown_s": shutdown, "tasks": tasks}


def _burst(name: str, backend: Any, specs: list[LaunchSpec]) -> float:
    """Seconds to launch all ``specs`` at once and see every one end successfully."""
    t0 = time.perf_counter()
    outcomes = [f.result(timeout=600) for f in [backend.launch(s) for s in specs]]
    burst = time.perf_counter() - t0
    if not all(o.ok for o in outcomes):
        raise RuntimeError(f"{name}: a burst task failed: {[o for o in outcomes if not o.ok][:1]}")
    return burst


LAB_BACKENDS = ("slurm", "radical", "parsl", "dask")
STEPS = "slurm-steps"
"""The slurm backend without its agents: one job step per task."""


def _window(name: str, backend: Any, specs: list[LaunchSpec], width: int) -> float:
    """Seconds to run every one of ``specs`` with at most ``width`` of them running at once (the next is
    launched as soon as one ends), each one ending successfully."""
    from concurrent.futures import FIRST_COMPLETED, wait

    todo = list(reversed(specs))
    running: set[Any] = set()
    failed = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < width:
            running.add(backend.launch(todo.pop()))
        done, running = wait(running, timeout=600, return_when=FIRST_COMPLETED)
        if not done:
            raise RuntimeError(f"{name}: no task ended in 600 s")
        failed += [f.result() for f in done if not f.result().ok]
    if failed:
        raise RuntimeError(f"{name}: a task failed: {failed[:1]}")
    return time.perf_counter() - t0


def lab_stage_specs(run_dir: Path, prefix: str, tasks: int, nodes: list[str]) -> list[LaunchSpec]:
    """One-rank no-op stages (:func:`noop`), alternating between the pilot's two nodes."""
    specs = []
    for i in range(tasks):
        spec = stage_spec(run_dir / prefix, i, 0)
        worker = json.loads(Path(spec.argv[-1]).read_text())
        worker.update(nodes=nodes, slots=[{"node": i % 2, "cores": [0], "gpus": []}])
        Path(spec.argv[-1]).write_text(json.dumps(worker))
        specs.append(LaunchSpec(task_id=f"{prefix}-{i}", argv=spec.argv, slots=(RankSlot(i % 2, (0,)),),
                                cwd=spec.cwd))
    return specs


def lab_pilot(name: str) -> PilotDescription:
    """The two-node pilot of ``name`` on the lab cluster (whole nodes of this machine's CPU count)."""
    common: dict[str, Any] = {"name": f"lab-{name}", "nodes": 2, "cores_per_node": os.cpu_count() or 1,
                              "gpus_per_node": 0, "memory_per_node": 2**30, "walltime": 1200.0}
    if name == "slurm":
        return PilotDescription(name="lab-slurm", backend="slurm").resolve()
    if name == STEPS:
        return PilotDescription(name="lab-slurm", backend="slurm", options={"slurm": {"warm_start": False}}).resolve()
    if name == "parsl":
        return PilotDescription(backend="parsl", launcher="srun", options={"parsl": {"scheduler": "slurm"}},
                                **common)
    if name == "dask":
        return PilotDescription(backend="dask", options={"dask": {"jobqueue": "slurm"}}, **common)
    if name == "radical":
        return PilotDescription(backend="radical", launcher="srun", resource="hetflow.slurm", **common)
    raise SystemExit(f"--lab: unknown backend {name!r} (expected some of {list(LAB_BACKENDS)})")


def lab_specs(run_dir: Path, prefix: str, tasks: int) -> list[LaunchSpec]:
    """One-rank no-op tasks, alternating between the pilot's two nodes."""
    return [LaunchSpec(task_id=f"{prefix}-{i}", argv=COMMAND, slots=(RankSlot(i % 2, (0,)),), cwd=run_dir)
            for i in range(tasks)]


def measure_lab(name: str, tasks: int, root: Path, asked: float | None = None, stages: bool = False) -> dict[str, Any]:
    """Start ``name``'s backend on the lab cluster, time the tasks, shut it down.

    ``asked``: the wall-clock time the allocation was asked for (``slurm``: before ``salloc``); the
    others ask for theirs in ``start()``.
    """
    pilot = lab_pilot(name)
    run_dir = root / name
    run_dir.mkdir(mode=0o700)
    started = time.perf_counter()
    wall = time.time()
    backend = get_backend(pilot.backend)(pilot, run_dir)
    backend.start()
    startup = time.perf_counter() - started + (wall - asked if asked is not None else 0.0)
    try:
        if stages:
            nodes = backend.node_names()
            latencies = _sequential(backend, lab_stage_specs(run_dir, "seq", tasks, nodes))
            width = pilot.nodes * (pilot.cores_per_node or 1)
            burst = _window(name, backend, lab_stage_specs(run_dir, "par", tasks, nodes), width)
        else:
            latencies = _sequential(backend, lab_specs(run_dir, "seq", tasks))
            burst = _burst(name, backend, lab_specs(run_dir, "par", tasks))
    finally:
        t0 = time.perf_counter()
        backend.shutdown()
        shutdown = time.perf_counter() - t0
    return {"backend": name, "startup_s": startup, "task_latency_median_s": statistics.median(latencies),
            "burst_tasks_per_s": tasks / burst, "shutdown_s": shutdown, "tasks": tasks}


def bare_srun(tasks: int) -> list[float]:
    """Seconds for the no-op command as a bare one-rank ``srun`` job step (inside an allocation)."""
    from hetflow.tasks.launchers.srun import SrunStep, step_env
    from hetflow.tasks.slurm_allocation import current_allocation

    nodes = list(current_allocation().nodes)
    argv = SrunStep(find_executable("srun")).argv(COMMAND, [RankSlot(0, (0,))], nodes)
    env = step_env(os.environ, {})
    times = []
    for _ in range(tasks):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - started)
    return times


def lab_slurm_round(tasks: int, root: Path, name: str = "slurm", stages: bool = False) -> dict[str, Any]:
    """The ``slurm`` row (or ``slurm-steps``): this script again inside ``salloc -N2 --exclusive``, which
    prints its result."""
    out = root / "slurm.json"
    asked = time.time()
    subprocess.run(["salloc", "-N2", "--exclusive", "--time=20", "--job-name=hetflow-bench", sys.executable,
                    str(Path(__file__).resolve()), "--lab-inside", str(out), "--tasks", str(tasks),
                    "--asked", repr(asked), "--backends", name, *(["--stages"] if stages else [])],
                   check=True, stdin=subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


def lab_inside(out: Path, tasks: int, asked: float, name: str = "slurm", stages: bool = False) -> int:
    """Inside the ``slurm`` row's allocation: the backend's figures and the bare ``srun`` floor."""
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-", dir=out.parent) as tmp:
        result = measure_lab(name, tasks, Path(tmp), asked, stages)
    result["bare_srun_median_s"] = statistics.median(bare_srun(tasks))
    out.write_text(json.dumps(result))
    return 0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def lab_main(names: list[str], tasks: int, rounds: int, out: Path, stages: bool = False) -> int:
    """Every round: each backend once (the order reversed every other round); then the table."""
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("--lab needs the lab cluster's SLURM_CONF: eval \"$(scripts/slurm-cluster.sh env)\"")
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    floors: list[float] = []
    failures: dict[str, list[str]] = {}
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else list(reversed(names))
        for name in order:
            print(f"round {round_ + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            # the work directory must be on a file system every node sees: here, this machine's /tmp
            with tempfile.TemporaryDirectory(prefix="hetflow-bench-lab-") as tmp:
                try:
                    result = (lab_slurm_round(tasks, Path(tmp), name, stages) if name in ("slurm", STEPS)
                              else measure_lab(name, tasks, Path(tmp), stages=stages))
                except Exception as exc:  # noqa: BLE001 - a failed task or start: the round is lost, the rest go on
                    print(f"round {round_ + 1}/{rounds}: {name} failed: {exc}", file=sys.stderr, flush=True)
                    failures.setdefault(name, []).append(str(exc)[:500])
                    continue
            if "bare_srun_median_s" in result:
                floors.append(result["bare_srun_median_s"])
            rows[name].append(result)
    floor = statistics.median(floors) if floors else 0.0
    load = os.getloadavg()
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_1_5_15": load, "python": sys.version.split()[0]},
              "mode": "lab-stages" if stages else "lab", "rounds": rounds, "bare_srun_median_s": floor, "results": rows,
              "failed_rounds": failures}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    header = (f"{'backend':<11} {'start-up s':>18} {'task median ms':>20} {'overhead ms':>12} "
              f"{'burst tasks/s':>18} {'shutdown s':>18}")
    print(header)
    print("-" * len(header))
    for name in names:
        runs = rows[name]
        if not runs:
            print(f"{name:<11} every round failed: {failures.get(name, ['?'])[0][:200]}")
            continue
        latency = [r["task_latency_median_s"] * 1e3 for r in runs]
        print(f"{name:<11} {spread([r['startup_s'] for r in runs]):>18} "
              f"{statistics.median(latency):>8.0f} ({min(latency):.0f}-{max(latency):.0f}) "
              f"{statistics.median(latency) - floor * 1e3:>12.0f} "
              f"{spread([r['burst_tasks_per_s'] for r in runs]):>18} {spread([r['shutdown_s'] for r in runs]):>18}")
    what = "no-op stages, burst at most the pilot's CPUs at once" if stages else "python -c pass"
    print(f"(bare one-rank srun step of python -c pass: {floor * 1e3:.0f} ms; {tasks} tasks ({what}) each, "
          f"{rounds} rounds: "
          f"median (range); load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} CPUs "
          f"shared by the lab's nodes; JSON: {out})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=None)
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lab", action="store_true", help="on the Slurm lab cluster (module docstring)")
    parser.add_argument("--rounds", type=int, default=3, help="--lab: rounds, alternating the order")
    parser.add_argument("--stages", action="store_true", help="--lab: no-op hetflow stages as the tasks")
    parser.add_argument("--lab-inside", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--asked", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lab_inside is not None:
        return lab_inside(args.lab_inside, args.tasks or 10, args.asked, args.backends or "slurm", args.stages)
    if args.lab:
        names = [n.strip() for n in (args.backends or ",".join(LAB_BACKENDS)).split(",") if n.strip()]
        default = "backends-lab-stages.json" if args.stages else "backends-lab.json"
        return lab_main(names, args.tasks or 10, args.rounds, args.out or Path("benchmarks/results") / default,
                        args.stages)
    args.backends = args.backends or f"local,dask,parsl,radical,{RAPTOR}"
    args.tasks = args.tasks or 20
    args.out = args.out or Path("benchmarks/results/backends.json")
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    floor = statistics.median(direct_latency(args.tasks))
    results = []
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as tmp:
        for name in names:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            if name == RAPTOR:
                results.append(measure_raptor(args.tasks, Path(tmp)))
                continue
            result = measure(name, args.tasks, Path(tmp))
            result["task_overhead_s"] = result["task_latency_median_s"] - floor
            results.append(result)
    load = os.getloadavg()
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_1_5_15": load, "python": sys.version.split()[0]},
              "direct_mpiexec_median_s": floor, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    header = f"{'backend':<14} {'start-up':>9} {'task (median)':>14} {'overhead':>9} {'burst':>10} {'shutdown':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['backend']:<14} {r['startup_s']:>8.2f}s {r['task_latency_median_s'] * 1e3:>12.0f}ms "
              f"{r['task_overhead_s'] * 1e3:>7.0f}ms {r['burst_tasks_per_s']:>6.1f}/s {r['shutdown_s']:>8.2f}s")
    for r in results:
        if r["backend"] == RAPTOR:
            print(f"({RAPTOR} times a no-op hetflow stage: {r['task_latency_median_s'] * 1e3:.0f} ms as a Raptor "
                  f"function task vs {r['stage_as_normal_rp_task_median_s'] * 1e3:.0f} ms as a normal RP task on the "
                  f"same pilot; the same stage under a direct mpiexec -n 1: "
                  f"{r['stage_direct_mpiexec_median_s'] * 1e3:.0f} ms)")
    print(f"(direct mpiexec -n 1 python -c pass: {floor * 1e3:.0f} ms; {args.tasks} tasks each; "
          f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} CPUs; JSON: {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
