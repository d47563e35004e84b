"""RADICAL-Pilot, Parsl and Dask submitting their own batch jobs to the Slurm lab cluster.

Each engine runs the backend conformance pipeline (tests/backends/conformance.py)
from a pilot config in tests/slurm/pilots/ -- Parsl's ``SlurmProvider``,
dask-jobqueue's ``SLURMCluster``, RP's pilot on the ``hetflow.slurm`` resource --
once for the whole module, in a process of its own.  The pilots have one core per
node, so every two-rank stage spans two nodes.  Each engine must commit the local
backend's datasets (content hashes), record the same transitions and error, run
its two-rank stages on two hosts, and leave no Slurm job and no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from conformance import DATASETS, leftovers

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent
ENGINES = ["parsl", "dask", "radical"]
SPANNING = ["generate", "sort_rows", "train"]
"""The two-rank stages that end well (both ranks write a record): on one-core nodes, a rank on each of two nodes."""


def _jobs_left(env: dict[str, str], wait: float = 30.0) -> str:
    """The jobs still listed; a job still COMPLETING (Slurm ending its processes) gets ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        listed = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=env, capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        if not listed or time.monotonic() > deadline:
            return listed
        time.sleep(0.5)


def _run(pilot: str, workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / "run_engine.py"), pilot, str(workdir)], env=env,
                          capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, f"{pilot} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    record["jobs_left"] = _jobs_left(env)
    record["leftovers"] = leftovers(str(workdir))
    return record


@pytest.fixture(scope="module")
def reference(slurm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("local", tmp_path_factory.mktemp("local"), slurm_env)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, slurm_env: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(str(HERE / "pilots" / f"{request.param}.yaml"), tmp_path_factory.mktemp(request.param), slurm_env)


@pytest.mark.timeout(900)
def test_same_datasets_as_local(engine: dict[str, Any], reference: dict[str, Any]) -> None:
    assert set(reference["hashes"]) == set(DATASETS), reference["stages"]
    assert engine["hashes"] == reference["hashes"], engine["stages"]
    assert engine["partitions"] == reference["partitions"]


@pytest.mark.timeout(900)
def test_two_rank_stages_span_two_nodes(engine: dict[str, Any], slurm_nodes: list[str]) -> None:
    for stage in SPANNING:
        hosts = engine["hosts"][stage]
        assert len(hosts) == 2 and len(set(hosts)) == 2 and set(hosts) <= set(slurm_nodes), (stage, hosts)


@pytest.mark.timeout(900)
def test_same_transitions_and_error(engine: dict[str, Any], reference: dict[str, Any]) -> None:
    assert engine["transitions"] == reference["transitions"]
    failed, expected = engine["stages"]["fail_on_rank_one"], reference["stages"]["fail_on_rank_one"]
    assert failed["state"] == "FAILED" and failed["failed_rank"] == 1, failed
    assert "ValueError: boom on rank 1" in (failed["error"] or "")
    assert failed["error"] == expected["error"]
    assert engine["stages"]["after_failure"]["state"] == "SKIPPED"


@pytest.mark.timeout(900)
def test_no_job_and_no_process_left(engine: dict[str, Any]) -> None:
    assert engine["jobs_left"] == ""
    assert engine["leftovers"] == []
