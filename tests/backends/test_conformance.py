"""The same pipeline through every backend, with a real session of each engine.

One run per backend (module-scoped: RP alone takes ~30 s to start a pilot) of a
pipeline with an operator stage (sample sort), an ML stage (data-parallel
training with torch.distributed over the stage's ranks), a stage that fails on
one rank, and a stage that depends on the failure.  Each backend must commit
byte-identical datasets (content hashes equal to the local backend's), record
the same state transitions, report the same error for the failing stage, and
leave no process behind.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pytest

import conformance_stages as S
import hetflow as hf

# Every run here takes half a minute or more (RP: a pilot per run), so the whole module is slow.
pytestmark = pytest.mark.slow

BACKENDS = ["local", "dask", "dask-tcp", "parsl", "radical"]
# "dask-tcp": the dask backend with every rank its own Dask task on the TCP communicator
VARIANTS = {"dask-tcp": ("dask", {"dask": {"communicator": "tcp"}})}
DATASETS = ["rows", "sorted", "model", "metrics"]
# Wall-clock measurements a training stage records along with its results: they
# differ between any two runs, so content hashes leave them out (and nothing else).
TIMING_COLUMNS = ("seconds", "samples_per_s")


def _pipeline(workdir: Path) -> hf.Pipeline:
    pipe = hf.Pipeline("conformance", workdir=workdir)
    pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 300})(S.generate)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["sorted"])(S.sort_rows)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["model", "metrics"])(S.train)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["never"])(S.fail_on_rank_one)
    pipe.stage(name="after_failure", ranks=1, inputs=["never"], outputs=["after"])(S.sort_rows)
    return pipe


def _table_hash(table: pa.Table) -> str:
    table = table.drop_columns([c for c in TIMING_COLUMNS if c in table.column_names])
    metadata = dict(table.schema.metadata or {})
    if b"hetflow.model" in metadata:  # the model manifest repeats the timings of the last epoch
        manifest = json.loads(metadata[b"hetflow.model"])
        for column in TIMING_COLUMNS:
            manifest.get("metrics", {}).pop(column, None)
        metadata[b"hetflow.model"] = json.dumps(manifest, sort_keys=True).encode()
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def _leftovers(marker: str) -> list[str]:
    """Live processes of this user whose command line names the run's work directory."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _run(backend: str, workdir: Path) -> dict[str, Any]:
    backend, options = VARIANTS.get(backend, (backend, {}))
    pilot = hf.PilotDescription(name="conformance", backend=backend, cores_per_node=2, gpus_per_node=0,
                                memory_per_node=2**34, options=options)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    run = _pipeline(workdir).run(pilot=pilot, check=False)
    took = time.monotonic() - started
    new_children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE]
    db = sqlite3.connect(workdir / "hetflow.db")
    transitions = {}
    for stage in run.stages:
        transitions[stage.name] = [r[0] for r in db.execute(
            "SELECT state FROM events WHERE run_id=? AND kind='stage' AND name=? ORDER BY id", (run.id, stage.name))]
    db.close()
    hashes = {}
    partitions = {}
    for name in DATASETS:
        if name in run.datasets:
            dataset = run.dataset(name)
            hashes[name] = _table_hash(dataset.to_table())
            partitions[name] = [_table_hash(part) for part in dataset.partitions()]
    return {"run": run, "took": took, "transitions": transitions, "hashes": hashes, "partitions": partitions,
            "leftovers": _leftovers(str(workdir)), "children": [f"{p.pid}: {p.cmdline()}" for p in new_children]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("local", tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module", params=BACKENDS)
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            reference: dict[str, Any]) -> dict[str, Any]:
    if request.param == "local":
        return reference
    return _run(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_same_datasets_as_local(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    assert outcome["hashes"] == reference["hashes"]
    assert outcome["partitions"] == reference["partitions"]


@pytest.mark.timeout(300)
def test_same_state_transitions(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    assert outcome["transitions"] == reference["transitions"]
    assert outcome["transitions"]["generate"][-1] == "DONE"


@pytest.mark.timeout(300)
def test_same_error_for_the_failing_stage(outcome: dict[str, Any], reference: dict[str, Any]) -> None:
    failed, expected = outcome["run"].stage("fail_on_rank_one"), reference["run"].stage("fail_on_rank_one")
    assert failed.state == expected.state == "FAILED"
    assert failed.failed_rank == expected.failed_rank == 1
    assert "ValueError: boom on rank 1" in (failed.error or "")
    assert failed.error == expected.error
    assert outcome["run"].state == reference["run"].state == "FAILED"


@pytest.mark.timeout(300)
def test_clean_shutdown(outcome: dict[str, Any]) -> None:
    assert outcome["leftovers"] == []
    assert outcome["children"] == []
