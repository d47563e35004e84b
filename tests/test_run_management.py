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


BIG = '''
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import hetflow as hf

pipe = hf.Pipeline("big")

@pipe.stage(ranks=2, outputs=["raw"])
def load(ctx):  # two partitions of 96 MB: checksummed before reuse, long enough to be caught at it
    return {"raw": pa.table({"x": pa.array(np.arange(12_000_000, dtype="int64") + ctx.rank)})}

@pipe.stage(inputs=["raw"], outputs=["total"])
def total(ctx, raw):
    return {"total": pa.table({"sum": [pc.sum(raw["x"]).as_py()]})}
'''


def _reading(pid: int, path: str) -> bool:
    """Whether process ``pid`` has the file ``path`` open (the cache look-up checksumming it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
        except OSError:
            continue
    return False


def test_rm_racing_a_cache_look_up_never_leaves_a_reuse_of_deleted_files(tmp_path: Path) -> None:
    """Two real processes: a run whose look-up of ``load`` is caught (SIGSTOP) while it checksums the
    cached dataset, and ``hetflow rm`` of the run that made it.  Before, rm deleted the files the stopped
    look-up had just verified, and the run recorded its reuse of them (CACHED, its input gone)."""
    (tmp_path / "big.py").write_text(BIG)
    first = hetflow_cmd("run", "big.py", "--no-progress", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    made = json.loads(hetflow_cmd("status", "--json", cwd=tmp_path).stdout)
    raw = made["datasets"]["raw"]
    from hetflow.operators.dataset import read_manifest

    last = str(Path(raw) / read_manifest(raw).partitions[-1].file)  # checked last: every other check passed
    run = subprocess.Popen([*HETFLOW, "run", "big.py", "--no-progress"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    remover = None
    try:
        deadline = time.time() + 120
        while not _reading(run.pid, last):
            assert run.poll() is None and time.time() < deadline, ("the look-up was never caught", run.communicate())
        os.kill(run.pid, signal.SIGSTOP)  # between verifying the cached files and recording their reuse
        remover = subprocess.Popen([*HETFLOW, "rm", made["id"]], cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            remover.wait(timeout=5)  # today it waits for the look-up; before, it deleted at once
        except subprocess.TimeoutExpired:
            pass
        os.kill(run.pid, signal.SIGCONT)
        out, err = run.communicate(timeout=240)
        removed_out, removed_err = remover.communicate(timeout=120)
    finally:
        for proc in (run, remover):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    assert remover.returncode == 0, removed_err
    assert run.returncode == 0, (out, err)
    second = json.loads(hetflow_cmd("status", "--json", cwd=tmp_path).stdout)
    states = {s["name"]: s["state"] for s in second["stages"]}
    assert second["id"] != made["id"] and states["load"] in ("CACHED", "DONE"), second
    listed = json.loads(hetflow_cmd("datasets", second["id"], "--json", cwd=tmp_path).stdout)
    assert {d["name"]: d["damaged"] for d in listed} == {"raw": None, "total": None}, listed
    if states["load"] == "CACHED":  # reused: so rm kept it, and said so
        assert f"kept {raw} (used by run {second['id']})" in removed_out, removed_out
    assert total_of(second) == 2 * sum(range(12_000_000)) + 12_000_000


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


def _start_held_run(cwd: Path, *store: str, command: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], dict]:
    """``hetflow run chain.py`` (or ``command``: a resume keeps the run's params) with its ``total`` stage held
    until ``cwd/hold`` is removed; ``store``: the ``--workdir``/``--db`` arguments it is given."""
    write_script(cwd)
    (cwd / "hold").touch()
    (cwd / "holding").unlink(missing_ok=True)
    command = command or ("run", "chain.py", "--param", f"hold={cwd / 'hold'}")
    proc = subprocess.Popen([*HETFLOW, *command, "--no-progress", *store],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while not (cwd / "holding").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    (run,) = json.loads(hetflow_cmd("runs", "--json", "--state", "RUNNING", *store, cwd=cwd).stdout)
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


def test_every_printed_follow_up_command_carries_the_workdir_and_db_given_quoted_for_the_shell(
        tmp_path: Path) -> None:
    """rm's cancel hint, cancel's resume hint, the run's summary, and Ctrl-C's line: each pasted as printed
    must reach the same store, whatever the shell makes of a space or a quote in the paths."""
    import shlex

    store = ("--workdir", "my runs/it's here", "--db", f"sqlite:///{tmp_path}/state store.db")
    where = shlex.join(store)
    assert where.startswith("--workdir 'my runs/it'\"'\"'s here' --db 'sqlite:///")
    proc, run = _start_held_run(tmp_path, *store)
    try:
        refused = hetflow_cmd("rm", run["id"], *store, cwd=tmp_path)
        assert refused.returncode == 2 and f"`hetflow cancel {run['id']} {where}`" in refused.stderr
        cancelled = hetflow_cmd("cancel", run["id"], *store, cwd=tmp_path)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"run {run['id']} CANCELLED; resume it with: hetflow resume {run['id']} {where}"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"resume it with: hetflow resume {run['id']} {where}" in out
    assert f"output of every rank: hetflow logs {run['id']} {where}" in out
    # the resume is held again and interrupted: the line hetflow prints says how to go on from here
    proc, _ = _start_held_run(tmp_path, *store, command=("resume", run["id"]))
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert (f"hetflow: run {run['id']} interrupted; running tasks were stopped; resume it with: "
            f"hetflow resume {run['id']} {where}") in err.splitlines()
    (tmp_path / "hold").unlink()
    # pasted into a shell as printed, the hint resumes the run from its own store
    hint = cancelled.stdout.split("resume it with: ", 1)[1].strip()
    argv = shlex.split(hint)
    assert argv[:2] == ["hetflow", "resume"]
    resumed = hetflow_cmd(*argv[1:], "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(hetflow_cmd("status", run["id"], "--json", *store, cwd=tmp_path).stdout)["state"] == "DONE"


@pytest.mark.parametrize("to", ["hetflow", "group"])
def test_sigterm_stops_the_run_like_ctrl_c_and_resume_finishes_it(tmp_path: Path, to: str) -> None:
    """What scancel and the end of a Slurm job send: SIGTERM to every process of the job (``group``), or
    ``kill PID`` to hetflow alone (then stopping the ranks is the orchestrator's doing).  Before, hetflow
    died at once: the run showed RUNNING until its lease lapsed, then FAILED, and its ranks lived on."""
    proc, run = _start_held_run(tmp_path)
    ranks = _ranks_of(run["run_dir"])
    assert ranks
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and f"run {run['id']} interrupted" in err, err
    assert f"hetflow resume {run['id']}" in err, err
    status = json.loads(hetflow_cmd("status", run["id"], "--json", cwd=tmp_path).stdout)
    assert status["state"] == "INTERRUPTED" and "SIGTERM" in status["error"], status
    states = {stage["name"]: stage["state"] for stage in status["stages"]}
    assert states == {"load": "DONE", "total": "CANCELLED"}, states  # as on Ctrl-C
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    (tmp_path / "hold").unlink()
    resumed = hetflow_cmd("resume", run["id"], "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    status = json.loads(hetflow_cmd("status", run["id"], "--json", cwd=tmp_path).stdout)
    assert status["state"] == "DONE" and total_of(status) == 2 * sum(range(5)) + 10 * 5, status


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


def done_id(cwd: Path, store: list[str]) -> str:
    (run,) = json.loads(hetflow_cmd("runs", "--json", "--state", "DONE", *store, cwd=cwd).stdout)
    return str(run["id"])


def test_gc_in_one_work_directory_leaves_the_runs_of_another_that_shares_its_store(tmp_path: Path) -> None:
    """Before, ``gc`` took every run of the store as its own: in a store two work directories share (a team's
    PostgreSQL server, one ``HETFLOW_DB``), A's newer run of the same pipeline made B's latest failure "not
    the latest", and A's ``gc`` removed its record and its directory in B's work directory: B could not resume."""
    db = ["--db", f"sqlite:///{tmp_path / 'team.db'}"]
    mine, theirs = tmp_path / "A", tmp_path / "B"
    mine.mkdir()
    theirs.mkdir()
    (theirs / "chain.py").write_text(SCRIPT.replace("FACTOR", "(1 / 0)"))
    failures = [hetflow_cmd("run", "chain.py", "--no-progress", *db, cwd=theirs) for _ in range(2)]
    assert [f.returncode for f in failures] == [1, 1], failures[-1].stderr
    write_script(mine)
    done = hetflow_cmd("run", "chain.py", "--no-progress", *db, cwd=mine)
    assert done.returncode == 0, done.stderr
    old, latest, _ = json.loads(hetflow_cmd("runs", "--json", *db, cwd=mine).stdout)

    collected = hetflow_cmd("gc", *db, cwd=mine)
    assert collected.returncode == 0 and collected.stdout.strip() == "nothing to remove", collected.stdout
    assert len(json.loads(hetflow_cmd("runs", "--json", *db, cwd=mine).stdout)) == 3
    assert Path(old["run_dir"]).is_dir() and Path(latest["run_dir"]).is_dir()

    collected = hetflow_cmd("gc", *db, cwd=theirs)  # B's own gc: its older failure goes, its latest stays
    assert collected.returncode == 0 and f"removed run {old['id']}" in collected.stdout, collected.stdout
    assert [r["id"] for r in json.loads(hetflow_cmd("runs", "--json", *db, cwd=theirs).stdout)] == \
        [latest["id"], done_id(mine, db)]
    write_script(theirs)
    resumed = hetflow_cmd("resume", latest["id"], "--no-progress", *db, cwd=theirs)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(hetflow_cmd("status", latest["id"], "--json", *db, cwd=theirs).stdout)["state"] == "DONE"
