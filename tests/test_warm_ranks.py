"""Stages of several ranks on this machine start warm: ``mpiexec`` runs a stub per rank, the fork server
forks the rank (:mod:`hetflow.tasks.warmranks`), and every failure path is still the launcher's.

Real runs, real ``mpiexec``: the ranks say who started them (the fork server), reduce over their world,
and faults (a rank that raises, a SIGKILL, a timeout) end the stage with nothing left running.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _warm_rank_stages as R
import hetflow as hf
import pytest
from _procs import alive as _alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

PILOT = hf.PilotDescription(name="two-cores", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34)
SERVER = "hetflow.tasks.forkserver"


def _attempt(run: hf.RunStatus, stage: str) -> Path:
    return Path(run.run_dir) / "stages" / stage / "attempt-1"


def _pids(run: hf.RunStatus, stage: str) -> list[int]:
    return [int(p.read_text()) for p in _attempt(run, stage).glob("rank-*.pid")]


def _starters(run: hf.RunStatus, stage: str) -> list[str]:
    return [(_attempt(run, stage) / f"starter-{r}.txt").read_text() for r in (0, 1)]


def test_a_two_rank_stage_starts_warm_and_its_ranks_reduce_over_their_world(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-ranks", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, outputs=["reduced"])(R.allreduces)
    run = pipe.run()
    rows = sorted(run.dataset("reduced").to_table().to_pylist(), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], rows  # both ranks' partitions are there
    for rank, row in enumerate(rows):
        assert SERVER in row["starter"], row  # forked by the run's fork server, not started by mpiexec
        assert row["session_leader"] and row["size"] == 2 and row["total"] == 3, row
        assert row["pmi_rank"] == str(rank), row  # the launcher's own rank, through its PMI
        assert row["cpus"] == row["cores"] and len(row["cores"]) == 1, row  # pinned to its slot's core
        assert Path(row["cwd"]) == _attempt(run, "allreduces"), row
    assert rows[0]["cores"] != rows[1]["cores"], rows
    for rank in (0, 1):  # each rank's output in its own log, the launcher's apart
        assert f"rank {rank} says hello" in (_attempt(run, "allreduces") / f"rank-{rank}.log").read_text()


def test_three_warm_ranks_end_cleanly_stage_after_stage(tmp_path: Path) -> None:
    """A warm rank ends by ``os._exit``, which skips MPICH's C exit handler that tells Hydra the rank has
    finalized; without it Hydra took each rank's closed PMI socket for a crash and killed the ranks still
    ending (most stages of three ranks failed "on their way out", killed by signal 9)."""
    pilot = hf.PilotDescription(name="three-cores", cores_per_node=3, gpus_per_node=0, memory_per_node=2**34)
    pipe = hf.Pipeline("warm-three", pilot=pilot, workdir=tmp_path)
    for i in range(4):
        pipe.stage(name=f"reduces{i}", ranks=3, outputs=[f"out{i}"], params={"out": f"out{i}"})(R.reduces_into)
    run = pipe.run(check=False)
    assert run.ok, [(s.name, s.error) for s in run.stages]
    for i in range(4):
        rows = sorted(run.dataset(f"out{i}").to_table().to_pylist(), key=lambda r: r["rank"])
        assert [(r["rank"], r["total"]) for r in rows] == [(0, 6), (1, 6), (2, 6)], rows
        assert all(SERVER in r["starter"] for r in rows), rows
        assert "BAD TERMINATION" not in (_attempt(run, f"reduces{i}") / "stdout.log").read_text()


def test_a_warm_rank_that_raises_fails_the_stage_naming_it_and_the_other_rank_ends(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-raises", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, timeout=120, retries=0)(R.one_raises)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("one_raises")
    assert all(SERVER in s for s in _starters(run, "one_raises"))
    assert stage.state == "FAILED" and stage.failed_rank == 1, stage
    assert "ValueError" in stage.error and "rank one gives up" in stage.error, stage.error
    assert time.time() - started < 60  # rank 0 did not wait in its barrier until the timeout
    assert not _alive(_pids(run, "one_raises"))


def test_a_warm_rank_killed_by_sigkill_fails_the_stage_naming_it(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-killed", pilot=PILOT, workdir=tmp_path)
    pipe.stage(ranks=2, timeout=120, retries=0)(R.one_is_killed)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("one_is_killed")
    assert all(SERVER in s for s in _starters(run, "one_is_killed"))
    assert stage.state == "FAILED" and stage.failed_rank == 1 and stage.signal == 9, stage
    assert "rank 1" in stage.error and "signal 9" in stage.error, stage.error
    assert time.time() - started < 60
    assert not _alive(_pids(run, "one_is_killed"))
    # only the rank that died by itself is recorded as such: rank 0 was ended with its launcher
    ended = sorted(p.name for p in _attempt(run, "one_is_killed").glob("ended-*.json"))
    assert ended == [f"ended-{int((_attempt(run, 'one_is_killed') / 'rank-1.pid').read_text())}.json"], ended


def test_a_warm_two_rank_stage_that_times_out_ends_both_ranks(tmp_path: Path) -> None:
    pipe = hf.Pipeline("warm-timeout", pilot=PILOT, workdir=tmp_path)
    # 15 s: both ranks must have started (and written who started them) before the limit ends them; on a slow
    # CI machine under three test workers two warm ranks once took more than 5 s to start
    pipe.stage(ranks=2, timeout=15, retries=0)(R.both_hang)
    started = time.time()
    run = pipe.run(check=False)
    stage = run.stage("both_hang")
    assert all(SERVER in s for s in _starters(run, "both_hang"))
    assert stage.state == "TIMED_OUT" and "timeout of 15" in stage.error, stage
    assert time.time() - started < 50
    pids = _pids(run, "both_hang")
    assert len(pids) == 2 and not _alive(pids)


RESTARTING = '''
import os, sys, time
from pathlib import Path

import psutil
import pyarrow as pa
import hetflow as hf
import importlib

pipe = hf.Pipeline("restarting", pilot=hf.PilotDescription(name="four", cores_per_node=4, gpus_per_node=0,
                                                            memory_per_node=2**34))


@pipe.stage(ranks=2, timeout=120, outputs=["reduced"])
def reduces(ctx):
    starter = " ".join(psutil.Process(os.getppid()).cmdline())
    (Path(ctx.workdir) / f"starter-{ctx.rank}.txt").write_text(starter)
    log = Path(ctx.workdir).parents[2] / "forkserver.log"
    deadline = time.time() + 90
    while "restarts without" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
        time.sleep(0.05)
    return {"reduced": pa.table({"rank": [ctx.rank], "total": [ctx.comm.allreduce(ctx.rank + 1)],
                                 "starter": [starter]})}


@pipe.stage(outputs=["started"])
def waits(ctx):
    folder = Path(ctx.workdir).parents[1] / "reduces" / "attempt-1"
    while not all((folder / f"starter-{r}.txt").exists() for r in (0, 1)):
        time.sleep(0.05)
    return {"started": pa.table({"x": [1]})}


# not imported at the script's top (the server would load threadpkg with the script's imports, before any stage)
pipe.stage(inputs=["started"], outputs=["threads"])(importlib.import_module("other").threaded)

if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print(run.state, [(s.name, s.state, s.error) for s in run.stages])
    if run.ok:
        print(sorted(run.dataset("reduced").to_table().to_pylist(), key=lambda r: r["rank"]))
'''

OTHER = '''
import threadpkg
import pyarrow as pa


def threaded(ctx, started):
    return {"threads": pa.table({"loaded": ["threadpkg" in __import__("sys").modules]})}
'''


def test_warm_ranks_carry_on_when_the_fork_server_restarts_beside_them(tmp_path: Path) -> None:
    """Another stage's installed import leaves a thread running while a warm two-rank stage runs: the server
    replaces itself (``exec``, without the script's imports), and hands the ranks' stubs' connections to its
    successor, which reports the ranks' ends: the stage finishes as if nothing had happened."""
    site = tmp_path / "lib" / "site-packages" / "threadpkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("import threading, time\n"
                                      "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    (tmp_path / "flow.py").write_text(RESTARTING)
    (site.parent / "other.py").write_text(OTHER)  # installed: the server loads its imports for its stage
    done = subprocess.run([sys.executable, "flow.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False,
                          env=dict(os.environ, PYTHONPATH=str(site.parent), HETFLOW_WORKDIR=str(tmp_path / "w")))
    lines = done.stdout.splitlines()
    assert lines and lines[0].startswith("DONE"), done.stdout + done.stderr
    rows = ast.literal_eval(lines[1])
    assert [(r["rank"], r["total"]) for r in rows] == [(0, 3), (1, 3)], rows
    assert all(SERVER in r["starter"] for r in rows), rows
    (log,) = (tmp_path / "w" / "runs").glob("*/forkserver.log")
    assert "restarts without loading them" in log.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="a server of another user is started with user=, which needs root")
def test_a_rank_stub_sends_nothing_to_a_socket_another_user_serves(tmp_path: Path) -> None:
    """Before, a rank's stub sent its token, its whole environment (credentials among it) and its PMI socket to
    whatever listened at ``HETFLOW_WARM_SOCKET``: were the server's folder made where others can rename entries,
    another user could serve that path.  Now the stub checks the server's uid first and, another user's, sends
    nothing and starts the rank cold, saying why."""
    import shutil
    import stat
    import tempfile

    from hetflow.tasks import rankstub

    python = "/usr/bin/python3"  # the other user cannot reach this one (under /root with pyenv)
    if not os.path.exists(python):
        pytest.skip("no system python for the other user")
    shared = Path(tempfile.mkdtemp(prefix="hetflow-test-", dir="/tmp"))  # reachable by the other user
    shared.chmod(0o777)
    theirs, received = shared / "s", shared / "received"
    server = subprocess.Popen([python, "-c", textwrap.dedent(f"""
        import socket
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind({str(theirs)!r})
        listener.listen(1)
        print("ready", flush=True)
        conn, _ = listener.accept()
        conn.settimeout(20)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        open({str(received)!r}, "wb").write(data)
    """)], user=4242, cwd=shared, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        assert stat.S_ISSOCK(os.lstat(theirs).st_mode) and os.lstat(theirs).st_uid == 4242
        stub = subprocess.run([sys.executable, "-I", "-S", rankstub.__file__, str(tmp_path / "no-spec.json")],
                              env={**os.environ, "HETFLOW_WARM_SOCKET": str(theirs),
                                   "HETFLOW_WARM_TOKEN": "secret-token-1234", "AWS_SECRET_ACCESS_KEY": "mine"},
                              capture_output=True, text=True, timeout=60)
        server.wait(timeout=30)
        assert f"rank started cold: the socket {str(theirs)!r} is served by uid 4242" in stub.stderr, stub.stderr
        assert received.read_bytes() == b""  # the connection closed with nothing sent: no token, no environment
    finally:
        server.kill()
        shutil.rmtree(shared, ignore_errors=True)
