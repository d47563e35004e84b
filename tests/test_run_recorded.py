"""Every run ends recorded: Ctrl-C, a read-only or full disk, no launcher, a missing extra.

Each case runs ``hetflow run`` as a user would (a real subprocess, real
mpiexec, real SQLite) and checks three things: the command prints one line
naming the cause and how to resume (no traceback), the store records the run
ended (never ``RUNNING`` without an owner) with the reason, and a resume
finishes it once the cause is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import os, subprocess, time
from pathlib import Path
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("recorded")


@pipe.stage(outputs=["numbers"])
def first(ctx):
    return {"numbers": pa.table({"x": list(range(100))})}


@pipe.stage(inputs=["numbers"], outputs=["after"], params={"action": "", "workdir": "."})
def second(ctx, numbers):
    action = ctx.params.get("action", "")
    workdir = Path(ctx.params.get("workdir", "."))
    once = workdir.parent / f"did-{action}"  # a resume (same params) must find the cause gone
    if action and once.exists():
        action = ""
    elif action:
        once.touch()
    if action == "sleep":
        (workdir / "sleeping").touch()
        time.sleep(120)
    elif action == "readonly":  # a read-only view of runs/ from now on (open logs keep the disk busy)
        subprocess.run(["mount", "--bind", str(workdir / "runs"), str(workdir / "runs")], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(workdir / "runs")], check=True)
    elif action == "fill":
        with open(workdir / "filler", "wb") as fh:
            try:
                while True:
                    fh.write(b"x" * (1 << 20))
                    fh.flush()
            except OSError:
                pass
    return {"after": numbers}


@pipe.stage(inputs=["after"], outputs=["last"])
def third(ctx, after):
    return {"last": after}
'''


def _hetflow(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env or dict(os.environ))


def _runs(db: Path) -> list[tuple[str, str, str | None]]:
    with sqlite3.connect(db) as connection:
        return connection.execute("SELECT id, state, error FROM runs").fetchall()


def _no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr, done.stderr


def _project(tmp_path: Path) -> Path:
    (tmp_path / "p.py").write_text(SCRIPT)
    return tmp_path


def test_ctrl_c_records_interrupted_says_how_to_resume_and_resume_finishes(tmp_path: Path) -> None:
    cwd = _project(tmp_path)
    work = cwd / "w"
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--workdir", str(work), "--no-progress", "--param",
                             "action=sleep", "--param", f"workdir={cwd}"], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (cwd / "sleeping").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "hetflow resume" in err, err
    ((run_id, state, error),) = _runs(work / "hetflow.db")
    assert state == "INTERRUPTED" and "Ctrl-C" in error and run_id in err
    shown = json.loads(_hetflow("status", "--workdir", str(work), "--json", cwd=cwd).stdout)
    assert {s["name"]: s["state"] for s in shown["stages"]} == {"first": "DONE", "second": "CANCELLED",
                                                                 "third": "CANCELLED"}
    (cwd / "p.py").write_text(SCRIPT.replace('time.sleep(120)', 'pass'))
    resumed = _hetflow("resume", run_id, "--workdir", str(work), "--no-progress", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr
    assert _runs(work / "hetflow.db")[0][1] == "DONE"


def test_no_launcher_records_the_run_failed_naming_it(tmp_path: Path) -> None:
    cwd = _project(tmp_path)
    work = cwd / "w"
    env = dict(os.environ, HETFLOW_MPIEXEC=str(cwd / "no-such-mpiexec"))
    done = _hetflow("run", "p.py", "--workdir", str(work), "--no-progress", cwd=cwd, env=env)
    assert done.returncode == 1
    _no_traceback(done)
    assert "no-such-mpiexec" in done.stderr and "hetflow resume" in done.stderr
    ((run_id, state, error),) = _runs(work / "hetflow.db")
    assert state == "FAILED" and "no-such-mpiexec" in error
    listed = _hetflow("runs", "--workdir", str(work), cwd=cwd)
    assert "RUNNING" not in listed.stdout and "FAILED" in listed.stdout
    resumed = _hetflow("resume", run_id, "--workdir", str(work), "--no-progress", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr
    assert _runs(work / "hetflow.db")[0][1] == "DONE"


def test_a_missing_extra_is_one_line_naming_it_before_any_run_is_recorded(tmp_path: Path) -> None:
    """The engine is looked for before the run is created: nothing to resume, nothing recorded FAILED
    (before, the run was recorded FAILED and the hint said to resume what could never run)."""
    cwd = _project(tmp_path)
    work = cwd / "w"
    fake = cwd / "broken"
    fake.mkdir()
    (fake / "parsl.py").write_text("raise ImportError(\"No module named 'parsl'\", name='parsl')\n")
    env = dict(os.environ, PYTHONPATH=str(fake))
    done = _hetflow("run", "p.py", "--workdir", str(work), "--no-progress", "--backend", "parsl", cwd=cwd, env=env)
    assert done.returncode == 2, done.stderr
    _no_traceback(done)
    assert "parsl" in done.stderr and "pip install 'hetflow[parsl]'" in done.stderr
    assert "hetflow resume" not in done.stderr
    assert not (work / "hetflow.db").exists() or _runs(work / "hetflow.db") == []


def _small_mount(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def test_a_workdir_that_turns_read_only_mid_run_ends_the_run_recorded_naming_the_path(tmp_path: Path) -> None:
    cwd = _project(tmp_path)
    work = cwd / "small"
    _small_mount(work, "8m")
    db = cwd / "state.db"  # the store on another disk, so the run's end can be recorded
    try:
        done = _hetflow("run", "p.py", "--workdir", str(work), "--db", f"sqlite:///{db}", "--no-progress",
                        "--param", "action=readonly", "--param", f"workdir={work}", cwd=cwd)
        assert done.returncode == 1, done.stdout + done.stderr
        _no_traceback(done)
        cause = "Read-only file system"
        assert cause in done.stderr and str(work / "runs") in done.stderr and "hetflow resume" in done.stderr
        ((run_id, state, error),) = _runs(db)
        assert state == "FAILED" and cause in error and str(work / "runs") in error
        subprocess.run(["umount", str(work / "runs")], check=True)
        resumed = _hetflow("resume", run_id, "--workdir", str(work), "--db", f"sqlite:///{db}", "--no-progress",
                           cwd=cwd)
        assert resumed.returncode == 0, resumed.stderr
        assert _runs(db)[0][1] == "DONE"
    finally:
        subprocess.run(["umount", "-l", str(work / "runs")], check=False, capture_output=True)
        subprocess.run(["umount", "-l", str(work)], check=False)


def test_a_workdir_that_fills_up_mid_run_ends_the_run_recorded_and_resumable(tmp_path: Path) -> None:
    cwd = _project(tmp_path)
    work = cwd / "small"
    _small_mount(work, "8m")
    db = cwd / "state.db"
    try:
        done = _hetflow("run", "p.py", "--workdir", str(work), "--db", f"sqlite:///{db}", "--no-progress",
                        "--param", "action=fill", "--param", f"workdir={work}", cwd=cwd)
        assert done.returncode == 1, done.stdout + done.stderr
        _no_traceback(done)
        assert "hetflow resume" in done.stdout + done.stderr
        ((run_id, state, _),) = _runs(db)
        assert state == "FAILED"
        shown = json.loads(_hetflow("status", run_id, "--workdir", str(work), "--db", f"sqlite:///{db}", "--json",
                                    cwd=cwd).stdout)
        second = {s["name"]: s for s in shown["stages"]}["second"]
        assert second["state"] == "FAILED"
        assert "No space left on device" in (second["error"] or "") + (second["traceback"] or "")
        (work / "filler").unlink()
        resumed = _hetflow("resume", run_id, "--workdir", str(work), "--db", f"sqlite:///{db}", "--no-progress",
                           cwd=cwd)
        assert resumed.returncode == 0, resumed.stderr
        assert _runs(db)[0][1] == "DONE"
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


def test_a_full_disk_under_the_store_itself_is_one_line_and_the_run_is_resumable(tmp_path: Path) -> None:
    cwd = _project(tmp_path)
    work = cwd / "small"
    _small_mount(work, "3m")
    try:
        done = _hetflow("run", "p.py", "--workdir", str(work), "--no-progress", "--param", "action=fill",
                        "--param", f"workdir={work}", cwd=cwd)
        assert done.returncode == 1, done.stdout + done.stderr
        _no_traceback(done)
        assert "hetflow resume" in done.stdout + done.stderr
        (work / "filler").unlink()
        listed = _hetflow("runs", "--workdir", str(work), cwd=cwd)
        assert "RUNNING" not in listed.stdout, listed.stdout  # its owner is gone: shown ended
        run_id = listed.stdout.split()[0]
        resumed = _hetflow("resume", run_id, "--workdir", str(work), "--no-progress", cwd=cwd)
        assert resumed.returncode == 0, resumed.stderr
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)
