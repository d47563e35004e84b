"""Many stages finishing at once: the single-writer store loses nothing and never reports a lock."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import _pipelines as P
import hetflow as hf

SLOTS = 8
"""The pilot's cores: this many one-rank stages run, and finish, at the same moment."""

READER = '''
import contextlib, io, json, sys, traceback
from pathlib import Path
from hetflow.cli import main

workdir, stop = sys.argv[1], Path(sys.argv[2])
seen = []
while not stop.exists():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["status", "--workdir", workdir, "--json"])
        except Exception:
            traceback.print_exc()
    try:
        status = json.loads(out.getvalue())
        seen.append([status["id"], sum(s["state"] == "DONE" for s in status["stages"]), len(status["stages"])])
    except (ValueError, KeyError):
        seen.append(None)
print(json.dumps(seen))
'''
"""A status reader: ``hetflow status --json`` of the work directory, over and over until told to stop, each time
opening the store afresh as the command does; it prints what each read saw (run id, stages DONE, stages)."""


@pytest.mark.slow
def test_many_short_tasks_finishing_together_reconcile(tmp_path: Path) -> None:
    """Waves of one-rank stages fill every slot of the pilot and finish together while a status reader reads the
    store without pause: no read reports a lock, and every stage's row, task, dataset and events are there.

    Two waves of :data:`SLOTS` stages: what is tested is a full pilot's worth of stages writing at one moment and a
    reader that overlaps them, not the count of stages (``benchmarks/map_scale.py`` times ``hetflow status``
    while a run of many thousands of items goes)."""
    stages = 2 * SLOTS
    pilot = hf.PilotDescription(name="wide", cores_per_node=SLOTS, gpus_per_node=0, memory_per_node=2**34)
    P.wide(tmp_path, 1, pilot).run()  # creates the store for the reader
    stop = tmp_path / "stop-reading"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path), str(stop)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        run = P.wide(tmp_path, stages, pilot).run(rerun=["all"])  # t000 is the warm-up's too
    finally:
        stop.touch()
        out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    assert "locked" not in err and "Traceback" not in err, err
    assert run.ok and len(run.stages) == stages
    seen = json.loads(out)
    assert None not in seen, seen
    # the reader read while the stages finished: it saw this run with some of its stages DONE and some not
    assert any(run_id == run.id and 0 < done < total == stages for run_id, done, total in seen), seen
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
