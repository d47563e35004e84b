"""Stages declared without a script file (a notebook cell, the prompt, stdin) on the ``slurm`` backend
(issue 30: a notebook on JupyterHub inside an allocation).

Their functions are shipped by value into the attempt directories, which the job steps on the lab's nodes
read from the shared file system; the run goes on in the background (``wait=False``) as in a notebook.
Real slurmctld and slurmd, real ``salloc``/``srun`` job steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

TYPED = '''
import json, socket, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("typed-slurm")
SCALE = 7


def calibrate(x):
    return x * SCALE


@pipe.stage(ranks=2, ranks_per_node=1, outputs=["events"])
def generate(ctx):
    return {"events": pa.table({"value": [calibrate(ctx.rank + 1)], "host": [socket.gethostname()]})}


@pipe.stage(inputs=["events"], outputs=["total"])
def total(ctx, events):
    return {"total": pa.table({"value": [sum(events["value"].to_pylist())]})}


handle = pipe.run(pilot=hf.PilotDescription(name="lab", backend="slurm"), workdir=WORKDIR, wait=False)
run = handle.wait()
print(json.dumps({"state": run.state, "run_dir": run.run_dir,
                  "events": run.dataset("events").to_table().to_pylist(),
                  "total": run.dataset("total").to_table().to_pylist()}))
'''


@pytest.mark.timeout(300)
def test_stages_piped_to_python_run_in_the_background_on_two_nodes_of_an_allocation(
        slurm_env: dict[str, str], slurm_nodes: list[str], tmp_path: Path) -> None:
    done = subprocess.run(["salloc", "-N2", f"--nodelist={','.join(slurm_nodes[:2])}", "--exclusive", "--time=5",
                           "--job-name=hetflow-shipped",
                           sys.executable, "-"], input=TYPED.replace("WORKDIR", repr(str(tmp_path / "w"))),
                          cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["state"] == "DONE", record
    # one rank per node: the 2-rank stage spans the allocation's two nodes, each rank unpickling the shipped
    # function (with the helper and SCALE it reaches) from the attempt directory on the shared file system
    assert record["events"] == [{"value": 7, "host": slurm_nodes[0]}, {"value": 14, "host": slurm_nodes[1]}]
    assert record["total"] == [{"value": 21}]
    shipped = sorted(p.parent.parent.name for p in Path(record["run_dir"]).glob("stages/*/attempt-1/function.pickle"))
    assert shipped == ["generate", "total"]
