"""The witness records how a rank ended when it died by itself, and nothing when its group was killed.

Real processes: a child Python runs :func:`hetflow.tasks.witness.witnessed`
around a rank body, and the test kills the rank, or its whole process group as
a launcher does.
"""

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

from hetflow.tasks.protocol import AttemptFiles

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the witness needs fork")

BODY = """
import os, sys, time
from pathlib import Path
from hetflow.tasks.witness import witnessed
attempt = Path(sys.argv[1])

def rank():
    (attempt / "rank-0.pid").write_text(f"{os.getpid()}\\n")
    how = sys.argv[2]
    if how == "exit3":
        return 3
    if how == "ok":
        return 0
    if how == "leave":  # a child keeping our stdout, and a setsid daemon (double fork) keeping it too
        import subprocess
        (attempt / "child.pid").write_text(str(subprocess.Popen(["sleep", "300"]).pid))
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                (attempt / "daemon.pid").write_text(str(os.getpid()))
                time.sleep(300)
            os._exit(0)
        while not (attempt / "daemon.pid").exists():
            time.sleep(0.01)
        return 0
    time.sleep(60)  # until killed
    return 0

sys.exit(witnessed(attempt, rank))
"""


def _start(tmp_path: Path, how: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BODY, str(tmp_path), how], start_new_session=True)


def _rank_pid(tmp_path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    path = tmp_path / "rank-0.pid"
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.01)
    return int(path.read_text())


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in AttemptFiles(tmp_path).ended_records()]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM])
def test_a_rank_killed_alone_is_recorded_and_the_witness_ends_the_same_way(tmp_path: Path, sig: int) -> None:
    proc = _start(tmp_path, "sleep")
    pid = _rank_pid(tmp_path)
    os.kill(pid, sig)
    assert proc.wait(30) == -sig  # the launcher sees what it would have seen without a witness
    [record] = _records(tmp_path)
    assert record["pid"] == pid and os.WIFSIGNALED(record["status"]) and os.WTERMSIG(record["status"]) == sig
    assert AttemptFiles(tmp_path).ended_alone({0: pid}) == {0: (record["status"], record["ended"])}
    assert AttemptFiles(tmp_path).ended_alone({0: pid + 1}) == {}  # another attempt's pid: not this rank


def test_an_exit_code_is_recorded_and_a_clean_exit_is_not(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "good").mkdir()
    assert _start(tmp_path / "bad", "exit3").wait(30) == 3
    [record] = _records(tmp_path / "bad")
    assert os.WIFEXITED(record["status"]) and os.WEXITSTATUS(record["status"]) == 3
    assert _start(tmp_path / "good", "ok").wait(30) == 0
    assert _records(tmp_path / "good") == []


def test_a_group_killed_by_its_launcher_leaves_no_record(tmp_path: Path) -> None:
    for attempt in range(20):  # the launcher's kill of the group must never look like a rank dying alone
        folder = tmp_path / str(attempt)
        folder.mkdir()
        proc = _start(folder, "sleep")
        pid = _rank_pid(folder)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        assert _records(folder) == [], attempt
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the rank outlived its group's SIGKILL"
            time.sleep(0.01)


def test_a_rank_whose_witness_is_killed_alone_does_not_outlive_it(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    proc = _start(tmp_path, "sleep")
    pid = _rank_pid(tmp_path)
    proc.kill()  # the witness only
    proc.wait(30)
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the rank outlived its witness"
        time.sleep(0.01)


def test_what_the_rank_leaves_behind_ends_before_the_witness_does(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_CHILD_SUBREAPER is Linux only")
    proc = subprocess.Popen([sys.executable, "-c", BODY, str(tmp_path), "leave"], stdout=subprocess.PIPE,
                            start_new_session=True)
    started = time.monotonic()
    proc.communicate(timeout=30)  # EOF on the rank's stdout: nobody holds it any more
    assert proc.returncode == 0 and time.monotonic() - started < 20
    left = [int((tmp_path / name).read_text()) for name in ("child.pid", "daemon.pid")]
    assert not [pid for pid in left if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_only_mpich_segments_a_rank_recorded_and_this_user_owns_are_removed(tmp_path: Path) -> None:
    from hetflow.tasks import shm

    maps = ("7f1c2a000000-7f1c2a305000 rw-s 00000000 00:19 4242   /dev/shm/mpich_shm_1058edaa_0\n"
            "7f1c2a305000-7f1c2a306000 rw-s 00000000 00:19 4243   /dev/shm/mpich_vci_1058edaa_0\n"
            "7f1c2b000000-7f1c2b001000 rw-s 00000000 00:19 4244   /dev/shm/mpich_shm_2f_1 (deleted)\n"
            "7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0 \n"
            "7f1c2d000000-7f1c2d001000 rw-s 00000000 00:19 4245   /dev/shm/PostgreSQL.1096881236\n"
            "7ffd5b3e1000-7ffd5b402000 rw-p 00000000 00:00 0                          [stack]\n")
    assert shm.mapped_segments(maps) == ["/dev/shm/mpich_shm_1058edaa_0", "/dev/shm/mpich_vci_1058edaa_0"]
    # removal: real files of this process's own MPI world (a 2-rank mpiexec would make them; here by hand)
    mine = Path(f"/dev/shm/mpich_shm_{os.getpid():x}_9")
    mine.write_bytes(b"x")
    record = tmp_path / "shm-1.txt"
    record.write_text(f"{mine}\n/dev/shm/PostgreSQL.1\n/tmp/mpich_shm_1_0\n/dev/shm/mpich_shm_{os.getpid():x}_8\n")
    try:
        assert shm.remove_recorded(record) == [str(mine)] and not mine.exists()
    finally:
        mine.unlink(missing_ok=True)
    assert shm.remove_recorded(tmp_path / "none.txt") == []
