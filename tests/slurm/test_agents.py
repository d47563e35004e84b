"""The slurm backend's per-node agents on the lab cluster: one-rank tasks cost no job step.

Real slurmctld and slurmd, real ``srun`` steps (the agents' and the multi-node stages'), real
``hetflow cancel``; a node is taken away with ``scontrol update State=DOWN`` (test_nodes.take_node).
The lab's nodes share this machine's pid space, so the tests can see that a rank is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_nodes import take_node  # noqa: F401 - the fixture

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent
AGENT = "hetflow.tasks.forkserver"


def _record(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def _who(record_dir: Path, stage: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((record_dir / f"{stage}-{rank}.json").read_text())


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"{path.name} never appeared (salloc: {proc.poll()})"


def _finish(proc: subprocess.Popen[str], slurm_env: dict[str, str], name: str) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # SIGTERM: salloc gives the allocation back
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            subprocess.run(["scancel", f"--name={name}"], env=slurm_env, capture_output=True, timeout=30, check=False)


def _two_nodes(slurm_nodes: list[str]) -> list[str]:
    """``salloc`` of the lab's first two nodes, whole: the assertions name them (a bare ``-N2`` takes the third
    while a node of the test before is still completing its job)."""
    return ["salloc", "-N2", f"--nodelist={','.join(slurm_nodes[:2])}", "--exclusive"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm", [True, False], ids=["agents", "warm_start_off"])
def test_one_rank_tasks_start_through_the_agents_and_an_mpi_stage_stays_a_job_step(
        slurm_env: dict[str, str], slurm_nodes: list[str], tmp_path: Path, warm: bool) -> None:
    records = tmp_path / "records"
    records.mkdir()
    argv = [*_two_nodes(slurm_nodes), "--time=5", "--job-name=hetflow-agents", sys.executable,
            str(HERE / "run_agents.py"), "mixed", str(tmp_path / "w"), str(records), str(warm).lower()]
    done = subprocess.run(argv, env=slurm_env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    record = _record(done.stdout)
    stages = record["stages"]
    for n in range(3):
        one = _who(records, f"one_{n}")
        assert stages[f"one_{n}"]["state"] == "DONE", record
        # on the node the scheduler chose; forked by that node's agent (the leader of its own session),
        # or, with warm start off, a job step's rank below its witness
        assert [one["host"]] == stages[f"one_{n}"]["nodes"] and one["size"] == 1, one
        assert (AGENT in one["parent"]) == one["leads_session"] == warm, one
        if warm:  # pipe.run() started the agents before it imported the orchestrator and recorded the run
            assert one["parent_started"] < record["created"], (one, record["created"])
    # a stage across nodes is one srun step, one MPI world, its ranks below their witnesses
    across = [_who(records, "across", r) for r in (0, 1)]
    assert stages["across"]["state"] == "DONE" and sorted(r["host"] for r in across) == sorted(slurm_nodes[:2])
    assert all(r["size"] == 2 and AGENT not in r["parent"] and "hetflow.tasks.worker" in r["parent"]
               for r in across), across
    # the timeout ended the rank on its node before the run ended
    assert stages["too_long"]["state"] == "TIMED_OUT", record
    assert record["alive"] == {"too_long": False}, record
    assert record["steps_left"] == [], record  # shutdown ended the agents' steps
    logs = sorted(p.name for p in Path(record["run_dir"]).glob("agent-*.log"))
    assert logs == ([f"agent-{n}.log" for n in sorted(slurm_nodes[:2])] if warm else []), logs


@pytest.mark.timeout(300)
def test_hetflow_cancel_ends_a_rank_an_agent_started(slurm_env: dict[str, str], slurm_nodes: list[str],
                                                       tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    argv = [*_two_nodes(slurm_nodes), "--time=5", "--job-name=hetflow-agent-cancel", sys.executable,
            str(HERE / "run_agents.py"), "sleep", str(tmp_path / "w"), str(records)]
    proc = subprocess.Popen(argv, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(records / "sleeper.pid", proc)
        rank = int((records / "sleeper.pid").read_text())
        parent = Path(f"/proc/{rank}/stat").read_text().rpartition(")")[2].split()[1]
        assert AGENT in Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        [run_dir] = (tmp_path / "w" / "runs").iterdir()
        hetflow = str(Path(sys.executable).parent / "hetflow")
        cancel = subprocess.run([hetflow, "cancel", run_dir.name, "--workdir", str(tmp_path / "w")],
                                env=slurm_env, capture_output=True, text=True, timeout=90, check=False)
        assert cancel.returncode == 0, cancel.stderr
    finally:
        out, err = _finish(proc, slurm_env, "hetflow-agent-cancel")
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out}\n{err}"
    record = _record(out)
    assert record["state"] == "CANCELLED" and record["stages"]["sleeper"]["state"] == "CANCELLED", record
    assert record["alive"] == {"sleeper": False}, record


@pytest.mark.timeout(300)
def test_a_lost_node_fails_the_task_its_agent_ran_and_the_retry_runs_on_the_node_left(
        slurm_env: dict[str, str], slurm_nodes: list[str], tmp_path: Path,
        take_node: Callable[[str], None]) -> None:  # noqa: F811 - the fixture
    records = tmp_path / "records"
    records.mkdir()
    argv = [*_two_nodes(slurm_nodes), "--no-kill", "--time=5", "--job-name=hetflow-agent-loss",
            sys.executable, str(HERE / "run_agents.py"), "node-loss", str(tmp_path / "w"), str(records)]
    proc = subprocess.Popen(argv, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(records / "rank-0", proc)
        victim = (records / "rank-0").read_text()
        take_node(victim)
    finally:
        out, err = _finish(proc, slurm_env, "hetflow-agent-loss")
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out}\n{err}"
    record = _record(out)
    first, retry = record["attempts"]["stages"]["wait_for_node_loss"]
    assert first["slots"] == [victim] and first["state"] == "FAILED", record
    assert f"node {victim} was lost" in first["error"] and f"the hetflow agent on {victim} ended" in first["error"]
    assert record["attempts"]["lost"] == [victim], record
    [left] = set(slurm_nodes[:2]) - {victim}
    assert retry["state"] == "DONE" and retry["slots"] == retry["hosts"] == [left], retry
    assert record["state"] == "DONE", record


@pytest.mark.timeout(300)
def test_a_killed_agent_fails_its_task_and_the_retry_is_a_job_step(slurm_env: dict[str, str],
                                                                   slurm_nodes: list[str], tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    argv = [*_two_nodes(slurm_nodes), "--time=5", "--job-name=hetflow-agent-killed", sys.executable,
            str(HERE / "run_agents.py"), "agent-killed", str(tmp_path / "w"), str(records)]
    proc = subprocess.Popen(argv, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(records / "first.json", proc)
        first_rank = json.loads((records / "first.json").read_text())
        agent = first_rank["parent"]
        assert AGENT in Path(f"/proc/{agent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        os.kill(agent, signal.SIGKILL)
    finally:
        out, err = _finish(proc, slurm_env, "hetflow-agent-killed")
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out}\n{err}"
    record = _record(out)
    first, retry = record["attempts"]["stages"]["wait_for_agent_kill"]
    node = first_rank["host"]
    assert first["state"] == "FAILED" and f"the hetflow agent on {node} ended" in first["error"], record
    assert record["attempts"]["lost"] == [], record  # the node itself is fine
    # the agent's step ended with it, and Slurm ended the rank the agent had forked
    assert not Path(f"/proc/{first_rank['pid']}").exists() or \
        Path(f"/proc/{first_rank['pid']}/stat").read_text().rpartition(")")[2].split()[0] == "Z", first_rank
    again = json.loads((records / "retry.json").read_text())
    if again["host"] == node:  # that node has no agent any more: a job step
        assert AGENT not in again["parent"] and "hetflow.tasks.worker" in again["parent"], again
    assert retry["state"] == "DONE" and record["state"] == "DONE", record
    assert record["steps_left"] == [], record
