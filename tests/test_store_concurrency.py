"""Many stages finishing at once: the single-writer store loses nothing and never reports a lock."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import _pipelines as P
import hetflow as hf


@pytest.mark.slow
def test_hundreds_of_short_tasks_reconcile(tmp_path: Path) -> None:
    stages = 120
    pilot = hf.PilotDescription(name="wide", cores_per_node=24, gpus_per_node=0, memory_per_node=2**34)
    readers_failed: list[str] = []
    done = threading.Event()

    def reader() -> None:  # status readers hammer the store while the orchestrator writes
        while not done.is_set():
            probe = subprocess.run([sys.executable, "-m", "hetflow.cli", "status", "--workdir", str(tmp_path),
                                    "--json"], capture_output=True, text=True)
            if "locked" in probe.stderr:
                readers_failed.append(probe.stderr)
            done.wait(0.2)

    thread = threading.Thread(target=reader, daemon=True)
    run_holder: list[hf.RunStatus] = []
    P.wide(tmp_path, 1, pilot).run()  # creates the store for the readers
    thread.start()
    try:
        run_holder.append(P.wide(tmp_path, stages, pilot).run(rerun=["all"]))  # t000 is the warm-up's too
    finally:
        done.set()
        thread.join(60)
    run = run_holder[0]
    assert run.ok and len(run.stages) == stages
    assert not readers_failed, readers_failed[0]
    db = sqlite3.connect(tmp_path / "hetflow.db")
    q = lambda sql: db.execute(sql, (run.id,)).fetchone()[0]  # noqa: E731
    assert q("SELECT count(*) FROM stages WHERE run_id=? AND state='DONE'") == stages
    assert q("SELECT count(*) FROM tasks t JOIN stages s ON t.stage_id=s.id WHERE s.run_id=? AND t.state='DONE'") == stages
    assert q("SELECT count(*) FROM datasets WHERE run_id=?") == stages
    # every stage has exactly QUEUED, RUNNING, DONE events: no lost or doubled update
    assert q("SELECT count(*) FROM events WHERE run_id=? AND kind='stage'") == 3 * stages
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_store_an_older_hetflow_made_gets_the_new_columns(tmp_path: Path) -> None:
    """Runs recorded before the cache parts and ownership columns existed stay readable and reusable."""
    from hetflow.store import Store

    db = tmp_path / "hetflow.db"
    Store.for_workdir(tmp_path).close()
    new = {"stages": ["cache_material", "cache_reason", "cache_hit", "params_read"], "runs": ["error"]}
    with sqlite3.connect(db) as connection:
        for table, columns in new.items():
            for column in columns:
                connection.execute(f'ALTER TABLE {table} DROP COLUMN "{column}"')
    store = Store.for_workdir(tmp_path)
    store.close()
    with sqlite3.connect(db) as connection:
        for table, columns in new.items():
            have = {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}
            assert set(columns) <= have, (table, have)
    pilot = hf.PilotDescription(name="one", cores_per_node=1, gpus_per_node=0, memory_per_node=2**33)
    assert P.wide(tmp_path, 2, pilot).run().ok
