"""End-to-end runs through the API with a real mpiexec and a real SQLite store."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pytest

import _pipelines as P
import hetflow as hf
from hetflow.operators.dataset import DatasetNotFound, open_dataset

LOCAL_2 = hf.PilotDescription(name="two-cores", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34)
FAKE_GPUS = hf.PilotDescription(name="fake-gpus", cores_per_node=4, gpus_per_node=4, memory_per_node=2**34)


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_independent_stages_run_at_the_same_time_on_disjoint_cores(tmp_path: Path) -> None:
    run = P.two_branches(tmp_path).run(pilot=LOCAL_2)
    assert run.state == "DONE", run
    left, right = run.stage("left").to_json(), run.stage("right").to_json()
    # their lifetimes overlap ...
    assert _ts(left["started"]) < _ts(right["ended"]) and _ts(right["started"]) < _ts(left["ended"])
    # ... on disjoint cores, and each process was pinned to what it was given
    left_cores = {c for s in left["slots"] for c in s["cores"]}
    right_cores = {c for s in right["slots"] for c in s["cores"]}
    assert left_cores and right_cores and not left_cores & right_cores
    for name, cores in (("left_out", left_cores), ("right_out", right_cores)):
        table = run.dataset(name).to_table()
        assert set(table["affinity"][0].as_py()) == cores


def test_rank_count_change_splits_rows_and_comm_is_private(tmp_path: Path) -> None:
    pipe = P.pipeline("reshape", workdir=tmp_path)
    pipe.stage(ranks=2, outputs=["numbers"], params={"rows_per_rank": 1001})(P.make_rows)
    pipe.stage(name="three", ranks=3, inputs=["numbers"], outputs=["three_out"])(P.describe_rank)
    pipe.stage(name="one", ranks=1, inputs=["numbers"], outputs=["one_out"])(P.describe_rank)
    run = pipe.run(pilot=hf.PilotDescription(name="three-cores", cores_per_node=3, gpus_per_node=0,
                                             memory_per_node=2**34))
    assert run.ok, run
    three = run.dataset("three_out").to_table().sort_by("rank").to_pylist()
    assert [r["size"] for r in three] == [3, 3, 3] and [r["comm_size"] for r in three] == [3, 3, 3]
    rows = [r["rows"] for r in three]
    assert sum(rows) == 2002 and max(rows) - min(rows) <= 1
    # rows arrive in order and nothing is lost or duplicated
    assert sum(r["sum"] for r in three) == sum(range(2002))
    assert [r["first"] for r in three] == [0, rows[0], rows[0] + rows[1]]
    one = run.dataset("one_out").to_table().to_pylist()
    assert one[0]["comm_size"] == 1 and one[0]["rows"] == 2002


def test_impossible_requests_are_rejected_before_anything_runs(tmp_path: Path) -> None:
    pipe = P.pipeline("too-big", workdir=tmp_path)
    pipe.stage(ranks=3, outputs=["numbers"])(P.make_rows)
    with pytest.raises(hf.UnsatisfiableRequest) as info:
        pipe.run(pilot=LOCAL_2)
    message = str(info.value)
    assert "stage 'make_rows'" in message and "ranks=3" in message and "2 usable cores" in message
    assert not (tmp_path / "runs").exists()

    gpu = P.pipeline("needs-gpu", workdir=tmp_path)
    gpu.stage(ranks=1, gpus_per_rank=1, outputs=["numbers"])(P.make_rows)
    with pytest.raises(hf.UnsatisfiableRequest, match=r"1 GPUs per rank but nodes have 0 GPUs"):
        gpu.run(pilot=LOCAL_2)


def test_failing_rank_fails_the_stage_fast_and_skips_dependents(tmp_path: Path) -> None:
    pipe = P.pipeline("failing", workdir=tmp_path)
    pipe.stage(ranks=2, outputs=["numbers"], params={"rows_per_rank": 10})(P.make_rows)
    pipe.stage(ranks=2, inputs=["numbers"], outputs=["never"])(P.fail_on_rank_one)
    pipe.stage(name="after", ranks=1, inputs=["never"], outputs=["after_out"])(P.describe_rank)
    pipe.stage(name="independent", ranks=1, inputs=["numbers"], outputs=["independent_out"])(P.describe_rank)
    run = pipe.run(pilot=LOCAL_2, check=False)
    assert run.state == "FAILED"
    failed = run.stage("fail_on_rank_one")
    assert failed.state == "FAILED" and failed.failed_rank == 1
    assert "ValueError: boom on rank 1" in (failed.error or "")
    assert failed.traceback and "fail_on_rank_one" in failed.traceback
    assert failed.ended - failed.started < 30  # the abort ended rank 0's barrier
    assert run.stage("after").state == "SKIPPED" and "fail_on_rank_one" in (run.stage("after").error or "")
    assert run.stage("independent").state == "DONE"
    # nothing of the failed output is visible as a dataset
    with pytest.raises(DatasetNotFound):
        open_dataset(Path(run.run_dir) / "datasets" / "never")
    assert "never" not in run.datasets


def test_fake_gpus_get_cuda_visible_devices_and_are_never_shared(tmp_path: Path) -> None:
    pipe = P.pipeline("gpus", workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["numbers"], params={"rows_per_rank": 10})(P.make_rows)
    pipe.stage(name="train", ranks=2, gpus_per_rank=1, inputs=["numbers"], outputs=["train_out"],
               params={"sleep": 1.0})(P.describe_rank)
    pipe.stage(name="infer", ranks=1, gpus_per_rank=2, inputs=["numbers"], outputs=["infer_out"],
               params={"sleep": 1.0})(P.describe_rank)
    pipe.stage(name="cpu", ranks=1, inputs=["numbers"], outputs=["cpu_out"])(P.describe_rank)
    run = pipe.run(pilot=FAKE_GPUS)
    assert run.ok, run
    seen: list[str] = []
    for name in ("train", "infer"):
        stage = run.stage(name)
        table = run.dataset(f"{name}_out").to_table().sort_by("rank").to_pylist()
        for slot, row in zip(stage.slots, table):
            assert row["cuda"] == ",".join(str(g) for g in slot.gpus)
            seen.extend(row["cuda"].split(","))
    assert len(seen) == 4 and len(set(seen)) == 4  # train and infer ran at once on 4 distinct GPUs
    assert run.dataset("cpu_out").to_table()["cuda"][0].as_py() == ""


def test_state_store_records_every_transition(tmp_path: Path) -> None:
    run = P.two_branches(tmp_path, sleep=0).run(pilot=LOCAL_2)
    db = sqlite3.connect(tmp_path / "hetflow.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    states = [r[0] for r in db.execute(
        "SELECT state FROM events WHERE run_id=? AND kind='stage' AND name='left' ORDER BY id", (run.id,))]
    assert states == ["QUEUED", "RUNNING", "DONE"]
    counts = dict(db.execute("SELECT state, count(*) FROM tasks GROUP BY state"))
    assert counts == {"DONE": 3}
    parts = db.execute("SELECT count(*), sum(rows) FROM partitions p JOIN datasets d ON p.dataset_id=d.id "
                       "WHERE d.run_id=? AND d.name='numbers'", (run.id,)).fetchone()
    assert parts == (2, 1000)
    # one name per node: the store's partitions name the node as the pilot placed the ranks (not gethostname())
    nodes = {r[0] for r in db.execute("SELECT p.node FROM partitions p JOIN datasets d ON p.dataset_id=d.id "
                                      "WHERE d.run_id=?", (run.id,))}
    assert nodes == {s.node for s in run.stage("make_rows").slots} == {"localhost"}


def test_rerun_reuses_committed_outputs_and_param_change_reruns(tmp_path: Path) -> None:
    first = P.two_branches(tmp_path, sleep=0).run(pilot=LOCAL_2)
    second = P.two_branches(tmp_path, sleep=0).run(pilot=LOCAL_2)
    assert first.ok and second.ok
    assert {s.state for s in second.stages} == {"CACHED"}
    assert second.dataset("left_out").to_table().equals(first.dataset("left_out").to_table())
    third = P.two_branches(tmp_path, sleep=0).run(pilot=LOCAL_2, params={"rows_per_rank": 7})
    assert all(s.state == "DONE" for s in third.stages)
    assert third.dataset("numbers").num_rows == 14


def test_stage_result_errors_name_the_stage_and_outputs(tmp_path: Path) -> None:
    pipe = P.pipeline("bad-return", workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["wrong_name"])(P.make_rows)
    run = pipe.run(pilot=LOCAL_2, check=False)
    stage = run.stage("make_rows")
    assert stage.state == "FAILED"
    assert "returned outputs ['numbers']; declared outputs are ['wrong_name']" in (stage.error or "")


def test_declaration_errors(tmp_path: Path) -> None:
    pipe = P.pipeline("decl", workdir=tmp_path)
    with pytest.raises(hf.PipelineError, match="bad stage name '../evil'"):
        pipe.stage(name="../evil")(P.make_rows)
    pipe.stage(outputs=["numbers"])(P.make_rows)
    with pytest.raises(hf.PipelineError, match="already produced by stage 'make_rows'"):
        pipe.stage(name="again", outputs=["numbers"])(P.make_rows)
    pipe.stage(name="orphan", inputs=["nothing"], outputs=["x"])(P.describe_rank)
    with pytest.raises(hf.PipelineError, match="input 'nothing' is not produced by any stage"):
        pipe.run(pilot=LOCAL_2)


def test_stages_ready_together_start_in_critical_path_order(tmp_path: Path) -> None:
    # One core: the two stages that become ready together cannot overlap.  "head" leads a
    # longer chain than "short", so it must start first although it is declared second.
    pipe = P.pipeline("priorities", workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["numbers"], params={"rows_per_rank": 10})(P.make_rows)
    pipe.stage(name="short", ranks=1, duration=1, inputs=["numbers"], outputs=["short_out"])(P.describe_rank)
    pipe.stage(name="head", ranks=1, duration=1, inputs=["numbers"], outputs=["head_out"])(P.passthrough)
    pipe.stage(name="tail", ranks=1, duration=5, inputs=["head_out"], outputs=["tail_out"])(P.describe_rank)
    run = pipe.run(pilot=hf.PilotDescription(name="one-core", cores_per_node=1, gpus_per_node=0,
                                             memory_per_node=2**34))
    assert run.ok, run
    short, head = run.stage("short").to_json(), run.stage("head").to_json()
    assert _ts(head["ended"]) <= _ts(short["started"]), (head, short)
