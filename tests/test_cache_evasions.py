"""Stale results the third red team still got (issue 25): each edit below changes what a stage computes.

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage reads the way the
attack did, runs again and checks that the stage ran (or was refused, saying
why) and that its dataset holds the new value, never the old one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cache_stale import HETFLOW, edit, run, states, status, value

TABLES = '''
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

HERE = Path(__file__).resolve().parent.parent
FRAME = pd.read_csv(HERE / "table.csv")  # computed at import from data: its value counts, not its source
OBJECTS = np.array([{"k": int(v)} for v in FRAME["v"]], dtype=object)
TABLE = pa.table({"v": FRAME["v"].to_numpy()})  # a type hetflow cannot digest: its repr is shortened
'''

VALUES = '''
import dataclasses

import pyarrow as pa
import hetflow as hf
from mylib import tables
from mylib.consts import CFG

CFG.boost = 1  # not a field of the dataclass: set on the instance


@dataclasses.dataclass
class Settings:
    lr: int = 1


SETTINGS = Settings()
setattr(SETTINGS, "extra", 10)

pipe = hf.Pipeline("values")


@pipe.stage(outputs=["frame"])
def frame(ctx):
    return {"frame": pa.table({"v": [int(tables.FRAME["v"].sum())]})}


@pipe.stage(outputs=["objects"])
def objects(ctx):
    return {"objects": pa.table({"v": [sum(o["k"] for o in tables.OBJECTS)]})}


@pipe.stage(outputs=["table"])
def table(ctx):
    return {"table": pa.table({"v": [tables.TABLE["v"][500].as_py()]})}


@pipe.stage(outputs=["boost"])
def boost(ctx):
    return {"boost": pa.table({"v": [CFG.lr * CFG.boost + SETTINGS.extra]})}
'''


def test_values_with_a_shortened_text_form_or_extra_attributes_rerun_what_reads_them(tmp_path: Path) -> None:
    """The third red team: a pandas frame and an object array built at import (their ``repr`` elides the
    middle rows) and an attribute set on a dataclass instance that is not one of its fields were hashed
    without the change: CACHED with the old values.  A value of a type hetflow cannot digest makes its
    stage run every time, saying why, instead of a key that misses a change."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "tables.py").write_text(TABLES)
    (lib / "consts.py").write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass Config:\n"
                                   "    lr: int = 1\n\n\nCFG = Config()\n")
    (tmp_path / "table.csv").write_text("v\n" + "".join(f"{i % 7}\n" for i in range(1000)))
    (tmp_path / "p.py").write_text(VALUES)
    first = run(tmp_path)
    total = sum(i % 7 for i in range(1000))
    assert [value(first, n) for n in ("frame", "objects", "table", "boost")] == [total, total, 500 % 7, 11]
    assert first["table"]["cache"]["reason"].startswith("not cached: mylib.tables.TABLE holds a pyarrow"), first
    again = run(tmp_path)
    assert states(again) == {"frame": "CACHED", "objects": "CACHED", "table": "DONE", "boost": "CACHED"}, \
        states(again)
    assert "hetflow cannot digest it" in again["table"]["cache"]["reason"]
    rows = (tmp_path / "table.csv").read_text().splitlines()
    rows[501] = "100"  # row 500, in the middle that the repr leaves out
    (tmp_path / "table.csv").write_text("\n".join(rows) + "\n")
    edited = run(tmp_path)
    assert states(edited) == {"frame": "DONE", "objects": "DONE", "table": "DONE", "boost": "CACHED"}, \
        states(edited)
    changed = total - 500 % 7 + 100
    assert [value(edited, n) for n in ("frame", "objects", "table")] == [changed, changed, 100]
    assert edited["frame"]["cache"]["reason"] == "mylib.tables.FRAME changed", edited["frame"]["cache"]
    edit(tmp_path / "p.py", "CFG.boost = 1", "CFG.boost = 3")
    boosted = run(tmp_path)
    assert boosted["boost"]["state"] == "DONE" and value(boosted, "boost") == 13
    edit(tmp_path / "p.py", '"extra", 10', '"extra", 20')
    extra = run(tmp_path)
    assert extra["boost"]["state"] == "DONE" and value(extra, "boost") == 23
    assert extra["boost"]["cache"]["reason"] == "SETTINGS changed"


RUNS = '''
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf
from mylib import calc

HERE = Path(__file__).resolve().parent
pipe = hf.Pipeline("runs")


@pipe.stage(outputs=["uses"], files=["data.txt"])
def uses(ctx):
    read = calc.f() * 100 + int(ctx.files[0].read_text())  # read as it starts
    (HERE / "started").touch()
    while not (HERE / "go").exists():
        time.sleep(0.1)
    return {"uses": pa.table({"v": [read]})}
'''


@pytest.mark.parametrize("edited", ["file", "module", "same"])
def test_an_edit_while_a_stage_runs_is_not_committed_under_the_earlier_key(tmp_path: Path, edited: str) -> None:
    """The third red team: a declared file (or a local module) edited while its stage ran; the result, made
    from the earlier content, was committed under the earlier content's key and then served CACHED for the
    new content.  A rewrite with the same bytes (a checkout, an editor's save) is not a change."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (tmp_path / "mylib" / "calc.py").write_text("def f():\n    return 1\n")
    (tmp_path / "data.txt").write_text("1")
    (tmp_path / "p.py").write_text(RUNS)
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        if edited == "module":
            (tmp_path / "mylib" / "calc.py").write_text("def f():\n    return 2\n")
        else:
            (tmp_path / "data.txt").write_text("2" if edited == "file" else "1")
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    shown = status(tmp_path)
    if edited == "same":
        assert shown["uses"]["state"] == "DONE" and value(shown, "uses") == 101, (out, err)
        return
    assert proc.returncode != 0 and shown["uses"]["state"] == "FAILED", (out, err)
    what = "declared file data.txt" if edited == "file" else f"local module {tmp_path / 'mylib' / 'calc.py'}"
    assert f"{what} changed while the stage ran" in shown["uses"]["error"], shown["uses"]["error"]
    again = run(tmp_path)  # made from what is there now, and computed with it
    assert again["uses"]["state"] == "DONE", again["uses"]
    assert value(again, "uses") == (201 if edited == "module" else 102)
    assert run(tmp_path)["uses"]["state"] == "CACHED"
