"""Map stages and ``--param``: an item counts only the parameters the stage's items read (issue 25).

A plain stage's key counts only the parameters it read the last time it ran; a
map's items counted every parameter of the run, so a ``--param`` that only
another stage reads re-ran every item.  Each test runs the ``hetflow`` command
(real fork server, real SQLite), changes a parameter, and checks which items ran
(a marker line per execution) and what the output holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_map_stages import hetflow, ran, rows, run

TWO_STAGES = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("twoparams")


def mark(text):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(text + "\\n")


@pipe.stage(files=["data/*.csv"], map_over="files", params={"scale": 1}, outputs=["scaled"])
def scaled(ctx):
    mark(ctx.item.name)
    text = ctx.item.read_text().strip()
    if text == "bad":
        raise ValueError(f"{ctx.item.name} is bad")
    return {"scaled": pa.table({"name": [ctx.item.name], "v": [int(text) * ctx.params["scale"]]})}


@pipe.stage(inputs=["scaled"], params={"lr": 1}, outputs=["fit"])
def fit(ctx, scaled):
    mark("fit")
    return {"fit": pa.table({"total": [sum(scaled["v"].to_pylist()) * ctx.params["lr"]]})}


pipe.run()
'''


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("MARKS", str(tmp_path / "marks"))
    (tmp_path / "data").mkdir()
    for name, value in (("a", 1), ("b", 2), ("c", 3)):
        (tmp_path / "data" / f"{name}.csv").write_text(f"{value}\n")
    (tmp_path / "p.py").write_text(TWO_STAGES)
    return tmp_path


def values(stages: dict, dataset: str = "scaled") -> dict[str, int]:
    return {r["name"]: r["v"] for r in rows(stages, dataset)}


def test_a_param_only_another_stage_reads_reuses_the_map_and_one_its_items_read_reruns_them(project: Path) -> None:
    marks = project / "marks"
    stages = run(project, "--param", "scale=1", "--param", "lr=1")
    assert ran(marks) == ["a.csv", "b.csv", "c.csv", "fit"]
    assert stages["scaled"]["items"] == {"DONE": 3}

    stages = run(project, "--param", "scale=1", "--param", "lr=2")  # only the plain stage reads lr
    assert ran(marks) == ["fit"]
    assert stages["scaled"]["state"] == "CACHED"
    assert stages["scaled"]["cache"]["reason"].startswith("map 3 items: 3 cached, 0 ran"), stages["scaled"]
    assert stages["fit"]["state"] == "DONE" and "param lr changed" in stages["fit"]["cache"]["reason"]
    assert rows(stages, "fit") == [{"total": 12}]

    stages = run(project, "--param", "scale=2", "--param", "lr=2")  # the items read scale: every one runs
    assert ran(marks) == ["a.csv", "b.csv", "c.csv", "fit"]
    assert stages["scaled"]["items"] == {"DONE": 3}
    assert stages["scaled"]["cache"]["reason"] == "map 3 items: 0 cached, 3 ran (param scale changed)"
    assert values(stages) == {"a.csv": 2, "b.csv": 4, "c.csv": 6}
    assert rows(stages, "fit") == [{"total": 24}]

    # a new file with a new lr: the map is not reused whole, its items are, one by one; the new one runs
    (project / "data" / "d.csv").write_text("4\n")
    stages = run(project, "--param", "scale=2", "--param", "lr=3")
    assert ran(marks) == ["d.csv", "fit"]
    assert stages["scaled"]["items"] == {"CACHED": 3, "DONE": 1}
    assert values(stages) == {"a.csv": 2, "b.csv": 4, "c.csv": 6, "d.csv": 8}

    # scale back to 1: the first run's items are served again (they read scale=1); d.csv never ran with it
    stages = run(project, "--param", "scale=1", "--param", "lr=3")
    assert ran(marks) == ["d.csv", "fit"]
    assert stages["scaled"]["items"] == {"CACHED": 3, "DONE": 1}
    assert values(stages) == {"a.csv": 1, "b.csv": 2, "c.csv": 3, "d.csv": 4}
    assert "param scale changed" in stages["scaled"]["cache"]["reason"], stages["scaled"]["cache"]


NO_PARAM = '''
import os
import pyarrow as pa
import hetflow as hf
from hetflow.tasks.context import TrackedParams

pipe = hf.Pipeline("noparam")


def mark(text):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(text + "\\n")


@pipe.stage(map_over={"k": POINTS}, outputs=["squares"])
def squares(ctx):
    assert type(ctx.params) is TrackedParams  # the stage's own tracking of what it read
    mark(f"k{ctx.params['k']}")  # its grid point's value: the item's own, not a parameter of the run
    return {"squares": pa.table({"k": [ctx.params["k"]], "sq": [ctx.params["k"] ** 2]})}


@pipe.stage(inputs=["squares"], params={"p": 0, "q": "x"}, outputs=["total"])
def total(ctx, squares):
    mark("total")
    return {"total": pa.table({"t": [sum(squares["sq"].to_pylist()) * ctx.params["p"]], "q": [ctx.params["q"]]})}


pipe.run()
'''


def test_a_map_whose_items_read_no_param_reuses_every_item_whatever_the_params(project: Path) -> None:
    marks = project / "marks"
    (project / "p.py").write_text(NO_PARAM.replace("POINTS", "[1, 2, 3]"))
    run(project, "--param", "p=1")
    assert ran(marks) == ["k1", "k2", "k3", "total"]
    for given in (("p=2",), ("p=2", "q=y"), ("p=5", "q=z")):
        stages = run(project, *[arg for value in given for arg in ("--param", value)])
        assert ran(marks) == ["total"], given
        assert stages["squares"]["state"] == "CACHED", given
    assert rows(stages, "total") == [{"t": 70, "q": "z"}]
    # a new point with new params: the map's old items are reused one by one, the new one runs
    (project / "p.py").write_text(NO_PARAM.replace("POINTS", "[1, 2, 3, 4]"))
    stages = run(project, "--param", "p=1", "--param", "q=w")
    assert ran(marks) == ["k4", "total"]
    assert stages["squares"]["items"] == {"CACHED": 3, "DONE": 1}
    assert rows(stages, "total") == [{"t": 30, "q": "w"}]


def test_a_partly_failed_map_resumed_after_a_fix_keeps_what_its_items_read(project: Path) -> None:
    marks = project / "marks"
    (project / "data" / "c.csv").write_text("bad\n")
    stages = run(project, "--param", "scale=1", "--param", "lr=1", ok=False)
    assert stages["scaled"]["state"] == "FAILED" and "c.csv is bad" in stages["scaled"]["error"]
    assert stages["scaled"]["items"] == {"DONE": 2, "FAILED": 1}
    assert ran(marks) == ["a.csv", "b.csv", "c.csv"]
    run_id = stages["_run"]["id"]

    (project / "data" / "c.csv").write_text("3\n")  # fixed: the resume runs that item only
    done = hetflow(project, "resume", run_id, "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ran(marks) == ["c.csv", "fit"]
    resumed = {s["name"]: s for s in json.loads(hetflow(project, "status", run_id, "--json").stdout)["stages"]}
    assert resumed["scaled"]["items"] == {"CACHED": 2, "DONE": 1}  # its own items of the first session

    stages = run(project, "--param", "scale=1", "--param", "lr=2")  # what the resumed map's items read: scale
    assert ran(marks) == ["fit"]
    assert stages["scaled"]["state"] == "CACHED"
    stages = run(project, "--param", "scale=3", "--param", "lr=2")
    assert ran(marks) == ["a.csv", "b.csv", "c.csv", "fit"]
    assert values(stages) == {"a.csv": 3, "b.csv": 6, "c.csv": 9}


SLOW = '''
import os
import time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("slowparams")


@pipe.stage(map_over={"n": list(range(24))}, params={"scale": 1}, outputs=["out"])
def slow(ctx):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(f"{ctx.params['n']}\\n")
    time.sleep(0.3)
    return {"out": pa.table({"n": [ctx.params["n"] * ctx.params["scale"]]})}


@pipe.stage(inputs=["out"], params={"lr": 1}, outputs=["fit"])
def fit(ctx, out):
    return {"fit": pa.table({"total": [sum(out["n"].to_pylist()) * ctx.params["lr"]]})}


pipe.run()
'''


def test_a_killed_orchestrator_s_finished_items_keep_what_they_read(project: Path) -> None:
    """The names the items read are written with each chunk's rows: an orchestrator killed before the map's
    end leaves rows that its resume, and a later run, match on those names, not on every parameter."""
    from test_map_stages import killed_after_an_item

    marks = project / "marks"
    (project / "p.py").write_text(SLOW)
    run_id, done = killed_after_an_item(project, "--param", "lr=1")
    ran(marks)
    resumed = hetflow(project, "resume", run_id, "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert {int(n) for n in ran(marks)} == set(range(24)) - set(done)

    stages = run(project, "--param", "lr=2")  # a later run: only the plain stage read lr
    assert ran(marks) == []
    assert stages["slow"]["state"] == "CACHED" and stages["fit"]["state"] == "DONE"
    assert rows(stages, "fit") == [{"total": 276 * 2}]
