"""One-rank stages start warm, from the local backend's fork server, with every guarantee of a cold start.

Real runs: the stage reports who started it; faults (a hang, a SIGKILL, children left behind, a
killed fork server, Ctrl-C) are injected as in test_faults.py, and nothing may survive them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _fault_stages as F
import _warm_stages as W
from _procs import alive as _alive
import hetflow as hf
import psutil
import pytest
from hetflow.operators.dataset import open_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

PILOT = hf.PilotDescription(name="two-cores", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34)
COLD = hf.PilotDescription(name="two-cores-cold", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34,
                           options={"local": {"warm_start": False}})


def _servers(run_dir: Path) -> list[int]:
    """Fork servers whose log is in ``run_dir`` (their children have their stages' logs open instead)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "hetflow.tasks.forkserver" in (proc.info["cmdline"] or []) and \
                    any(f.path == str(run_dir / "forkserver.log") for f in proc.open_files()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _lineage(run: hf.RunStatus, name: str = "lineage") -> list[dict]:
    return open_dataset(Path(run.run_dir) / "datasets" / name).to_table().to_pylist()


def test_a_one_rank_stage_starts_warm_with_a_real_communicator_and_so_do_two_ranks_under_mpiexec(
        tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["lineage"])(W.lineage)
    pipe.stage(ranks=2, outputs=["lineage2"])(W.lineage2)
    run = pipe.run()
    assert run.ok, run
    (one,) = _lineage(run)
    assert "hetflow.tasks.forkserver" in one["starter"], one
    assert one["starter_is_parent"], one  # one fork per task: the server is the rank's parent and witness
    assert one["session_leader"] and one["mpi_comm"] and one["size"] == 1 and one["gathered"] == [0], one
    assert one["blas_threads"] == "1" and one["stdin_null"], one
    assert one["fi_provider_path"] == os.devnull, one  # libfabric's shm only: no dynamic provider is loaded
    assert Path(one["cwd"]) == Path(run.run_dir) / "stages" / "lineage" / "attempt-1"
    two = _lineage(run, "lineage2")
    # forked by the server too, their stubs started by mpiexec (hetflow.tasks.warmranks): one world of two
    assert len(two) == 2 and all("hetflow.tasks.forkserver" in r["starter"] and r["size"] == 2 for r in two), two
    assert sorted(r["gathered"] == [0, 1] for r in two) == [True, True], two
    assert _servers(Path(run.run_dir)) == []  # ended with the run


def test_a_warm_rank_starts_mpi_only_when_its_stage_reads_ctx_comm(tmp_path: Path) -> None:
    pipe = hf.Pipeline("lazy", pilot=PILOT, workdir=tmp_path)
    pipe.stage(outputs=["mpi_started"])(W.mpi_started)
    pipe.stage(outputs=["mpi_unused"])(W.mpi_unused)
    pipe.stage(outputs=["mpi_direct"])(W.mpi_direct)
    run = pipe.run()
    assert run.ok, run
    (used,) = _lineage(run, "mpi_started")
    assert not used["before"] and not used["after_rank"] and (used["rank"], used["size"]) == (0, 1), used
    assert used["after_comm"] and used["mpi_comm"] and used["same"] and used["comm_size"] == 1, used
    assert used["gathered"] == [7], used
    (unused,) = _lineage(run, "mpi_unused")
    assert not unused["started"] and (unused["rank"], unused["size"]) == (0, 1), unused
    # code that names mpi4py may use MPI.COMM_WORLD without ctx.comm: MPI is started before it runs
    assert _lineage(run, "mpi_direct") == [{"gathered": [5], "size": 1}]
    for stage in ("mpi_started", "mpi_unused", "mpi_direct"):  # MPI finalized at the rank's exit where it started: a clean log
        log = (Path(run.run_dir) / "stages" / stage / "attempt-1" / "rank-0.log").read_text()
        assert "MPI" not in log and "Error" not in log, log


LAZY_MPI_USER = '''
import pyarrow as pa
import hetflow as hf
import mpilib

pipe = hf.Pipeline("lazy-mpi-user", pilot="local")


@pipe.stage(outputs=["sizes"])
def sizes(ctx):
    return {"sizes": pa.table({"size": [mpilib.world_size()], "rank": [ctx.rank]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print(run.state, run.stage("sizes").error)
    if run.ok:
        print(run.dataset("sizes").to_table().to_pylist())
'''


def test_an_installed_package_that_imports_mpi4py_when_called_finds_mpi_started(tmp_path: Path) -> None:
    """Red team 9 (mpilazy): a package on the path with no version (so not in the key) that imports mpi4py
    inside a function and calls MPI.COMM_WORLD, from a warm one-rank stage that never reads ctx.comm,
    aborted the rank ("an MPI routine before initializing"); cold it ran."""
    lib = tmp_path / "site-packages" / "mpilib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("def world_size():\n    from mpi4py import MPI\n"
                                     "    return MPI.COMM_WORLD.Get_size()\n")
    (tmp_path / "p.py").write_text(LAZY_MPI_USER)
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "site-packages"),
                                   HETFLOW_WORKDIR=str(tmp_path / "work")))
    assert done.stdout.splitlines()[:2] == ["DONE None", "[{'size': 1, 'rank': 0}]"], done.stdout + done.stderr


@pytest.mark.parametrize("package", [
    "from mpi4py import MPI\nCOMM = MPI.COMM_WORLD\ndef world_size():\n    return COMM.Get_size()\n",
    "from mpi4py import MPI\nclass World:\n    comm = MPI.COMM_WORLD\n"
    "def world_size():\n    return World.comm.Get_size()\n",
    "def world_size():\n    from mpi4py import MPI\n    if not MPI.Is_initialized():\n        MPI.Init()\n"
    "    return MPI.COMM_WORLD.Get_size()\n",
], ids=["held-at-its-top", "held-in-a-class", "initialized-if-not"])
def test_an_installed_package_holding_mpi_from_its_import_finds_mpi_started(tmp_path: Path, package: str) -> None:
    """Red team 10: a package on the path with no version (not in the key) that holds ``MPI.COMM_WORLD`` from its
    own top (the fork server imported it before any rank put its deferring ``mpi4py.MPI`` in place) aborted the
    warm rank ("an MPI routine before initializing"); one asking ``MPI.Is_initialized()`` before ``MPI.Init()``
    was told False and its Init failed ("MPI_INIT more than once").  Cold, both ran."""
    lib = tmp_path / "site-packages" / "mpilib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(package)
    (tmp_path / "p.py").write_text(LAZY_MPI_USER)
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "site-packages"),
                                   HETFLOW_WORKDIR=str(tmp_path / "work")))
    assert done.stdout.splitlines()[:2] == ["DONE None", "[{'size': 1, 'rank': 0}]"], done.stdout + done.stderr


def test_warm_start_off_starts_one_rank_with_mpiexec(tmp_path: Path) -> None:
    pipe = hf.Pipeline("cold", pilot=COLD, workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["lineage"])(W.lineage)
    run = pipe.run()
    (one,) = _lineage(run)
    assert "hydra_pmi_proxy" in one["starter"] and not one["starter_is_parent"] and one["size"] == 1, one
    assert not (Path(run.run_dir) / "forkserver.log").exists()


def test_a_bad_warm_start_option_is_a_config_error(tmp_path: Path) -> None:
    bad = hf.PilotDescription(name="bad", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34,
                              options={"local": {"warm_start": "yes"}})
    pipe = hf.Pipeline("bad", pilot=bad, workdir=tmp_path)
    pipe.stage(outputs=["lineage"])(W.lineage)
    with pytest.raises(hf.HetflowError, match=r"options.local.warm_start must be true or false, got 'yes'"):
        pipe.run()


def test_a_warm_stage_writes_to_its_attempt_logs(tmp_path: Path) -> None:
    pipe = hf.Pipeline("logs", pilot=PILOT, workdir=tmp_path)
    pipe.stage()(W.prints)
    run = pipe.run()
    attempt = Path(run.run_dir) / "stages" / "prints" / "attempt-1"
    # the rank's own output (stdout and stderr) is rank-0.log, as under mpiexec (docs/observing.md)
    text = (attempt / "rank-0.log").read_text()
    assert "hello from prints" in text and "warning from prints" in text, text
    assert oct((attempt / "rank-0.log").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("how", ["sigstop", "loop"])
def test_a_hung_warm_stage_times_out_and_leaves_nothing(tmp_path: Path, how: str) -> None:
    pipe = hf.Pipeline("hung", pilot=PILOT, workdir=tmp_path)
    # 10 s: the rank must have started (and written its pid) before the limit ends it; on a slow CI machine
    # under three test workers a warm rank once took more than 3 s to start
    pipe.stage(timeout=10, params={"how": how})(W.hangs)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("hangs")
    assert stage.state == "TIMED_OUT" and "timeout of 10" in stage.error, stage
    assert time.time() - started < 40
    rank = int((Path(run.run_dir) / "stages" / "hangs" / "attempt-1" / "rank-0.pid").read_text())
    assert _alive([rank]) == []


def test_a_warm_rank_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    pipe = hf.Pipeline("killed", pilot=PILOT, workdir=tmp_path)
    pipe.stage()(W.kills_itself)
    run = pipe.run(check=False)
    stage = run.stage("kills_itself")
    assert stage.state == "FAILED" and stage.failed_rank == 0 and stage.signal == 9, stage
    assert stage.error.startswith("rank 0 of stage 'kills_itself' ended without a result (killed by signal 9"), \
        stage.error


@pytest.mark.parametrize("how", ["stdout", "group", "daemon"])
def test_what_a_warm_rank_leaves_behind_ends_with_its_stage(tmp_path: Path, how: str) -> None:
    pipe = hf.Pipeline("leaves", pilot=PILOT, workdir=tmp_path)
    # what is checked is that the stage ends without waiting for its limit (it would end TIMED_OUT there): a
    # bound of 15 s on the whole run failed on a slow CI machine under three test workers (16.7 and 19.5 s)
    pipe.stage(ranks=1, timeout=60, params={"how": how})(F.leaves_children)
    started = time.time()
    run = pipe.run()
    assert run.ok, run.stage("leaves_children")
    assert time.time() - started < 45
    child = int((Path(run.run_dir) / "stages" / "leaves_children" / "attempt-1" / "child-0.pid").read_text())
    assert _alive([child]) == []


def test_what_a_killed_warm_rank_leaves_behind_is_ended_by_its_server_and_its_neighbour_runs_on(
        tmp_path: Path) -> None:
    """A warm rank that dies by SIGKILL cannot end its daemon: the fork server, its witness, does, and
    records the death; the other stage it forked meanwhile runs to its end untouched."""
    pipe = hf.Pipeline("orphans", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=1, timeout=30, retries=0)(W.daemon_then_killed)
    pipe.stage(ranks=1, timeout=30, outputs=["beside"])(W.sleeps_beside)
    started = time.time()
    run = pipe.run(check=False)
    assert time.time() - started < 20
    killed = run.stage("daemon_then_killed")
    assert killed.state == "FAILED" and killed.signal == 9, killed
    attempt = Path(run.run_dir) / "stages" / "daemon_then_killed" / "attempt-1"
    rank = int((attempt / "rank-0.pid").read_text())
    assert (attempt / f"ended-{rank}.json").exists()  # the server's record, as a witness's
    assert _alive([int((attempt / "child-0.pid").read_text())]) == []
    assert run.stage("sleeps_beside").state == "DONE", run.stage("sleeps_beside")


def test_a_killed_fork_server_fails_its_running_stage_and_the_retry_starts_cold(tmp_path: Path) -> None:
    pipe = hf.Pipeline("lost", pilot=PILOT, workdir=tmp_path)
    pipe.stage(outputs=["slept"], retries=1)(W.sleeps)
    pipe.stage(inputs=["slept"], outputs=["lineage"])(W.lineage_after)

    def kill_the_server() -> None:
        deadline = time.time() + 60
        while time.time() < deadline:
            flags = list(tmp_path.glob("runs/*/stages/sleeps/attempt-1/sleeping"))
            if flags:
                rank = int((flags[0].parent / "rank-0.pid").read_text())
                server = W.starter(rank)
                assert "hetflow.tasks.forkserver" in server.cmdline()
                server.kill()
                return
            time.sleep(0.05)

    import threading

    killer = threading.Thread(target=kill_the_server, daemon=True)
    killer.start()
    run = pipe.run()
    killer.join()
    assert run.ok, run
    sleeps = run.stage("sleeps")
    assert sleeps.attempts == 2
    first = Path(run.run_dir) / "stages" / "sleeps" / "attempt-1"
    assert _alive([int((first / "rank-0.pid").read_text())]) == []
    (after,) = _lineage(run)
    assert "hydra_pmi_proxy" in after["starter"], after  # the server is gone: mpiexec from then on


def test_ctrl_c_during_a_warm_stage_leaves_no_process(tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text((
        "import sys, time\n"
        "sys.path.insert(0, {tests!r})\n"
        "import hetflow as hf\n"
        "import _fault_stages as F\n"
        "pipe = hf.Pipeline('ctrlc', pilot='local', workdir={workdir!r})\n"
        "@pipe.stage(outputs=['numbers'])\n"
        "def numbers(ctx):\n"
        "    return F.numbers(ctx)\n"
        "@pipe.stage(inputs=['numbers'], outputs=['slept'], params={{'sleep': 300}})\n"
        "def sleeper(ctx, table):\n"
        "    return F.sleeper(ctx, table)\n"
        "if __name__ == '__main__':\n"
        "    pipe.run()\n").format(tests=str(Path(__file__).parent), workdir=str(tmp_path / "w")))
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", str(tmp_path)))
    as_in_a_terminal = ("import signal, runpy, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                        "sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", as_in_a_terminal, str(script)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        flags: list[Path] = []
        while not flags and time.time() < deadline:
            flags = list((tmp_path / "w").glob("runs/*/stages/sleeper/attempt-1/sleeping-0"))
            time.sleep(0.05)
        assert flags, "the stage never started"
        attempt = flags[0].parent
        rank = int((attempt / "rank-0.pid").read_text())
        witness = psutil.Process(rank).ppid()
        servers = _servers(attempt.parents[2])
        assert len(servers) == 1
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.time() + 10
    while _alive([rank, witness, *servers]) and time.time() < deadline:
        time.sleep(0.1)
    assert _alive([rank, witness, *servers]) == []


SHADOWED = '''
import os

import psutil
import pyarrow as pa

import hetflow as hf

pipe = hf.Pipeline("shadowed")


def _who(ctx):
    rank = psutil.Process()
    starter = rank.parent() if os.getsid(0) == rank.pid else rank.parent().parent()  # a warm rank has no witness
    return pa.table({"rank": [ctx.rank], "hetflow": [hf.__file__], "pipeline": [hasattr(hf, "Pipeline")],
                     "starter": [" ".join(starter.cmdline()) if starter else ""]})


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": _who(ctx)}


@pipe.stage(ranks=2, inputs=["one"], outputs=["two"])
def two(ctx, one):
    return {"two": _who(ctx)}
'''


@pytest.mark.parametrize("shadow", ["empty", "package"])
def test_a_hetflow_directory_where_the_run_starts_does_not_shadow_hetflow_in_the_ranks(
        tmp_path: Path, shadow: str) -> None:
    """A directory named ``hetflow`` beside the script, where ``hetflow run`` is started (the clone itself,
    run from its parent), is not what the ranks import: one-rank stages and two-rank stages (mpiexec's
    stubs, :mod:`hetflow.tasks.warmranks`), both forked by the fork server, get hetflow's own package."""
    (tmp_path / "hetflow").mkdir()
    if shadow == "package":
        (tmp_path / "hetflow" / "__init__.py").write_text("SHADOW = True\n")
    (tmp_path / "flow.py").write_text(SHADOWED)
    done = subprocess.run([str(Path(sys.executable).parent / "hetflow"), "run", "flow.py", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = sorted((tmp_path / ".hetflow" / "runs").iterdir())
    rows = [row for name in ("one", "two") for row in
            open_dataset(runs[-1] / "datasets" / name).to_table().to_pylist()]
    assert len(rows) == 3
    for row in rows:
        assert row["pipeline"] and Path(row["hetflow"]).resolve() == Path(hf.__file__).resolve(), row
    assert "hetflow.tasks.forkserver" in rows[0]["starter"], rows[0]  # started warm, not after a failed server
    assert all("hetflow.tasks.forkserver" in row["starter"] for row in rows[1:]), rows  # under mpiexec, warm too


EARLY = '''
import json, sys
import pyarrow as pa
import hetflow as hf

seen = []


def _spawned(event, args):
    if event == "subprocess.Popen" and "hetflow.tasks.forkserver" in [str(a) for a in args[1] or ()]:
        seen.append(sorted(m for m in ("hetflow.orchestrator", "hetflow.store", "sqlalchemy") if m in sys.modules))


sys.addaudithook(_spawned)
pipe = hf.Pipeline("early", pilot=hf.PilotDescription(name="two-cores", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(outputs=["one"])
def one(ctx):
    return {"one": pa.table({"x": [1]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, workdir=sys.argv[1], check=False)
    print("SERVERS", json.dumps(seen), run.state)
'''


def test_a_blocking_run_starts_its_fork_server_before_it_imports_the_orchestrator(tmp_path: Path) -> None:
    """The server's imports (pyarrow, pandas, MPI's library) go on while the run imports the orchestrator
    and opens its store, not after: one server per run, spawned before either is imported, and adopted by
    the run (its log is the run's)."""
    (tmp_path / "flow.py").write_text(EARLY)
    done = subprocess.run([sys.executable, "flow.py", str(tmp_path / "work")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SERVERS [[]] DONE" in done.stdout, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    assert (run_dir / "forkserver.log").is_file()
    assert "fork server" not in done.stderr, done.stderr  # started warm: no fallback to mpiexec was needed


def test_a_fork_server_started_early_for_a_run_that_fails_to_start_is_ended(tmp_path: Path) -> None:
    """A run refused after its server was started (here: its work directory is a file) leaves no server."""
    (tmp_path / "flow.py").write_text(EARLY.replace('    run = pipe.run(', '''    try:
        pipe.run(''').replace('''    print("SERVERS", json.dumps(seen), run.state)''', '''    except hf.PipelineError as exc:
        print("REFUSED", exc)
    import psutil
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]
    print("SERVERS", json.dumps(seen), "LEFT", left)'''))
    (tmp_path / "work").write_text("not a directory")
    done = subprocess.run([sys.executable, "flow.py", str(tmp_path / "work")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REFUSED" in done.stdout and "work directory" in done.stdout, done.stdout
    assert "SERVERS [[]] LEFT []" in done.stdout, done.stdout  # one was started, and has ended


FROZEN = '''
import gc, sys
import pyarrow as pa
import hetflow as hf

seen = []
gc.callbacks.append(lambda phase, info: seen.append(gc.get_freeze_count()) if phase == "start" else None)
pipe = hf.Pipeline("frozen", pilot=hf.PilotDescription(name="two-cores", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(map_over={"i": list(range(300))}, outputs=["one"])
def one(ctx):
    return {"one": pa.table({"x": [ctx.item_index]})}


if __name__ == "__main__":
    if sys.argv[2] == "user":
        gc.freeze()
    before = gc.get_freeze_count()
    seen.clear()
    run = pipe.run(progress=False, workdir=sys.argv[1], check=False)
    print("RUN", run.state, "BEFORE", before, "DURING", max(seen) if seen else None, "AFTER", gc.get_freeze_count())
'''


@pytest.mark.parametrize("who", ["none", "user"])
def test_a_blocking_run_keeps_what_the_process_held_before_it_out_of_the_collectors_scans(
        tmp_path: Path, who: str) -> None:
    """During a blocking run, what the process held before it (the imports, the script's objects) is in the
    collector's permanent generation, and is put back when the run ends; objects the process froze itself
    stay frozen, and the run then freezes nothing."""
    (tmp_path / "flow.py").write_text(FROZEN)
    done = subprocess.run([sys.executable, "flow.py", str(tmp_path / "work"), who], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    at = words.index("RUN")
    state, before, during, after = words[at + 1], int(words[at + 3]), int(words[at + 5]), int(words[at + 7])
    assert state == "DONE", done.stdout
    if who == "none":
        assert before == 0 and during > 10_000 and after == 0, done.stdout
    else:  # the user's frozen objects stay frozen (some were freed meanwhile); none were added
        assert before > 0 and during <= before and 0 < after <= before, done.stdout


UNCOLLECTED = '''
import gc, sys
import pyarrow as pa
import hetflow as hf

during = []


def importing_the_orchestrator():
    orchestrator = sys.modules.get("hetflow.orchestrator")
    return "sqlalchemy" in sys.modules and not hasattr(orchestrator, "Orchestrator")


gc.callbacks.append(lambda phase, info: during.append(importing_the_orchestrator()) if phase == "start" else None)
pipe = hf.Pipeline("uncollected", pilot=hf.PilotDescription(name="two-cores", cores_per_node=2,
                                                             memory_per_node=2**33))


@pipe.stage(outputs=["seen"])
def seen(ctx):
    import gc
    import pandas  # loaded by the fork server before it forked this rank

    return {"seen": pa.table({"enabled": [gc.isenabled()], "frozen": [gc.get_freeze_count()],
                              "listed": [any(o is pandas.DataFrame for o in gc.get_objects())]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, workdir=sys.argv[1], check=False)
    print("RUN", run.state, "COLLECTIONS", sum(during), "OF", len(during), "ENABLED", gc.isenabled(),
          "FROZEN", gc.get_freeze_count())
'''


def test_a_run_imports_its_orchestrator_without_collections_and_a_warm_rank_collects_as_a_cold_one(
        tmp_path: Path) -> None:
    """The orchestrator's imports (SQLAlchemy's ORM, the store) run with the collector paused: no collection
    starts while they load (hetflow.tasks.collector); after the run the collector is on and nothing stays
    frozen.  The fork server imports its packages the same way and freezes them, but a rank it forks sees
    the collector as a cold start does: on, nothing frozen, the server's objects listed by ``gc``."""
    (tmp_path / "flow.py").write_text(UNCOLLECTED)
    done = subprocess.run([sys.executable, "flow.py", str(tmp_path / "work")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    at = words.index("RUN")
    assert words[at + 1] == "DONE", done.stdout + done.stderr
    collections, total = int(words[at + 3]), int(words[at + 5])
    assert collections == 0 and total > 0, done.stdout  # collections happened, none while the imports ran
    assert words[at + 7] == "True" and words[at + 9] == "0", done.stdout
    (rank,) = open_dataset(tmp_path / "work" / "runs" / os.listdir(tmp_path / "work" / "runs")[0] / "datasets" /
                           "seen").to_table().to_pylist()
    assert rank == {"enabled": True, "frozen": 0, "listed": True}, rank
