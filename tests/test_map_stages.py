"""Map stages (issue 27): one item per file, grid point, row or partition, each cached by its own key.

Every test runs the ``hetflow`` command in a subprocess (real fork server,
real mpiexec, real SQLite), changes what the items are made of, runs again and
checks which items ran (a marker file per execution of an item) and what the
one output dataset holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hetflow import PipelineError, Pipeline
from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)


def run(cwd: Path, *args: str, ok: bool = True) -> dict[str, Any]:
    done = hetflow(cwd, "run", "p.py", "--no-progress", *args)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    shown = hetflow(cwd, "status", "--json")
    data = json.loads(shown.stdout)
    stages: dict[str, Any] = {s["name"]: s for s in data["stages"]}
    stages["_run"] = data
    return stages


def rows(stages: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    return Dataset(stages["_run"]["datasets"][dataset]).to_table().to_pylist()


def ran(marks: Path) -> list[str]:
    """The items that ran since the last call (each execution appends a marker line), then clear them."""
    path = marks / "ran.txt"
    found = sorted(path.read_text().split()) if path.exists() else []
    path.unlink(missing_ok=True)
    return found


FILES = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("perfile")


@pipe.stage(files=["data/*.csv"], map_over="files", outputs=["sizes"])
def sizes(ctx):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(ctx.item.name + "\\n")
    assert ctx.files == (ctx.item,)  # its key covers its own file only
    return {"sizes": pa.table({"name": [ctx.item.name], "text": [ctx.item.read_text().strip()]})}


@pipe.stage(inputs=["sizes"], outputs=["count"])
def count(ctx, sizes):
    return {"count": pa.table({"n": [sizes.num_rows]})}


pipe.run()
'''


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("MARKS", str(tmp_path / "marks"))
    return tmp_path


def test_files_added_edited_removed_run_only_their_items(project: Path) -> None:
    (project / "data").mkdir()
    for name in ("a", "b", "c"):
        (project / "data" / f"{name}.csv").write_text(f"{name}1\n")
    (project / "p.py").write_text(FILES)
    stages = run(project)
    assert ran(project / "marks") == ["a.csv", "b.csv", "c.csv"]
    assert [r["name"] for r in rows(stages, "sizes")] == ["a.csv", "b.csv", "c.csv"]
    assert stages["sizes"]["items"] == {"DONE": 3}

    (project / "data" / "d.csv").write_text("d1\n")  # added: one new item
    stages = run(project)
    assert ran(project / "marks") == ["d.csv"]
    assert stages["sizes"]["cache"]["reason"].startswith("map 4 items: 3 cached, 1 ran (data/d.csv added")
    assert [r["name"] for r in rows(stages, "sizes")] == ["a.csv", "b.csv", "c.csv", "d.csv"]
    assert rows(stages, "count") == [{"n": 4}]

    (project / "data" / "b.csv").write_text("b2\n")  # edited: that one re-runs
    stages = run(project)
    assert ran(project / "marks") == ["b.csv"]
    assert rows(stages, "sizes")[1] == {"name": "b.csv", "text": "b2"}

    (project / "data" / "a.csv").unlink()  # removed: its partition is dropped, nothing runs
    stages = run(project)
    assert ran(project / "marks") == []
    assert [r["name"] for r in rows(stages, "sizes")] == ["b.csv", "c.csv", "d.csv"]
    assert rows(stages, "count") == [{"n": 3}]
    assert "data/a.csv removed" in stages["sizes"]["cache"]["reason"]

    stages = run(project)  # nothing changed: the whole map is reused
    assert ran(project / "marks") == []
    assert stages["sizes"]["state"] == "CACHED"
    assert stages["sizes"]["cache"]["reason"].startswith("map 3 items: 3 cached, 0 ran")

    (project / "p.py").write_text(FILES.replace('.strip()]', '.strip().upper()]'))  # code: every item
    stages = run(project)
    assert ran(project / "marks") == ["b.csv", "c.csv", "d.csv"]
    assert rows(stages, "sizes")[0]["text"] == "B2"
    # the code changed, not the files: said so (it named every file as changed, session 18)
    assert stages["sizes"]["cache"]["reason"] == "map 3 items: 0 cached, 3 ran (code of sizes() changed)"


GRID = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("sweep")


@pipe.stage(map_over={"lr": LRS, "depth": [1, 2]}, params={"scale": 10}, outputs=["fits"])
def fit(ctx):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(f"{ctx.params['lr']}/{ctx.params['depth']}\\n")
    return {"fits": pa.table({"lr": [ctx.params["lr"]], "depth": [ctx.params["depth"]],
                              "score": [ctx.params["lr"] * ctx.params["depth"] * ctx.params["scale"]],
                              "index": [ctx.item_index], "stage": [ctx.stage]})}


pipe.run()
'''


def test_grid_point_added_runs_only_its_items(project: Path) -> None:
    (project / "p.py").write_text(GRID.replace("LRS", "[0.1, 0.01]"))
    stages = run(project)
    assert ran(project / "marks") == ["0.01/1", "0.01/2", "0.1/1", "0.1/2"]
    fits = rows(stages, "fits")
    assert [(r["lr"], r["depth"]) for r in fits] == [(0.1, 1), (0.1, 2), (0.01, 1), (0.01, 2)]
    assert [r["index"] for r in fits] == [0, 1, 2, 3] and {r["stage"] for r in fits} == {"fit"}

    (project / "p.py").write_text(GRID.replace("LRS", "[0.1, 0.01, 0.5]"))
    stages = run(project)
    assert ran(project / "marks") == ["0.5/1", "0.5/2"]
    assert [(r["lr"], r["depth"]) for r in rows(stages, "fits")][-2:] == [(0.5, 1), (0.5, 2)]
    assert len(rows(stages, "fits")) == 6

    stages = run(project, "--rerun", "fit")  # forced: every item, whatever the items' cache says
    assert len(ran(project / "marks")) == 6
    assert stages["fit"]["items"] == {"DONE": 6}


ROWS = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("found")


@pipe.stage(files=["list.txt"], outputs=["tasks"])
def discover(ctx):
    names = ctx.files[0].read_text().split()
    return {"tasks": pa.table({"name": names})}


@pipe.stage(inputs=["tasks"], map_over="rows:tasks", outputs=["done"])
def work(ctx, tasks):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(ctx.item["name"] + "\\n")
    assert tasks.num_rows == 1 and tasks["name"][0].as_py() == ctx.item["name"]
    return {"done": pa.table({"name": [ctx.item["name"]], "len": [len(ctx.item["name"])]})}


@pipe.stage(inputs=["done"], map_over="partitions:done", outputs=["again"])
def again(ctx, done):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write("p:" + done["name"][0].as_py() + "\\n")
    return {"again": done}


pipe.run()
'''


def test_rows_found_upstream_at_run_time(project: Path) -> None:
    (project / "list.txt").write_text("x yy zzz\n")
    (project / "p.py").write_text(ROWS)
    stages = run(project)
    assert ran(project / "marks") == ["p:x", "p:yy", "p:zzz", "x", "yy", "zzz"]
    assert rows(stages, "done") == [{"name": "x", "len": 1}, {"name": "yy", "len": 2}, {"name": "zzz", "len": 3}]

    (project / "list.txt").write_text("x zzz wwww\n")  # upstream now makes other rows
    stages = run(project)
    assert ran(project / "marks") == ["p:wwww", "wwww"]
    assert [r["name"] for r in rows(stages, "done")] == ["x", "zzz", "wwww"]
    assert rows(stages, "again") == rows(stages, "done")


FAILING = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("failing")


@pipe.stage(map_over={"n": list(range(8))}, retries=1, max_failures=MAXF, outputs=["out"])
def work(ctx):
    n = ctx.params["n"]
    print(f"working on {n}")
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(f"{n}\\n")
    bad = open(os.path.join(os.environ["MARKS"], "bad.txt")).read().split()
    if str(n) in bad:
        raise ValueError(f"item {n} is bad")
    if n == 5 and "crash" in bad:
        os.kill(os.getpid(), 9)
    return {"out": pa.table({"n": [n]})}


pipe.run()
'''


def test_item_failures_retries_resume_and_max_failures(project: Path) -> None:
    marks = project / "marks"
    (marks / "bad.txt").write_text("2 6 crash")
    (project / "p.py").write_text(FAILING.replace("MAXF", "0"))
    stages = run(project, ok=False)
    # every item once; the two that raise and the one that crashed its process once more (retries=1)
    assert ran(marks) == sorted([str(n) for n in range(8)] + ["2", "5", "6"])
    work = stages["work"]
    assert work["state"] == "FAILED"
    assert "3 of 8 items failed: item 2 ({\"n\": 2}): ValueError: item 2 is bad" in work["error"]
    assert "item 5 ({\"n\": 5}): the item's process ended without a result (killed by signal 9)" in work["error"]
    run_id = stages["_run"]["id"]
    listed = json.loads(hetflow(project, "status", run_id, "work", "--items", "--json").stdout)
    assert [(i["index"], i["state"], i["tries"]) for i in listed["items"] if i["state"] != "DONE"] == \
        [(2, "FAILED", 2), (5, "FAILED", 2), (6, "FAILED", 2)]
    shown = hetflow(project, "logs", run_id, "work", "--item", "3")  # what that item printed, and only that
    assert shown.returncode == 0 and "working on 3" in shown.stdout, shown.stdout + shown.stderr
    assert "working on 4" not in shown.stdout and "working on 2" not in shown.stdout
    shown = hetflow(project, "logs", run_id, "work")  # every chunk's output, not only the first's
    assert all(f"working on {n}" in shown.stdout for n in range(8)), shown.stdout
    shown = hetflow(project, "logs", run_id, "work", "--item", "2")
    assert "working on 2" in shown.stdout and "ValueError: item 2 is bad" in shown.stdout, shown.stdout

    (marks / "bad.txt").write_text("")  # the cause fixed: the resume runs only the failed items
    done = hetflow(project, "resume", run_id, "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ran(marks) == ["2", "5", "6"]
    stages = json.loads(hetflow(project, "status", run_id, "--json").stdout)
    out = Dataset(stages["datasets"]["out"]).to_table()
    assert out["n"].to_pylist() == list(range(8))

    (marks / "bad.txt").write_text("1 3")  # accepted failures: the stage succeeds without them
    (project / "p.py").write_text(FAILING.replace("MAXF", "0.25").replace("range(8)", "range(10, 18)")
                                  .replace('"1 3"', "").replace("str(n) in bad", "str(n - 10) in bad"))
    stages = run(project)
    assert stages["work"]["state"] == "DONE"
    assert [r["n"] for r in rows(stages, "out")] == [10, 12, 14, 15, 16, 17]
    assert "2 failed" in stages["work"]["cache"]["reason"] and "max_failures=0.25" in stages["work"]["cache"]["reason"]
    assert stages["work"]["items"] == {"DONE": 6, "FAILED": 2}

    (marks / "bad.txt").write_text("1 3 4")  # one more than a quarter of 8: the stage fails
    (project / "p.py").write_text(FAILING.replace("MAXF", "0.25").replace("range(8)", "range(20, 28)")
                                  .replace("str(n) in bad", "str(n - 20) in bad"))
    stages = run(project, ok=False)
    assert stages["work"]["state"] == "FAILED" and "3 of 8 items failed" in stages["work"]["error"]


TWO_RANKS = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("tworanks")


@pipe.stage(map_over={"k": [0, 1, 2]}, ranks=2, outputs=["two"])
def two(ctx):
    total = ctx.comm.allreduce(ctx.rank + 1)
    return {"two": pa.table({"k": [ctx.params["k"]], "rank": [ctx.rank], "total": [total]})}


pipe.run()
'''


def test_two_rank_items_each_run_on_their_own_communicator(project: Path) -> None:
    (project / "p.py").write_text(TWO_RANKS)
    stages = run(project)
    assert rows(stages, "two") == [{"k": k, "rank": r, "total": 3} for k in range(3) for r in range(2)]
    assert stages["two"]["items"] == {"DONE": 3}


def test_declaration_errors_name_the_stage_and_what_is_expected() -> None:
    pipe = Pipeline("bad")

    def body(ctx: Any, *inputs: Any) -> None:
        return None

    cases = [
        (dict(map_over="files"), "stage 'body': map_over='files' needs files=[...]"),
        (dict(map_over={"lr": 0.1}), "map_over grid value for 'lr' must be a list of values, got float 0.1"),
        (dict(map_over="rows:nope", inputs=[]), "map_over='rows:nope' names 'nope', which is not one of its inputs []"),
        (dict(map_over="columns"), "map_over='columns' is not one of"),
        (dict(map_over={"n": [1]}, max_failures=1.5), "max_failures must be a count (int >= 0) or a fraction"),
        (dict(max_failures=2), "max_failures is for map stages"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(PipelineError) as caught:
            pipe.stage(name="body", **kwargs)(body)
        assert expected in str(caught.value) and "\n" not in str(caught.value)


MANY = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("many")


@pipe.stage(map_over={"i": list(range(COUNT))}, outputs=["out"])
def trivial(ctx):
    return {"out": pa.table({"i": [ctx.params["i"]]})}


pipe.run()
'''


def test_a_thousand_trivial_items_run_in_warm_workers(project: Path) -> None:
    count = 1000
    (project / "p.py").write_text(MANY.replace("COUNT", str(count)))
    started = time.perf_counter()
    stages = run(project)
    took = time.perf_counter() - started
    assert Dataset(stages["_run"]["datasets"]["out"]).to_table()["i"].to_pylist() == list(range(count))
    print(f"{count} items end to end (hetflow run + status) in {took:.1f} s: {count / took:.0f} items/s")
    assert took < 60
    started = time.perf_counter()
    stages = run(project)
    assert stages["trivial"]["state"] == "CACHED"
    assert time.perf_counter() - started < 30


GPUS = '''
import os
import time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("gpus", pilot=hf.PilotDescription(name="fake-gpus", cores_per_node=4, gpus_per_node=4,
                                                     memory_per_node=2**34))


@pipe.stage(map_over={"k": list(range(8))}, gpus_per_rank=1, outputs=["seen"])
def on_gpu(ctx):
    started = time.time()
    time.sleep(0.5)
    return {"seen": pa.table({"k": [ctx.params["k"]], "cuda": [os.environ.get("CUDA_VISIBLE_DEVICES", "")],
                              "gpus": [list(ctx.gpus)], "started": [started], "ended": [time.time()]})}


pipe.run()
'''


def test_gpu_items_run_at_once_on_disjoint_fake_gpus(project: Path) -> None:
    (project / "p.py").write_text(GPUS)
    stages = run(project)
    seen = rows(stages, "seen")
    assert [r["k"] for r in seen] == list(range(8))
    for row in seen:  # one GPU each, and the visible device is the one the pilot gave
        assert len(row["gpus"]) == 1 and row["cuda"] == str(row["gpus"][0])
    overlapping = [(a, b) for i, a in enumerate(seen) for b in seen[i + 1:]
                   if a["started"] < b["ended"] and b["started"] < a["ended"]]
    assert overlapping, "no two items ran at the same time"
    assert all(a["cuda"] != b["cuda"] for a, b in overlapping), overlapping
    assert len({r["cuda"] for r in seen}) >= 2


def test_serve_shows_a_map_stage_as_one_row_with_its_items(project: Path) -> None:
    import signal
    import urllib.request

    (project / "marks" / "bad.txt").write_text("3")
    (project / "p.py").write_text(FAILING.replace("MAXF", "1"))
    stages = run(project)
    serve = subprocess.Popen([*HETFLOW, "serve", stages["_run"]["id"], "--port", "0", "--workdir",
                              str(project / "work")], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        base, token = line.split(" at ", 1)[1].split()[0].split("?token=")
        with urllib.request.urlopen(f"{base}api/status?token={token}", timeout=30) as answer:
            shown = json.loads(answer.read())
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=30)
    [work] = [s for s in shown["stages"] if s["name"] == "work"]
    assert work["state"] == "DONE" and work["items"] == {"DONE": 7, "FAILED": 1}
    assert work["progress"]["text"] == "items 7/8, 1 failed" and work["progress"]["total"] == 8
    assert work["cache"]["reason"].startswith("map 8 items: 0 cached, 7 ran, 1 failed")


SLOW = '''
import os
import time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("slow")


@pipe.stage(map_over={"n": list(range(24))}, outputs=["out"])
def slow(ctx):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(f"{ctx.params['n']}\\n")
    time.sleep(0.3)
    return {"out": pa.table({"n": [ctx.params["n"]]})}


pipe.run()
'''


def killed_after_an_item(project: Path, *args: str) -> tuple[str, list[int]]:
    """``hetflow run p.py ARGS`` in ``project``, killed with its chunks (SIGKILL, nothing more recorded) once a
    map item is recorded DONE: the run's id and the items recorded DONE, some of the 24 of ``SLOW``."""
    import os
    import signal
    import sqlite3

    started = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", *args, "--workdir", str(project / "work")],
                               cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    db = project / "work" / "hetflow.db"
    deadline = time.time() + 120
    done: list[int] = []
    while time.time() < deadline and not done:
        time.sleep(0.2)
        try:
            with sqlite3.connect(db) as conn:
                done = [r[0] for r in conn.execute("SELECT \"index\" FROM map_items WHERE state='DONE'")]
        except sqlite3.Error:
            continue
    assert done, "no chunk of the map ended in time"
    os.killpg(started.pid, signal.SIGKILL)  # the orchestrator and its chunks, at once: nothing more recorded
    started.wait(timeout=30)
    with sqlite3.connect(db) as conn:
        run_id, = conn.execute("SELECT id FROM runs").fetchone()
        done = sorted(r[0] for r in conn.execute("SELECT \"index\" FROM map_items WHERE state='DONE'"))
    assert 0 < len(done) < 24
    return run_id, done


def test_a_killed_orchestrator_s_resume_runs_only_the_items_it_had_not_finished(project: Path) -> None:
    (project / "p.py").write_text(SLOW)
    run_id, done = killed_after_an_item(project)
    ran(project / "marks")
    resumed = hetflow(project, "resume", run_id, "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = {int(n) for n in ran(project / "marks")}
    assert again == set(range(24)) - set(done)  # exactly the items the killed session had not finished
    shown = json.loads(hetflow(project, "status", run_id, "--json").stdout)
    assert Dataset(shown["datasets"]["out"]).to_table()["n"].to_pylist() == list(range(24))


def test_a_map_run_can_be_removed_and_its_items_run_again_after(project: Path) -> None:
    (project / "p.py").write_text(GRID.replace("LRS", "[0.1]"))
    first = run(project)
    ran(project / "marks")
    (project / "p.py").write_text(GRID.replace("LRS", "[0.1, 0.2]"))
    second = run(project)  # reuses the first run's items, in its own dataset
    assert ran(project / "marks") == ["0.2/1", "0.2/2"]
    removed = hetflow(project, "rm", first["_run"]["id"])
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert len(rows(second, "fits")) == 4  # its output holds its own links to the removed run's files
    (project / "p.py").write_text(GRID.replace("LRS", "[0.1, 0.2, 0.3]"))
    run(project)  # the removed run's items are gone: they run again, the second run's are reused
    assert ran(project / "marks") == ["0.1/1", "0.1/2", "0.3/1", "0.3/2"]


STUCK = '''
import time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("stuck")


@pipe.stage(map_over={"n": [0, 1, 2, 3]}, timeout=2, max_failures=1, outputs=["out"])
def stuck(ctx):
    if ctx.params["n"] == 1:
        time.sleep(600)
    return {"out": pa.table({"n": [ctx.params["n"]]})}


pipe.run()
'''


def test_an_item_past_the_timeout_ends_alone_and_the_others_go_on(project: Path) -> None:
    (project / "p.py").write_text(STUCK)
    started = time.perf_counter()
    stages = run(project)
    assert time.perf_counter() - started < 60  # not 600 s, nor the task's limit of every item's timeout
    assert [r["n"] for r in rows(stages, "out")] == [0, 2, 3]
    listed = json.loads(hetflow(project, "status", stages["_run"]["id"], "stuck", "--items", "--json").stdout)
    [failed] = [i for i in listed["items"] if i["state"] == "FAILED"]
    assert failed["index"] == 1 and "exceeded the stage's timeout of 2s and was killed" in failed["error"]


TWO_OUTPUTS = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("many", pilot=hf.PilotDescription(name="two", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(map_over={"n": list(range(40))}, outputs=["out", "twice"])
def many(ctx):
    return {"out": pa.table({"n": [ctx.params["n"]]}),
            "twice": None if ctx.params["n"] % 2 else pa.table({"n2": [2 * ctx.params["n"]]})}


pipe.run()
'''


def test_a_map_s_item_rows_are_written_once_and_its_items_share_a_directory_per_output(project: Path) -> None:
    """The map's end wrote every item's row again (deleting those its chunks had written as they ended),
    and each item made two directories of its own for its one partition file."""
    import sqlite3

    from hetflow.store import Store

    (project / "work").mkdir()
    Store(f"sqlite:///{project / 'work' / 'hetflow.db'}")   # the schema, then a witness of every row written
    with sqlite3.connect(project / "work" / "hetflow.db") as conn:
        conn.executescript("CREATE TABLE written (id INTEGER, deleted INTEGER);"
                           "CREATE TRIGGER w AFTER INSERT ON map_items BEGIN INSERT INTO written VALUES (NEW.id, 0); END;"
                           "CREATE TRIGGER d AFTER DELETE ON map_items BEGIN INSERT INTO written VALUES (OLD.id, 1); END;")
    (project / "p.py").write_text(TWO_OUTPUTS)
    stages = run(project)
    assert [r["n"] for r in rows(stages, "out")] == list(range(40))
    assert [r["n2"] for r in rows(stages, "twice")] == list(range(0, 80, 4))
    assert stages["many"]["items"] == {"DONE": 40}
    with sqlite3.connect(project / "work" / "hetflow.db") as conn:
        written = conn.execute("SELECT count(*), sum(deleted) FROM written").fetchone()
    assert tuple(written) == (40, 0), written   # 40 rows inserted, none deleted
    items_dir = Path(stages["_run"]["run_dir"]) / "items" / "many"
    assert sorted(p.name for p in items_dir.iterdir()) == ["out", "twice"]
    assert len(list((items_dir / "out").iterdir())) == 40 and len(list((items_dir / "twice").iterdir())) == 20
    run_id = stages["_run"]["id"]
    listed = json.loads(hetflow(project, "status", run_id, "many", "--items", "--json", "--limit", "3",
                                "--offset", "37").stdout)
    assert [(i["index"], i["state"]) for i in listed["items"]] == [(37, "DONE"), (38, "DONE"), (39, "DONE")]
    assert listed["total"] == 40 and listed["counts"] == {"DONE": 40}
    (project / "p.py").write_text(TWO_OUTPUTS.replace("range(40)", "range(41)"))   # one item added: the rest reused
    again = run(project)
    assert again["many"]["items"] == {"CACHED": 40, "DONE": 1}
    assert [r["n"] for r in rows(again, "out")] == list(range(41))


def test_the_reason_names_only_the_items_that_ran(project: Path) -> None:
    """An item served from an earlier run's cache is not named as changed, though its key differs from the
    latest execution's: the reason says why the items that ran ran (it named every edited-back file)."""
    (project / "data").mkdir()
    for name in ("a", "b", "c"):
        (project / "data" / f"{name}.csv").write_text(f"{name}1\n")
    (project / "p.py").write_text(FILES)
    run(project)
    assert ran(project / "marks") == ["a.csv", "b.csv", "c.csv"]
    (project / "data" / "b.csv").write_text("b2\n")
    run(project)
    assert ran(project / "marks") == ["b.csv"]
    (project / "data" / "b.csv").write_text("b1\n")  # back as the first run had it: reused from there
    (project / "data" / "c.csv").write_text("c2\n")  # edited: the one item to run
    stages = run(project)
    assert ran(project / "marks") == ["c.csv"]
    assert stages["sizes"]["cache"]["reason"] == "map 3 items: 2 cached, 1 ran (data/c.csv changed)"
    assert [r["text"] for r in rows(stages, "sizes")] == ["a1", "b1", "c2"]


FAILS_AFTER_MAP = FILES.replace("pipe.run()", '''
@pipe.stage(outputs=["other"])
def other(ctx):
    if os.path.exists(os.path.join(os.environ["MARKS"], "fail")):
        raise ValueError("told to fail")
    return {"other": pa.table({"ok": [1]})}


pipe.run()''')


def test_a_resume_says_a_reused_map_was_reused_once(project: Path) -> None:
    (project / "data").mkdir()
    (project / "data" / "a.csv").write_text("a1\n")
    (project / "p.py").write_text(FAILS_AFTER_MAP)
    first = run(project)["_run"]["id"]
    (project / "marks" / "fail").write_text("")
    stages = run(project, "--rerun", "other", ok=False)  # the map reused whole; the other stage fails
    run_id = stages["_run"]["id"]
    reason = f"map 1 items: 1 cached, 0 ran (unchanged since run {first})"
    assert stages["sizes"]["cache"]["reason"] == reason
    (project / "marks" / "fail").unlink()
    done = hetflow(project, "resume", run_id, "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    stages = {s["name"]: s for s in json.loads(hetflow(project, "status", run_id, "--json").stdout)["stages"]}
    assert stages["other"]["state"] == "DONE"
    assert stages["sizes"]["cache"]["reason"] == reason  # said once, not wrapped in itself again
