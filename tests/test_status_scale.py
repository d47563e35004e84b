"""``status`` of a run with many tasks (a map stage has one per chunk; retries add more) reads the store in
a number of statements that does not grow with the tasks: it loaded every task and each one's attempt."""

from __future__ import annotations

import time

from sqlalchemy import event

from hetflow.status import run_status
from hetflow.store import AttemptRecord, RunRecord, StageRecord, Store, TaskRecord


def _store_with(tmp_path, tasks: int) -> Store:  # type: ignore[no-untyped-def]
    store = Store(f"sqlite:///{tmp_path}/state-{tasks}.db")
    now = time.time()
    with store.session() as session:
        session.add(RunRecord(id="r1", pipeline="p", state="DONE", created=now, run_dir=str(tmp_path),
                              hetflow_version="0"))
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
