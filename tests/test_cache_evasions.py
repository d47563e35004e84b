"""Stale results the third red team still got (issue 25): each edit below changes what a stage computes.

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage reads the way the
attack did, runs again and checks that the stage ran (or was refused, saying
why) and that its dataset holds the new value, never the old one.
"""

from __future__ import annotations

import os
import signal
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
TABLE = pa.table({"v": FRAME["v"].to_numpy()})
MASKED = np.ma.masked_less(FRAME["v"].to_numpy(), 0)  # hetflow cannot digest it: its repr is shortened
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


@pipe.stage(outputs=["masked"])
def masked(ctx):
    return {"masked": pa.table({"v": [int(tables.MASKED[500])]})}


@pipe.stage(outputs=["boost"])
def boost(ctx):
    return {"boost": pa.table({"v": [CFG.lr * CFG.boost + SETTINGS.extra]})}
'''


def test_values_with_a_shortened_text_form_or_extra_attributes_rerun_what_reads_them(tmp_path: Path) -> None:
    """The third red team: a pandas frame and an object array built at import (their ``repr`` elides the
    middle rows; an Arrow table's too) and an attribute set on a dataclass instance that is not one of its fields were hashed
    without the change: CACHED with the old values.  A value of a type hetflow cannot digest makes its
    stage run every time, saying why, instead of a key that misses a change."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "tables.py").write_text(TABLES)
    (lib / "consts.py").write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass Config:\n"
                                   "    lr: int = 1\n\n\nCFG = Config()\n")
    (tmp_path / "table.csv").write_text("v\n" + "".join(f"{i % 7}\n" for i in range(2000)))
    (tmp_path / "p.py").write_text(VALUES)
    first = run(tmp_path)
    total = sum(i % 7 for i in range(2000))
    assert [value(first, n) for n in ("frame", "objects", "table", "masked", "boost")] == \
        [total, total, 500 % 7, 500 % 7, 11]
    assert first["masked"]["cache"]["reason"].startswith(
        "not cached: mylib.tables.MASKED holds a numpy.ma.MaskedArray whose text form is shortened"), first
    again = run(tmp_path)
    assert states(again) == {"frame": "CACHED", "objects": "CACHED", "table": "CACHED", "masked": "DONE",
                             "boost": "CACHED"}, states(again)
    assert "hetflow cannot digest it" in again["masked"]["cache"]["reason"]
    rows = (tmp_path / "table.csv").read_text().splitlines()
    rows[501] = "100"  # row 500, in the middle that the repr leaves out
    (tmp_path / "table.csv").write_text("\n".join(rows) + "\n")
    edited = run(tmp_path)
    # boost reads none of the tables, but table.csv is a file the script's top read (through mylib.tables):
    # such a file counts for every stage of the script, since library state set from it is not seen
    # (docs/caching.md, "Files read and folders listed")
    assert states(edited) == {"frame": "DONE", "objects": "DONE", "table": "DONE", "masked": "DONE",
                              "boost": "DONE"}, states(edited)
    assert edited["boost"]["cache"]["reason"].startswith("file table.csv read at the script's top changed"), \
        edited["boost"]["cache"]
    changed = total - 500 % 7 + 100
    assert [value(edited, n) for n in ("frame", "objects", "table", "masked")] == [changed, changed, 100, 100]
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


UNSEEN = '''
import pyarrow as pa
import hetflow as hf
from mylib import consts

consts.KA = 1  # read below by a name built at run time


def setup():
    from mylib.model import Model  # imported inside the function: not one of the script's globals
    Model.SCALE = 1


setup()
pipe = hf.Pipeline("unseen")


@pipe.stage(outputs=["k"], params={"which": "A"})
def dynamic(ctx):
    return {"k": pa.table({"v": [getattr(consts, "K" + ctx.params["which"])]})}


@pipe.stage(outputs=["s"])
def scaled(ctx):
    from mylib.model import Model
    return {"s": pa.table({"v": [Model.SCALE * 10]})}
'''


def test_a_name_built_at_run_time_and_a_class_attribute_set_after_a_local_import_rerun_what_reads_them(
        tmp_path: Path) -> None:
    """The third red team: ``getattr(consts, "K" + which)`` read a value the script set (the key held only
    the names the code spells out), and ``Model.SCALE = 2`` after a function-local ``from ... import Model``
    was not seen: both CACHED with the old values.  Reached code that reads names computed at run time now
    counts every value of the modules it reaches."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "consts.py").write_text("KA = 0\nKB = 0\n")
    (lib / "model.py").write_text("class Model:\n    SCALE = 0\n")
    (tmp_path / "p.py").write_text(UNSEEN)
    first = run(tmp_path)
    assert (value(first, "k"), value(first, "s")) == (1, 10)
    edit(tmp_path / "p.py", "consts.KA = 1", "consts.KA = 2")
    second = run(tmp_path)
    assert states(second) == {"dynamic": "DONE", "scaled": "CACHED"}, states(second)
    assert value(second, "k") == 2 and second["dynamic"]["cache"]["reason"] == "mylib.consts.KA changed"
    edit(tmp_path / "p.py", "Model.SCALE = 1", "Model.SCALE = 3")
    third = run(tmp_path)
    assert states(third) == {"dynamic": "CACHED", "scaled": "DONE"}, states(third)
    assert value(third, "s") == 30 and third["scaled"]["cache"]["reason"] == "mylib.model.Model.SCALE changed"


LATE = '''
import contextlib
import pyarrow as pa
import hetflow as hf

SCALE = 1
pipe = hf.Pipeline("late")


def bump():
    global SCALE
    SCALE = 5


def helper():
    return 7


@pipe.stage(outputs=["s"])
def scaled(ctx):
    return {"s": pa.table({"v": [SCALE * 10]})}


@pipe.stage(outputs=["h"])
def helped(ctx):
    return {"h": pa.table({"v": [helper()]})}


@pipe.stage(outputs=["p"])
def plain(ctx):
    return {"p": pa.table({"v": [1]})}


if __name__ == "__main__":
    FORM
    run = pipe.run(check=False)
    for name in ("scaled", "helped", "plain"):
        print(name, run.stage(name).state, run.stage(name).error)
'''


@pytest.mark.parametrize("form", ["with contextlib.nullcontext(5) as SCALE:\n        pass",
                                  "callback = bump\n    callback()", "for f in [bump]:\n        f()",
                                  'exec("SCALE = 5")', 'globals().update(SCALE=5)',
                                  'exec("def helper():\\n    return 8")'])
def test_what_the_main_block_sets_through_with_exec_globals_update_or_an_indirect_call_is_refused(
        tmp_path: Path, form: str) -> None:
    """The third red team set a global the stage reads in the ``__main__`` block (which the stage's ranks
    never execute) through ``with ... as``, ``exec``, ``globals().update`` and a function called through
    another name: the key had the new value, the stage computed with the old one.  A named assignment
    refuses the stages that read the name; code that may set any global refuses the stages that read any
    of the script's globals (a helper too: ``exec`` may redefine it), naming the construct."""
    (tmp_path / "p.py").write_text(LATE.replace("FORM", form))
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")), check=False)
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()}
    assert lines["plain"].startswith("plain DONE"), done.stdout + done.stderr
    assert lines["scaled"].startswith("scaled FAILED"), done.stdout + done.stderr
    if form.startswith(("exec", "globals")):
        assert "may set any global (" in lines["scaled"] and " at line " in lines["scaled"], lines["scaled"]
        assert lines["helped"].startswith("helped FAILED") and "it reads helper()" in lines["helped"], lines
    else:
        assert "it reads SCALE, which the script sets" in lines["scaled"], lines["scaled"]
        assert lines["helped"].startswith("helped DONE"), lines["helped"]


ON_A_MODULE = '''
import pyarrow as pa
import hetflow as hf
from mylib import consts

pipe = hf.Pipeline("on-a-module")


@pipe.stage(outputs=["k"])
def reads(ctx):
    return {"k": pa.table({"v": [consts.KA + sum(consts.ITEMS) + getattr(reads, "alpha", 0)]})}


@pipe.stage(outputs=["p"])
def plain(ctx):
    return {"p": pa.table({"v": [1]})}


if __name__ == "__main__":
    FORM
    run = pipe.run(check=False)
    for name in ("reads", "plain"):
        print(name, run.stage(name).state, run.stage(name).error)
'''


@pytest.mark.parametrize("form, named", [("consts.KA = 5", "mylib.consts.KA"),
                                         ('setattr(consts, "KA", 5)', "mylib.consts.KA"),
                                         ("consts.ITEMS.append(5)", "mylib.consts.ITEMS"),
                                         ("reads.alpha = 5", "reads()"),
                                         ("consts.configure(5)", "mylib.consts.KA")])
def test_a_value_the_main_block_sets_on_a_module_or_on_the_stage_is_refused(tmp_path: Path, form: str,
                                                                            named: str) -> None:
    """Found while checking the fix above: ``consts.KA = 5`` in the ``__main__`` block counted in the key (a
    value set on a module) while the stage's ranks, which never execute that block, computed with 0."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (tmp_path / "mylib" / "consts.py").write_text("KA = 0\nITEMS = []\n\n\ndef configure(v):\n    global KA\n"
                                                  "    KA = v\n")
    (tmp_path / "p.py").write_text(ON_A_MODULE.replace("FORM", form))
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")), check=False)
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()}
    assert lines["plain"].startswith("plain DONE"), done.stdout + done.stderr
    assert lines["reads"].startswith("reads FAILED"), done.stdout + done.stderr
    assert f"it reads {named}, which the script sets in its `if __name__" in lines["reads"], lines["reads"]


def test_a_retry_after_an_edit_while_the_stage_ran_is_keyed_by_the_new_content(tmp_path: Path) -> None:
    """With ``retries``, the attempt that saw the edit is not committed; the retry computes from the new
    content under the new content's key, so the next run serves that result, never the earlier one."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (tmp_path / "mylib" / "calc.py").write_text("def f():\n    return 1\n")
    (tmp_path / "data.txt").write_text("1")
    (tmp_path / "p.py").write_text(RUNS.replace('files=["data.txt"]', 'files=["data.txt"], retries=1'))
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        (tmp_path / "data.txt").write_text("2")
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    shown = status(tmp_path)
    assert proc.returncode == 0 and shown["uses"]["state"] == "DONE", (out, err)
    assert shown["uses"]["attempts"] == 2 and value(shown, "uses") == 102, shown["uses"]
    again = run(tmp_path)
    assert again["uses"]["state"] == "CACHED" and value(again, "uses") == 102


SET_LITERAL = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("sets")


@pipe.stage(outputs=["cols"])
def pick(ctx):
    names = ["ra", "dec", "z", "mag_g", "mag_r", "id"]
    return {"cols": pa.table({"kept": [c for c in names if c in {"ra", "dec", "z", "mag_g", "mag_r"}]})}
'''


def test_a_set_literal_in_a_stage_does_not_make_it_rerun_on_every_run(tmp_path: Path) -> None:
    """The fourth red team: a set literal of strings compiles to a frozenset constant whose order follows
    the process's hash seed, and its repr was in the key, so the stage ran again on most runs ("code of
    pick() changed").  Each run is a fresh process with its own seed (they are set here so that they differ)."""
    (tmp_path / "p.py").write_text(SET_LITERAL)
    for seed in ("1", "2", "3", "4"):
        shown = run(tmp_path, env={**os.environ, "PYTHONHASHSEED": seed})
        assert shown["pick"]["state"] == ("DONE" if seed == "1" else "CACHED"), (seed, shown["pick"])


NESTED = '''
import pandas as pd
import pyarrow as pa
import hetflow as hf

HITS = pa.table({"hits": [[1, 2], [3]]}).to_pandas(types_mapper=pd.ArrowDtype)
pipe = hf.Pipeline("nested")


@pipe.stage(outputs=["n"])
def count(ctx):
    return {"n": pa.table({"n": [sum(len(h) for h in HITS["hits"])]})}
'''


def test_a_frame_of_nested_arrow_values_is_keyed_by_content(tmp_path: Path) -> None:
    """The fourth red team: pandas cannot hash a column of nested Arrow lists, and the run died before any
    stage with a raw TypeError; such a column is now keyed element by element."""
    (tmp_path / "p.py").write_text(NESTED)
    assert value(run(tmp_path), "n", "n") == 3
    assert states(run(tmp_path)) == {"count": "CACHED"}
    edit(tmp_path / "p.py", "[3]]", "[3, 4]]")
    again = run(tmp_path)
    assert states(again) == {"count": "DONE"} and value(again, "n", "n") == 4


TRAINING = '''
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf

LR = 0.001
pipe = hf.Pipeline("training")


@pipe.stage(outputs=["fit"], params={"hold": ""})
def fit(ctx):
    saved = Path(ctx.checkpoint_dir) / "state.txt"
    if saved.exists():  # resume from the checkpoint, as hf.ml.fit does
        lr = float(saved.read_text())
    else:
        lr = LR
        saved.write_text(str(lr))
        (Path(ctx.params["hold"]).parent / "holding").touch()
        while Path(ctx.params["hold"]).exists():
            time.sleep(0.1)
    return {"fit": pa.table({"lr": [lr]})}
'''


@pytest.mark.parametrize("edited", [True, False])
def test_a_resume_after_an_edit_does_not_continue_from_checkpoints_of_the_old_key(tmp_path: Path,
                                                                                  edited: bool) -> None:
    """The fourth red team: an ``hf.ml.fit`` stage stopped by SIGTERM, ``LR`` edited, ``hetflow resume``:
    training went on from the old checkpoint (the old LR) and stored it under the new key.  Checkpoints
    are kept for a resume under the same key only; under another they are set aside."""
    (tmp_path / "p.py").write_text(TRAINING)
    hold = tmp_path / "hold"
    hold.touch()
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--param", f"hold={hold}",
                             "--workdir", str(tmp_path / "work")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "holding").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    run_id = status(tmp_path)["_run"]["id"]
    hold.unlink()
    if edited:
        edit(tmp_path / "p.py", "LR = 0.001", "LR = 0.1")
    resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress", "--workdir", str(tmp_path / "work")],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    shown = status(tmp_path, run_id)
    assert value(shown, "fit", "lr") == (0.1 if edited else 0.001)  # not edited: resumed from its checkpoint
    aside = list((tmp_path / "work" / "runs" / run_id / "stages" / "fit").glob("checkpoints-stale-*"))
    assert len(aside) == (1 if edited else 0)
    if edited:
        assert (aside[0] / "state.txt").read_text() == "0.001"
