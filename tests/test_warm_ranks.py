"""Stages of several ranks on this machine start warm: ``mpiexec`` runs a stub per rank, the fork server
forks the rank (:mod:`hetflow.tasks.warmranks`), and every failure path is still the launcher's.

Real runs, real ``mpiexec``: the ranks say who started them (the fork server), reduce over their world,
and faults (a rank that raises, a SIGKILL, a timeout) end the stage with nothing left running.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import _warm_rank_stages as R
import hetflow as hf
import pytest
from _procs import alive as _alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

PILOT = hf.PilotDescription(name="two-cores", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34)
SERVER = "hetflow.tasks.forkserver"


def _attempt(run: hf.RunStatus, stage: str) -> Path:
    return Path(run.run_dir) / "stages" / stage / "attempt-1"


def _pids(run: hf.RunStatus, stage: str) -> list[int]:
    return [int(p.read_text()) for p in _attempt(run, stage).glob("rank-*.pid")]


def _starters(run: hf.RunStatus, stage: str) -> list[str]:
    return [(_attempt(run, stage) / f"starter-{r}.txt").read_text() for r in (0, 1)]


def test_a_two_rank_stage_starts_warm_and_its_ranks_reduce_over_their_world(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-ranks", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, outputs=["reduced"])(R.allreduces)
    run = pipe.run()
    rows = sorted(run.dataset("reduced").to_table().to_pylist(), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], rows  # both ranks' partitions are there
    for rank, row in enumerate(rows):
        assert SERVER in row["starter"], row  # forked by the run's fork server, not started by mpiexec
        assert row["session_leader"] and row["size"] == 2 and row["total"] == 3, row
        assert row["pmi_rank"] == str(rank), row  # the launcher's own rank, through its PMI
        assert row["cpus"] == row["cores"] and len(row["cores"]) == 1, row  # pinned to its slot's core
        assert Path(row["cwd"]) == _attempt(run, "allreduces"), row
    assert rows[0]["cores"] != rows[1]["cores"], rows
    for rank in (0, 1):  # each rank's output in its own log, the launcher's apart
        assert f"rank {rank} says hello" in (_attempt(run, "allreduces") / f"rank-{rank}.log").read_text()


def test_a_warm_rank_that_raises_fails_the_stage_naming_it_and_the_other_rank_ends(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-raises", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, timeout=120, retries=0)(R.one_raises)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("one_raises")
    assert all(SERVER in s for s in _starters(run, "one_raises"))
    assert stage.state == "FAILED" and stage.failed_rank == 1, stage
    assert "ValueError" in stage.error and "rank one gives up" in stage.error, stage.error
    assert time.time() - started < 60  # rank 0 did not wait in its barrier until the timeout
    assert not _alive(_pids(run, "one_raises"))


def test_a_warm_rank_killed_by_sigkill_fails_the_stage_naming_it(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-killed", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, timeout=120, retries=0)(R.one_is_killed)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("one_is_killed")
    assert all(SERVER in s for s in _starters(run, "one_is_killed"))
    assert stage.state == "FAILED" and stage.failed_rank == 1 and stage.signal == 9, stage
    assert "rank 1" in stage.error and "signal 9" in stage.error, stage.error
    assert time.time() - started < 60
    assert not _alive(_pids(run, "one_is_killed"))
    # only the rank that died by itself is recorded as such: rank 0 was ended with its launcher
    ended = sorted(p.name for p in _attempt(run, "one_is_killed").glob("ended-*.json"))
    assert ended == [f"ended-{int((_attempt(run, 'one_is_killed') / 'rank-1.pid').read_text())}.json"], ended


def test_a_warm_two_rank_stage_that_times_out_ends_both_ranks(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-timeout", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, timeout=5, retries=0)(R.both_hang)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("both_hang")
    assert all(SERVER in s for s in _starters(run, "both_hang"))
    assert stage.state == "TIMED_OUT" and "timeout of 5" in stage.error, stage
    assert time.time() - started < 40
    pids = _pids(run, "both_hang")
    assert len(pids) == 2 and not _alive(pids)
