"""What a stage's ranks could depend on beyond its key, observed where they ran (issue 25, fourth red team).

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage depends on the
way the attack did, runs again and checks that the stage RAN, says why, and
that its dataset holds the new value (see :mod:`hetflow.observed`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hetflow.operators.dataset import Dataset
from test_cache_stale import HETFLOW, edit, run, states, status, value

HELPER = '''
import pyarrow as pa
import hetflow as hf
import helperlib

pipe = hf.Pipeline("helper")


@pipe.stage(ranks=RANKS, outputs=["k"])
def uses_helper(ctx):
    return {"k": pa.table({"v": [helperlib.K]})}
'''


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_helper_module_outside_the_scripts_folder_reruns_its_stage_when_edited(tmp_path: Path, ranks: int) -> None:
    """A ``scripts/`` + ``src/`` layout: the helper is reached through PYTHONPATH, outside the script's folder,
    without a version; it was left out of the key, and an edit was served CACHED.  Two ranks start cold under
    mpiexec, where the script's import of the helper is deferred until the stage reads it."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "helperlib.py").write_text("K = 1\n")
    project = tmp_path / "scripts"
    project.mkdir()
    (project / "p.py").write_text(HELPER.replace("RANKS", str(ranks)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    assert value(run(project, env=env), "k") == 1
    (tmp_path / "src" / "helperlib.py").write_text("K = 2\n")
    edited = run(project, env=env)
    assert states(edited) == {"uses_helper": "DONE"}, edited["uses_helper"]["cache"]
    # the key names the helper it reaches (hetflow.fingerprint); the ranks' observation names one it does not
    assert edited["uses_helper"]["cache"]["reason"].startswith("module helperlib changed")
    assert value(edited, "k") == 2
    assert states(run(project, env=env)) == {"uses_helper": "CACHED"}


SEEDED = '''
import random

import numpy as np
import pyarrow as pa
import hetflow as hf

SEED = 1
np.random.seed(SEED)
random.seed(SEED)

pipe = hf.Pipeline("seeded")


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())], "w": [random.random()]})}
'''


def test_a_seed_set_at_the_scripts_top_reruns_the_stages_when_it_changes(tmp_path: Path) -> None:
    """``np.random.seed(SEED)`` at the top sets no global the stage reads: the key did not change with SEED."""
    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED)
    np.random.seed(1)
    assert value(run(tmp_path), "draw") == float(np.random.rand())
    edit(tmp_path / "p.py", "SEED = 1", "SEED = 2")
    edited = run(tmp_path)
    assert states(edited) == {"draw": "DONE"}
    # the seeding call's text and the globals it names are in the key now; the state is observed as well
    assert edited["draw"]["cache"]["reason"] == "SEED changed"
    np.random.seed(2)
    assert value(edited, "draw") == float(np.random.rand())
    assert states(run(tmp_path)) == {"draw": "CACHED"}


UNSEEDED = '''
import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("unseeded")


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"v": [1]})}
'''


def test_an_unseeded_generator_does_not_make_a_stage_run_every_time(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(UNSEEDED)
    assert states(run(tmp_path)) == {"one": "DONE"}
    assert states(run(tmp_path)) == {"one": "CACHED"}


TOP_READ = '''
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf

HERE = Path(__file__).resolve().parent
TABLE = int((HERE / "table.txt").read_text())
pipe = hf.Pipeline("topread", pilot=hf.PilotDescription(name="two", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(cores_per_rank=2, outputs=["slow"])
def slow(ctx):  # holds both cores until the test says go
    (HERE / "started").touch()
    while not (HERE / "go").exists():
        time.sleep(0.1)
    return {"slow": pa.table({"v": [0]})}


@pipe.stage(cores_per_rank=2, outputs=["uses"])
def uses(ctx):
    return {"uses": pa.table({"v": [TABLE]})}
'''


def test_data_read_at_the_scripts_top_and_edited_while_a_stage_waits_is_not_committed_under_the_old_key(
        tmp_path: Path) -> None:
    """The key held TABLE = 1 (read when the run started); the rank read 2 when it started: its result was
    stored under the key of 1, and served CACHED once the file held 1 again."""
    (tmp_path / "table.txt").write_text("1")
    (tmp_path / "p.py").write_text(TOP_READ)
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        (tmp_path / "table.txt").write_text("2")
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    shown = status(tmp_path)
    assert shown["uses"]["state"] == "FAILED", (out, err)
    assert "file table.txt read at the script's top changed after the run started" in shown["uses"]["error"]
    (tmp_path / "go").unlink()
    (tmp_path / "table.txt").write_text("1")
    (tmp_path / "go").touch()
    again = run(tmp_path)
    assert states(again) == {"slow": "CACHED", "uses": "DONE"} and value(again, "uses") == 1


PACKAGE_FLOW = '''
import pyarrow as pa
import hetflow as hf

from .values import K

pipe = hf.Pipeline("pkgflow")


@pipe.stage(outputs=["k"])
def first(ctx):
    return {"k": pa.table({"v": [K]})}
'''


def test_stages_declared_in_a_package_beside_the_script_run_in_their_ranks(tmp_path: Path) -> None:
    """``from lib.flow import pipe`` in the script: the ranks imported ``lib.flow`` with only ``lib/`` on
    sys.path (ModuleNotFoundError: No module named 'lib'); Python puts the script's folder there."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "values.py").write_text("K = 1\n")
    (tmp_path / "lib" / "flow.py").write_text(PACKAGE_FLOW)
    (tmp_path / "p.py").write_text("from lib.flow import pipe\n\npipe.run()\n")
    first = run(tmp_path)
    assert states(first) == {"first": "DONE"} and value(first, "k") == 1
    (tmp_path / "lib" / "values.py").write_text("K = 2\n")
    edited = run(tmp_path)
    assert states(edited) == {"first": "DONE"} and value(edited, "k") == 2


REUSED = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("reused")


@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": pa.table({"v": [1]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    return {"b": pa.table({"v": [2]})}
'''


def test_a_refused_resume_of_a_done_run_leaves_it_done(tmp_path: Path) -> None:
    """A resume that must re-run a stage whose output a later run reuses is refused; it marked the DONE run
    FAILED (and its stage), though it had changed nothing."""
    from test_cache_stale import hetflow

    (tmp_path / "p.py").write_text(REUSED)
    done = run(tmp_path)
    later = run(tmp_path)
    assert states(later) == {"first": "CACHED", "second": "CACHED"}
    edit(tmp_path / "p.py", "[2]", "[3]")
    refused = hetflow("resume", done["_run"]["id"], "--no-progress", cwd=tmp_path)
    after = status(tmp_path, done["_run"]["id"])
    assert after["_run"]["state"] == "DONE" and states(after) == {"first": "DONE", "second": "DONE"}
    assert refused.returncode != 0
    assert f"which run(s) {later['_run']['id']} reuse" in refused.stderr and "stays DONE" in refused.stderr
    assert value(after, "b") == 2 and value(status(tmp_path, later["_run"]["id"]), "b") == 2


NAMED = '''
import configparser
import string

import duckdb
import pandas as pd
import pyarrow as pa
import hetflow as hf

THRESH = 1
CATALOG = pd.DataFrame({"flux": [1, 2, 3]})
CFG = configparser.ConfigParser()
CFG.read_string("[fit]\\nscale = 10\\n")
LABEL = string.Template("n=$n")
METHOD = "a"

pipe = hf.Pipeline("named")


def norm_a(x):
    return x * 1


@pipe.stage(outputs=["query"])
def query(ctx):
    return {"query": pa.table({"v": [len(CATALOG.query("flux > @THRESH"))]})}


@pipe.stage(outputs=["sql"])
def sql(ctx):
    return {"sql": pa.table({"v": [int(duckdb.sql("SELECT sum(flux) AS s FROM CATALOG").fetchall()[0][0])]})}


@pipe.stage(outputs=["picked"])
def picked(ctx):
    return {"picked": pa.table({"v": [globals()["norm_" + METHOD](5)]})}


@pipe.stage(outputs=["config"])
def config(ctx):
    return {"config": pa.table({"v": [CFG.getint("fit", "scale")]})}


@pipe.stage(outputs=["label"])
def label(ctx):
    return {"label": pa.table({"v": [LABEL.substitute(n=1)]})}
'''


@pytest.mark.parametrize("old, new, stage, now", [
    ("THRESH = 1", "THRESH = 2", "query", 1), ('"flux": [1, 2, 3]', '"flux": [1, 2, 4]', "sql", 7),
    ("x * 1", "x * 2", "picked", 10), ("scale = 10", "scale = 20", "config", 20), ('"n=$n"', '"m=$n"', "label", "m=1"),
], ids=["query-at-name", "duckdb-frame", "globals-built-name", "configparser", "string-template"])
def test_globals_named_in_strings_picked_by_a_built_name_or_shown_only_by_address_rerun_what_reads_them(
        tmp_path: Path, old: str, new: str, stage: str, now: object) -> None:
    """``df.query("@THRESH")``, a DuckDB query naming a global frame, ``globals()["norm_" + m]``, a
    ``ConfigParser`` and a ``string.Template`` (whose text form is an address): an edit was served CACHED."""
    (tmp_path / "p.py").write_text(NAMED)
    first = run(tmp_path)
    assert [value(first, n) for n in ("query", "sql", "picked", "config", "label")] == [2, 6, 5, 10, "n=1"]
    edit(tmp_path / "p.py", old, new)
    again = run(tmp_path)
    assert again[stage]["state"] == "DONE", again[stage]["cache"]
    assert value(again, stage) == now
    assert states(run(tmp_path))[stage] == "CACHED"


CONFIGURED = '''
import pyarrow as pa
import hetflow as hf
from shapes import Model

Model.configure(3)
THRESH = 2

pipe = hf.Pipeline("configured")


@pipe.stage(outputs=["scaled"])
def scaled(ctx):
    return {"scaled": pa.table({"v": [Model.SCALE]})}


@pipe.stage(outputs=["evaluated"])
def evaluated(ctx):
    return {"evaluated": pa.table({"v": [eval("THRESH + 1")]})}
'''

SHAPES = '''
class Model:
    SCALE = 1

    @classmethod
    def configure(cls, scale):
        cls.SCALE = scale
'''


@pytest.mark.parametrize("old, new, stage, now", [
    ("Model.configure(3)", "Model.configure(4)", "scaled", 4), ("THRESH = 2", "THRESH = 5", "evaluated", 6),
], ids=["classmethod-sets-class-attribute", "global-read-in-eval"])
def test_a_class_attribute_a_classmethod_sets_and_a_global_read_in_eval_rerun_what_reads_them(
        tmp_path: Path, old: str, new: str, stage: str, now: int) -> None:
    (tmp_path / "shapes.py").write_text(SHAPES)
    (tmp_path / "p.py").write_text(CONFIGURED)
    first = run(tmp_path)
    assert value(first, "scaled") == 3 and value(first, "evaluated") == 3
    edit(tmp_path / "p.py", old, new)
    again = run(tmp_path)
    assert again[stage]["state"] == "DONE", again[stage]["cache"]
    assert value(again, stage) == now
    assert states(run(tmp_path))[stage] == "CACHED"


def test_a_commit_recorded_without_observations_is_not_served(tmp_path: Path) -> None:
    """A stage committed by a hetflow that did not observe its ranks (an upgrade): what it depended on beyond
    its key is unknown, so it runs once more instead of being served."""
    import sqlite3

    (tmp_path / "p.py").write_text(UNSEEDED)
    assert states(run(tmp_path)) == {"one": "DONE"}
    with sqlite3.connect(tmp_path / "work" / "hetflow.db") as db:
        rows = db.execute("SELECT id, cache_material FROM stages").fetchall()
        for row_id, material in rows:
            older = {k: v for k, v in json.loads(material).items() if k != "observed"}
            db.execute("UPDATE stages SET cache_material = ? WHERE id = ?", (json.dumps(older), row_id))
    again = run(tmp_path)
    assert states(again) == {"one": "DONE"}, again["one"]["cache"]
    assert states(run(tmp_path)) == {"one": "CACHED"}


def test_a_file_name_that_is_not_utf8_or_holds_a_newline_fails_its_stage_legibly(tmp_path: Path) -> None:
    """The refusal names the file: a name the store cannot encode (bytes that are not UTF-8) killed the
    orchestrator with a UnicodeEncodeError and left the stage RUNNING; a newline in it faked a line of output."""
    odd = os.fsdecode(b"caf\xe9\nfake line.txt")
    (tmp_path / odd).write_text("1")
    (tmp_path / "p.py").write_text(TOP_READ.replace('(HERE / "table.txt")', f'(HERE / {odd!r})'))
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        (tmp_path / odd).write_text("2")
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err, err
    shown = status(tmp_path)
    assert shown["uses"]["state"] == "FAILED", (out, err)
    assert "file caf\\udce9\\nfake line.txt read at the script's top changed" in shown["uses"]["error"]


COUNTER = '''
from pathlib import Path

import pyarrow as pa
import hetflow as hf

HERE = Path(__file__).resolve().parent
counter = HERE / "counter.txt"
RUNS = int(counter.read_text()) + 1 if counter.exists() else 1   # every process running the top counts
counter.write_text(str(RUNS))
pipe = hf.Pipeline("counter")


@pipe.stage(outputs=["one"], params={"k": 1})
def one(ctx):
    return {"one": pa.table({"v": [ctx.params["k"]]})}
'''


def test_a_file_the_scripts_top_reads_and_writes_is_its_own_state_not_an_input(tmp_path: Path) -> None:
    """A run counter kept at the script's top: each process that runs the top (the orchestrator, each rank)
    changes it, so comparing it failed every run of the script, whatever changed."""
    (tmp_path / "p.py").write_text(COUNTER)
    assert states(run(tmp_path)) == {"one": "DONE"}
    (tmp_path / "p.py").write_text(COUNTER.replace('{"k": 1}', '{"k": 2}'))
    again = run(tmp_path)
    assert states(again) == {"one": "DONE"} and value(again, "one") == 2



ZONED = '''
import os
import time

import pyarrow as pa
import hetflow as hf

os.environ["TZ"] = "UTC"
time.tzset()
pipe = hf.Pipeline("zoned")


@pipe.stage(outputs=["local"])
def local(ctx):
    return {"local": pa.table({"v": [time.strftime("%H:%M", time.localtime(0))]})}
'''


def test_a_time_zone_set_at_the_scripts_top_reruns_the_stage_when_it_changes(tmp_path: Path) -> None:
    """``os.environ["TZ"] = "UTC"; time.tzset()`` at the top, the stage formats a local time: edited to
    ``Asia/Tokyo``, the stage was served CACHED with the UTC hour.  The zone is process state the top sets, like
    a seed: the rank and the script agree on it, and a change re-runs the stage."""
    (tmp_path / "p.py").write_text(ZONED)
    assert value(run(tmp_path), "local") == "00:00"
    assert states(run(tmp_path)) == {"local": "CACHED"}
    edit(tmp_path / "p.py", '"UTC"', '"Asia/Tokyo"')
    edited = run(tmp_path)
    assert states(edited) == {"local": "DONE"}, edited["local"]["cache"]
    assert "the time zone set at the script's top (os.environ['TZ'], time.tzset) changed" in \
        edited["local"]["cache"]["reason"]
    assert value(edited, "local") == "09:00"
    assert states(run(tmp_path)) == {"local": "CACHED"}


NATIVE_READ = '''
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import hetflow as hf

HERE = Path(__file__).resolve().parent
TABLE = READ
pipe = hf.Pipeline("nativeread", pilot=hf.PilotDescription(name="two", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(cores_per_rank=2, outputs=["slow"])
def slow(ctx):  # holds both cores until the test says go
    (HERE / "started").touch()
    while not (HERE / "go").exists():
        time.sleep(0.1)
    return {"slow": pa.table({"v": [0]})}


@pipe.stage(cores_per_rank=2, outputs=["uses"])
def uses(ctx):
    return {"uses": pa.table({"v": [TABLE]})}
'''


def _write_table(path: Path, v: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"v": [v]}), path)
    else:
        path.write_text(str(v))


@pytest.mark.parametrize("name, read", [
    ("table.parquet", 'pq.read_table(HERE / "table.parquet").column("v")[0].as_py()'),
    (".data/table.txt", 'int((HERE / ".data" / "table.txt").read_text())'),
], ids=["native-reader", "hidden-folder"])
def test_data_read_at_the_top_unseen_by_the_open_hook_and_edited_while_a_stage_waits_is_never_served(
        tmp_path: Path, name: str, read: str) -> None:
    """``pq.read_table`` opens its file natively (no Python ``open`` to observe), a file under a hidden folder
    is not observed: edited while the stage waited for its slot, the rank computed 2 and the result was stored
    under the key of 1, then served CACHED once the file held 1 again.  The rank now digests the globals the
    stage reads as the key did, and a result computed from another value is kept for its run only."""
    _write_table(tmp_path / name, 1)
    (tmp_path / "p.py").write_text(NATIVE_READ.replace("READ", read))
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        _write_table(tmp_path / name, 2)
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = status(tmp_path)
    assert states(first) == {"slow": "DONE", "uses": "DONE"}, (out, err)
    assert value(first, "uses") == 2  # what the file held when the rank ran: kept for this run
    _write_table(tmp_path / name, 1)
    again = run(tmp_path)
    assert states(again) == {"slow": "CACHED", "uses": "DONE"}, again["uses"]["cache"]
    assert "TABLE had another value where it was computed than its key says" in again["uses"]["cache"]["reason"]
    assert value(again, "uses") == 1
    assert states(run(tmp_path)) == {"slow": "CACHED", "uses": "CACHED"}


PER_PROCESS = '''
import logging
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf

STAMP = time.time()
log = logging.getLogger(__name__)
HERE = Path(__file__).parent
pipe = hf.Pipeline("perprocess")


@pipe.stage(outputs=["stamped"])
def stamped(ctx):
    return {"stamped": pa.table({"v": [STAMP]})}


@pipe.stage(outputs=["logged"])
def logged(ctx):
    log.info("in %s", HERE)
    return {"logged": pa.table({"v": [1]})}
'''


def test_a_value_the_top_computes_anew_in_each_process_runs_its_stage_and_a_scripts_logger_stays_cached(
        tmp_path: Path) -> None:
    """A global that differs in every process (the time) is computed otherwise in the rank than in the key: the
    stage is not failed for it, it runs each time; the script's ``getLogger(__name__)`` (``__main__`` where the
    key is made, the worker's module name in the rank) and ``__file__`` are the same everywhere."""
    (tmp_path / "p.py").write_text(PER_PROCESS)
    assert states(run(tmp_path)) == {"stamped": "DONE", "logged": "DONE"}
    assert states(run(tmp_path)) == {"stamped": "DONE", "logged": "CACHED"}



PER_PROCESS_READ = '''
import os
import pyarrow as pa
import hetflow as hf

PID = os.getpid()
MODNAME = __name__
pipe = hf.Pipeline("perprocread", pilot="local")


@pipe.stage(outputs=["pid"])
def pid(ctx):
    return {"pid": pa.table({"v": [PID > 0]})}


@pipe.stage(outputs=["modname"])
def modname(ctx):
    return {"modname": pa.table({"v": [MODNAME != ""]})}


@pipe.stage(outputs=["plain"])
def plain(ctx):
    return {"plain": pa.table({"v": [1]})}


if __name__ == "__main__":
    pipe.run(workdir="work")
'''


def test_a_global_made_anew_in_each_rank_is_named_at_the_end_of_the_run_with_what_to_do(tmp_path: Path) -> None:
    """``PID = os.getpid()`` / ``MODNAME = __name__`` at the top, read by a stage: its rank computes another
    value than the key's, so the stage runs every run.  The run says so as it ends, one line per stage naming
    the global and what to do (before, only ``hetflow status`` of the next run said why), and ``status`` of
    this run says it too."""
    (tmp_path / "p.py").write_text(PER_PROCESS_READ)
    for attempt in range(2):
        done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        notes = [line for line in done.stderr.splitlines() if "differs in its ranks" in line]
        assert len(notes) == 2, done.stderr
        for stage, name in (("modname", "MODNAME"), ("pid", "PID")):
            line = next(line for line in notes if line.startswith(f"hetflow: stage {stage}: "))
            assert line.startswith(f"hetflow: stage {stage}: {name} differs in its ranks from the value the "
                                   "script's top computed where the key was made"), line
            assert line.endswith("compute it inside the stage, or pass it as a param"), line
        shown = status(tmp_path)
        assert states(shown) == {"pid": "DONE", "modname": "DONE", "plain": "CACHED" if attempt else "DONE"}
        assert shown["pid"]["cache"]["reason"].startswith("not cached: PID differs in its ranks"), shown["pid"]


MPI_WORLD = '''
import pyarrow as pa
import hetflow as hf
from mpi4py import MPI

pipe = hf.Pipeline("mpiworld", pilot="local")


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"v": [MPI.COMM_WORLD.Get_rank()]})}


@pipe.stage(ranks=2, outputs=["two"])
def two(ctx):
    return {"two": pa.table({"v": [MPI.COMM_WORLD.Get_rank()]})}
'''


def test_a_stage_calling_mpi_comm_world_through_the_scripts_mpi_module_is_cached(tmp_path: Path) -> None:
    """Red team: ``MPI.COMM_WORLD.Get_rank()`` makes ``mpi4py.MPI.COMM_WORLD`` a library global its calls
    change, which the key counts by type (the library's own state); the rank digested it by its value, so
    every such stage, one rank or two, "differs in its ranks" and was never served from the cache."""
    (tmp_path / "p.py").write_text(MPI_WORLD)
    first = run(tmp_path)
    assert states(first) == {"one": "DONE", "two": "DONE"}
    assert "differs in its ranks" not in first["one"]["cache"]["reason"], first["one"]["cache"]
    assert states(run(tmp_path)) == {"one": "CACHED", "two": "CACHED"}


CONFIGURED_HELPER = '''
import json
import os

GAIN = json.load(open(os.path.join(os.path.dirname(__file__), "gain.json")))["gain"]
ENV_GAIN = int(os.environ.get("LAB_GAIN", "2"))


def calibrate(x):
    return x * GAIN


def calibrate_env(x):
    return x * ENV_GAIN
'''

READS_HELPER = '''
import pyarrow as pa
import hetflow as hf
import labcfg

pipe = hf.Pipeline("labcfg")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [labcfg.calibrate(10)]})}


@pipe.stage(outputs=["env"])
def make_env(ctx):
    return {"env": pa.table({"v": [labcfg.calibrate_env(10)]})}
'''


def test_a_value_a_helper_outside_the_scripts_folder_reads_when_imported_reruns_what_uses_it(tmp_path: Path) -> None:
    """The helper's source did not change, the file and the variable it reads at import did: CACHED with 20."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "labcfg.py").write_text(CONFIGURED_HELPER)
    (tmp_path / "src" / "gain.json").write_text('{"gain": 2}')
    project = tmp_path / "scripts"
    project.mkdir()
    (project / "p.py").write_text(READS_HELPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    first = run(project, env=env)
    assert (value(first, "out"), value(first, "env")) == (20, 20)
    (tmp_path / "src" / "gain.json").write_text('{"gain": 3}')
    edited = run(project, env=env)
    assert edited["make"]["state"] == "DONE", edited["make"]["cache"]
    assert "the values helper module ../src/labcfg.py holds changed" in edited["make"]["cache"]["reason"]
    assert value(edited, "out") == 30
    variable = run(project, env={**env, "LAB_GAIN": "9"})
    assert variable["make_env"]["state"] == "DONE" and value(variable, "env") == 90
    assert states(run(project, env={**env, "LAB_GAIN": "9"})) == {"make": "CACHED", "make_env": "CACHED"}


SEEDED_THEN_DRAWN = '''
import numpy as np
import pyarrow as pa
import hetflow as hf

SEED = 1
np.random.seed(SEED)
pipe = hf.Pipeline("drawn")


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


if __name__ == "__main__":
    print("preview:", np.random.rand())  # a look before running: this process only
    pipe.run()
'''


def test_a_seed_set_at_the_top_counts_when_the_main_block_draws_before_running(tmp_path: Path) -> None:
    """The orchestrator's generator had moved on (the main block drew) when ``pipe.run()`` started, so it
    disagreed with the rank's, the state was taken for unseeded and left out: a SEED change was served CACHED.
    The states are now taken where the top level ends."""
    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED_THEN_DRAWN)
    np.random.seed(1)
    assert value(run(tmp_path), "draw") == float(np.random.rand())
    edit(tmp_path / "p.py", "SEED = 1", "SEED = 2")
    edited = run(tmp_path)
    assert states(edited) == {"draw": "DONE"}, edited["draw"]["cache"]
    np.random.seed(2)
    assert value(edited, "draw") == float(np.random.rand())
    assert states(run(tmp_path)) == {"draw": "CACHED"}


MAPPED_HELPER = '''
import pyarrow as pa
import hetflow as hf
from mapgain import calibrate

pipe = hf.Pipeline("mapped")


@pipe.stage(map_over={"n": [1, 2]}, outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [calibrate(ctx.item["n"])]})}
'''


def test_a_map_stage_reruns_its_items_when_a_helper_outside_the_scripts_folder_is_edited(tmp_path: Path) -> None:
    """Map stages were not observed: their items, reused one by one, were served CACHED after the edit."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mapgain.py").write_text("GAIN = 2\n\n\ndef calibrate(x):\n    return x * GAIN\n")
    project = tmp_path / "scripts"
    project.mkdir()
    (project / "p.py").write_text(MAPPED_HELPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}

    def values(stages: dict[str, object]) -> list[int]:
        return Dataset(stages["_run"]["datasets"]["out"]).to_table()["v"].to_pylist()

    assert values(run(project, env=env)) == [2, 4]
    (tmp_path / "src" / "mapgain.py").write_text("GAIN = 3\n\n\ndef calibrate(x):\n    return x * GAIN\n")
    edited = run(project, env=env)
    assert states(edited) == {"make": "DONE"}, edited["make"]["cache"]
    assert values(edited) == [3, 6]
    assert states(run(project, env=env)) == {"make": "CACHED"}


SUMMARY = '''
import json
from pathlib import Path

import pyarrow as pa
import hetflow as hf

HERE = Path(__file__).resolve().parent
SUMMARY = HERE / "summary.json"
if SUMMARY.exists():  # the script shows the last summary when it starts
    print("last summary:", json.loads(SUMMARY.read_text()))
pipe = hf.Pipeline("summary")


@pipe.stage(outputs=["a"], params={"k": 1})
def first(ctx):
    SUMMARY.write_text(json.dumps({"k": ctx.params["k"]}))
    return {"a": pa.table({"v": [ctx.params["k"]]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    return {"b": pa.table({"v": [2]})}
'''


def test_a_file_the_scripts_top_reads_that_a_stage_of_the_run_writes_does_not_fail_a_later_stage(
        tmp_path: Path) -> None:
    """``first`` rewrites summary.json, which the top level reads: ``second``'s rank read the new one, unlike
    the orchestrator when the run started, and was refused (FAILED) though nothing the user did changed it."""
    (tmp_path / "p.py").write_text(SUMMARY)
    assert states(run(tmp_path)) == {"first": "DONE", "second": "DONE"}
    edit(tmp_path / "p.py", '{"k": 1}', '{"k": 2}')
    again = run(tmp_path)
    assert states(again) == {"first": "DONE", "second": "DONE"} and value(again, "a") == 2
    assert states(run(tmp_path)) == {"first": "CACHED", "second": "CACHED"}


SEEDED_IN_MAIN = '''
import random
import sys

import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("seedmain")


def draw():
    return pa.table({"v": [float(np.random.rand())], "w": [random.random()]})


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": draw()}


@pipe.stage(ranks=2, outputs=["two"])
def two(ctx):
    return {"two": draw()}


@pipe.stage(map_over={"n": [1, 2]}, outputs=["mapped"])
def mapped(ctx):
    return {"mapped": draw()}


@pipe.stage(outputs=["none"])
def none(ctx):
    return {"none": pa.table({"v": [0.0], "w": [0.0]})}


if __name__ == "__main__":
    np.random.seed(int(sys.argv[1]))
    random.seed(int(sys.argv[1]))
    print("preview:", np.random.rand())  # a draw after the seed moves the state the stages start from
    pipe.run()
'''


def test_a_seed_the_main_block_sets_reaches_every_rank_and_item_and_another_seed_reruns(tmp_path: Path) -> None:
    """The seventh red team (seedmain): ``np.random.seed(int(sys.argv[1]))`` in the main block, which the ranks
    never execute: they drew unseeded numbers, and ``python p.py 2`` was served run 1's CACHED.  The states
    the block seeded are now given to every rank (the same to each, as a seeded script started on each rank
    would have) and to each map item, and a state that differs is no match (for every stage of the script, as
    for a seed set at its top)."""
    import random

    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED_IN_MAIN)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def script(seed: int) -> dict[str, object]:
        done = subprocess.run([sys.executable, "p.py", str(seed)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    def seeded(seed: int) -> tuple[float, float]:
        numbers = np.random.RandomState(seed)
        numbers.rand()  # the preview
        plain = random.Random(seed)
        return float(numbers.rand()), plain.random()

    def drawn(stages: dict[str, object], name: str) -> list[tuple[float, float]]:
        table = Dataset(stages["_run"]["datasets"][name]).to_table()  # type: ignore[index]
        return list(zip(table["v"].to_pylist(), table["w"].to_pylist()))

    first = script(1)
    assert drawn(first, "one") == [seeded(1)]
    assert drawn(first, "two") == [seeded(1)] * 2 and drawn(first, "mapped") == [seeded(1)] * 2
    other = script(2)
    # as a seed changed at the top does, it re-runs every stage of the script (none, too)
    assert states(other) == {"one": "DONE", "two": "DONE", "mapped": "DONE", "none": "DONE"}, other
    assert "numpy's global random state (np.random.seed) changed" in other["one"]["cache"]["reason"]
    assert drawn(other, "one") == [seeded(2)] and drawn(other, "two") == [seeded(2)] * 2
    assert drawn(other, "mapped") == [seeded(2)] * 2
    again = script(1)
    assert states(again) == {"one": "CACHED", "two": "CACHED", "mapped": "CACHED", "none": "CACHED"}
    assert drawn(again, "one") == [seeded(1)]


SEEDED_SESSION = '''
import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("nbseed")
SEEDING


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


@pipe.stage(outputs=["fixed"])
def fixed(ctx):
    return {"fixed": pa.table({"v": [1.0]})}


for seed in SEEDS:
    np.random.seed(seed)
    run = pipe.run(progress=False)
    print("VALUE", run.dataset("draw").to_table()["v"][0].as_py(),
          {s.name: s.state for s in run.stages}["draw"], {s.name: s.state for s in run.stages}["fixed"])
'''


def test_a_seed_set_in_a_session_reaches_its_stages_ranks(tmp_path: Path) -> None:
    """The seventh red team (nbseed): ``np.random.seed(5)`` in a session (``python -``), whose stages are
    shipped by value and whose ranks run none of it: they drew unseeded, and ``np.random.seed(6)`` then
    ``pipe.run()`` was served CACHED.  A stage that draws from no generator stays cached from one session to
    the next, whose generators nobody seeded."""
    import numpy as np

    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def session(seeds: list[int]) -> list[list[str]]:
        code = SEEDED_SESSION.replace("SEEDING", "").replace("SEEDS", repr(seeds))
        done = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("VALUE")]

    def expected(seed: int) -> str:
        return str(float(np.random.RandomState(seed).rand()))

    assert session([5, 6]) == [[expected(5), "DONE", "DONE"], [expected(6), "DONE", "CACHED"]]
    assert session([6, 5]) == [[expected(6), "CACHED", "CACHED"], [expected(5), "CACHED", "CACHED"]]


DRAWN_IN_MAIN = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("drawn-in-main")


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"v": [1]})}


if __name__ == "__main__":
    import random

    import numpy as np
    import pandas  # noqa: F401 - loads numpy.random, unseeded

    print("preview:", np.random.rand(), random.random())
    pipe.run()
'''


def test_a_main_block_that_draws_unseeded_numbers_does_not_make_its_stages_run_every_time(tmp_path: Path) -> None:
    """Only a generator the main block seeded is given to the ranks and observed: one it loaded (numpy.random,
    which the top had not) or drew from unseeded would differ on every run, and so would its stages' records."""
    (tmp_path / "p.py").write_text(DRAWN_IN_MAIN)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))
    for expected in ("DONE", "CACHED"):
        done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert states(status(tmp_path)) == {"one": expected}


SEEDED_BY_A_HELPER = """
import sys

import numpy as np
import pyarrow as pa
import hetflow as hf
from labutils import set_seeds

pipe = hf.Pipeline("helperseed")


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


@pipe.stage(map_over={"n": [1, 2]}, outputs=["mapped"])
def mapped(ctx):
    return {"mapped": pa.table({"v": [float(np.random.rand())]})}


@pipe.stage(outputs=["fixed"])
def fixed(ctx):
    return {"fixed": pa.table({"v": [1.0]})}


if __name__ == "__main__":
    set_seeds(int(sys.argv[1]))
    pipe.run()
"""


def test_a_seed_a_helper_sets_from_the_main_block_reaches_the_ranks_and_another_seed_reruns(tmp_path: Path) -> None:
    """The eighth red team (helperseed2): ``import numpy as np`` loads no generator (``np.random`` is loaded on
    first use), so a helper's ``np.random.seed(seed)`` called from the main block was numpy's first use: with no
    state at the top's end to compare, and no seeding call in the script's own source, the block's seed was
    not given to the ranks, which drew unseeded, and ``python p.py 2`` was served run 1's CACHED.  A generator
    the main block loads is now given to the ranks, and counts where a stage draws from it."""
    import numpy as np

    (tmp_path / "labutils.py").write_text("import numpy as np\n\n\ndef set_seeds(seed):\n    np.random.seed(seed)\n")
    (tmp_path / "p.py").write_text(SEEDED_BY_A_HELPER)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def script(seed: int) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "p.py", str(seed)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    def seeded(seed: int) -> float:
        return float(np.random.RandomState(seed).rand())

    first = script(1)
    assert value(first, "draw") == seeded(1)
    assert Dataset(first["_run"]["datasets"]["mapped"]).to_table()["v"].to_pylist() == [seeded(1)] * 2
    other = script(2)
    assert states(other) == {"draw": "DONE", "mapped": "DONE", "fixed": "CACHED"}, other
    assert "numpy's global random state (np.random.seed) changed" in other["draw"]["cache"]["reason"]
    assert value(other, "draw") == seeded(2)
    assert states(script(1)) == {"draw": "CACHED", "mapped": "CACHED", "fixed": "CACHED"}


TORCH_SEEDED_AGAIN = """
import sys

import pyarrow as pa
import torch
import hetflow as hf

pipe = hf.Pipeline("torchsame")
torch.manual_seed(0)
WEIGHTS = torch.rand(3)  # a model's initialisation at the top draws


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(torch.rand(1)[0])]})}


if __name__ == "__main__":
    torch.manual_seed(int(sys.argv[1]))
    pipe.run()
"""


def test_the_tops_torch_seed_given_again_in_the_main_block_reaches_the_ranks(tmp_path: Path) -> None:
    """Red team: ``torch.manual_seed(0)`` at the top, a draw there, and the main block's ``torch.manual_seed(0)``
    (a ``--seed`` whose default is the top's): torch's seed was the same, so the block was taken for one that
    only drew, and the ranks drew from the top's state after its draws, not seed 0's, where ``python p.py 1``
    drew seed 1's."""
    torch = pytest.importorskip("torch")
    (tmp_path / "p.py").write_text(TORCH_SEEDED_AGAIN)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))
    done = subprocess.run([sys.executable, "p.py", "0"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = float(torch.rand(1, generator=torch.Generator().manual_seed(0))[0])
    assert value(status(tmp_path), "draw") == expected


SEEDED_UNDER_AN_AND_GUARD = """
import sys

import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("guard")
np.random.seed(0)


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


if __name__ == "__main__" and len(sys.argv) > 1:
    np.random.seed(int(sys.argv[1]))
    pipe.run()
"""


def test_a_seed_set_under_a_main_guard_with_a_further_condition_reaches_the_ranks(tmp_path: Path) -> None:
    """Red team: ``if __name__ == "__main__" and len(sys.argv) > 1:`` was not taken for the main block, so the
    seed it set was neither given to the ranks nor in the key: ``python p.py 1`` drew the top's seed 0 and
    ``python p.py 2`` was served that, CACHED."""
    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED_UNDER_AN_AND_GUARD)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))
    for seed in (1, 2):
        done = subprocess.run([sys.executable, "p.py", str(seed)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = status(tmp_path)
        assert states(shown) == {"draw": "DONE"}, shown
        assert value(shown, "draw") == float(np.random.RandomState(seed).rand())


SEEDED_FROM_ARGS = """
import argparse
import random

import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("argseed")
RNG = random.Random(0)


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


@pipe.stage(outputs=["own"])
def own(ctx):
    return {"own": pa.table({"v": [RNG.random()]})}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    np.random.seed(args.seed)
    RNG.seed(args.seed)
    pipe.run(check=False)
"""


def test_a_seed_from_parse_args_in_the_main_block_is_given_and_a_global_generator_seeded_there_refused(
        tmp_path: Path) -> None:
    """The eighth red team (argseed, rnginst): ``np.random.seed(args.seed)`` in the main block, the usual form,
    was refused (``it reads args``): the seeding call's names were read into the key, though the block's seed
    reaches the ranks by its state.  ``RNG.seed(args.seed)`` on a global ``random.Random`` seeded it where the
    ranks never run: they drew from the top's seed whatever ``--seed`` said, under a DONE stage."""
    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED_FROM_ARGS)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def script(seed: int) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "p.py", "--seed", str(seed)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    first = script(1)
    assert states(first) == {"draw": "DONE", "own": "FAILED"}, first
    assert value(first, "draw") == float(np.random.RandomState(1).rand())
    assert "it reads RNG, which the script sets in its `if __name__ == \"__main__\":` block" in \
        first["own"]["error"], first["own"]
    other = script(2)
    assert states(other)["draw"] == "DONE" and value(other, "draw") == float(np.random.RandomState(2).rand())
    assert states(script(1))["draw"] == "CACHED"


COMM_AT_THE_TOP = """
import pyarrow as pa
import hetflow as hf
from mpi4py import MPI

comm = MPI.COMM_WORLD
pipe = hf.Pipeline("commtop")


@pipe.stage(outputs=["pair"], ranks=2)
def pair(ctx):
    return {"pair": pa.table({"v": [comm.Get_size() * 10 + comm.Get_rank()]})}


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"v": [comm.Get_size()]})}


if __name__ == "__main__":
    pipe.run(check=False)
"""


@pytest.mark.timeout(300)
def test_a_communicator_the_scripts_top_holds_is_cached(tmp_path: Path) -> None:
    """Red team 10: ``comm = MPI.COMM_WORLD`` at the script's top (the usual mpi4py form) made every stage that
    reads ``comm`` 'not cached': the communicator's text form is its type and address.  A predefined handle
    counts by its name."""
    (tmp_path / "p.py").write_text(COMM_AT_THE_TOP)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))
    for expected in ("DONE", "CACHED"):
        done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=250,
                              env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = status(tmp_path)
        assert states(shown) == {"pair": expected, "one": expected}, shown
        assert Dataset(shown["_run"]["datasets"]["pair"]).to_table()["v"].to_pylist() == [20, 21]
        assert value(shown, "one") == 1


SPLIT_BY_ITS_OWN_GENERATOR = """
import argparse

import numpy as np
import pyarrow as pa
import torch
import hetflow as hf

pipe = hf.Pipeline("ownsplit")
np.random.seed(0)


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    print("held out", torch.randperm(6, generator=g)[:3].tolist())
    pipe.run(check=False)
"""


@pytest.mark.timeout(300)
def test_a_generator_the_main_block_makes_and_seeds_for_itself_refuses_no_stage(tmp_path: Path) -> None:
    """Red team 10: ``g = torch.Generator().manual_seed(args.seed)`` in the main block (a split drawn there) put
    ``args`` in every stage's key, as the values a seeding call names: every stage was refused ('it reads
    args'), though none reads ``g``, which seeds only itself."""
    import numpy as np

    (tmp_path / "p.py").write_text(SPLIT_BY_ITS_OWN_GENERATOR)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def script(seed: int) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "p.py", "--seed", str(seed)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=250, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    first = script(1)
    assert states(first) == {"draw": "DONE"}, first
    assert value(first, "draw") == float(np.random.RandomState(0).rand())
    assert states(script(2)) == {"draw": "CACHED"}  # the stage reads neither the seed nor g


SEEDED_UNDER_A_DEBUGGER = """
import sys

import numpy as np
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("traced")
np.random.seed(0)


@pipe.stage(outputs=["draw"])
def draw(ctx):
    return {"draw": pa.table({"v": [float(np.random.rand())]})}


if __name__ == "__main__":
    np.random.seed(int(sys.argv[1]))
    pipe.run()
"""

DEBUGGER = """
import runpy
import sys

sys.settrace(lambda frame, event, arg: None)  # what a debugger (pdb, debugpy) or coverage sets
sys.argv = ["p.py", *sys.argv[1:]]
runpy.run_path("p.py", run_name="__main__")
"""


def test_a_seed_the_main_block_sets_under_a_debugger_reaches_the_ranks(tmp_path: Path) -> None:
    """The eighth red team (traced): under a debugger the top's end is not watched (a trace function is set
    already), so no generator was taken for seeded by the main block: the ranks drew from the top's seed, and
    ``p.py 2`` was served run 1's CACHED.  There every generator is now given to the ranks, and counts where a
    stage draws from it."""
    import numpy as np

    (tmp_path / "p.py").write_text(SEEDED_UNDER_A_DEBUGGER)
    (tmp_path / "debug.py").write_text(DEBUGGER)
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))

    def debugged(seed: int) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "debug.py", str(seed)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    assert value(debugged(1), "draw") == float(np.random.RandomState(1).rand())
    other = debugged(2)
    assert states(other) == {"draw": "DONE"}, other
    assert value(other, "draw") == float(np.random.RandomState(2).rand())
    assert states(debugged(1)) == {"draw": "CACHED"}


RICH_SESSION = '''
import random

import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("richdraw")


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"v": [1]})}


random.seed(3)
run = pipe.run(progress=True)
print("AFTER", random.random(), run.state)
'''


def test_the_progress_view_leaves_a_sessions_seeded_random_where_it_was(tmp_path: Path) -> None:
    """rich's first import draws from Python's global ``random`` (``rich.style``: ``getrandbits``): a session
    that seeded ``random`` and ran its pipeline with the progress view on drew other numbers afterwards than
    the same session with no pipeline run in between."""
    import random

    done = subprocess.run([sys.executable, "-"], input=RICH_SESSION, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    after = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("AFTER")]
    assert after == [[str(random.Random(3).random()), "DONE"]], done.stdout + done.stderr
