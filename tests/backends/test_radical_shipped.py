"""Stages declared without a script file (code piped to ``python -``, as a notebook's kernel runs it) on the
``radical`` backend: RADICAL-Pilot's agent starts the same worker on the same attempt directory, which holds
the function shipped by value (issue 30: every backend that runs a script's stages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hetflow.operators.dataset import Dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SESSION = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("shipped-rp")
OFFSET = OFFSET_VALUE


def helper(x):
    return x + OFFSET


@pipe.stage(ranks=2, outputs=["t"])
def gen(ctx):
    return {"t": pa.table({"v": [helper(ctx.rank)]})}


@pipe.stage(inputs=["t"], outputs=["s"])
def total(ctx, t):
    return {"s": pa.table({"sum": [sum(t["v"].to_pylist())]})}


run = pipe.run(backend="radical", workdir="w", progress=False)
print("STATE", run.state, [(s.name, s.state) for s in run.stages])
print("PATH", run.datasets["s"])
'''


def _session(tmp_path: Path, offset: int) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-"], input=SESSION.replace("OFFSET_VALUE", str(offset)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    state = next(line for line in done.stdout.splitlines() if line.startswith("STATE"))
    path = next(line for line in done.stdout.splitlines() if line.startswith("PATH"))[5:]
    return state, path


def test_a_pipeline_piped_to_python_runs_on_radical_and_an_edited_value_reruns(tmp_path: Path) -> None:
    state, path = _session(tmp_path, 5)
    assert state == "STATE DONE [('gen', 'DONE'), ('total', 'DONE')]"
    assert Dataset(path).to_table()["sum"].to_pylist() == [5 + 6]
    state, path = _session(tmp_path, 7)   # the session's value the stages read changed: both run again
    assert state == "STATE DONE [('gen', 'DONE'), ('total', 'DONE')]"
    assert Dataset(path).to_table()["sum"].to_pylist() == [7 + 8]
