"""Nodes on the lab cluster: one name per node makes locality work, and a lost node is left behind.

Real slurmctld and slurmd, real job steps; the node is taken away with
``scontrol update State=DOWN`` (what a site's health check or slurmctld itself does to a dead
node) and given back afterwards whatever happens, so later tests see three nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent


def _run_nodes(argv: list[str], env: dict[str, str], timeout: float = 180) -> dict[str, Any]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_consumer_runs_on_the_node_holding_its_input(slurm_env: dict[str, str], slurm_nodes: list[str],
                                                       tmp_path: Path) -> None:
    # hold_node fills the first node (n1) while produce runs beside it on the second (n2); consume needs a
    # whole node, and when it is ready n3 is as free as n2 (placement alone takes n3, and n2 only once
    # produce has let go of it): only the partition's node name, with produce released as consume is
    # placed, sends it to n2
    n1, n2, _ = slurm_nodes
    record = _run_nodes(["salloc", "-N3", "--exclusive", "--time=5", "--job-name=hetflow-locality",
                         sys.executable, str(HERE / "run_nodes.py"), "locality", str(tmp_path)], slurm_env)
    assert record["state"] == "DONE", record
    stages = record["stages"]
    [hold], [produce], [consume] = stages["hold_node"], stages["produce"], stages["consume"]
    assert hold["hosts"] == [n1] and produce["hosts"] == [n2], record
    # one name for n2 everywhere: the rank's own hostname, the slot, the manifest, the store
    assert produce["slots"] == [n2] and record["manifest_nodes"]["made"] == [n2], record
    assert record["partition_nodes"]["made"] == [n2], record
    assert consume["hosts"] == [n2] and consume["slots"] == [n2], record


@pytest.fixture
def take_node(slurm_env: dict[str, str]) -> Iterator[Callable[[str], None]]:
    """``take_node(name)`` sets a lab node DOWN; every node taken is RESUMEd at the end, pass or fail."""
    taken: list[str] = []

    def take(name: str) -> None:
        taken.append(name)
        subprocess.run(["scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=hetflow-test-node-loss"],
                       env=slurm_env, check=True, capture_output=True, timeout=30)

    yield take
    for name in taken:
        subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], env=slurm_env,
                       capture_output=True, timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=slurm_env, capture_output=True,
                                text=True, timeout=30).stdout.split("\n")
        if all(line.split()[1] in ("idle", "mix", "alloc") for line in states if line.strip()):
            return
        time.sleep(0.5)
    pytest.fail(f"lab nodes {taken} did not come back after State=RESUME: {states}")


@pytest.mark.timeout(300)
def test_a_lost_node_fails_its_tasks_and_the_retry_runs_on_the_nodes_left(
        slurm_env: dict[str, str], slurm_nodes: list[str], tmp_path: Path, take_node: Callable[[str], None]) -> None:
    n1, n2, n3 = slurm_nodes
    ready = tmp_path / "ready"
    ready.mkdir()
    argv = ["salloc", "-N3", "--exclusive", "--no-kill", "--time=5", "--job-name=hetflow-node-loss",
            sys.executable, str(HERE / "run_nodes.py"), "node-loss", str(tmp_path / "w"), str(ready)]
    proc = subprocess.Popen(argv, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ready / "rank-1").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (ready / "rank-1").exists(), f"the first attempt never started: {proc.poll()}"
        victim = (ready / "rank-1").read_text()
        take_node(victim)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # SIGTERM: salloc gives the allocation back (SIGKILL would leave the job)
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            subprocess.run(["scancel", "--name=hetflow-node-loss"], env=slurm_env, capture_output=True, timeout=30)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out}\n{err}"
    record = json.loads(out.strip().splitlines()[-1])
    first, retry = record["stages"]["wait_for_node_loss"]
    # the first attempt's ranks were killed with the node (no rank records): where they ran, they said
    assert [(ready / f"rank-{r}").read_text() for r in (0, 1)] == first["slots"] == [n1, n2], record
    assert first["state"] == "FAILED" and f"node {n2} was lost" in first["error"], first
    assert record["lost"] == [n2], record
    # hetflow places nothing on n2 again: the retry (the only one allowed) runs on n1 and n3
    assert retry["state"] == "DONE" and sorted(retry["slots"]) == sorted([n1, n3]) and \
        retry["hosts"] == retry["slots"], retry
    assert record["state"] == "DONE", record
