"""The cache and resume a scientist can trust: a script edited between runs, as users edit them.

Each test writes a pipeline the way a scientist would (imports at the top, a
helper, a module-level constant, a data file, a parameter), runs it with the
``hetflow`` command (real subprocess, real mpiexec, real SQLite), edits it and
runs it again: what must re-run re-runs, what must not does not, and the
results are the new ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import hetflow as hf

from mylib import OFFSET

SCALE = 2


def rescale(column):
    return pc.add(pc.multiply(column, SCALE), OFFSET)


pipe = hf.Pipeline("science")


@pipe.stage(outputs=["obs"], files=["data/obs-*.csv"])
def load(ctx):
    return {"obs": pa.concat_tables([pcsv.read_csv(path) for path in ctx.files])}


@pipe.stage(inputs=["obs"], outputs=["scaled"])
def transform(ctx, obs):
    return {"scaled": obs.append_column("scaled", rescale(obs["flux"]))}


@pipe.stage(inputs=["scaled"], outputs=["model"], params={"epochs": 1})
def train(ctx, scaled):
    return {"model": pa.table({"epochs": [ctx.params.get("epochs", 1)], "rows": [scaled.num_rows],
                               "total": [pc.sum(scaled["scaled"]).as_py()]})}
'''


def hetflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    return done


def run(cwd: Path, *args: str) -> dict[str, dict]:
    """``hetflow run p.py ARGS``; returns the stages of ``hetflow status --json`` by name."""
    done = hetflow("run", "p.py", "--no-progress", *args, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return status(cwd)


def status(cwd: Path, run_id: str | None = None) -> dict[str, dict]:
    shown = hetflow("status", *([run_id] if run_id else []), "--json", cwd=cwd)
    data = json.loads(shown.stdout)
    stages = {s["name"]: s for s in data["stages"]}
    stages["_run"] = data
    return stages


def table(stages: dict[str, dict], name: str) -> pa.Table:
    return Dataset(stages["_run"]["datasets"][name]).to_table()


def states(stages: dict[str, dict]) -> dict[str, str]:
    return {n: s["state"] for n, s in stages.items() if n != "_run"}


def project(tmp_path: Path, rows: int = 2000) -> Path:
    (tmp_path / "data").mkdir()
    write_csv(tmp_path / "data/obs-1.csv", range(rows))
    (tmp_path / "mylib.py").write_text("OFFSET = 0\n")
    (tmp_path / "p.py").write_text(SCRIPT)
    return tmp_path


def write_csv(path: Path, ids: range) -> None:
    path.write_text("id,flux\n" + "".join(f"{i},{i * 0.5}\n" for i in ids))


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_editing_a_constant_a_helper_reads_reruns_the_stage_with_new_results(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    first = run(cwd)
    assert set(states(first).values()) == {"DONE"}
    assert table(first, "model")["total"][0].as_py() == sum(i * 0.5 * 2 for i in range(2000))
    again = run(cwd)
    assert set(states(again).values()) == {"CACHED"}
    edit(cwd / "p.py", "SCALE = 2", "SCALE = 10")
    edited = run(cwd)
    assert states(edited) == {"load": "CACHED", "transform": "DONE", "train": "DONE"}
    assert edited["transform"]["cache"] == {"hit": False, "from_run": None, "reason": "SCALE changed"}
    assert edited["train"]["cache"]["reason"] == "input scaled changed"
    assert table(edited, "model")["total"][0].as_py() == sum(i * 0.5 * 10 for i in range(2000))
    edit(cwd / "mylib.py", "OFFSET = 0", "OFFSET = 1")  # a local module the script imports
    moved = run(cwd)
    assert states(moved)["transform"] == "DONE" and moved["transform"]["cache"]["reason"] == "OFFSET changed"
    assert table(moved, "model")["total"][0].as_py() == sum(i * 0.5 * 10 + 1 for i in range(2000))


def test_a_changed_added_or_removed_data_file_reruns_what_reads_it(tmp_path: Path) -> None:
    cwd = project(tmp_path, rows=20000)
    assert table(run(cwd), "obs").num_rows == 20000
    write_csv(cwd / "data/obs-1.csv", range(100))  # cut to 100 lines
    cut = run(cwd)
    assert states(cut) == {"load": "DONE", "transform": "DONE", "train": "DONE"}
    assert cut["load"]["cache"]["reason"] == "file data/obs-1.csv changed"
    assert table(cut, "obs").num_rows == 100 and table(cut, "model")["rows"][0].as_py() == 100
    write_csv(cwd / "data/obs-2.csv", range(5))
    added = run(cwd)
    assert added["load"]["cache"]["reason"] == "file data/obs-2.csv added"
    assert table(added, "obs").num_rows == 105
    (cwd / "data/obs-1.csv").unlink()
    removed = run(cwd)
    assert removed["load"]["cache"]["reason"] == "file data/obs-1.csv removed"
    assert table(removed, "obs").num_rows == 5
    write_csv(cwd / "data/obs-1.csv", range(100))
    (cwd / "data/obs-2.csv").unlink()
    back = run(cwd)  # the same files as two runs ago: that run's output is reused
    assert states(back) == {"load": "CACHED", "transform": "CACHED", "train": "CACHED"}
    assert back["load"]["cache"]["from_run"] == cut["_run"]["id"] and table(back, "obs").num_rows == 100


def test_a_parameter_reruns_only_the_stages_that_read_it(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    run(cwd)
    three = run(cwd, "--param", "epochs=3")
    assert states(three) == {"load": "CACHED", "transform": "CACHED", "train": "DONE"}
    assert three["train"]["cache"]["reason"] == "param epochs changed"
    assert table(three, "model")["epochs"][0].as_py() == 3
    assert states(run(cwd, "--param", "epochs=3")) == {n: "CACHED" for n in ("load", "transform", "train")}


def test_editing_another_stage_does_not_rerun_this_one(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    run(cwd)
    edit(cwd / "p.py", '"rows": [scaled.num_rows]', '"rows": [scaled.num_rows * 2]')
    edited = run(cwd)
    assert states(edited) == {"load": "CACHED", "transform": "CACHED", "train": "DONE"}
    assert edited["train"]["cache"]["reason"] == "code of train() changed"
    assert table(edited, "model")["rows"][0].as_py() == 4000


def test_rerun_forces_a_stage_and_everything_downstream(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    run(cwd)
    forced = run(cwd, "--rerun", "transform")
    assert states(forced) == {"load": "CACHED", "transform": "DONE", "train": "DONE"}
    assert forced["transform"]["cache"]["reason"] == "forced"
    assert set(states(run(cwd, "--rerun", "all")).values()) == {"DONE"}
    bad = hetflow("run", "p.py", "--no-progress", "--rerun", "trian", cwd=cwd)
    assert bad.returncode == 2 and "'trian' is not a stage" in bad.stderr and "'train'" in bad.stderr


def test_resume_of_a_finished_run_after_an_edit_reruns_and_never_relabels_old_outputs(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    first = run(cwd)
    run_id = first["_run"]["id"]
    edit(cwd / "p.py", "SCALE = 2", "SCALE = 10")
    resumed = hetflow("resume", run_id, "--no-progress", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr
    after = status(cwd, run_id)
    assert states(after) == {"load": "DONE", "transform": "DONE", "train": "DONE"}
    assert after["transform"]["cache"]["reason"] == "SCALE changed"
    assert after["load"]["cache"]["hit"] is True and after["transform"]["attempts"] == 2
    assert table(after, "model")["total"][0].as_py() == sum(i * 0.5 * 10 for i in range(2000))
    # and a later run of the edited script gets the new result, not the first run's
    later = run(cwd)
    assert set(states(later).values()) == {"CACHED"}
    assert table(later, "model")["total"][0].as_py() == sum(i * 0.5 * 10 for i in range(2000))
    edit(cwd / "p.py", "SCALE = 10", "SCALE = 2")  # back: the first run's outputs are still right for it
    back = run(cwd)
    assert table(back, "model")["total"][0].as_py() == sum(i * 0.5 * 2 for i in range(2000))


def test_a_declared_file_that_is_missing_is_refused_before_anything_runs_naming_it(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    edit(cwd / "p.py", 'files=["data/obs-*.csv"]', 'files=["data/obs-*.csv", "data/calib.csv"]')
    done = hetflow("run", "p.py", "--no-progress", cwd=cwd)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"hetflow: error: pipeline 'science', stage 'load': declared file 'data/calib.csv' "
                                   f"does not exist ({cwd / 'data' / 'calib.csv'})")


RESUME_WITH_PARAMS = '''
import sys
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("params", workdir="w")


@pipe.stage(outputs=["a"], params={"k": 0})
def reads(ctx):
    return {"a": pa.table({"v": [ctx.params.get("k", 0)]})}


@pipe.stage(outputs=["b"])
def ignores(ctx):
    return {"b": pa.table({"v": [1]})}


if __name__ == "__main__":
    first = pipe.run(params={"k": 1})
    again = pipe.run(run_id=first.id, params={"k": 2})
    reads_, ignores_ = again.stage("reads"), again.stage("ignores")
    print(reads_.attempts, ignores_.attempts, reads_.cache_reason, again.dataset("a").to_table()["v"].to_pylist())
'''


def test_resuming_with_other_parameters_reruns_the_stages_that_read_them(tmp_path: Path) -> None:
    """Through the Python API a resume can bring new parameters: a committed stage that read one
    runs again; its record keeps the parameters it ran with until then."""
    (tmp_path / "r.py").write_text(RESUME_WITH_PARAMS)
    done = subprocess.run([sys.executable, "r.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "2 1 param k changed [2]", done.stdout


ORDER = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("order")

@pipe.stage(outputs=["x"])
def mx(ctx):
    return {"x": pa.table({"v": [10]})}

@pipe.stage(outputs=["y"])
def my(ctx):
    return {"y": pa.table({"v": [1]})}

@pipe.stage(inputs=["x", "y"], outputs=["d"])
def diff(ctx, first, second):
    return {"d": pa.table({"v": [first["v"][0].as_py() - second["v"][0].as_py()]})}
'''


def test_swapping_the_order_of_inputs_reruns_the_stage(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(ORDER)
    assert table(run(tmp_path), "d")["v"].to_pylist() == [9]
    (tmp_path / "p.py").write_text(ORDER.replace('inputs=["x", "y"]', 'inputs=["y", "x"]'))
    swapped = run(tmp_path)
    assert swapped["diff"]["state"] == "DONE" and "order of the inputs" in swapped["diff"]["cache"]["reason"]
    assert table(swapped, "d")["v"].to_pylist() == [-9]


def test_datasets_lists_a_damaged_dataset_naming_the_damage(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(ORDER)
    run(tmp_path)
    (manifest,) = (tmp_path / "work").glob("runs/*/datasets/d/_manifest.json")
    manifest.write_text('{"garbage": 1}')
    listing = hetflow("datasets", cwd=tmp_path)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    line = next(ln for ln in listing.stdout.splitlines() if ln.startswith("d "))
    assert "DAMAGED" in line and "_manifest.json" in line
    again = run(tmp_path)  # and a rerun recomputes it
    assert again["diff"]["state"] == "DONE" and table(again, "d")["v"].to_pylist() == [9]
