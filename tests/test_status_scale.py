"""``status`` of a run with many tasks (a map stage has one per chunk; retries add more) reads the store in
a number of statements that does not grow with the tasks: it loaded every task and each one's attempt."""

from __future__ import annotations

import json
import time

from sqlalchemy import event, select

from hetflow.status import run_status
from hetflow.store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord


def _run_record(tmp_path, state: str) -> RunRecord:  # type: ignore[no-untyped-def]
    return RunRecord(id="r1", pipeline="p", state=state, created=time.time(), run_dir=str(tmp_path),
                     hetflow_version="0")


def _store_with(tmp_path, tasks: int) -> Store:  # type: ignore[no-untyped-def]
    store = Store(f"sqlite:///{tmp_path}/state-{tasks}.db")
    now = time.time()
    with store.session() as session:
        session.add(_run_record(tmp_path, "DONE"))
        stage = StageRecord(run_id="r1", name="items", order=0, state="DONE", function="f:items")
        other = StageRecord(run_id="r1", name="total", order=1, state="DONE", function="f:total")
        session.add_all([stage, other])
        session.flush()
        for i in range(tasks):
            session.add(TaskRecord(id=f"r1/items/c{i}", stage_id=stage.id, submitted=now + i, state="DONE",
                                   slots=[{"node": 0, "cores": [i % 2], "gpus": []}]))
            session.add(AttemptRecord(task_id=f"r1/items/c{i}", stage_id=stage.id, number=1, state="DONE",
                                      started=now + i, attempt_dir=f"{tmp_path}/c{i}"))
        session.add(TaskRecord(id="r1/total", stage_id=other.id, submitted=now, state="QUEUED"))   # never launched
    return store


def _statements(store: Store) -> tuple[object, int]:
    count = 0

    def counted(*_: object) -> None:
        nonlocal count
        count += 1

    event.listen(store.engine, "before_cursor_execute", counted)
    try:
        view = run_status(store, "r1")
    finally:
        event.remove(store.engine, "before_cursor_execute", counted)
    return view, count


def test_status_reads_the_store_in_statements_that_do_not_grow_with_the_tasks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    few, few_statements = _statements(_store_with(tmp_path, 3))
    many, many_statements = _statements(_store_with(tmp_path, 300))
    assert many_statements == few_statements
    items = many.stage("items")   # type: ignore[attr-defined]
    assert items.attempts == 300
    assert items.log_dir == f"{tmp_path}/c299"   # the last task launched
    assert [s.cores for s in items.slots] == [(299 % 2,)]
    total = many.stage("total")   # type: ignore[attr-defined]
    assert total.attempts == 0 and total.log_dir is None and total.slots == ()


def _store_of_stages(tmp_path, stages: int) -> Store:  # type: ignore[no-untyped-def]
    """A run of ``stages`` plain stages, each tried twice (on other cores) but the last."""
    store = Store(f"sqlite:///{tmp_path}/stages-{stages}.db")
    now = time.time()
    with store.session() as session:
        session.add(_run_record(tmp_path, "FAILED"))
        records = [StageRecord(run_id="r1", name=f"s{i}", order=i, state="DONE", function=f"f:s{i}")
                   for i in range(stages)]
        session.add_all(records)
        session.flush()
        for i, stage in enumerate(records):
            for attempt in (1, 2) if i < stages - 1 else (1,):
                task = f"r1/s{i}/{attempt}"
                session.add(TaskRecord(id=task, stage_id=stage.id, submitted=now + attempt, state="DONE",
                                       slots=[{"node": 0, "cores": [attempt], "gpus": []}]))
                session.add(AttemptRecord(task_id=task, stage_id=stage.id, number=attempt, state="DONE",
                                          started=now + attempt, attempt_dir=f"{tmp_path}/s{i}-{attempt}"))
    return store


def test_status_reads_the_store_in_statements_that_do_not_grow_with_the_stages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    few, few_statements = _statements(_store_of_stages(tmp_path, 2))
    many, many_statements = _statements(_store_of_stages(tmp_path, 60))
    assert many_statements == few_statements
    for view, stages in ((few, 2), (many, 60)):
        for i in range(stages):
            last = 2 if i < stages - 1 else 1
            stage = view.stage(f"s{i}")  # type: ignore[attr-defined]
            assert (stage.attempts, stage.log_dir) == (last, f"{tmp_path}/s{i}-{last}")  # each its own last
            assert [s.cores for s in stage.slots] == [(last,)]


def test_status_from_the_shell_loads_neither_pyarrow_nor_the_orchestrator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    store = _store_with(tmp_path, 3)
    probe = ("import sys\nfrom hetflow.cli import main\n"
             "try:\n    main(['status', 'r1', '--db', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('pyarrow', 'numpy', 'hetflow.pipeline', 'hetflow.orchestrator') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(store.url)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "items" in done.stdout, done.stdout + done.stderr   # it did print the run's table
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def _map_store(tmp_path, items: int, counts: bool = True) -> Store:  # type: ignore[no-untyped-def]
    """A run whose map stage ``items`` recorded ``items`` items (the last tenth FAILED) and a plain stage."""
    from sqlalchemy import insert

    from hetflow.store import MapItemRecord

    store = _store_with(tmp_path, 2)
    failed = items // 10
    with store.session() as session:
        session.execute(insert(MapItemRecord), [
            {"run_id": "r1", "stage": "items", "index": i, "key": f"k{i}", "label": f'{{"i": {i}}}',
             "state": "FAILED" if i >= items - failed else "DONE", "tries": 1, "directory": "/nowhere",
             "outputs": {"out": [{"file": f"part-{i}.arrow", "rows": 1}]}, "log": ["/nowhere/rank-0.log", 0, 0]}
            for i in reversed(range(items))])   # rows in any order: pages are by index
        record = session.scalars(select(StageRecord).where(StageRecord.name == "items")).one()
        record.item_counts = {"DONE": items - failed, "FAILED": failed} if counts else None
    return store


def test_status_counts_a_map_s_items_from_its_stage_record_without_reading_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = _map_store(tmp_path, 3000)
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_: object) -> None:  # type: ignore[no-untyped-def]
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        view = run_status(store, "r1")
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert view.stage("items").items == {"DONE": 2700, "FAILED": 300}
    assert view.stage("total").items is None
    # the only look at the items' table is for the plain stage, by the (run, stage, index) index: no row read
    looks = [s for s in seen if "map_items" in s]
    assert len(looks) == 1 and "AND stage IN" in looks[0], looks
    older = _map_store(tmp_path / "older", 3000, counts=False)   # a store written before the counts were kept
    assert run_status(older, "r1").stage("items").items == {"DONE": 2700, "FAILED": 300}


def test_a_page_of_a_map_s_items_is_read_in_index_order_with_every_item_counted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hetflow.status import map_items

    store = _map_store(tmp_path, 3000)
    page = map_items(store, "r1", "items", offset=2695, limit=10)
    assert [i["index"] for i in page["items"]] == list(range(2695, 2705))
    assert [i["state"] for i in page["items"]] == ["DONE"] * 5 + ["FAILED"] * 5
    assert page["total"] == 3000 and page["counts"] == {"DONE": 2700, "FAILED": 300} and page["offset"] == 2695
    assert len(map_items(store, "r1", "items")["items"]) == 3000
    plan = store.engine.connect().exec_driver_sql(
        "EXPLAIN QUERY PLAN SELECT \"index\" FROM map_items WHERE run_id='r1' AND stage='items' "
        "ORDER BY \"index\" LIMIT 10 OFFSET 2695").fetchall()
    assert any("ix_map_items_run_stage_index" in str(row) for row in plan), plan   # no sort of every row


def test_a_store_made_before_the_items_index_gets_it_when_opened(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sqlite3

    _map_store(tmp_path, 10)
    path = tmp_path / "state-2.db"
    with sqlite3.connect(path) as conn:
        conn.execute("DROP INDEX ix_map_items_run_stage_index")
    Store(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "ix_map_items_run_stage_index" in names


def test_status_items_lists_a_page_as_text_and_says_how_to_see_the_rest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    store = _map_store(tmp_path, 3000)
    command = [sys.executable, "-m", "hetflow.cli", "status", "r1", "items", "--items", "--db", str(store.url)]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("items of run r1: 3,000 items: 2,700 done, 300 failed")
    assert lines[1].split()[0] == "0" and lines[-2].split()[0] == "999"
    assert lines[-1] == "  ... listed 1 to 1,000 of 3,000: --offset 1000 for the next 1,000, --limit 0 for all"
    shown = subprocess.run(command + ["--offset", "2998", "--json"], capture_output=True, text=True, timeout=120,
                           check=False)
    assert [i["index"] for i in json.loads(shown.stdout)["items"]] == [2998, 2999]
    shown = subprocess.run(command + ["--limit", "-1"], capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 2 and "--offset and --limit must be >= 0" in shown.stderr


def test_a_read_only_store_an_older_hetflow_wrote_is_read_without_being_changed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A store in a directory hetflow cannot write (an archived or a colleague's work directory) is opened
    read-only and its schema is not upgraded; a column a newer hetflow declares (``stages.item_counts``) made
    every query fail with ``no such column``.  The store is read through an upgraded private copy and the
    file is left as it was.  (Root writes anywhere, so the directory's verdict is the one piece set here.)"""
    import sqlite3

    import hetflow.store as store_module

    _map_store(tmp_path, 30, counts=False).engine.dispose()   # its last connection closed: the WAL is in the file
    path = tmp_path / "state-2.db"
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE stages DROP COLUMN item_counts")   # as the hetflow before it wrote it
    conn.close()   # the WAL checkpointed into the file: a read-only open reads the file alone
    before = path.read_bytes()
    monkeypatch.setattr(store_module, "_writable", lambda directory: False)
    store = Store(f"sqlite:///{path}")
    assert store.read_only
    view = run_status(store, "r1")
    assert {stage.name: stage.state for stage in view.stages} == {"items": "DONE", "total": "DONE"}
    assert [stage.items for stage in view.stages if stage.name == "items"][0]["FAILED"] == 3
    assert path.read_bytes() == before


def test_status_of_a_sqlite_store_loads_no_sqlalchemy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``hetflow status`` (and ``status RUN STAGE --items``) of a SQLite store read it with the standard library's
    sqlite3: importing SQLAlchemy and the store's models took most of the command's time, whatever the run."""
    import subprocess
    import sys

    store = _map_store(tmp_path, 300)
    probe = ("import sys\nfrom hetflow.cli import main\n"
             "for argv in (['status', 'r1'], ['status', 'r1', '--json'], ['status', 'r1', 'items', '--items']):\n"
             "    assert main(argv + ['--db', sys.argv[1]]) == 0, argv\n"
             "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy')[:3])")
    done = subprocess.run([sys.executable, "-c", probe, str(store.url)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "items of run r1: 300 items: 270 done, 30 failed" in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1] == "loaded []", done.stdout + done.stderr


def test_the_sqlite_reader_and_the_store_read_a_run_alike(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """:func:`quick_status` and :func:`quick_map_items` (sqlite3) give what the store's session gives, and leave
    to the store what it must answer: a prefix naming no run or several, a RUNNING run whose orchestrator is
    gone (recorded FAILED first), a file that is not a store."""
    from sqlalchemy import update

    from hetflow.status import map_items, quick_map_items, quick_status
    from hetflow.store import DatasetRecord

    store = _map_store(tmp_path, 300)
    now = time.time()
    with store.session() as session:
        session.execute(update(RunRecord).where(RunRecord.id == "r1").values(rerun=["items"], error="why"))
        session.execute(update(StageRecord).where(StageRecord.name == "items").values(
            cache_hit=False, cache_reason="map 300 items: 0 cached, 300 ran", outputs=["out"], error="two\nlines"))
        session.execute(update(StageRecord).where(StageRecord.name == "total").values(cache_hit=True,
                                                                                      cached_from="r0"))
        session.execute(update(AttemptRecord).values(traceback="Traceback\n  here", failed_rank=1, signal=9))
        session.add(DatasetRecord(run_id="r1", name="out", path="/d/out", producer_stage="items", producer_attempt=1,
                                  num_rows=1, num_bytes=1, schema="", fingerprint="f", committed=now))
        session.add(RunRecord(id="r1-b", pipeline="p", state="DONE", created=now - 10, run_dir="/r",
                              hetflow_version="0"))
    url = str(store.url)
    assert quick_status(url, "r1") is not None
    assert quick_status(url, "r1").to_json() == run_status(store, "r1").to_json()   # type: ignore[union-attr]
    assert quick_status(url, None).to_json() == run_status(store, None).to_json()   # type: ignore[union-attr]
    assert quick_status(url, "r1-").id == "r1-b"   # type: ignore[union-attr]
    for offset, limit in ((0, None), (295, 10), (0, 0), (400, 5)):
        assert quick_map_items(url, "r1", "items", offset=offset, limit=limit) == \
            map_items(store, "r1", "items", offset=offset, limit=limit)
    import pytest

    with pytest.raises(KeyError, match="run r1 has no stage 'nope' \\(stages: \\['items', 'total'\\]\\)"):
        quick_map_items(url, "r1", "nope")
    with pytest.raises(ValueError, match="stage 'total' of run r1 has no items recorded"):
        quick_map_items(url, "r1", "total")
    assert quick_status(url, "r") is None and quick_status(url, "r2") is None   # several, none: the store says
    assert quick_status(f"sqlite:///{tmp_path}/absent.db", "r1") is None
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    assert quick_status(f"sqlite:///{tmp_path}/junk.db", "r1") is None
    with store.session() as session:   # an orchestrator on this host that is gone (no such pid)
        session.add(RunRecord(id="r3", pipeline="p", state="RUNNING", created=now, run_dir="/r", hetflow_version="0",
                              owner=f"{__import__('socket').gethostname()}:{2**22 + 7}:1.00", lease_until=now + 600))
    assert quick_status(url, "r1") is None and quick_map_items(url, "r1", "items") is None
    store.reconcile_dead_runs()
    assert quick_status(url, "r3").state == "FAILED"   # type: ignore[union-attr]
