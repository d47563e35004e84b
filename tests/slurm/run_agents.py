"""Pipelines on backend slurm about its per-node agents.  Prints what the tests check, as JSON.

    salloc -N2 --exclusive python run_agents.py mixed WORKDIR RECORD_DIR [warm_start]
    salloc -N2 --exclusive python run_agents.py sleep WORKDIR RECORD_DIR

``mixed``: three one-rank stages (the agents start them), one two-rank stage across the two nodes
(a job step) and a one-rank stage that outlives its timeout; each rank says where and how it was
started (:func:`slurm_stages.who`).  ``warm_start`` (``true``/``false``) sets
``options.slurm.warm_start``.
``sleep``: one one-rank stage that sleeps until the test cancels the run (``hetflow cancel``).
``node-loss``: one one-rank stage (one retry) whose first attempt waits until the test takes its node
away (:func:`slurm_stages.wait_for_node_loss`, its ready files in RECORD_DIR); its retry must run on
the node left.
``agent-killed``: one one-rank stage (one retry) whose first attempt waits until the test kills its
parent (the agent); its retry says where and how it started (:func:`slurm_stages.wait_for_agent_kill`).

The record says, for every pid a stage wrote (``<stage>.pid``), whether it is still alive when the run
has ended (the lab's nodes are this machine: one pid space).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hetflow as hf

sys.path.insert(0, str(Path(__file__).parent))
import slurm_stages as S
from run_nodes import attempts


def alive(pid: int, grace: float = 10.0) -> bool:
    """Whether ``pid`` still runs (not a zombie) ``grace`` seconds on (Slurm's KillWait for a step's ranks)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def main(kind: str, workdir: Path, record_dir: Path, warm: bool) -> None:
    pilot = hf.PilotDescription(name="lab", backend="slurm", options={"slurm": {"warm_start": warm}})
    pipe = hf.Pipeline(f"agents{kind}", workdir=workdir)
    params = {"record_dir": str(record_dir)}
    if kind == "mixed":
        for n in range(3):
            pipe.stage(name=f"one_{n}", ranks=1, params=params)(S.who)
        pipe.stage(name="across", ranks=2, ranks_per_node=1, params=params)(S.who)
        pipe.stage(name="too_long", ranks=1, timeout=3, params=params)(S.sleep_flagged)
    elif kind == "sleep":
        pipe.stage(name="sleeper", ranks=1, params=params)(S.sleep_flagged)
    elif kind == "agent-killed":
        pipe.stage(ranks=1, retries=1, params=params)(S.wait_for_agent_kill)
    else:
        pipe.stage(ranks=1, retries=1, params={"ready_dir": str(record_dir)})(S.wait_for_node_loss)
    run = pipe.run(pilot=pilot, check=False)
    job = os.environ["SLURM_JOB_ID"]  # the steps of the job left once the run has ended: none
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%j"], capture_output=True, text=True,
                           check=True).stdout.split()
    pids = {path.stem: int(path.read_text()) for path in record_dir.glob("*.pid")}
    print(json.dumps({"id": run.id, "state": run.state, "run_dir": str(run.run_dir), "created": run.created,
                      "stages": {
        s.name: {"state": s.state, "error": s.error, "nodes": sorted({v.node for v in s.slots})}
        for s in run.stages}, "alive": {stage: alive(pid) for stage, pid in pids.items()},
        "attempts": attempts(workdir, run.id), "steps_left": steps}, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), len(sys.argv) < 5 or sys.argv[4] == "true")
