"""What a run pays once, before its first task and after its last: only what a local run of plain stages needs.

Real runs of real scripts (``python flow.py``): what the process and its fork server have loaded when the server
is spawned, when each rank starts, and how the run waits for its server's end (docs/benchmarks.md, "a run's
fixed cost").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

LATE = ("yaml", "ssl", "pyarrow.fs", "psutil")
"""Modules a local run of plain stages never uses before its first task: PyYAML (a pilot config file), pyarrow.fs
and the TLS it loads (datasets and declared files on an object store), psutil (the processes below a task)."""

FLOW = '''
import json, sys
import pyarrow as pa
import hetflow as hf

LATE = %r
spawned = []


def watch(event, args):
    if event == "subprocess.Popen" and "hetflow.tasks.forkserver" in args[1] and not spawned:
        spawned.append(sorted(m for m in LATE if m in sys.modules))


sys.addaudithook(watch)
pipe = hf.Pipeline("late", pilot=hf.PilotDescription(name="two-cores", cores_per_node=2, memory_per_node=2**33))
SCHEMA = pa.schema([("loaded", pa.string())])


@pipe.stage(outputs=["first"])
def first(ctx):
    return {"first": pa.table({"loaded": sorted(m for m in LATE if m in sys.modules)}, schema=SCHEMA)}


@pipe.stage(inputs=["first"], outputs=["second"])
def second(ctx, first):
    return {"second": pa.table({"loaded": sorted(m for m in LATE if m in sys.modules)}, schema=SCHEMA)}


if __name__ == "__main__":
    run = pipe.run(progress=False, workdir=sys.argv[1])
    seen = {name: hf.open_dataset(f"{run.run_dir}/datasets/{name}").to_table().column("loaded").to_pylist()
            for name in ("first", "second")}
    print("SPAWNED", json.dumps(spawned), "RANKS", json.dumps(seen), run.state)
''' % (LATE,)


def test_the_fork_server_is_spawned_and_forks_without_what_a_local_run_never_uses(tmp_path: Path) -> None:
    """The server is spawned before the script's process loads any of :data:`LATE` (each import before the spawn
    delays the run's first task: the task waits for the server's own imports), and its ranks inherit none of them
    from it: not at its start, and not after it has reported a task's end (``second`` is forked after
    ``first`` ended)."""
    (tmp_path / "flow.py").write_text(FLOW)
    done = subprocess.run([sys.executable, "flow.py", str(tmp_path / "work")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("SPAWNED"))
    spawned, ranks = line.split(" ", 1)[1].split(" RANKS ")
    assert json.loads(spawned) == [[]], line
    assert ranks.endswith(" DONE"), line
    assert json.loads(ranks[: -len(" DONE")]) == {"first": [], "second": []}, line


CLOSE = '''
import sys, time
from hetflow.tasks.forkserver import ForkServer

sleeps = []


def count(frame, event, arg):
    if event == "c_call" and arg is time.sleep:
        sleeps.append(frame.f_code.co_name)


server = ForkServer(None)
sys.setprofile(count)  # this thread's calls only: the one that waits
server.close()
sys.setprofile(None)
print("SLEEPS", len(sleeps), "RETURNCODE", server._proc.returncode, "READER", server._reader.is_alive())
'''


def test_closing_the_fork_server_waits_for_its_end_without_polling(tmp_path: Path) -> None:
    """``ForkServer.close`` returns when the server has exited (reaped, its reader thread done), woken by the end
    of the server's output, not by polling: ``Popen.wait(timeout)`` slept in growing steps of up to 50 ms, and
    the run's end waited for the next one.  Closed at once, the server first finishes its imports (it reads
    its input only then), so a polling wait would sleep many times; at most one short sleep is left (the exit
    may not be reaped yet when the output ends)."""
    done = subprocess.run([sys.executable, "-c", CLOSE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    assert words[0] == "SLEEPS" and int(words[1]) <= 1, done.stdout
    assert words[2:] == ["RETURNCODE", "0", "READER", "False"], done.stdout


STORE = '''
import sys
from pathlib import Path
from sqlalchemy import event
from sqlalchemy.engine import Engine
from hetflow.store import Store

read = []
event.listen(Engine, "before_cursor_execute",
             lambda conn, cursor, statement, *rest: read.append(statement) if "table_" in statement.lower() and "info" in statement.lower() else None)
for label in ("new", "again"):
    read.clear()
    Store.for_workdir(Path(sys.argv[1])).close()
    print(label.upper(), len(read))
'''


def test_a_new_store_is_made_without_reading_its_tables_back(tmp_path: Path) -> None:
    """Opening the store makes its missing tables and adds the columns an older hetflow's tables lack, asking
    the database for each table's columns (``PRAGMA table_info``).  A new file has no table to ask about: every
    first run in a work directory asked 16 times.  An existing store is still checked."""
    done = subprocess.run([sys.executable, "-c", STORE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert counts["NEW"] == "0", done.stdout
    assert int(counts["AGAIN"]) > 0, done.stdout
