"""A resume keeps what the earlier session of the run recorded about the stages it committed: their
times, attempts and whether they were computed or reused (real ``hetflow run`` / ``resume`` processes,
real SQLite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("kept")
FLAG = Path(__file__).resolve().parent / "fail"


@pipe.stage(outputs=["a"])
def slow(ctx):
    time.sleep(1.0)
    return {"a": pa.table({"x": [1, 2, 3]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def flaky(ctx, a):
    if FLAG.exists():
        raise RuntimeError("the flag file is there")
    return {"b": a}
'''


def hetflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def status(cwd: Path, run_id: str) -> dict[str, dict]:
    shown = hetflow("status", run_id, "--json", cwd=cwd)
    assert shown.returncode in (0, 1), shown.stderr
    return {s["name"]: s for s in json.loads(shown.stdout)["stages"]}


def latest(cwd: Path) -> str:
    return json.loads(hetflow("status", "--json", cwd=cwd).stdout)["id"]


def test_a_resume_keeps_the_times_and_attempts_of_stages_the_earlier_session_committed(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(SCRIPT)
    (tmp_path / "fail").touch()
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 1
    run_id = latest(tmp_path)
    before = status(tmp_path, run_id)
    assert before["slow"]["state"] == "DONE" and before["flaky"]["state"] == "FAILED"
    (tmp_path / "fail").unlink()
    resumed = hetflow("resume", run_id, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = status(tmp_path, run_id)
    for key in ("state", "started", "ended", "attempts", "cached_from"):
        assert after["slow"][key] == before["slow"][key], (key, before["slow"], after["slow"])
    assert after["flaky"]["state"] == "DONE" and after["flaky"]["attempts"] == 2


def test_a_resume_shows_a_stage_reused_from_another_run_as_cached_from_that_run(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(SCRIPT)
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 0
    first = latest(tmp_path)
    (tmp_path / "p.py").write_text(SCRIPT.replace('return {"b": a}', 'return {"b": a.slice(1)}'))
    (tmp_path / "fail").touch()
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 1
    second = latest(tmp_path)
    assert second != first
    before = status(tmp_path, second)
    assert before["slow"]["state"] == "CACHED" and before["slow"]["cached_from"] == first
    (tmp_path / "fail").unlink()
    resumed = hetflow("resume", second, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = status(tmp_path, second)
    assert after["slow"]["state"] == "CACHED" and after["slow"]["cached_from"] == first, after["slow"]
    assert after["slow"]["attempts"] == 0 and after["slow"]["ended"] == before["slow"]["ended"]
    assert after["slow"]["cache"]["reason"] == f"unchanged since run {first}", after["slow"]["cache"]
    summary = [line for line in resumed.stdout.splitlines() if line.strip().startswith("slow ")]
    assert summary and "CACHED" in summary[0] and f"unchanged since run {first}" in summary[0], resumed.stdout


def test_a_resume_that_runs_a_committed_stage_again_records_the_new_execution(tmp_path: Path) -> None:
    """Its code changed since the earlier session committed it: it runs again, with its own times."""
    (tmp_path / "p.py").write_text(SCRIPT)
    (tmp_path / "fail").touch()
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 1
    run_id = latest(tmp_path)
    before = status(tmp_path, run_id)["slow"]
    assert before["state"] == "DONE" and before["attempts"] == 1
    (tmp_path / "fail").unlink()
    (tmp_path / "p.py").write_text(SCRIPT.replace("time.sleep(1.0)", "time.sleep(0.5)"))
    assert hetflow("resume", run_id, "--no-progress", cwd=tmp_path).returncode == 0
    after = status(tmp_path, run_id)["slow"]
    assert after["state"] == "DONE" and after["cached_from"] is None and after["attempts"] == 2, after
    assert after["started"] > before["ended"] and after["ended"] > after["started"], (before, after)


def test_a_resume_never_rewrites_a_dataset_another_run_reuses(tmp_path: Path) -> None:
    """Run F fails after committing ``a``; run G reuses F's ``a``; then ``slow`` is edited and F resumed.
    Before, F's resume rewrote ``a`` in place: G then held the new ``a`` beside a ``b`` made from the old
    one while its status said nothing had changed."""
    from hetflow.operators.dataset import open_dataset

    (tmp_path / "p.py").write_text(SCRIPT)
    (tmp_path / "fail").touch()
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 1
    first = latest(tmp_path)
    (tmp_path / "fail").unlink()
    assert hetflow("run", "p.py", "--no-progress", cwd=tmp_path).returncode == 0
    second = latest(tmp_path)
    assert status(tmp_path, second)["slow"]["state"] == "CACHED"
    (tmp_path / "p.py").write_text(SCRIPT.replace("[1, 2, 3]", "[7, 8, 9]"))
    resumed = hetflow("resume", first, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 1, resumed.stdout + resumed.stderr
    assert f"which run(s) {second} reuse" in resumed.stderr, resumed.stderr
    reused = json.loads(hetflow("status", second, "--json", cwd=tmp_path).stdout)["datasets"]["a"]
    assert open_dataset(reused).to_table().column("x").to_pylist() == [1, 2, 3]  # what run G read, untouched
    again = hetflow("run", "p.py", "--no-progress", cwd=tmp_path)  # the way to the new code: a new run
    assert again.returncode == 0, again.stderr
    third = latest(tmp_path)
    assert open_dataset(json.loads(hetflow("status", third, "--json", cwd=tmp_path).stdout)["datasets"]["b"]
                        ).to_table().column("x").to_pylist() == [7, 8, 9]


ARGS = '''
import argparse
from pathlib import Path

import pyarrow as pa
import hetflow as hf

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=1)
N = parser.parse_args().n
pipe = hf.Pipeline("args")
FLAG = Path(__file__).resolve().parent / "fail"


@pipe.stage(outputs=["a"])
def make(ctx):
    return {"a": pa.table({"x": [N]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def flaky(ctx, a):
    if FLAG.exists():
        raise RuntimeError("the flag file is there")
    return {"b": a}


if __name__ == "__main__":
    pipe.run()
'''


def test_a_resume_gives_the_script_the_arguments_its_run_started_with(tmp_path: Path) -> None:
    """``python p.py --n 5`` fails; ``hetflow resume RUN`` used to execute the script without its arguments:
    N fell back to its default, ``make`` re-ran ("N changed") and the run ended DONE with n=1."""
    from hetflow.operators.dataset import open_dataset

    (tmp_path / "p.py").write_text(ARGS)
    (tmp_path / "fail").touch()
    first = subprocess.run([sys.executable, "p.py", "--n", "5"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 1, first.stdout + first.stderr
    run_id = latest(tmp_path)
    (tmp_path / "fail").unlink()
    resumed = hetflow("resume", run_id, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = status(tmp_path, run_id)
    assert after["make"]["attempts"] == 1 and after["flaky"]["state"] == "DONE", after
    b = json.loads(hetflow("status", run_id, "--json", cwd=tmp_path).stdout)["datasets"]["b"]
    assert open_dataset(b).to_table().column("x").to_pylist() == [5]
