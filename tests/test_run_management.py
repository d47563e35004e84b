"""Run management through the real CLI: ``--version``, ``runs --json/--state``, run-id prefixes,
``rm`` and ``gc`` that never break a later run's cached inputs, ``cancel`` from another terminal,
and Ctrl-C (real subprocesses, real mpiexec, real SQLite)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import hetflow

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import os, time
from pathlib import Path
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("chain")

@pipe.stage(ranks=2, outputs=["raw"])
def load(ctx):
    return {"raw": pa.table({"x": [ctx.rank * 10 + i for i in range(5)]})}

@pipe.stage(inputs=["raw"], outputs=["total"], params={"hold": "/nonexistent"})
def total(ctx, raw):
    hold = Path(ctx.params.get("hold", "/nonexistent"))
    if hold.exists():
        (hold.parent / "holding").write_text(str(os.getpid()))
        give_up = time.time() + 180  # a test that failed half-way leaves nothing running for long
        while hold.exists() and time.time() < give_up:
            time.sleep(0.2)
    return {"total": pa.table({"sum": [sum(raw["x"].to_pylist()) * FACTOR]})}
'''


def write_script(cwd: Path, factor: int = 1) -> None:
    (cwd / "chain.py").write_text(SCRIPT.replace("FACTOR", str(factor)))


def hetflow_cmd(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_ok(cwd: Path, *extra: str) -> dict:
    done = hetflow_cmd("run", "chain.py", "--no-progress", *extra, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(hetflow_cmd("status", "--json", cwd=cwd).stdout)


def total_of(status: dict) -> int:
    from hetflow.operators.dataset import open_dataset

    return int(open_dataset(status["datasets"]["total"]).to_table()["sum"][0].as_py())


def test_version_runs_json_and_state_filter(tmp_path: Path) -> None:
    version = hetflow_cmd("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"hetflow {hetflow.__version__}"
    write_script(tmp_path)
    first = run_ok(tmp_path)
    (tmp_path / "chain.py").write_text(SCRIPT.replace("FACTOR", "(1 / 0)"))
    failed = hetflow_cmd("run", "chain.py", "--no-progress", cwd=tmp_path)
    assert failed.returncode == 1
    listed = json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)
    assert [(r["state"], r["pipeline"]) for r in listed] == [("DONE", "chain"), ("FAILED", "chain")]
    assert listed[0]["id"] == first["id"] and listed[0]["run_dir"] == first["run_dir"]
    only_failed = json.loads(hetflow_cmd("runs", "--json", "--state", "failed", cwd=tmp_path).stdout)
    assert [r["id"] for r in only_failed] == [listed[1]["id"]]
    plain = hetflow_cmd("runs", "--state", "DONE", cwd=tmp_path).stdout.splitlines()
    assert len(plain) == 1 and plain[0].startswith(first["id"])
    bad = hetflow_cmd("runs", "--state", "finished", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "CANCELLED" in bad.stderr


def test_prefixes_name_the_ambiguity_and_unknown_runs_list_what_exists(tmp_path: Path) -> None:
    write_script(tmp_path)
    ids = [run_ok(tmp_path, "--rerun", "all")["id"] for _ in range(2)]
    ambiguous = hetflow_cmd("status", "chain", cwd=tmp_path)
    assert ambiguous.returncode == 2
    assert ambiguous.stderr.strip() == (f"hetflow: error: 'chain' matches 2 runs: {ids[1]}, {ids[0]}; "
                                        "give more of the id")
    unknown = hetflow_cmd("status", "slow", cwd=tmp_path)
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "no run 'slow'" in unknown.stderr and ids[0] in unknown.stderr and ids[1] in unknown.stderr
    unique = hetflow_cmd("status", ids[0][:-1], "--json", cwd=tmp_path)
    assert unique.returncode == 0 and json.loads(unique.stdout)["id"] == ids[0]


def test_rm_keeps_what_a_later_run_reuses_and_the_later_run_still_reads_and_resumes(tmp_path: Path) -> None:
    write_script(tmp_path)
    first = run_ok(tmp_path)
    second = run_ok(tmp_path)  # every stage reused: its dataset records point into the first run's directory
    assert {s["state"] for s in second["stages"]} == {"CACHED"}
    assert all(p.startswith(first["run_dir"]) for p in second["datasets"].values())

    dry = hetflow_cmd("rm", first["id"], "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and f"would remove run {first['id']}" in dry.stdout
    assert len(json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)) == 2  # nothing removed

    removed = hetflow_cmd("rm", first["id"][:-2], cwd=tmp_path)
    assert removed.returncode == 0, removed.stderr
    assert f"removed run {first['id']}" in removed.stdout
    assert f"kept {first['run_dir']}/datasets/raw (used by run {second['id']})" in removed.stdout
    assert [r["id"] for r in json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)] == [second["id"]]
    assert not (Path(first["run_dir"]) / "stages").exists()  # its logs and attempts went
    listed = json.loads(hetflow_cmd("datasets", second["id"], "--json", cwd=tmp_path).stdout)
    assert {d["name"]: d["damaged"] for d in listed} == {"raw": None, "total": None}

    # a later run reuses `load` through the second run's records and reads its output in a changed `total`
    write_script(tmp_path, factor=3)
    third = run_ok(tmp_path)
    assert {s["name"]: s["state"] for s in third["stages"]} == {"load": "CACHED", "total": "DONE"}
    assert total_of(third) == 3 * sum(r * 10 + i for r in range(2) for i in range(5))

    # removing the second run keeps `raw` (the third uses it); removing the third frees it
    assert hetflow_cmd("rm", second["id"], cwd=tmp_path).returncode == 0
    assert (Path(first["run_dir"]) / "datasets" / "raw" / "_manifest.json").exists()
    fourth = run_ok(tmp_path)
    assert {s["state"] for s in fourth["stages"]} == {"CACHED"} and total_of(fourth) == total_of(third)
    gone = hetflow_cmd("rm", third["id"], fourth["id"], cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert not Path(first["run_dir"]).exists() and not Path(third["run_dir"]).exists()
    assert hetflow_cmd("runs", "--json", cwd=tmp_path).stdout.strip() == "[]"


def test_gc_removes_unfinished_runs_but_the_latest_and_leftovers_and_keeps_cache_sources(tmp_path: Path) -> None:
    write_script(tmp_path)
    done = run_ok(tmp_path)
    (tmp_path / "chain.py").write_text(SCRIPT.replace("FACTOR", "(1 / 0)"))
    old_failure = hetflow_cmd("run", "chain.py", "--no-progress", cwd=tmp_path)
    latest_failure = hetflow_cmd("run", "chain.py", "--no-progress", cwd=tmp_path)
    assert old_failure.returncode == latest_failure.returncode == 1
    runs = json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)
    old, latest = runs[1], runs[2]
    # both failed runs reused `load` from the DONE run; a leftover directory no record names
    leftover = Path(done["run_dir"]).parent / "chain-19990101-000000-dead"
    (leftover / "stages").mkdir(parents=True)
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))

    dry = hetflow_cmd("gc", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and f"would remove run {old['id']}" in dry.stdout
    assert f"would remove {leftover}" in dry.stdout and leftover.exists()
    collected = hetflow_cmd("gc", cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr
    assert [r["id"] for r in json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)] == \
        [done["id"], latest["id"]]
    assert not Path(old["run_dir"]).exists() and not leftover.exists()
    # the latest failure resumes from what it reused, once the cause is fixed
    write_script(tmp_path)
    resumed = hetflow_cmd("resume", latest["id"], "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    status = json.loads(hetflow_cmd("status", latest["id"], "--json", cwd=tmp_path).stdout)
    assert status["state"] == "DONE" and total_of(status) == total_of(done)
    assert hetflow_cmd("gc", cwd=tmp_path).stdout.strip() == "nothing to remove"


def _start_held_run(cwd: Path) -> tuple[subprocess.Popen[str], dict]:
    write_script(cwd)
    (cwd / "hold").touch()
    proc = subprocess.Popen([*HETFLOW, "run", "chain.py", "--no-progress", "--param", f"hold={cwd / 'hold'}"],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while not (cwd / "holding").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    (run,) = json.loads(hetflow_cmd("runs", "--json", "--state", "RUNNING", cwd=cwd).stdout)
    return proc, run


def _ranks_of(run_dir: str) -> list[psutil.Process]:
    """The live rank processes of the run, by the pid files each rank writes in its attempt directory
    (a 1-rank stage forked by the fork server does not carry the spec path in its command line)."""
    found = []
    for pid_file in Path(run_dir).glob("stages/*/attempt-*/rank-*.pid"):
        try:
            proc = psutil.Process(int(pid_file.read_text()))
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ValueError, OSError, psutil.NoSuchProcess):
            continue
    return found


def test_cancel_from_another_terminal_stops_the_ranks_records_cancelled_and_resume_finishes(tmp_path: Path) -> None:
    proc, run = _start_held_run(tmp_path)
    try:
        assert _ranks_of(run["run_dir"])
        refused = hetflow_cmd("rm", run["id"], cwd=tmp_path)
        assert refused.returncode == 2 and "is running" in refused.stderr and f"hetflow cancel {run['id']}" in \
            refused.stderr
        assert Path(run["run_dir"]).exists()
        cancelled = hetflow_cmd("cancel", run["id"][:-1], cwd=tmp_path)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"run {run['id']} CANCELLED; resume it with: hetflow resume {run['id']}"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert f"resume it with: hetflow resume {run['id']}" in out and "Traceback" not in err
    assert not [p for p in _ranks_of(run["run_dir"]) if p.status() != psutil.STATUS_ZOMBIE]
    status = json.loads(hetflow_cmd("status", run["id"], "--json", cwd=tmp_path).stdout)
    assert status["state"] == "CANCELLED" and "hetflow cancel" in status["error"]
    assert {s["name"]: s["state"] for s in status["stages"]} == {"load": "DONE", "total": "CANCELLED"}
    again = hetflow_cmd("cancel", run["id"], cwd=tmp_path)
    assert again.returncode == 2 and "not running" in again.stderr
    (tmp_path / "hold").unlink()
    resumed = hetflow_cmd("resume", run["id"], "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(hetflow_cmd("status", run["id"], "--json", cwd=tmp_path).stdout)["state"] == "DONE"


def test_ctrl_c_in_the_terminal_records_interrupted_without_error_logs_and_prints_the_resume_command(
        tmp_path: Path) -> None:
    """The terminal sends SIGINT to the whole foreground group: hetflow, mpiexec and every rank."""
    proc, run = _start_held_run(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=180)  # a hang guard: ~2 s alone, over 60 s twice beside 3 xdist workers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and " ERROR " not in err, err
    assert f"hetflow resume {run['id']}" in err and f"run {run['id']} interrupted" in err
    status = json.loads(hetflow_cmd("status", run["id"], "--json", cwd=tmp_path).stdout)
    assert status["state"] == "INTERRUPTED" and "Ctrl-C" in status["error"]
    assert not [p for p in _ranks_of(run["run_dir"]) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("damage", [b"\x00garbage" * 100, b"SQLite format 3\x00" + b"\x01" * 200])
def test_a_damaged_state_store_is_one_line(tmp_path: Path, damage: bytes) -> None:
    (tmp_path / ".hetflow").mkdir()
    (tmp_path / ".hetflow" / "hetflow.db").write_bytes(damage)
    write_script(tmp_path)
    for args in (["runs"], ["datasets"], ["status"], ["gc"], ["run", "chain.py", "--no-progress"]):
        done = hetflow_cmd(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.startswith("hetflow: error: cannot read the state store sqlite:///"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
