"""Warm stages: the fork server loads a script's installed imports once; each stage executes the script itself.

Real ``python script.py`` runs of scripts as users write them.  What the script makes at its top (an
unseeded random generator, a temporary directory, module state) must be each stage's own, as in a fresh
process; an installed import that leaves a thread running must not be forked from; a script that fails in
workers fails its stage with its own error; a script edited during its run never runs in its new version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hetflow.operators.dataset import open_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")

HEAD = '''
import os
import sys
import tempfile
import numpy as np
import hetflow as hf
import pyarrow as pa

EXECUTED_BY = os.getpid()
SEEN = []
RNG = np.random.default_rng()  # unseeded: a fresh process draws its own numbers
TMP = tempfile.TemporaryDirectory()  # removed when the process that made it ends
pipe = hf.Pipeline("warm-script", pilot=hf.PilotDescription(
    name="two", cores_per_node=2, memory_per_node=2**33,
    options={"local": {"warm_start": os.environ.get("COLD") != "1"}}))
'''

STAGES = '''
def facts(name):
    SEEN.append(name)
    with open(os.path.join(TMP.name, name), "w") as fh:  # the directory must still be there
        fh.write(name)
    return pa.table({"seen": [list(SEEN)], "mine": [EXECUTED_BY == os.getpid()], "draw": [float(RNG.random())],
                     "global_draw": [float(np.random.rand())], "threadpkg": ["threadpkg" in sys.modules]})


@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": facts("first")}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    return {"b": facts("second")}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state)
    print("ERROR", run.stage("first").error, run.stage("second").error)
'''


def _run(tmp_path: Path, top: str = "", cold: bool = False, script: str | None = None,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "script.py").write_text(script or textwrap.dedent(HEAD) + textwrap.dedent(top) + STAGES)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, COLD="1" if cold else "0", **(env or {})))
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    return done, run_dir


def _row(run_dir: Path, name: str) -> dict:
    (row,) = open_dataset(run_dir / "datasets" / name).to_table().to_pylist()
    return row


def test_what_the_script_makes_at_its_top_is_each_warm_stages_own(tmp_path: Path) -> None:
    """Before, the server executed the script and forked the stages from it: both drew the same "random"
    numbers and the first to end removed the temporary directory under the second."""
    done, run_dir = _run(tmp_path, top='print("hello from the top of the script", flush=True)\n')
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    a, b = _row(run_dir, "a"), _row(run_dir, "b")
    assert a["mine"] and b["mine"], (a, b)  # each stage executed the script itself
    assert a["seen"] == ["first"] and b["seen"] == ["second"], (a, b)
    assert a["draw"] != b["draw"], (a, b)
    assert a["global_draw"] != b["global_draw"], (a, b)  # numpy's global generator, loaded by the server
    assert "hello from the top of the script" not in (run_dir / "forkserver.log").read_text()


def test_an_installed_import_that_leaves_a_thread_running_is_not_forked_from(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "site-packages" / "threadpkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("import threading, time\n"
                                      "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    done, run_dir = _run(tmp_path, top="import threadpkg\n", env={"PYTHONPATH": str(site.parent)})
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    a, b = _row(run_dir, "a"), _row(run_dir, "b")
    assert a["threadpkg"] and b["threadpkg"] and a["mine"] and b["mine"], (a, b)
    log = (run_dir / "forkserver.log").read_text()
    assert "left 1 thread(s) running" in log and "restarts without loading them" in log, log


def test_a_script_that_fails_in_workers_fails_its_stage_with_the_scripts_own_error(tmp_path: Path) -> None:
    top = 'if os.environ.get("HETFLOW_WORKER"):\n    raise RuntimeError("this script refuses to run in a worker")\n'
    done, _ = _run(tmp_path, top=top)
    assert "STATE FAILED" in done.stdout, done.stdout + done.stderr
    assert "RuntimeError: this script refuses to run in a worker" in done.stdout, done.stdout


EDITS_ITSELF = """
_first = first


def first(ctx):  # as a user editing the script while the run goes on: the file changes under the run
    with open(__file__, "a") as fh:
        fh.write("\\\\n# edited while the run went on\\\\n")
    return _first(ctx)


pipe.stages["first"] = pipe.stages["first"].__class__(**{**vars(pipe.stages["first"]), "func": first})
"""


@pytest.mark.parametrize("cold", [False, True])
def test_a_script_edited_during_its_run_is_never_executed_in_its_new_version(tmp_path: Path, cold: bool) -> None:
    """The stages' keys are made from the version the run started with: a stage that would execute the
    edited file refuses, naming the script, instead of storing the new code's result under the old key."""
    script = textwrap.dedent(HEAD) + STAGES.replace('if __name__ == "__main__":',
                                                    EDITS_ITSELF + '\nif __name__ == "__main__":')
    done, _ = _run(tmp_path, cold=cold, script=script)
    assert "edited while the run went on" in (tmp_path / "script.py").read_text()
    assert "STATE FAILED" in done.stdout, done.stdout + done.stderr
    assert "was changed after this run started" in done.stdout, done.stdout


def _package(tmp_path: Path, name: str, source: str) -> dict[str, str]:
    """An installed package (a ``site-packages`` directory on ``PYTHONPATH``): the env that finds it."""
    package = tmp_path / "lib" / "site-packages" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": str(package.parent)}


EXITPKG = """
import atexit, os, shutil, tempfile
CACHE = tempfile.mkdtemp(prefix="exitpkg-")  # as matplotlib makes its config dir when $HOME is read-only
atexit.register(shutil.rmtree, CACHE, True)
SCRATCH = tempfile.TemporaryDirectory(prefix="exitpkg-")  # removed at exit by a weakref.finalize
"""

USES_EXITPKG = HEAD + '''
import exitpkg


def note(name):
    for folder in (exitpkg.CACHE, exitpkg.SCRATCH.name):  # what the import made must still be there
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(name)
    print("FOLDERS", exitpkg.CACHE, exitpkg.SCRATCH.name, flush=True)
    return pa.table({"n": [1]})


@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": note("first")}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    return {"b": note("second")}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state)
    print("ERROR", run.stage("first").error, run.stage("second").error)
'''


def test_an_installed_imports_exit_handlers_run_once_in_the_server_not_at_each_warm_stages_end(
        tmp_path: Path) -> None:
    """Before, each warm stage ran at its end the ``atexit`` handlers and finalizers that the package's import
    registered in the server: the first stage to end removed the server's directories, and the second
    failed with FileNotFoundError (it passes cold, where each rank makes its own)."""
    done, run_dir = _run(tmp_path, script=textwrap.dedent(USES_EXITPKG),
                         env=_package(tmp_path, "exitpkg", EXITPKG))
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    logs = "".join(p.read_text() for p in run_dir.glob("stages/*/attempt-1/rank-0.log"))
    folders = {line.split(maxsplit=1)[1] for line in logs.splitlines() if line.startswith("FOLDERS ")}
    assert len(folders) == 1, logs  # both stages used the server's: loaded once, shared
    assert not any(Path(f).exists() for f in folders.pop().split()), "the server removes them when it ends"


BLOCKPKG = """
import time
with open("/proc/self/cmdline", "rb") as fh:
    if b"script.py" not in fh.read().split(b"\\0"):  # blocks in a rank or the fork server, not in `python script.py`
        time.sleep(600)
"""

BLOCKS = HEAD + '''
import blockpkg


@pipe.stage(outputs=["a"], timeout=3)
def first(ctx):
    return {"a": pa.table({"n": [1]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state, run.stage("first").state)
    print("ERROR", run.stage("first").error)
'''


@pytest.mark.parametrize("cold", [False, True])
def test_an_installed_import_that_blocks_is_ended_by_the_stage_timeout(tmp_path: Path, cold: bool) -> None:
    """Before, the fork server blocked in its import of the package before forking the task, and the stage's
    timeout of 3 s never started: the run waited for good.  Cold, the rank's own import is timed out."""
    done, run_dir = _run(tmp_path, cold=cold, script=textwrap.dedent(BLOCKS),
                         env=_package(tmp_path, "blockpkg", BLOCKPKG))
    assert "STATE FAILED TIMED_OUT" in done.stdout, done.stdout + done.stderr
    assert "exceeded its timeout of 3s" in done.stdout, done.stdout
    if not cold:
        log = (run_dir / "forkserver.log").read_text()
        assert "took longer than the stage's timeout of 3s" in log, log


HALFCORE = """
REGISTERED = set()


def register(name):  # as a C extension's set-up, once per process (torch: "already has a docstring")
    if name in REGISTERED:
        raise RuntimeError(f"{name} is set up already in this process")
    REGISTERED.add(name)
"""

HALFPKG = """
import time
import halfcore
halfcore.register("halfpkg")
with open("/proc/self/cmdline", "rb") as fh:
    if b"script.py" not in fh.read().split(b"\\0"):  # slow in a rank or the fork server, not in `python script.py`
        time.sleep(4)
"""

HALF = HEAD + '''
import halfpkg


@pipe.stage(outputs=["a"], timeout=2)
def first(ctx):
    return {"a": pa.table({"n": [1]})}


@pipe.stage(outputs=["b"])
def second(ctx):
    return {"b": pa.table({"n": [2]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.stage("first").state, run.stage("second").state)
    print("ERROR", run.stage("second").error)
'''


@pytest.mark.parametrize("cold", [False, True])
def test_an_import_the_stage_timeout_stopped_in_the_server_does_not_break_the_next_stages(
        tmp_path: Path, cold: bool) -> None:
    """Before, the fork server stopped at the first stage's timeout of 2 s in the middle of a slow import
    (``import torch`` on a cold file system) and went on forking from the half-imported state: the second
    stage (no timeout) then failed in its own import of the package (torch: ``module 'torch' has no attribute
    'distributed'``), where cold it ran.  Now the server restarts without the script's imports."""
    _package(tmp_path, "halfcore", HALFCORE)
    done, run_dir = _run(tmp_path, cold=cold, script=textwrap.dedent(HALF),
                         env=_package(tmp_path, "halfpkg", HALFPKG))
    assert "STATE TIMED_OUT DONE" in done.stdout, done.stdout + done.stderr
    assert _row(run_dir, "b") == {"n": 2}
    if not cold:
        log = (run_dir / "forkserver.log").read_text()
        assert "took longer than the stage's timeout of 2s; stopped, the server restarts" in log, log


def test_a_run_interrupted_while_the_server_blocks_in_an_import_leaves_no_process(tmp_path: Path) -> None:
    """Before, Ctrl-C while the fork server was stuck in a stage's import (no timeout to bound it) ended the
    server at shutdown, and the task it had been asked for was then started cold, through mpiexec, after
    its cancel: it outlived the run, blocked in the same import."""
    import psutil

    (tmp_path / "script.py").write_text(textwrap.dedent(BLOCKS).replace(", timeout=3)", ")"))
    env = dict(os.environ, COLD="0", **_package(tmp_path, "blockpkg", BLOCKPKG))
    run = subprocess.Popen([sys.executable, "script.py"], cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".hetflow/runs/*/stages/first/attempt-1/spec.json")):
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()[0]
            time.sleep(0.2)
        time.sleep(2.0)  # the server is in the import now
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
        assert "interrupted; running tasks were stopped" in out, out
        time.sleep(2.0)
        left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
        assert not left, [p.info["cmdline"] for p in left]
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                proc.kill()
        if run.poll() is None:
            run.kill()


FILEPKG = """
import os
import socket
HERE = os.path.dirname(__file__)
with open(os.path.join(HERE, "table.txt"), "w") as fh:
    fh.write("0123456789" * 10)
TABLE = open(os.path.join(HERE, "table.txt"))  # read lazily, as a package holding a lookup table open does
RAW = os.open(os.path.join(HERE, "table.txt"), os.O_RDONLY)
LINK, PEER = socket.socketpair()  # a connection made at import (a database client, a message queue)
"""

USES_FILEPKG = HEAD + '''
import filepkg


def take():
    filepkg.PEER.sendall(b"x" * 3)
    got = filepkg.LINK.recv(100, socket.MSG_DONTWAIT)
    return pa.table({"text": [len(filepkg.TABLE.read())], "raw": [len(os.read(filepkg.RAW, 1000))],
                     "link": [len(got)]})


@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": take()}


@pipe.stage(outputs=["b"])
def second(ctx):
    taken = take()
    filepkg.PEER.sendall(b"y" * 5)  # left unread: a shared connection would hand it to the next task
    return {"b": taken}


@pipe.stage(inputs=["a", "b"], outputs=["c"])
def third(ctx, a, b):
    return {"c": take()}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state)
    print("ERROR", run.stage("first").error, run.stage("second").error)
'''


@pytest.mark.parametrize("cold", [False, True])
def test_files_and_connections_an_installed_import_opens_are_each_warm_stages_own(tmp_path: Path,
                                                                                    cold: bool) -> None:
    """Before, the server imported the package once and forked every stage from it: the stages shared one
    file offset (the second stage read 0 bytes of the file the first had read to its end, and stored that)
    and one connection (a stage received what another had sent).  Cold, each rank opens its own."""
    script = textwrap.dedent(USES_FILEPKG).replace("import os\n", "import os\nimport socket\n", 1)
    done, run_dir = _run(tmp_path, cold=cold, script=script, env=_package(tmp_path, "filepkg", FILEPKG))
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    for name in ("a", "b", "c"):
        assert _row(run_dir, name) == {"text": 100, "raw": 100, "link": 3}, (name, _row(run_dir, name))
    if not cold:
        log = (run_dir / "forkserver.log").read_text()
        assert "left 4 file(s), socket(s) or pipe(s) open" in log and "restarts without loading them" in log, log
