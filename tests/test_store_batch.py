"""The store's group commit (``Store.batch``): what one loop turn of the orchestrator records costs few statements.

Real SQLite; the statements are counted with SQLAlchemy's own cursor hook.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy import event, select

from hetflow.store import EventRecord, RunRecord, StageRecord, Store


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(f"sqlite:///{tmp_path / 'hetflow.db'}")
    with opened.session() as session:
        session.add(RunRecord(id="r", pipeline="p", created=time.time(), run_dir=str(tmp_path), hetflow_version="t"))
        session.add(StageRecord(run_id="r", name="s", order=0, function="f"))
    yield opened
    opened.close()


def _statements(store: Store) -> list[str]:
    seen: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: seen.append(" ".join(args[2].split())))
    return seen


def _stage_id(store: Store) -> int:
    with store.session() as session:
        return session.scalars(select(StageRecord.id)).one()


def test_a_batch_writes_its_events_in_one_statement_in_order(store: Store) -> None:
    seen = _statements(store)
    with store.batch():
        for state in ("QUEUED", "RUNNING", "DONE"):
            with store.session() as session:
                store.event(session, "r", "task", "s:1", state, note=state.lower())
        store.commit()  # an intermediate commit writes what was recorded so far
        with store.session() as session:
            store.event(session, "r", "stage", "s", "DONE")
    inserts = [s for s in seen if s.startswith("INSERT INTO events")]
    assert len(inserts) == 2, inserts
    with store.session() as session:
        rows = session.scalars(select(EventRecord).order_by(EventRecord.id)).all()
    assert [(r.kind, r.state, r.detail) for r in rows] == [
        ("task", "QUEUED", {"note": "queued"}), ("task", "RUNNING", {"note": "running"}),
        ("task", "DONE", {"note": "done"}), ("stage", "DONE", {})]


def test_a_batch_that_fails_writes_none_of_its_events(store: Store) -> None:
    with pytest.raises(RuntimeError):
        with store.batch():
            with store.session() as session:
                store.event(session, "r", "task", "s:1", "QUEUED")
            raise RuntimeError("the loop turn failed")
    with store.session() as session:
        assert session.scalars(select(EventRecord)).all() == []


def test_a_batch_reads_a_record_once_though_it_is_flushed_between_reads(store: Store) -> None:
    stage_id = _stage_id(store)
    seen = _statements(store)
    with store.batch():
        for state in ("QUEUED", "RUNNING", "DONE"):
            with store.session() as session:
                record = session.get(StageRecord, stage_id)
                assert record is not None
                record.state = state
                session.flush()  # what a query's autoflush does between two steps
            del record  # nothing but the batch holds it now
    selects = [s for s in seen if s.startswith("SELECT") and "FROM stages" in s]
    assert len(selects) == 1, selects
    with store.session() as session:
        assert session.get(StageRecord, stage_id).state == "DONE"  # type: ignore[union-attr]


def test_a_record_held_from_an_earlier_batch_is_taken_back_without_a_query(store: Store) -> None:
    stage_id = _stage_id(store)
    with store.batch():
        with store.session() as session:
            held = store.get(session, StageRecord, stage_id)
            held.state = "QUEUED"
    seen = _statements(store)
    with store.batch():
        with store.session() as session:
            again = store.get(session, StageRecord, stage_id, held)
            assert again is held
            again.state = "RUNNING"
    assert not [s for s in seen if s.startswith("SELECT")], seen
    assert [s for s in seen if s.startswith("UPDATE stages")], seen
    with store.session() as session:
        assert session.get(StageRecord, stage_id).state == "RUNNING"  # type: ignore[union-attr]


def test_a_held_record_gives_way_to_the_session_s_own_copy_and_to_loaded_relations(store: Store) -> None:
    stage_id = _stage_id(store)
    with store.batch():
        with store.session() as session:
            held = store.get(session, StageRecord, stage_id)
    with store.batch():
        with store.session() as session:
            own = session.get(StageRecord, stage_id)  # this batch loaded its own copy first
            assert store.get(session, StageRecord, stage_id, held) is own
    with store.batch():
        with store.session() as session:
            loaded = store.get(session, StageRecord, stage_id)
            assert loaded.tasks == []  # a relation loaded on it: adding it back would add those too
    with store.batch():
        with store.session() as session:
            fresh = store.get(session, StageRecord, stage_id, loaded)
            assert fresh is not loaded and fresh.id == stage_id


def test_a_held_record_is_read_again_after_its_batch_was_rolled_back(store: Store) -> None:
    stage_id = _stage_id(store)
    with store.batch():
        with store.session() as session:
            held = store.get(session, StageRecord, stage_id)
            held.state = "QUEUED"
    with pytest.raises(RuntimeError):
        with store.batch():
            with store.session() as session:
                store.get(session, StageRecord, stage_id, held).state = "RUNNING"
                raise RuntimeError("the loop turn failed")
    with store.batch():
        with store.session() as session:
            assert store.get(session, StageRecord, stage_id, held).state == "QUEUED"  # the store's, not RUNNING
