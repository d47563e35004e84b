"""The same pipeline through every backend, with a real session of each engine.

One run per backend (module-scoped: RP alone takes ~30 s to start a pilot) of a
pipeline with an operator stage (sample sort), an ML stage (data-parallel
training with torch.distributed over the stage's ranks), a stage that fails on
one rank, and a stage that depends on the failure.  Each backend must commit
byte-identical datasets (content hashes equal to the local backend's), record
the same state transitions, report the same error for the failing stage, and
leave no process behind.

RADICAL-Pilot's run is in test_conformance_radical.py, which collects these tests against it: the files that start
RP sessions share one xdist group (tests/conftest.py), and the other engines' runs need not wait in it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import hetflow as hf
from conformance import DATASETS, dataset_hashes, transitions
from conformance import leftovers as _leftovers
from conformance import pipeline as _pipeline

# Every run here takes half a minute or more (RP: a pilot per run), so the whole module is slow.  A test's
# limit covers its fixtures' runs too (the reference and one engine's): 15 minutes, a guard against a hang
# that a slow CI machine under three workers' load does not reach (the dask run took 216 s there once).
pytestmark = pytest.mark.slow

BACKENDS = ["local", "dask", "dask-tcp", "parsl"]  # and "radical": test_conformance_radical.py
# "dask-tcp": the dask backend with every rank its own Dask task on the TCP communicator
VARIANTS = {"dask-tcp": ("dask", {"dask": {"communicator": "tcp"}})}


def run_on(backend: str, workdir: Path) -> dict[str, Any]:
    backend, options = VARIANTS.get(backend, (backend, {}))
    pilot = hf.PilotDescription(name="conformance", backend=backend, cores_per_node=2, gpus_per_node=0,
                                memory_per_node=2**34, options=options)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    run = _pipeline(workdir).run(pilot=pilot, check=False)
    took = time.monotonic() - started
    new_children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE]
    hashes, partitions = dataset_hashes(run)
    return {"run": run, "took": took, "transitions": transitions(workdir, run), "hashes": hashes,
            "partitions": partitions,
            "leftovers": _leftovers(str(workdir)), "children": [f"{p.pid}: {p.cmdline()}" for p in new_children]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_on("local", tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module", params=BACKENDS)
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            reference: dict[str, Any]) -> dict[str, Any]:
    if request.param == "local":
        return reference
    return run_on(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.timeout(900)
def test_reference_run_is_what_the_suite_expects(reference: dict[str, Any]) -> None:
    run = reference["run"]
    states = {s.name: s.state for s in run.stages}
    assert states == {"generate": "DONE", "sort_rows": "DONE", "train": "DONE", "fail_on_rank_one": "FAILED",
                      "after_failure": "SKIPPED"}
    assert set(reference["hashes"]) == set(DATASETS)
    rows = run.dataset("rows").to_table()
    ordered = run.dataset("sorted").to_table()
    assert ordered.num_rows == rows.num_rows == 600
    assert ordered.column("key").to_pylist() == sorted(rows.column("key").to_pylist())


@pytest.mark.timeout(900)
def test_same_datasets_as_local(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    assert outcome["hashes"] == reference["hashes"]
    assert outcome["partitions"] == reference["partitions"]


@pytest.mark.timeout(900)
def test_same_state_transitions(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    assert outcome["transitions"] == reference["transitions"]
    assert outcome["transitions"]["generate"][-1] == "DONE"


@pytest.mark.timeout(900)
def test_same_error_for_the_failing_stage(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    failed, expected = outcome["run"].stage("fail_on_rank_one"), reference["run"].stage("fail_on_rank_one")
    assert failed.state == expected.state == "FAILED"
    assert failed.failed_rank == expected.failed_rank == 1
    assert "ValueError: boom on rank 1" in (failed.error or "")
    assert failed.error == expected.error
    assert outcome["run"].state == reference["run"].state == "FAILED"


@pytest.mark.timeout(900)
def test_clean_shutdown(outcome: dict[str, Any]) -> None:
    assert outcome["leftovers"] == []
    assert outcome["children"] == []
