"""Two ``hetflow resume RUN`` at once, and a third while the first runs: one owner, nothing of it touched.

Real processes through the CLI on real SQLite, as two terminals would do it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import os, time
from pathlib import Path
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("race")
HERE = Path(__file__).parent


@pipe.stage(outputs=["numbers"])
def slow(ctx):
    attempt = HERE / "attempts"
    attempt.write_text(attempt.read_text() + "x" if attempt.exists() else "x")
    if len(attempt.read_text()) == 1:
        raise RuntimeError("the first run fails, so there is something to resume")
    (HERE / "pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (HERE / "release").exists() and time.monotonic() < deadline:  # alive until the test has looked
        time.sleep(0.05)
    return {"numbers": pa.table({"x": [1, 2, 3]})}
'''


def _cli(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*HETFLOW, *args, "--workdir", "w", "--no-progress"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_resumes_one_owner_and_a_late_one_leaves_the_live_rank_alone(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(SCRIPT)
    first = _cli("run", "p.py", cwd=tmp_path)
    first.communicate(timeout=120)
    assert first.returncode == 1
    run_id = subprocess.run([*HETFLOW, "runs", "--workdir", "w"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60).stdout.split()[0]
    both = [_cli("resume", run_id, cwd=tmp_path) for _ in range(2)]
    deadline = time.time() + 60
    while not (tmp_path / "pid").exists():
        assert time.time() < deadline, [p.poll() for p in both]
        time.sleep(0.1)
    rank = int((tmp_path / "pid").read_text())
    late = _cli("resume", run_id, cwd=tmp_path)
    _, late_err = late.communicate(timeout=60)
    assert late.returncode == 2 and "held by orchestrator" in late_err, late_err
    assert psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE, \
        "the refused resume touched the owner's rank"
    deadline = time.time() + 120
    while all(p.poll() is None for p in both):  # the refused one ends; the owner's rank waits for release
        assert time.time() < deadline, "neither concurrent resume was refused"
        time.sleep(0.1)
    (tmp_path / "release").touch()
    outcomes = [(p.communicate(timeout=120), p.returncode) for p in both]
    codes = sorted(code for _, code in outcomes)
    assert codes == [0, 2], outcomes  # one finished the run, the other was refused naming the holder
    refused = next(err for (_, err), code in outcomes if code == 2)
    assert "held by orchestrator" in refused
    assert (tmp_path / "attempts").read_text() == "xx"  # the stage ran once more, not twice
    shown = subprocess.run([*HETFLOW, "status", run_id, "--workdir", "w"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
