"""Per-task overhead of backend slurm vs local: a chain of trivial one-rank stages, median seconds per task.

Run inside an allocation of the lab cluster (or any Slurm cluster), e.g.

    eval "$(scripts/slurm-cluster.sh env)"
    salloc -N2 --exclusive .venv/bin/python scripts/slurm-overhead.py --runs 5 --stages 6

Runs alternate local, slurm, local, slurm, ... in fresh work directories; a task's
time is its RUNNING -> DONE events in the store (job step or mpiexec, worker start,
stage, record).  Also times the bare launchers: `srun` (one --exact job step) and
`mpiexec -n 1` of `true`.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

import hetflow as hf


def tiny(ctx, *inputs):  # type: ignore[no-untyped-def]
    """A trivial stage: one row into the output its parameters name."""
    return {ctx.params["out"]: pa.table({"x": [ctx.rank]})}


def run_once(backend: str, stages: int, root: Path) -> list[float]:
    if backend == "slurm":
        pilot = hf.PilotDescription(name="lab", backend="slurm")
    else:
        pilot = hf.PilotDescription(name="lab", backend="local", cores_per_node=2, gpus_per_node=0,
                                    memory_per_node=2**34)
    pipe = hf.Pipeline("overhead", workdir=root)
    for i in range(stages):  # a chain: one task at a time
        pipe.stage(name=f"s{i}", ranks=1, inputs=[f"d{i - 1}"] if i else [], outputs=[f"d{i}"],
                   params={"out": f"d{i}"})(tiny)
    run = pipe.run(pilot=pilot)
    assert run.state == "DONE", (backend, run.state)
    db = sqlite3.connect(root / "hetflow.db")
    times: dict[str, dict[str, float]] = {}
    for name, state, at in db.execute("SELECT name, state, time FROM events WHERE run_id=? AND kind='task'",
                                      (run.id,)):
        times.setdefault(name, {})[state] = at
    db.close()
    return [t["DONE"] - t["RUNNING"] for t in times.values()]


def bare(argv: list[str], n: int) -> float:
    took = []
    for _ in range(n):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        took.append(time.perf_counter() - started)
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stages", type=int, default=6)
    args = parser.parse_args()
    per_task: dict[str, list[float]] = {"local": [], "slurm": []}
    for _ in range(args.runs):
        for backend in ("local", "slurm"):
            root = Path(tempfile.mkdtemp(prefix=f"overhead-{backend}-"))
            try:
                per_task[backend] += run_once(backend, args.stages, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    srun = ["srun", "-N1", "-n1", "--exact", "--cpu-bind=cores", "--mpi=pmi2", "true"]
    for backend, values in per_task.items():
        print(f"{backend}: median {statistics.median(values) * 1000:.0f} ms per task "
              f"(n={len(values)}, min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})")
    print(f"bare srun job step of `true`: {bare(srun, 10) * 1000:.0f} ms; "
          f"bare mpiexec -n 1 true: {bare([mpiexec, '-n', '1', 'true'], 10) * 1000:.0f} ms (medians of 10)")


if __name__ == "__main__":
    main()
