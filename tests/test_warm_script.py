"""The fork server executes a pipeline script once per run, and each warm stage is forked from it.

Real ``python script.py`` runs of scripts as users write them: what the script does at its top
(prints, starts a thread, fails in workers, keeps module state) must not change what a stage sees
or break the server's protocol, and what one stage changes must not reach the next.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetflow.operators.dataset import open_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

HEAD = '''
import os
import sys
import threading
import time
import hetflow as hf
import pyarrow as pa

EXECUTED_BY = os.getpid()
SEEN = []
pipe = hf.Pipeline("warm-script", pilot=hf.PilotDescription(
    name="two", cores_per_node=2, memory_per_node=2**33,
    options={"local": {"warm_start": os.environ.get("COLD") != "1"}}))
'''

STAGES = '''
@pipe.stage(outputs=["a"])
def first(ctx):
    SEEN.append("first")
    return {"a": pa.table({"seen": [list(SEEN)], "mine": [EXECUTED_BY == os.getpid()], "by": [EXECUTED_BY]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    SEEN.append("second")
    return {"b": pa.table({"seen": [list(SEEN)], "mine": [EXECUTED_BY == os.getpid()], "by": [EXECUTED_BY]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state)
    print("ERROR", run.stage("first").error)
'''


def _run(tmp_path: Path, top: str = "", cold: bool = False) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "script.py").write_text(textwrap.dedent(HEAD) + textwrap.dedent(top) + STAGES)
    env = dict(os.environ, COLD="1" if cold else "0")
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    return done, run_dir


def _row(run_dir: Path, name: str) -> dict:
    (row,) = open_dataset(run_dir / "datasets" / name).to_table().to_pylist()
    return row


def test_stages_share_one_execution_and_nothing_one_changes_reaches_the_next(tmp_path: Path) -> None:
    done, run_dir = _run(tmp_path, top='print("hello from the top of the script", flush=True)\n')
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    a, b = _row(run_dir, "a"), _row(run_dir, "b")
    assert a["seen"] == ["first"] and b["seen"] == ["second"], (a, b)  # module state of the script: forked, not shared
    assert not a["mine"] and not b["mine"] and a["by"] == b["by"], (a, b)  # executed once, by the fork server
    log = (run_dir / "forkserver.log").read_text()
    assert "hello from the top of the script" in log  # the script's output went to the server's log, not its pipe


def test_a_script_that_leaves_a_thread_running_is_executed_by_each_stage_instead(tmp_path: Path) -> None:
    top = 'threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n'
    done, run_dir = _run(tmp_path, top=top)
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    a, b = _row(run_dir, "a"), _row(run_dir, "b")
    assert a["mine"] and b["mine"], (a, b)  # each stage executed the script itself, in its own process
    assert a["seen"] == ["first"] and b["seen"] == ["second"]
    log = (run_dir / "forkserver.log").read_text()
    assert "left 1 thread(s) running" in log and "restarts without executing scripts" in log, log


def test_a_script_that_fails_in_workers_fails_its_stage_with_the_scripts_own_error(tmp_path: Path) -> None:
    top = 'if os.environ.get("HETFLOW_WORKER"):\n    raise RuntimeError("this script refuses to run in a worker")\n'
    done, run_dir = _run(tmp_path, top=top)
    assert "STATE FAILED" in done.stdout, done.stdout + done.stderr
    assert "RuntimeError: this script refuses to run in a worker" in done.stdout, done.stdout
    log = (run_dir / "forkserver.log").read_text()
    assert "not executed before forking (RuntimeError: this script refuses to run in a worker)" in log, log


EDITS_ITSELF = """
_first = first


def first(ctx):  # as a user editing the script while the run goes on: the file changes under the run
    with open(__file__, "a") as fh:
        fh.write("\\n# edited while the run went on\\n")
    return _first(ctx)


pipe.stages["first"] = pipe.stages["first"].__class__(**{**vars(pipe.stages["first"]), "func": first})
"""


@pytest.mark.parametrize("cold", [False, True])
def test_a_script_edited_during_its_run_is_never_executed_in_its_new_version(tmp_path: Path, cold: bool) -> None:
    """The stages' keys are made from the version the run started with.  A warm stage is forked from that
    version (the fork server executed it before the edit); a cold one would execute the file as it is now,
    so it refuses, naming the script, instead of storing the new code's result under the old code's key."""
    (tmp_path / "script.py").write_text(textwrap.dedent(HEAD) + STAGES.replace(
        'if __name__ == "__main__":', EDITS_ITSELF + '\nif __name__ == "__main__":'))
    env = dict(os.environ, COLD="1" if cold else "0")
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert "edited while the run went on" in (tmp_path / "script.py").read_text()
    if cold:
        assert "STATE FAILED" in done.stdout, done.stdout + done.stderr
        (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
        status = subprocess.run([sys.executable, "-m", "hetflow.cli", "status", "--json"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120, check=False)
        assert "was changed after this run started" in status.stdout, status.stdout
    else:
        assert "STATE DONE" in done.stdout, done.stdout + done.stderr
