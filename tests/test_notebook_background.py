"""Runs from a notebook, second part (issue 30): ``pipe.run(wait=False)`` in a real kernel, the run shown as a
table in the notebook, and ``hetflow resume`` from a shell for a run whose stages were shipped by value.

Every notebook here executes in a real IPython kernel (nbclient), one cell at a time, so that the test can
look at the run from outside (``hetflow status``, the run's processes) between cells.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from hetflow.operators.dataset import Dataset

HETFLOW = str(Path(sys.executable).parent / "hetflow")


class Kernel:
    """A notebook executed cell by cell in a real kernel started in ``where``."""

    def __init__(self, client: Any, notebook: Any) -> None:
        self.client, self.notebook = client, notebook

    def run(self, source: str) -> dict[str, Any]:
        """Execute ``source`` as the next cell: ``{"stdout": ..., "html": [...], "error": ...}``."""
        import nbformat

        cell = nbformat.v4.new_code_cell(source)
        self.notebook.cells.append(cell)
        self.client.execute_cell(cell, len(self.notebook.cells) - 1)
        outputs = cell.get("outputs", [])
        return {"stdout": "".join(o["text"] for o in outputs if o.get("name") == "stdout"),
                "html": [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})],
                "text": [o["data"]["text/plain"] for o in outputs if "text/plain" in o.get("data", {})]}


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        yield Kernel(client, notebook)


GATED = '''
import os, time, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("gated")
STARTED, RELEASE = {started!r}, {release!r}

@pipe.stage(outputs=["a"], params={{"k": 1}})
def first(ctx):
    return {{"a": pa.table({{"value": [ctx.params["k"]]}})}}

@pipe.stage(inputs=["a"], outputs=["b"], params={{"k": 1}})
def second(ctx, a):
    with open(STARTED + "tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(STARTED + "tmp", STARTED + str(ctx.params["k"]))
    while not os.path.exists(RELEASE) and not os.environ.get("QUICK"):
        time.sleep(0.05)
    return {{"b": pa.table({{"value": [a["value"][0].as_py() * 10]}})}}

def started(k=1):
    while not os.path.exists(STARTED + str(k)):
        time.sleep(0.05)
    return int(open(STARTED + str(k)).read())
'''


def _gated(tmp_path: Path) -> str:
    return GATED.format(started=str(tmp_path / "started-"), release=str(tmp_path / "release"))


def test_a_run_started_with_wait_false_goes_on_while_the_kernel_runs_other_cells(tmp_path: Path,
                                                                                   kernel: Kernel) -> None:
    kernel.run(_gated(tmp_path))
    began = kernel.run("handle = pipe.run(workdir='w', wait=False)\nprint(type(handle).__name__, handle.done())")
    assert began["stdout"] == "RunHandle False\n"

    # the kernel answers while the run goes on: the first stage's output is readable, the second's is not yet
    during = kernel.run(
        "started()\nstatus = handle.status()\n"
        "print(status.state, [(s.name, s.state) for s in status.stages])\n"
        "print(handle.dataset('a').to_table()['value'].to_pylist())\n"
        "try:\n    handle.dataset('b')\nexcept KeyError as exc:\n    print(exc.args[0])\n"
        "try:\n    handle.wait(timeout=0.2)\nexcept TimeoutError as exc:\n    print(exc)\n"
        "print(handle.run_id)")
    run_id = during["stdout"].splitlines()[-1]
    assert during["stdout"].splitlines()[:-1] == [
        "RUNNING [('first', 'DONE'), ('second', 'RUNNING')]",
        "[1]",
        f"run {run_id}: dataset 'b' is not committed: its stage 'second' is RUNNING (wait() for the run, or ask "
        "again later)",
        f"run {run_id} is still running after 0.2 s; wait() again, or stop it with cancel()",
    ]
    # status() is what `hetflow status` says of the run
    shell = subprocess.run([HETFLOW, "status", run_id, "--json", "--workdir", "w"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert shell.returncode == 1, shell.stderr  # a run that has not ended DONE
    mine = kernel.run("import json\nprint(json.dumps(handle.status().to_json()))")
    assert json.loads(mine["stdout"]) == json.loads(shell.stdout)

    shown = kernel.run("handle")  # the handle as the cell's value: a table of its stages
    assert len(shown["html"]) == 1
    assert re.search(r"<td[^>]*>second</td><td[^>]*><span[^>]*>RUNNING</span></td><td[^>]*>runs</td>"
                     r"<td[^>]*>no earlier execution</td>", shown["html"][0]), shown["html"][0]
    assert shown["text"][0].startswith(f"RunHandle('{run_id}', pipeline='gated', state=RUNNING)\n")

    ended = kernel.run("open(RELEASE, 'w').close()\nrun = handle.wait()\n"
                       "print(run.state, handle.done(), run.dataset('b').to_table()['value'].to_pylist())")
    assert ended["stdout"] == "DONE True [10]\n"
    table = kernel.run("run")["html"][0]
    assert re.search(r"<td[^>]*>first</td><td[^>]*><span[^>]*>DONE</span></td><td[^>]*>ran</td>", table), table


def test_cancel_stops_a_background_run_resumably_and_the_notebook_resumes_it(tmp_path: Path,
                                                                              kernel: Kernel) -> None:
    kernel.run(_gated(tmp_path))
    out = kernel.run("handle = pipe.run(workdir='w', wait=False)\nprint(started(), handle.run_id)")["stdout"]
    rank_pid, run_id = out.split()
    assert psutil.pid_exists(int(rank_pid))
    cancelled = kernel.run(
        "print(handle.cancel(), handle.done(), handle.status().state)\n"
        "print([(s.name, s.state) for s in handle.status().stages])\n"
        "try:\n    handle.wait()\nexcept hf.RunFailed as exc:\n    print(exc)\n"
        "print(handle.cancel())")
    assert cancelled["stdout"] == (
        "True True CANCELLED\n[('first', 'DONE'), ('second', 'CANCELLED')]\n"
        f"run {run_id} ended CANCELLED; stage second CANCELLED (stage 'second' was cancelled); resume it with: "
        f"pipe.run(run_id='{run_id}') from the same code, or from a shell: hetflow resume {run_id} --workdir w\n"
        "False\n")
    assert not _alive(int(rank_pid))  # the stage's rank was stopped, not left running
    resumed = kernel.run("os.environ['QUICK'] = '1'\nrun = pipe.run(workdir='w', run_id=handle.run_id)\n"
                         "print(run.state, [(s.name, s.state, s.attempts) for s in run.stages])")
    assert resumed["stdout"] == "DONE [('first', 'DONE', 1), ('second', 'DONE', 2)]\n"


def test_two_background_runs_of_one_kernel_run_at_once_each_with_its_own_records(tmp_path: Path,
                                                                                  kernel: Kernel) -> None:
    kernel.run(_gated(tmp_path))
    both = kernel.run("one = pipe.run(workdir='w', wait=False)\n"
                      "two = pipe.run(workdir='w', wait=False, params={'k': 2})\n"
                      # one run's second stage holds the core (the machine-wide ledger) until released: the
                      # other run waits for it, RUNNING, as a run of another process would
                      "while not any(os.path.exists(STARTED + k) for k in '12'):\n    time.sleep(0.05)\n"
                      "print(one.status().state, two.status().state)\n"
                      "try:\n    pipe.run(workdir='w', run_id=one.run_id)\nexcept hf.RunLocked as exc:\n"
                      "    print(exc)\nprint(one.run_id)")
    lines = both["stdout"].splitlines()
    one_id = lines[-1]
    assert lines[:-1] == ["RUNNING RUNNING",
                          f"run {one_id} is running in this process already (started with wait=False): wait for it "
                          "with handle.wait(), or stop it with handle.cancel(), before resuming it"]
    ended = kernel.run("open(RELEASE, 'w').close()\nfor h in (one, two):\n    run = h.wait()\n"
                       "    print(run.state, run.dataset('a').to_table()['value'].to_pylist(), "
                       "run.dataset('b').to_table()['value'].to_pylist())\n"
                       "again = pipe.run(workdir='w', params={'k': 2})\n"
                       "print([(s.state, s.cached_from == two.run_id) for s in again.stages], "
                       "again.dataset('b').to_table()['value'].to_pylist())")
    assert ended["stdout"] == "DONE [1] [10]\nDONE [2] [20]\n[('CACHED', True), ('CACHED', True)] [20]\n"
    db = sqlite3.connect(tmp_path / "w" / "hetflow.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = db.execute("SELECT runs.state, stages.name, stages.state, stages.params FROM runs JOIN stages "
                          "ON stages.run_id = runs.id ORDER BY runs.created, stages.name").fetchall()
    finally:
        db.close()
    assert [(r[0], r[1], r[2], json.loads(r[3])["k"]) for r in rows] == [
        ("DONE", "first", "DONE", 1), ("DONE", "second", "DONE", 1),
        ("DONE", "first", "DONE", 2), ("DONE", "second", "DONE", 2),
        ("DONE", "first", "CACHED", 2), ("DONE", "second", "CACHED", 2)]


EXITS = '''
import os, time, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("left")

@pipe.stage(outputs=["a"])
def forever(ctx):
    open({started!r} + ".tmp", "w").write(str(os.getpid()))
    os.rename({started!r} + ".tmp", {started!r})
    time.sleep(600)

handle = pipe.run(workdir="w", wait=False)
while not os.path.exists({started!r}):
    time.sleep(0.05)
print(handle.run_id, flush=True)
'''


def test_a_process_that_exits_with_a_background_run_stops_it_interrupted(tmp_path: Path) -> None:
    """A kernel shut down or restarted while a run goes on: the run is stopped and recorded, not left RUNNING."""
    started = tmp_path / "started"
    done = subprocess.run([sys.executable, "-"], input=EXITS.format(started=str(started)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert not _alive(int(started.read_text()))
    shell = subprocess.run([HETFLOW, "status", run_id, "--json", "--workdir", "w"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    status = json.loads(shell.stdout)
    assert (status["state"], status["error"]) == (
        "INTERRUPTED", "interrupted (the Python process that started it in the background exited)")
    assert [(s["name"], s["state"]) for s in status["stages"]] == [("forever", "CANCELLED")]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ the run as a table in the notebook
FAILS = '''
import pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("shown")

@pipe.stage(outputs=["a"])
def fine(ctx):
    return {"a": pa.table({"value": [1]})}

@pipe.stage(inputs=["a"], outputs=["b"])
def breaks(ctx, a):
    raise RuntimeError("<script>alert(1)</script> & <img src=x onerror=alert(2)>")

run = pipe.run(workdir="w", check=False)
'''


def test_a_run_shows_as_a_table_with_its_texts_escaped_and_links_a_server_of_its_store(tmp_path: Path,
                                                                                      kernel: Kernel) -> None:
    kernel.run(FAILS)
    table = kernel.run("run")["html"][0]
    assert "<script" not in table and "<img" not in table
    assert re.search(r"<td[^>]*>breaks</td><td[^>]*><span[^>]*>FAILED</span></td><td[^>]*>ran</td><td[^>]*>"
                     r"rank 0 raised RuntimeError: &lt;script&gt;alert\(1\)&lt;/script&gt; &amp; &lt;img src=x "
                     r"onerror=alert\(2\)&gt;</td>", table), table
    assert re.search(r"<td[^>]*>fine</td><td[^>]*><span[^>]*>DONE</span></td><td[^>]*>ran</td>"
                     r"<td[^>]*>no earlier execution</td><td[^>]*>\d+\.\ds</td><td[^>]*>1</td>", table), table
    assert "href" not in table  # no server

    server = subprocess.Popen([HETFLOW, "serve", "--workdir", "w", "--port", "0"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        address = re.search(r"at (http://127\.0\.0\.1:\d+/\?token=[\w-]{40,})", server.stdout.readline())
        assert address is not None
        linked = kernel.run("run")["html"][0]
        assert f'<a href="{address[1]}" target="_blank">{address[1]}</a>' in linked
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "href" not in kernel.run("run")["html"][0]  # the server is gone


def test_a_stage_name_from_the_store_is_shown_as_text() -> None:
    """Names are checked where a stage is declared, but the store is a boundary: a shared one can hold
    anything; whatever the run says is put into the page as text."""
    from hetflow.display import run_html, run_text
    from hetflow.status import RunStatus, StageStatus

    stage = StageStatus(name="<script>alert(1)</script>", state="FAILED", attempts=1, started=1.0, ended=2.5,
                        slots=(), error='<b onmouseover="x">boom</b>\nmore', cache_hit=False)
    status = RunStatus(id="r<1>", pipeline="p&q", state="FAILED", created=0.0, started=1.0, ended=3.0,
                       run_dir="/nonexistent/runs/r", stages=(stage,), error="<i>why</i>")
    page = run_html(status)
    assert "<script" not in page and "<b " not in page and "<i>" not in page
    assert ("<td style=\"text-align:left\">&lt;script&gt;alert(1)&lt;/script&gt;</td>"
            "<td style=\"text-align:left\"><span style=\"color:#c62828\">FAILED</span></td>"
            "<td style=\"text-align:left\">ran</td>"
            "<td style=\"text-align:left\">&lt;b onmouseover=&quot;x&quot;&gt;boom&lt;/b&gt;</td>"
            "<td style=\"text-align:left\">1.5s</td><td style=\"text-align:left\">1</td>") in page
    assert "<b>run r&lt;1&gt;</b> (pipeline p&amp;q)" in page and "<div>&lt;i&gt;why&lt;/i&gt;</div>" in page
    assert run_text(status) == ("RunStatus('r<1>', pipeline='p&q', state=FAILED)\n"
                                "  <script>alert(1)</script> FAILED           1.5s  "
                                "ran (<b onmouseover=\"x\">boom</b>)\n"
                                "  <i>why</i>")


# ------------------------------------------------------------------ hetflow resume of a notebook's run
RESUMABLE = '''
import os, pyarrow as pa, hetflow as hf, mylocal
pipe = hf.Pipeline("resumable")
SCALE = 3
FIXED = {fixed!r}

def helper(x):
    return x * SCALE + mylocal.OFFSET

@pipe.stage(outputs=["a"])
def first(ctx):
    return {{"a": pa.table({{"value": [helper(1)]}})}}

@pipe.stage(inputs=["a"], outputs=["b"], files=["data.txt"])
def second(ctx, a):
    if not os.path.exists(FIXED):
        raise RuntimeError("not fixed yet")
    extra = int(open(ctx.files[0]).read())
    return {{"b": pa.table({{"value": [a["value"][0].as_py() * 10 + extra]}})}}
'''


def test_hetflow_resume_resumes_a_run_a_notebook_started(tmp_path: Path, kernel: Kernel) -> None:
    """From another directory, with the work directory given: the stages recorded in the run, the
    notebook's local module and declared file found where the notebook ran; what committed is kept."""
    (tmp_path / "mylocal.py").write_text("OFFSET = 100\n")
    (tmp_path / "data.txt").write_text("7\n")
    fixed = tmp_path / "fixed"
    kernel.run(RESUMABLE.format(fixed=str(fixed)))
    failed = kernel.run("try:\n    pipe.run(workdir='w')\nexcept hf.RunFailed as exc:\n"
                        "    print(exc.status.id)\n    print(exc)")["stdout"].splitlines()
    run_id = failed[0]
    assert failed[1].endswith(f"resume it with: pipe.run(run_id='{run_id}') from the same code, or from a shell: "
                              f"hetflow resume {run_id} --workdir w")
    recorded = tmp_path / "w" / "runs" / run_id / "pipeline.pickle"
    assert recorded.stat().st_mode & 0o777 == 0o600

    fixed.touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([HETFLOW, "resume", run_id, "--workdir", str(tmp_path / "w"), "--no-progress"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("  first ") or
             line.startswith("  second ")]
    assert [(line[0], line[1], line[3]) for line in lines] == [("first", "DONE", "attempts=1"),
                                                               ("second", "DONE", "attempts=2")]
    assert "(committed earlier in this run, unchanged)" in done.stdout
    (path,) = (tmp_path / "w" / "runs" / run_id / "datasets").glob("b")
    assert Dataset(path).to_table()["value"].to_pylist() == [(3 + 100) * 10 + 7]


STDIN_FAILS = '''
import os, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("typed")

@pipe.stage(outputs=["a"])
def only(ctx):
    if not os.environ.get("FIXED"):
        raise RuntimeError("not fixed yet")
    return {"a": pa.table({"value": [1]})}

try:
    pipe.run(workdir="w")
except hf.RunFailed as exc:
    print(exc.status.id)
'''


def _failed_stdin_run(tmp_path: Path) -> tuple[str, Path]:
    done = subprocess.run([sys.executable, "-"], input=STDIN_FAILS, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    run_id = done.stdout.strip()
    assert run_id, done.stderr
    return run_id, tmp_path / "w" / "runs" / run_id / "pipeline.pickle"


def _resume(tmp_path: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HETFLOW, "resume", run_id, "--workdir", "w", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "FIXED": "1"})


def test_hetflow_resume_refuses_recorded_stages_group_or_others_can_write(tmp_path: Path) -> None:
    run_id, recorded = _failed_stdin_run(tmp_path)
    os.chmod(recorded, 0o620)
    done = _resume(tmp_path, run_id)
    assert done.returncode == 2
    assert done.stderr == (f"hetflow: error: run {run_id}: refusing to unpickle its recorded stages: file {recorded}: "
                           "its mode 0620 lets group or others write it (expected a file owned by this user that "
                           "group and others cannot write)\n")
    os.chmod(recorded, 0o600)
    os.chmod(recorded.parent, 0o770)
    done = _resume(tmp_path, run_id)
    assert done.returncode == 2
    # refused before anything of the run is read (since resume checks started.json, that file's check
    # meets the directory first): the message names the directory and its mode
    assert "refusing to unpickle" in done.stderr and f"directory {recorded.parent}: its mode 0770 lets group or " \
           "others write it" in done.stderr
    os.chmod(recorded.parent, 0o700)
    assert _resume(tmp_path, run_id).returncode == 0


def test_hetflow_resume_refuses_a_symlinked_record(tmp_path: Path) -> None:
    run_id, recorded = _failed_stdin_run(tmp_path)
    elsewhere = tmp_path / "planted.pickle"
    recorded.rename(elsewhere)
    recorded.symlink_to(elsewhere)
    done = _resume(tmp_path, run_id)
    assert done.returncode == 2
    assert done.stderr == (f"hetflow: error: run {run_id}: refusing its recorded stages {recorded}: it is a symbolic "
                           "link (expected a regular file hetflow wrote for this run)\n")


def test_hetflow_resume_of_a_run_without_recorded_stages_says_what_to_do(tmp_path: Path) -> None:
    run_id, recorded = _failed_stdin_run(tmp_path)
    recorded.unlink()
    done = _resume(tmp_path, run_id)
    assert done.returncode == 2
    assert done.stderr == (f"hetflow: error: run {run_id} was started from Python code and has no record of its "
                           f"stages ({recorded} is missing: a run of an older hetflow, or stages that could not be "
                           f"pickled); resume it with pipe.run(run_id='{run_id}') from the same code\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_hetflow_resume_refuses_stages_another_user_recorded(tmp_path: Path) -> None:
    run_id, recorded = _failed_stdin_run(tmp_path)
    os.chown(recorded, 65534, -1)
    done = _resume(tmp_path, run_id)
    assert done.returncode == 2
    assert f"file {recorded}: it is owned by uid 65534, not by this user (uid 0)" in done.stderr


LEFT_GOING = '''
import pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("left-going")

@pipe.stage(outputs=["a"])
def only(ctx):
    return {"a": pa.table({"value": [1]})}

handle = pipe.run(wait=False)
print("started", handle.run_id, flush=True)
'''


def test_hetflow_run_of_a_script_that_leaves_a_background_run_going_waits_for_it_and_runs_it_once(
        tmp_path: Path) -> None:
    """``hetflow run`` runs the pipelines of a script that ran none: a run left going in the background is
    one, waited for and summarized, not started a second time (nor interrupted by the exit)."""
    (tmp_path / "left.py").write_text(LEFT_GOING)
    done = subprocess.run([HETFLOW, "run", "left.py", "--no-progress"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    started = re.search(r"^started (\S+)$", done.stdout, re.MULTILINE)
    assert started is not None, done.stdout
    assert re.search(rf"^run {started[1]}: DONE in ", done.stdout, re.MULTILINE), done.stdout
    from hetflow.store import Store

    store = Store.for_workdir(tmp_path / ".hetflow")
    try:
        assert [(run.id, run.state) for run in store.runs()] == [(started[1], "DONE")]
    finally:
        store.close()


LIVE = '''
import time, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("live")

@pipe.stage(outputs=["a"])
def slow(ctx):
    print("working <on> it")
    time.sleep(2)
    return {"a": pa.table({"value": [1]})}

@pipe.stage(inputs=["a"], outputs=["b"])
def after(ctx, a):
    return {"b": a}
'''


def test_a_blocking_run_in_a_notebook_shows_its_live_table_as_one_display_updated_in_place(
        tmp_path: Path, kernel: Kernel) -> None:
    kernel.run(LIVE)
    import nbformat

    cell = nbformat.v4.new_code_cell("run = pipe.run(workdir='w')")
    kernel.notebook.cells.append(cell)
    kernel.client.execute_cell(cell, len(kernel.notebook.cells) - 1)
    outputs = cell["outputs"]
    live = [o for o in outputs if "hetflow-live" in o.get("data", {}).get("text/html", "")]
    assert len(live) == 1, outputs    # one display, redrawn in place, not a table per refresh
    page = live[0]["data"]["text/html"]
    # drawn first with both stages waiting, it shows their last state: updated in place (nbclient applies
    # update_display_data to the output of its display id); the stage's printed line escaped
    assert re.search(r"<td[^>]*>slow</td><td[^>]*>DONE</td>", page), page
    assert re.search(r"<td[^>]*>after</td><td[^>]*>DONE</td>", page), page
    assert "<on>" not in page and "working &lt;on&gt; it" in page
    assert not any("hetflow: [" in o.get("text", "") for o in outputs)   # no plain progress lines in the cell


def test_a_run_printed_as_text_shows_control_characters_of_its_errors_not_their_effect() -> None:
    """``print(handle.status())`` on a terminal: a stage's error (from a shared store, another user's run)
    cannot retitle, clear or rewrite the terminal."""
    from hetflow.display import run_text
    from hetflow.status import RunStatus, StageStatus

    hostile = "\x1b]0;owned\x07\x1b[2Jboom\rfake line"
    stage = StageStatus(name="s", state="FAILED", attempts=1, started=1.0, ended=2.0, slots=(), error=hostile,
                        cache_hit=False)
    status = RunStatus(id="r1", pipeline="p", state="FAILED", created=0.0, started=1.0, ended=3.0,
                       run_dir="/nonexistent/runs/r1", stages=(stage,), error=hostile)
    text = run_text(status)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert "boom" in text and "fake line" in text


def test_hetflow_resume_refuses_a_session_directory_others_can_write(tmp_path: Path) -> None:
    """A run started from ``python -`` in a shared directory (mode 1777, as /tmp): a module planted there
    afterwards would be imported when ``hetflow resume`` loads the stages from elsewhere."""
    session = tmp_path / "shared"
    session.mkdir()
    run_id, _ = _failed_stdin_run(session)
    os.chmod(session, 0o1777)
    (session / "statistics.py").write_text(f"open({str(tmp_path / 'PLANTED')!r}, 'w').close()\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([HETFLOW, "resume", run_id, "--workdir", str(session / "w"), "--no-progress"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FIXED": "1"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"hetflow: error: run {run_id} was started in {session}, and its mode 1777 lets group "
                           "or others write it: a module put there by someone else would be imported when its "
                           f"stages are loaded; resume it with pipe.run(run_id={run_id!r}) from the same session, "
                           "or start runs from a directory only you can write\n")
    assert not (tmp_path / "PLANTED").exists()
    os.chmod(session, 0o700)
    (session / "statistics.py").unlink()
    assert subprocess.run([HETFLOW, "resume", run_id, "--workdir", str(session / "w"), "--no-progress"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FIXED": "1"}).returncode == 0
