"""The Dask backend's TCP communicator: ranks as separate Dask tasks on the workers of their nodes.

A two-node pilot (each node one Dask worker process on this host) runs, with
``options.dask.communicator: tcp``, a pipeline whose stages span both nodes:
a 3-rank generator, a 2-rank distributed sort and a 3-rank join + group-by
with hetflow's operators, a 2-rank data-parallel training stage (torch Gloo,
rendezvous over the TCP communicator) and a 3-rank stage failing on rank 1.
Its datasets must have the content hashes of the same pipeline on the local
backend (one ``mpiexec`` per stage), the same error for the failing stage, and
no process may be left behind.  Backend-level tests check cancellation and a
rank that dies before the rendezvous.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

import conformance_stages as S
from _procs import alive as _alive
import hetflow as hf
from hetflow.tasks.backends import get_backend
from hetflow.tasks.backends.base import LaunchSpec
from hetflow.tasks.scheduler import RankSlot
from conformance import leftovers as _leftovers
from conformance import table_hash as _table_hash

DATASETS = ["rows", "sorted", "joined", "model", "metrics"]


def _pipeline(workdir: Path) -> hf.Pipeline:
    pipe = hf.Pipeline("dask-tcp", workdir=workdir)
    pipe.stage(ranks=3, outputs=["rows"], params={"rows_per_rank": 200})(S.generate)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["sorted"])(S.sort_rows)
    pipe.stage(ranks=3, inputs=["rows"], outputs=["joined"])(S.join_and_group)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["model", "metrics"])(S.train)
    pipe.stage(ranks=3, inputs=["rows"], outputs=["never"])(S.fail_on_rank_one)
    return pipe


def _run(pilot: hf.PilotDescription, workdir: Path) -> dict[str, Any]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    run = _pipeline(workdir).run(pilot=pilot, check=False)
    took = time.monotonic() - started
    new_children = [f"{p.pid}: {p.cmdline()}" for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    db = sqlite3.connect(workdir / "hetflow.db")
    nodes = {}
    for task_id, slots in db.execute("SELECT id, slots FROM tasks"):
        nodes[task_id.split("/")[1] if "/" in task_id else task_id] = sorted({s["node"] for s in json.loads(slots)})
    db.close()
    hashes = {n: _table_hash(run.dataset(n).to_table()) for n in DATASETS if n in run.datasets}
    partitions = {n: [_table_hash(p) for p in run.dataset(n).partitions()] for n in DATASETS if n in run.datasets}
    return {"run": run, "took": took, "hashes": hashes, "partitions": partitions, "nodes": nodes,
            "leftovers": _leftovers(str(workdir)), "children": new_children}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    local = hf.PilotDescription(name="ref", backend="local", cores_per_node=4, gpus_per_node=0,
                                memory_per_node=2**34)
    dask = hf.PilotDescription(name="two-nodes", backend="dask", nodes=2, cores_per_node=2, gpus_per_node=0,
                               memory_per_node=2**34, options={"dask": {"communicator": "tcp"}})
    return {"local": _run(local, tmp_path_factory.mktemp("local")),
            "tcp": _run(dask, tmp_path_factory.mktemp("dask-tcp"))}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_same_datasets_as_the_local_backend(runs: dict[str, dict[str, Any]]) -> None:
    local, tcp = runs["local"], runs["tcp"]
    assert {s.name: s.state for s in tcp["run"].stages} == {s.name: s.state for s in local["run"].stages} == {
        "generate": "DONE", "sort_rows": "DONE", "join_and_group": "DONE", "train": "DONE",
        "fail_on_rank_one": "FAILED"}
    assert set(tcp["hashes"]) == set(DATASETS)
    assert tcp["hashes"] == local["hashes"]
    assert tcp["partitions"] == local["partitions"]
    joined = tcp["run"].dataset("joined").to_table()
    assert sum(joined.column(1).to_pylist()) > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_rank_stages_span_both_nodes(runs: dict[str, dict[str, Any]]) -> None:
    nodes = runs["tcp"]["nodes"]
    assert nodes["generate"] == nodes["join_and_group"] == [0, 1]  # 3 ranks on 2-core nodes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failing_rank_gives_the_same_error(runs: dict[str, dict[str, Any]]) -> None:
    failed = runs["tcp"]["run"].stage("fail_on_rank_one")
    expected = runs["local"]["run"].stage("fail_on_rank_one")
    assert failed.state == expected.state == "FAILED"
    assert failed.failed_rank == expected.failed_rank == 1
    assert "ValueError: boom on rank 1" in (failed.error or "")
    assert failed.error == expected.error


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_process_left_behind(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["tcp"]["leftovers"] == [] and runs["tcp"]["children"] == []


# ------------------------------------------------------------ backend level
@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("tcp-backend")
    pilot = hf.PilotDescription(name="two-nodes", backend="dask", nodes=2, cores_per_node=1, gpus_per_node=0,
                                memory_per_node=2**33, options={"dask": {"communicator": "tcp"}})
    run = root / "run"
    run.mkdir(mode=0o700)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = get_backend("dask")(pilot, run)
    engine.start()
    yield engine, root
    seen = set(engine.pids()) | ({p.pid for p in psutil.Process().children(recursive=True)} - before)
    engine.shutdown()
    assert _alive(seen) == []
    assert not any((run / "dask" / "comm").iterdir()), "rendezvous directories must be removed"


RANK_PROGRAM = """
import json, os, sys, time
import mpi4py
mpi4py.rc.initialize = False
rank = int(os.environ["HETFLOW_COMM_RANK"])
open(os.path.join(sys.argv[1], f"pid-{rank}"), "w").write(str(os.getpid()))
if sys.argv[2] == "die" and rank == 1:
    sys.exit(5)  # before the rendezvous: rank 0 would wait for it until the connect timeout
from hetflow.tasks.tcpenv import connect_from_env
comm = connect_from_env()
total = comm.allreduce(rank + 1)
json.dump({"rank": rank, "size": comm.Get_size(), "total": total, "host": os.environ["HETFLOW_COMM_HOST"],
           "gpus": os.environ["CUDA_VISIBLE_DEVICES"]}, open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w"))
if sys.argv[2] == "sleep":
    time.sleep(120)
comm.Free()
"""


def _spec(root: Path, name: str, mode: str, **kwargs: Any) -> LaunchSpec:
    cwd = root / name
    cwd.mkdir(mode=0o700)
    return LaunchSpec(task_id=f"run/{name}/1", argv=(sys.executable, "-c", RANK_PROGRAM, str(cwd), mode),
                      slots=(RankSlot(0, (0,)), RankSlot(1, (0,))), cwd=cwd, stdout=cwd / "stdout",
                      stderr=cwd / "stderr", **kwargs)


@pytest.mark.timeout(300)
def test_ranks_on_two_workers_share_one_communicator(backend: Any) -> None:
    engine, root = backend
    spec = _spec(root, "ok", "ok")
    outcome = engine.launch(spec).result(timeout=120)
    assert outcome.ok, (outcome, spec.stderr.read_text())
    ranks = [json.loads((spec.cwd / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["total"] for r in ranks] == [3, 3] and {r["size"] for r in ranks} == {2}
    assert [r["host"] for r in ranks] == [engine.node_names()[0], engine.node_names()[1]]


@pytest.mark.timeout(300)
def test_a_rank_failing_before_the_rendezvous_stops_the_others(backend: Any) -> None:
    engine, root = backend
    spec = _spec(root, "die", "die")
    started = time.monotonic()
    outcome = engine.launch(spec).result(timeout=120)
    assert time.monotonic() - started < 60  # not the 120 s connect timeout
    assert not outcome.ok and outcome.returncode == 5, outcome
    assert "rank 0: stopped: another rank of the task failed" in outcome.detail
    # rank 0's process may not have started at all when rank 1's failure stopped the task (a loaded machine:
    # CI found no pid-0): then there is nothing to outlive it; a rank that started wrote its pid first
    assert (spec.cwd / "pid-1").exists()
    pids = {int(path.read_text()) for r in range(2) if (path := spec.cwd / f"pid-{r}").exists()}
    assert _alive(pids) == []


@pytest.mark.timeout(300)
def test_cancel_and_timeout_kill_every_rank(backend: Any) -> None:
    engine, root = backend
    spec = _spec(root, "cancel", "sleep")
    future = engine.launch(spec)
    deadline = time.monotonic() + 90
    while not all((spec.cwd / f"rank-{r}.json").exists() for r in range(2)):
        assert time.monotonic() < deadline and not future.done(), spec.stderr.read_text()
        time.sleep(0.1)
    engine.cancel(spec.task_id)
    outcome = future.result(timeout=60)
    assert outcome.cancelled and not outcome.ok, outcome
    timed = _spec(root, "timeout", "sleep", timeout=4)
    late = engine.launch(timed).result(timeout=120)
    assert late.timed_out and not late.ok, late
    pids = {int((d / f"pid-{r}").read_text()) for d in (spec.cwd, timed.cwd) for r in range(2)}
    assert _alive(pids) == []


def test_auto_takes_mpi_on_one_host_and_tcp_across_hosts() -> None:
    from hetflow.tasks.backends.dask import choose_communicator

    assert choose_communicator("auto", ["127.0.0.1", "127.0.0.1"]) == "mpi"
    assert choose_communicator("auto", ["10.0.0.1", "10.0.0.2", "10.0.0.1"]) == "tcp"
    assert choose_communicator("tcp", ["127.0.0.1"]) == "tcp"
    assert choose_communicator("mpi", ["10.0.0.1", "10.0.0.2"]) == "mpi"


def test_combined_outcome_names_the_rank_that_failed_first() -> None:
    from hetflow.tasks.backends.dask import combine_ranks

    stopped = {"returncode": -15, "signal": 15, "aborted": True, "detail": "stopped: another rank of the task failed",
               "started": 1.0, "ended": 3.0}
    failed = {"returncode": 2, "signal": None, "detail": "exited with 2", "started": 2.0, "ended": 2.5}
    outcome = combine_ranks("t", [stopped, failed, RuntimeError("worker died")])
    assert (outcome.returncode, outcome.signal, outcome.started, outcome.ended) == (2, None, 1.0, 3.0)
    assert outcome.detail.startswith("rank 0: stopped: another rank") and "rank 2: dask task failed" in outcome.detail
    ok = {"returncode": 0, "started": 1.0, "ended": 2.0}
    assert combine_ranks("t", [ok, ok]).ok


def test_unknown_communicator_is_rejected(tmp_path: Path) -> None:
    pilot = hf.PilotDescription(name="bad", backend="dask", cores_per_node=1, gpus_per_node=0,
                                memory_per_node=2**33, options={"dask": {"communicator": "gloo"}})
    with pytest.raises(ValueError, match=r"communicator is 'gloo' \(allowed: \['auto', 'mpi', 'tcp'\]\)"):
        get_backend("dask")(pilot, tmp_path)
    assert os.listdir(tmp_path) == []
