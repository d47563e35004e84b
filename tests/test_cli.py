"""The hetflow command, run as a user would (a real subprocess, real mpiexec, real SQLite)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_demo_runs_and_status_json_shows_concurrent_disjoint_stages(tmp_path: Path) -> None:
    done = hetflow("run", str(ROOT / "examples/demo/pipeline.py"), "--workdir", str(tmp_path / "w"),
                   "--param", "events_per_rank=3000", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    status = hetflow("status", "--workdir", str(tmp_path / "w"), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    run = json.loads(status.stdout)
    stages = {s["name"]: s for s in run["stages"]}
    assert {s["state"] for s in stages.values()} == {"DONE"}
    a, b = stages["summarize"], stages["quantiles"]
    t = {k: datetime.fromisoformat(v) for k, v in (("a0", a["started"]), ("a1", a["ended"]),
                                                   ("b0", b["started"]), ("b1", b["ended"]))}
    assert t["a0"] < t["b1"] and t["b0"] < t["a1"], "summarize and quantiles did not overlap"
    cores = [{c for s in x["slots"] for c in s["cores"]} for x in (a, b)]
    assert cores[0] and cores[1] and not cores[0] & cores[1]
    assert all(s["node"] == "localhost" for s in a["slots"])
    listed = hetflow("datasets", run["id"][:12], "--workdir", str(tmp_path / "w"), "--json", cwd=tmp_path)
    names = {d["name"]: d for d in json.loads(listed.stdout)}
    assert names["events"]["rows"] == 6000 and names["events"]["partitions"] == 2


SCRIPT = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("scripted")

@pipe.stage(ranks=2, outputs=["t"], params={"fail": False, "tag": ""})
def make(ctx):
    if ctx.params.get("fail") and ctx.rank == 1:
        raise RuntimeError("rank one refuses; param $(touch /tmp/pwned) ; `id`")
    return {"t": pa.table({"r": [ctx.rank], "p": [str(ctx.params.get("tag", ""))]})}
'''


def test_script_without_main_block_failure_exit_codes_and_literal_params(tmp_path: Path) -> None:
    script = tmp_path / "flow.py"
    script.write_text(SCRIPT)
    workdir = str(tmp_path / "w")
    tag = "a;b $(echo x) `id` ../.. -n"
    ok = hetflow("run", str(script), "--workdir", workdir, "--param", f"tag={tag}", "--no-progress", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    run = json.loads(hetflow("status", "--workdir", workdir, "--json", cwd=tmp_path).stdout)
    from hetflow.operators.dataset import open_dataset

    table = open_dataset(run["datasets"]["t"]).to_table()
    assert table["p"].to_pylist() == [tag, tag]  # reached the stage literally

    bad = hetflow("run", str(script), "--workdir", workdir, "--param", "fail=true", "--no-progress", cwd=tmp_path)
    assert bad.returncode == 1
    assert "rank 1 raised RuntimeError: rank one refuses" in bad.stdout
    shown = hetflow("status", "--workdir", workdir, cwd=tmp_path)
    assert shown.returncode == 1 and "Traceback" in shown.stdout and "rank one refuses" in shown.stdout
    assert not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("args, message", [
    (["run", "does-not-exist.py"], "does not exist"),
    (["run", "{script}", "--pilot", "nowhere"], "unknown pilot 'nowhere'"),
    (["status", "nope", "--workdir", "{tmp}"], "no hetflow state store"),
    (["pilot", "show", "mars"], "unknown pilot 'mars'"),
])
def test_bad_usage_exits_2_with_a_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    script = tmp_path / "flow.py"
    script.write_text(SCRIPT)
    args = [a.format(script=script, tmp=tmp_path) for a in args]
    result = hetflow(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_pilots_and_pilot_show(tmp_path: Path) -> None:
    listed = hetflow("pilots", cwd=tmp_path)
    assert listed.returncode == 0 and "local" in listed.stdout
    shown = hetflow("pilot", "show", "local", cwd=tmp_path)
    assert shown.returncode == 0 and "backend: local" in shown.stdout


def test_pilots_names_each_config_by_its_own_name_and_says_what_it_extends(tmp_path: Path) -> None:
    listed = hetflow("pilots", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert {"frontier", "ornl-frontier", "local"} <= set(lines)
    assert lines["frontier"].endswith("(extends ornl-frontier)")              # frontier.yaml: extends: ornl-frontier
    assert "ornl-frontier" not in lines["ornl-frontier"].split(None, 1)[1]     # its own line: no parent, no alias
    assert "9408 node(s) x 56 usable cores x 8 GPUs (amd)" in lines["frontier"]
    assert len(set(lines.values())) == len(lines)                             # no two configs print alike


SWEEP = '''
import hetflow as hf

pipe = hf.Pipeline("sweep", pilot="local")

for lr in ("0_001", "0_003"):
    def member(ctx):
        pass
    pipe.stage(ranks=1, name=f"train_member_of_the_learning_rate_sweep_with_lr_{lr}")(member)
'''


def _stage_column(table: str) -> list[str]:
    """The stage names of ``hetflow status``'s table, each cell's lines joined (a folded name back whole)."""
    names: list[str] = []
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[1]:          # a row's first line has its state; the next lines continue its cells
            names.append(cells[0])
        else:
            names[-1] += cells[0]
    return names


@pytest.mark.parametrize("columns", ["80", "200"])
def test_status_never_cuts_a_stage_name_so_sweep_members_stay_apart(tmp_path: Path, columns: str) -> None:
    (tmp_path / "sweep.py").write_text(SWEEP)
    done = hetflow("run", "sweep.py", "--workdir", "w", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    import os

    shown = subprocess.run([*HETFLOW, "status", "--workdir", "w"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, COLUMNS=columns))
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.split("\n└")[0]
    assert "…" not in table
    assert _stage_column(table) == ["train_member_of_the_learning_rate_sweep_with_lr_0_001",
                                    "train_member_of_the_learning_rate_sweep_with_lr_0_003"]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert rows and all(line.endswith("│") and len(line) <= int(columns) for line in rows)   # no column cropped
    import re

    started = [cells[3] for line in rows if (cells := [c.strip() for c in line.strip("│").split("│")])[3]]
    # the start time is never split inside its date or its time (it was: "2026-11-27T13" / ":18:44.211+00" / ":00")
    assert started and all(re.fullmatch(r"\d{4}-\d\d-\d\d( \d\d:\d\d:\d\d)?|\d\d:\d\d:\d\d", c) for c in started), started


FAILS_ONCE = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("fails-once")


@pipe.stage(outputs=["a"])
def flaky(ctx):
    if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fail")):
        raise RuntimeError("asked to fail")
    return {"a": pa.table({"v": [1]})}
'''


def test_the_summary_of_a_resume_counts_the_time_of_this_session_only(tmp_path: Path) -> None:
    """issue 25 (low): the resume's summary counted from the run's first session, the hours between included."""
    import re
    import time

    (tmp_path / "p.py").write_text(FAILS_ONCE)
    (tmp_path / "fail").touch()
    failed = hetflow("run", "p.py", "--workdir", "w", "--no-progress", cwd=tmp_path)
    assert failed.returncode != 0 and "FAILED" in failed.stdout, failed.stdout + failed.stderr
    run_id = re.search(r"^run (\S+): FAILED", failed.stdout, re.M).group(1)  # type: ignore[union-attr]
    (tmp_path / "fail").unlink()
    time.sleep(1)  # between the sessions: not this session's time
    began = time.monotonic()
    resumed = hetflow("resume", run_id, "--workdir", "w", "--no-progress", cwd=tmp_path)
    session = time.monotonic() - began
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    took = re.search(rf"^run {run_id}: DONE in ([\d.]+)s \(this session\)", resumed.stdout, re.M)
    # at most the resume's own process time: counted from the first session, it would add that session and the gap
    assert took is not None and float(took.group(1)) <= session, (session, resumed.stdout)


MOVES = '''
import os
from pathlib import Path
import pyarrow as pa
import hetflow as hf

os.chdir(Path(__file__).parent / "data")  # common at a script's top: its relative reads are from data/
pipe = hf.Pipeline("moves")

@pipe.stage(outputs=["out"], params={"n": 1})
def make(ctx):
    return {"out": pa.table({"v": [ctx.params["n"]]})}

if __name__ == "__main__":
    pipe.run()
'''


def test_run_takes_the_paths_it_was_given_from_where_it_was_typed_though_the_script_changes_directory(
        tmp_path: Path) -> None:
    """A script's top level runs before its ``pipe.run()`` reads ``--pilot``, ``--workdir``, ``--db`` and
    ``--data-dir``: each names a file as seen from the directory the command was typed in, the default work
    directory too, and the run's summary and follow-up commands hold from there."""
    (tmp_path / "p.py").write_text(MOVES)
    (tmp_path / "data").mkdir()
    (tmp_path / "mine.yaml").write_text("name: mine\nextends: local\n")
    done = hetflow("run", "p.py", "--pilot", "mine.yaml", "--workdir", "w", "--db", "sqlite:///state.db",
                   "--data-dir", "out", "--param", "n=3", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("-lock") and
                  not p.name.endswith(".lock")) == ["data", "mine.yaml", "out", "p.py", "state.db", "w"]
    assert any((tmp_path / "out").iterdir())                               # the datasets, where --data-dir said
    assert list((tmp_path / "data").iterdir()) == []                       # nothing went where the script moved
    status = hetflow("status", "--workdir", "w", "--db", "sqlite:///state.db", "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert shown["state"] == "DONE" and shown["run_dir"] == str(tmp_path / "w" / "runs" / shown["id"])
    assert f"hetflow logs {shown['id']} --workdir w --db sqlite:///state.db" in done.stdout + done.stderr
    default = hetflow("run", "p.py", "--no-progress", cwd=tmp_path)           # the default work directory
    assert default.returncode == 0, default.stderr
    assert (tmp_path / ".hetflow" / "hetflow.db").is_file() and list((tmp_path / "data").iterdir()) == []
    latest = hetflow("status", "--json", cwd=tmp_path)                        # found from where it was typed
    assert latest.returncode == 0 and json.loads(latest.stdout)["pipeline"] == "moves", latest.stderr
