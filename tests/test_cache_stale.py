"""Stale results the second red team found (issue 25): each edit below changes what a stage computes.

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage reads in the way
the attack did, runs again and checks that the stage RAN, says why, and that
its dataset holds the new value; and that what it does not read leaves it
cached.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``hetflow run p.py ARGS``; returns the stages of ``hetflow status --json`` by name (the run as ``_run``)."""
    done = hetflow("run", "p.py", "--no-progress", *args, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return status(cwd)


def status(cwd: Path, run_id: str | None = None) -> dict[str, Any]:
    shown = hetflow("status", *([run_id] if run_id else []), "--json", cwd=cwd)
    data = json.loads(shown.stdout)
    stages: dict[str, Any] = {s["name"]: s for s in data["stages"]}
    stages["_run"] = data
    return stages


def states(stages: dict[str, Any]) -> dict[str, str]:
    return {n: s["state"] for n, s in stages.items() if n != "_run"}


def value(stages: dict[str, Any], dataset: str, column: str = "v") -> Any:
    table: pa.Table = Dataset(stages["_run"]["datasets"][dataset]).to_table()
    return table[column][0].as_py()


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


PATCHED = '''
import pyarrow as pa
import hetflow as hf
import mpatch

mpatch.K = 1
mpatch.J = 0

pipe = hf.Pipeline("patched")


@pipe.stage(outputs=["k"])
def reads_k(ctx):
    return {"k": pa.table({"v": [mpatch.K]})}


@pipe.stage(outputs=["alpha"])
def fit(ctx):
    return {"alpha": pa.table({"v": [fit.alpha]})}


fit.alpha = 3
'''


def test_a_value_the_script_sets_on_a_module_it_imports_reruns_what_reads_it(tmp_path: Path) -> None:
    (tmp_path / "mpatch.py").write_text("K = 0\n")
    (tmp_path / "p.py").write_text(PATCHED)
    first = run(tmp_path)
    assert value(first, "k") == 1 and value(first, "alpha") == 3
    edit(tmp_path / "p.py", "mpatch.K = 1", "mpatch.K = 2")
    edited = run(tmp_path)
    assert states(edited) == {"reads_k": "DONE", "fit": "CACHED"}
    assert edited["reads_k"]["cache"]["reason"] == "mpatch.K changed" and value(edited, "k") == 2
    edit(tmp_path / "p.py", "mpatch.K = 2", 'setattr(mpatch, "K", 5)')
    assert value(set_by_setattr := run(tmp_path), "k") == 5 and set_by_setattr["reads_k"]["state"] == "DONE"
    edit(tmp_path / "p.py", "mpatch.J = 0", "mpatch.J = 9")  # no stage reads mpatch.J
    assert states(run(tmp_path)) == {"reads_k": "CACHED", "fit": "CACHED"}
    edit(tmp_path / "p.py", "fit.alpha = 3", "fit.alpha = 4")  # an attribute of the stage function
    alpha = run(tmp_path)
    assert states(alpha) == {"reads_k": "CACHED", "fit": "DONE"} and value(alpha, "alpha") == 4
    assert alpha["fit"]["cache"]["reason"] == "code of fit() changed"
