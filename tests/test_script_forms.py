"""Scripts written the ways scientists write them: unguarded ``pipe.run()``, stages from a factory or a loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hetflow.operators.dataset import Dataset

UNGUARDED = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("tour")

@pipe.stage(ranks=2, outputs=["events"])
def generate(ctx):
    return {"events": pa.table({"rank": [ctx.rank] * 3})}

@pipe.stage(inputs=["events"], outputs=["summary"])
def summarize(ctx, events):
    return {"summary": pa.table({"rows": [events.num_rows]})}

run = pipe.run(workdir=WORKDIR)
print("STATE", run.state)
'''

FACTORY = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("factory")


def make(i, factor):
    def step(ctx):
        return {f"out{i}": pa.table({"value": [i * factor]})}
    return step


for i in range(3):
    pipe.stage(make(i, FACTOR), name=f"s{i}", outputs=[f"out{i}"])

pipe.stage(lambda ctx, a, b: {"sum": pa.table({"value": [a["value"][0].as_py() + b["value"][0].as_py()]})},
           name="add", inputs=["out1", "out2"], outputs=["sum"])
'''


def test_a_script_without_a_main_guard_runs_its_stages(tmp_path: Path) -> None:
    script = tmp_path / "tour.py"
    script.write_text(UNGUARDED.replace("WORKDIR", repr(str(tmp_path / "w"))))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    (summary,) = (tmp_path / "w" / "runs").glob("*/datasets/summary")
    assert Dataset(summary).to_table()["rows"].to_pylist() == [6]


def _run(tmp_path: Path, factor: int) -> dict:
    (tmp_path / "f.py").write_text(FACTORY.replace("FACTOR", str(factor)))
    cli = [sys.executable, "-m", "hetflow.cli"]
    done = subprocess.run([*cli, "run", "f.py", "--workdir", "w", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = subprocess.run([*cli, "status", "--workdir", "w", "--json"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    return json.loads(shown.stdout)


def test_stages_from_a_factory_a_loop_and_a_lambda_run_and_are_cached_by_what_they_capture(tmp_path: Path) -> None:
    first = _run(tmp_path, factor=10)
    assert {s["name"]: s["state"] for s in first["stages"]} == {"s0": "DONE", "s1": "DONE", "s2": "DONE",
                                                                "add": "DONE"}
    assert Dataset(first["datasets"]["sum"]).to_table()["value"].to_pylist() == [30]
    again = _run(tmp_path, factor=10)
    assert {s["state"] for s in again["stages"]} == {"CACHED"}
    changed = _run(tmp_path, factor=100)  # what the closures captured changed: they run again
    assert {s["name"]: s["state"] for s in changed["stages"]} == {"s0": "DONE", "s1": "DONE", "s2": "DONE",
                                                                  "add": "DONE"}
    assert Dataset(changed["datasets"]["sum"]).to_table()["value"].to_pylist() == [300]


DECORATOR = '''
import functools


def logged(fn):
    @functools.wraps(fn)
    def wrapper(ctx, *args):
        ctx.log.info("starting %s", fn.__name__)
        return fn(ctx, *args)
    return wrapper
'''

DECORATED = '''
import pyarrow as pa
import hetflow as hf
from deco import logged

pipe = hf.Pipeline("deco")


@pipe.stage(outputs=["one"])
@logged
def one(ctx):
    return {"one": pa.table({"v": [1]})}


@pipe.stage(ranks=2, outputs=["two"])
@logged
def two(ctx):
    return {"two": pa.table({"v": [ctx.rank]})}
'''


def test_a_stage_wrapped_by_a_decorator_from_a_local_module_runs(tmp_path: Path) -> None:
    """The third red team: the workers executed deco.py (where the wrapper's code is) as the pipeline script
    and found no stage there, on every rank; a ``functools.wraps`` wrapper names what it wraps."""
    (tmp_path / "deco.py").write_text(DECORATOR)
    (tmp_path / "p.py").write_text(DECORATED)
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "p.py", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    assert "starting one" in (run_dir / "stages" / "one" / "attempt-1" / "rank-0.log").read_text()


TWO_PIPELINES = '''
import pyarrow as pa
import hetflow as hf

calibrate = hf.Pipeline("calibrate")
analyse = hf.Pipeline("analyse")

@calibrate.stage(outputs=["x"])
def load(ctx):
    return {"x": pa.table({"v": [1]})}

@analyse.stage(outputs=["x"])
def load(ctx):
    return {"x": pa.table({"v": [2]})}

if __name__ == "__main__":
    analyse.run()
'''


def test_a_rank_runs_the_stage_of_the_pipeline_that_runs_when_two_declare_it_with_the_same_function_name(
        tmp_path: Path) -> None:
    # both pipelines declare a stage 'load' by a function 'load': the rank ran the first pipeline's (value 1),
    # stored under the key of the second's code
    (tmp_path / "two.py").write_text(TWO_PIPELINES)
    cli = [sys.executable, "-m", "hetflow.cli"]
    done = subprocess.run([*cli, "run", "two.py", "--workdir", "w", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = json.loads(subprocess.run([*cli, "status", "--workdir", "w", "--json"], cwd=tmp_path,
                                      capture_output=True, text=True, timeout=60).stdout)
    assert [(s["name"], s["state"]) for s in shown["stages"]] == [("load", "DONE")]
    assert Dataset(shown["datasets"]["x"]).to_table()["v"].to_pylist() == [2]


READS_ITS_PIPELINE = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("labelled")

@pipe.stage(outputs=["x"])
def first(ctx):
    return {"x": pa.table({"label": [pipe.name]})}

@pipe.stage(inputs=["x"], outputs=["y"])
def second(ctx, x):
    return {"y": x}

if __name__ == "__main__":
    pipe.run()
'''


def test_a_stage_reading_its_pipeline_object_is_cached_on_a_repeat(tmp_path: Path) -> None:
    # a rank declares only its own stage: the pipeline it saw (pipe.stages, its repr) differed from the one the
    # key was made from, and the stage was "not cached: pipe differs in its ranks" at every run
    (tmp_path / "labelled.py").write_text(READS_ITS_PIPELINE)
    cli = [sys.executable, "-m", "hetflow.cli"]
    states = []
    for _ in range(2):
        done = subprocess.run([*cli, "run", "labelled.py", "--workdir", "w", "--no-progress"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = json.loads(subprocess.run([*cli, "status", "--workdir", "w", "--json"], cwd=tmp_path,
                                          capture_output=True, text=True, timeout=60).stdout)
        states.append([(s["name"], s["state"]) for s in shown["stages"]])
    assert states == [[("first", "DONE"), ("second", "DONE")], [("first", "CACHED"), ("second", "CACHED")]]
    assert Dataset(shown["datasets"]["x"]).to_table()["label"].to_pylist() == ["labelled"]
