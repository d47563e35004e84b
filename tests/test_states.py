"""pipeline/states.py: one enum for the states of stages, tasks, attempts, map items and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from sqlalchemy import select

import hetflow as hf
from hetflow.states import ACTIVE, FAILURE, FINISHED, SUCCESS, TERMINAL, State
from hetflow.store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord


def test_a_state_reads_as_its_word_wherever_it_is_shown():
    """The store, status, the web view and their JSON show the words they showed before the enum."""
    assert State.RUNNING == "RUNNING" and "RUNNING" == State.RUNNING
    assert str(State.TIMED_OUT) == f"{State.TIMED_OUT}" == "TIMED_OUT"
    assert repr(State.DONE) == repr("DONE")  # a message quoting a state ({state!r}) reads as before
    assert json.dumps({"state": State.CACHED}) == '{"state": "CACHED"}'
    assert "DONE" in SUCCESS and "SKIPPED" in FAILURE and "LOOKING" in ACTIVE  # text from the store
    assert TERMINAL == SUCCESS | FAILURE and not TERMINAL & ACTIVE
    assert FINISHED == TERMINAL | {"INTERRUPTED", "REJECTED"}


def _ok(ctx):  # type: ignore[no-untyped-def]
    return {"a": pa.table({"x": [1]})}


def _fails(ctx, a):  # type: ignore[no-untyped-def]
    raise RuntimeError("no")


def _after(ctx, b):  # type: ignore[no-untyped-def]
    return {"c": b}


def test_every_state_a_run_records_is_a_member_and_queries_by_member_find_it(tmp_path: Path):
    pipe = hf.Pipeline("states", pilot=hf.PilotDescription(name="p", cores_per_node=2), workdir=tmp_path)
    pipe.stage(outputs=["a"])(_ok)
    pipe.stage(inputs=["a"], outputs=["b"])(_fails)
    pipe.stage(inputs=["b"], outputs=["c"])(_after)
    run = pipe.run(check=False, progress=False)
    assert run.state == State.FAILED
    store = Store(f"sqlite:///{tmp_path / 'hetflow.db'}")
    try:
        with store.session() as session:
            recorded = {kind.__name__: {r.state for r in session.scalars(select(kind))}
                        for kind in (RunRecord, StageRecord, TaskRecord, AttemptRecord)}
            assert recorded == {"RunRecord": {"FAILED"}, "StageRecord": {"DONE", "FAILED", "SKIPPED"},
                                "TaskRecord": {"DONE", "FAILED"}, "AttemptRecord": {"DONE", "FAILED"}}
            assert all(state in State.__members__ for states in recorded.values() for state in states)
            failed = session.scalars(select(StageRecord.name).where(StageRecord.state == State.FAILED)).all()
            assert failed == ["_fails"]
    finally:
        store.close()
