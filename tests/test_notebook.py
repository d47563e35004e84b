"""Pipelines declared without a script file (issue 30): code piped to ``python -``, ``python -c``, a notebook.

Their stage functions have no file a worker could execute, so they are shipped by value
(:mod:`hetflow.tasks.shipping`); a worker unpickles only a file that no other user could write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetflow.operators.dataset import Dataset
from hetflow.tasks.protocol import AttemptFiles, RankResult, RankSlot, StageFunction, WorkerSpec

PIPELINE = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("typed")

OFFSET = 100


def helper():
    return HELPER_VALUE


@pipe.stage(ranks=2, outputs=["events"])
def generate(ctx):
    return {"events": pa.table({"value": [helper() + ctx.rank]})}


@pipe.stage(inputs=["events"], outputs=["total"])
def total(ctx, events):
    return {"total": pa.table({"value": [sum(events["value"].to_pylist()) + OFFSET]})}


run = pipe.run(workdir=WORKDIR)
for stage in run.stages:
    print("STAGE", stage.name, stage.state, stage.cache_reason)
print("STATE", run.state)
'''


def _pipeline(tmp_path: Path, helper_value: int) -> str:
    return (PIPELINE.replace("WORKDIR", repr(str(tmp_path / "w")))
            .replace("HELPER_VALUE", str(helper_value)))


def _run(argv: list[str], tmp_path: Path, stdin: str | None = None) -> dict[str, tuple[str, str]]:
    done = subprocess.run(argv, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    return {m[1]: (m[2], m[3]) for m in re.finditer(r"^STAGE (\S+) (\S+) (.*)$", done.stdout, re.MULTILINE)}


def _total(tmp_path: Path, run_dir: str = "*") -> list[int]:
    newest = max((tmp_path / "w" / "runs").glob(f"{run_dir}/datasets/total"), key=os.path.getmtime)
    return Dataset(newest).to_table()["value"].to_pylist()


def test_a_pipeline_piped_to_python_runs_caches_and_reruns_what_an_edited_helper_changes(tmp_path: Path) -> None:
    stages = _run([sys.executable, "-"], tmp_path, stdin=_pipeline(tmp_path, 1))
    assert stages == {"generate": ("DONE", "no earlier execution"), "total": ("DONE", "no earlier execution")}
    assert _total(tmp_path) == [1 + 2 + 100]  # ranks 0 and 1 of generate, then the total
    shipped = sorted((tmp_path / "w" / "runs").glob("*/stages/*/attempt-1/" + AttemptFiles.FUNCTION))
    assert [p.parent.parent.name for p in shipped] == ["generate", "total"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in shipped)

    again = _run([sys.executable, "-"], tmp_path, stdin=_pipeline(tmp_path, 1))
    assert {name: state for name, (state, _) in again.items()} == {"generate": "CACHED", "total": "CACHED"}

    edited = _run([sys.executable, "-"], tmp_path, stdin=_pipeline(tmp_path, 10))
    assert edited["generate"] == ("DONE", "code of helper() changed")
    assert edited["total"][0] == "DONE"  # its input changed
    assert _total(tmp_path) == [10 + 11 + 100]


def test_a_pipeline_given_with_python_c_runs(tmp_path: Path) -> None:
    stages = _run([sys.executable, "-c", _pipeline(tmp_path, 5)], tmp_path)
    assert {name: state for name, (state, _) in stages.items()} == {"generate": "DONE", "total": "DONE"}
    assert _total(tmp_path) == [5 + 6 + 100]


def test_a_value_of_the_session_the_stage_reads_is_in_its_key(tmp_path: Path) -> None:
    _run([sys.executable, "-"], tmp_path, stdin=_pipeline(tmp_path, 1))
    changed = _run([sys.executable, "-"], tmp_path, stdin=_pipeline(tmp_path, 1).replace("OFFSET = 100", "OFFSET = 7"))
    assert changed["generate"][0] == "CACHED"
    assert changed["total"] == ("DONE", "OFFSET changed")
    assert _total(tmp_path) == [1 + 2 + 7]


REDEFINED = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("cells")

@pipe.stage(outputs=["total"])
def total(ctx):
    return {"total": pa.table({"value": [1]})}

# a later cell: the same stage, edited
@pipe.stage(outputs=["total"])
def total(ctx):
    return {"total": pa.table({"value": [2]})}

run = pipe.run(workdir=WORKDIR)
print("STATE", run.state, list(pipe.stages))
'''


def test_redefining_a_stage_without_a_script_file_replaces_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-"], input=REDEFINED.replace("WORKDIR", repr(str(tmp_path / "w"))),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "STATE DONE ['total']" in done.stdout, done.stdout + done.stderr
    assert _total(tmp_path) == [2]


def test_redefining_a_stage_in_a_script_is_still_an_error(tmp_path: Path) -> None:
    script = tmp_path / "twice.py"
    script.write_text(REDEFINED.replace("WORKDIR", repr(str(tmp_path / "w"))))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode != 0
    assert "stage 'total': a stage with this name is already declared" in done.stderr, done.stderr


UNPICKLABLE = '''
import threading
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("locked")
LOCK = threading.Lock()

@pipe.stage(outputs=["out"])
def guarded(ctx):
    with LOCK:
        return {"out": pa.table({"value": [1]})}

try:
    pipe.run(workdir=WORKDIR)
except hf.HetflowError as exc:
    print("ERROR", type(exc).__name__, exc)
'''


def test_a_stage_that_cannot_be_pickled_is_refused_naming_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-"], input=UNPICKLABLE.replace("WORKDIR", repr(str(tmp_path / "w"))),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "ERROR ShippingFailed stage 'guarded' is declared without a script file" in done.stdout, \
        done.stdout + done.stderr
    assert "cannot pickle '_thread.lock' object" in done.stdout


# ------------------------------------------------------------------ what a worker unpickles
def _attempt(tmp_path: Path, mode: int = 0o600, owner: int | None = None) -> AttemptFiles:
    """An attempt of a stage shipped by value, its function file written with ``mode`` (and ``owner``)."""
    import cloudpickle

    namespace: dict[str, object] = {"__name__": "__main__"}
    exec("def marker(ctx):\n    open('ran', 'w').close()\n", namespace)  # a function of __main__: by value
    files = AttemptFiles(tmp_path / "attempt")
    files.directory.mkdir(mode=0o700)
    files.function.write_bytes(cloudpickle.dumps(namespace["marker"]))
    os.chmod(files.function, mode)
    if owner is not None:
        os.chown(files.function, owner, -1)
    WorkerSpec(run_id="r", stage="marker", attempt=1, function=StageFunction(module="__main__", name="marker"),
               attempt_dir=files.directory, checkpoint_dir=tmp_path / "checkpoints", slots=(RankSlot(0, (0,)),),
               nodes=("localhost",)).write(files.spec)
    return files


def _worker(files: AttemptFiles) -> RankResult:
    subprocess.run([sys.executable, "-m", "hetflow.tasks.worker", str(files.spec)], cwd=files.directory,
                   capture_output=True, text=True, timeout=120)
    return RankResult.from_json(json.loads(files.rank_result(0).read_text()))


def test_a_worker_runs_a_function_file_only_its_user_can_write(tmp_path: Path) -> None:
    files = _attempt(tmp_path)
    result = _worker(files)
    assert result.status == "ok", result.error
    assert (files.directory / "ran").exists()


def test_a_worker_refuses_a_function_file_group_or_others_can_write(tmp_path: Path) -> None:
    files = _attempt(tmp_path, mode=0o662)
    result = _worker(files)
    assert result.status == "error" and result.error is not None
    assert result.error.type == "UnsafeShippedFunction"
    assert result.error.message == (
        f"stage 'marker': refusing to unpickle its shipped function: file {files.function}: its mode 0662 lets "
        "group or others write it (expected a file owned by this user that group and others cannot write)")
    assert not (files.directory / "ran").exists()


def test_a_worker_refuses_a_function_file_in_a_directory_others_can_write(tmp_path: Path) -> None:
    files = _attempt(tmp_path)
    os.chmod(files.directory, 0o777)
    result = _worker(files)
    assert result.status == "error" and result.error is not None
    assert result.error.type == "UnsafeShippedFunction"
    assert f"directory {files.directory}: its mode 0777 lets group or others write it" in result.error.message
    assert not (files.directory / "ran").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_worker_refuses_a_function_file_another_user_owns(tmp_path: Path) -> None:
    files = _attempt(tmp_path, owner=65534)
    result = _worker(files)
    assert result.status == "error" and result.error is not None
    assert f"file {files.function}: it is owned by uid 65534, not by this user (uid 0)" in result.error.message
    assert not (files.directory / "ran").exists()


def test_a_worker_refuses_a_symlinked_function_file(tmp_path: Path) -> None:
    files = _attempt(tmp_path)
    real = files.directory / "elsewhere.pickle"
    files.function.rename(real)
    files.function.symlink_to(real)
    result = _worker(files)
    assert result.status == "error" and result.error is not None
    assert "it is a symbolic link" in result.error.message
    assert not (files.directory / "ran").exists()


LOCAL_MODULE = '''
import pyarrow as pa
import hetflow as hf
import mylocal

pipe = hf.Pipeline("local")

@pipe.stage(outputs=["total"])
def total(ctx):
    return {"total": pa.table({"value": [mylocal.value()]})}

run = pipe.run(workdir=WORKDIR)
for stage in run.stages:
    print("STAGE", stage.name, stage.state, stage.cache_reason)
print("STATE", run.state)
'''


def test_a_module_beside_the_session_is_imported_by_the_worker_and_counts_in_the_key(tmp_path: Path) -> None:
    """Its function is pickled by reference: the worker imports it from the session's directory."""
    (tmp_path / "mylocal.py").write_text("def value():\n    return 1\n")
    script = LOCAL_MODULE.replace("WORKDIR", repr(str(tmp_path / "w")))
    assert _run([sys.executable, "-"], tmp_path, stdin=script)["total"][0] == "DONE"
    assert _total(tmp_path) == [1]
    assert _run([sys.executable, "-"], tmp_path, stdin=script)["total"][0] == "CACHED"
    (tmp_path / "mylocal.py").write_text("def value():\n    return 2\n")
    assert _run([sys.executable, "-"], tmp_path, stdin=script)["total"] == ("DONE", "module mylocal changed")
    assert _total(tmp_path) == [2]


SET_ON_MODULE = '''
import pyarrow as pa
import hetflow as hf
import mylocal
SETTING

pipe = hf.Pipeline("set-on-module")

@pipe.stage(outputs=["total"])
def total(ctx):
    return {"total": pa.table({"value": [mylocal.K * 10]})}

run = pipe.run(workdir=WORKDIR, check=False)
print("STATE", run.state, run.stage("total").error)
'''


@pytest.mark.parametrize("setting, expected", [("mylocal.K = 2", "FAILED"), ("pass", "DONE")])
def test_a_value_the_session_sets_on_an_imported_module_is_not_committed_from_ranks_that_never_saw_it(
        tmp_path: Path, setting: str, expected: str) -> None:
    """``import mylib; mylib.K = 2`` in a session (round-6 red team n01): the key held 2, the ranks import mylib
    afresh and computed with its own 1, and that result was committed.  It fails, saying why."""
    (tmp_path / "mylocal.py").write_text("K = 1\n")
    script = SET_ON_MODULE.replace("WORKDIR", repr(str(tmp_path / "w"))).replace("SETTING", setting)
    done = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert f"STATE {expected}" in done.stdout, done.stdout + done.stderr
    if expected == "FAILED":
        assert "it reads mylocal.K, which this session set on an imported module" in done.stdout
        assert not list((tmp_path / "w" / "runs").glob("*/datasets/total/_manifest*"))
    else:
        assert _total(tmp_path) == [10]



MEMO_MODULE = '''
CFG = {"k": 1}


class Opts:
    k = 1


OPTS = Opts()
_CACHE = {}


def get():
    if "d" not in _CACHE:
        _CACHE["d"] = [1, 2, 3]
    return _CACHE["d"]
'''

SESSION_READS = '''
import pyarrow as pa
import hetflow as hf
import mylocal
SETTING

pipe = hf.Pipeline("session-reads")

@pipe.stage(outputs=["total"])
def total(ctx):
    return {"total": pa.table({"value": [READ]})}

run = pipe.run(workdir=WORKDIR, check=False)
print("STATE", run.state, run.stage("total").error)
'''


@pytest.mark.parametrize("setting, read, expected, value", [
    ("print(sum(mylocal.get()))", "sum(mylocal.get())", "DONE", 6),         # a memo the session filled
    ("mylocal._CACHE['d'] = [9]", "sum(mylocal.get())", "mylocal._CACHE", None),  # filled by the session itself
    ("mylocal.CFG['k'] = 2", "mylocal.CFG['k'] * 10 + mylocal.OPTS.k", "mylocal.CFG", None),
    ("pass", "mylocal.OPTS.k * 10", "DONE", 10),                            # an instance of a local class
], ids=["memo-filled-by-its-module", "memo-filled-by-the-session", "dict-item-set", "local-instance"])
def test_what_a_session_left_in_an_imported_modules_containers_fails_only_when_the_session_made_it(
        tmp_path: Path, setting: str, read: str, expected: str, value: int | None) -> None:
    """A session that called a memoizing helper (``mylocal.get()`` fills ``mylocal._CACHE``) before the run:
    the key holds the filled cache, the rank starts empty and the stage's own ``get()`` fills it the same way,
    so the result is the key's (it was refused every time).  A cache the session filled itself, or a dict item
    it set, the stage's rank does not make again: refused, naming only that global (an instance of a local
    class, untouched, was named too: a rank digested it as not local; alone it failed every stage)."""
    (tmp_path / "mylocal.py").write_text(MEMO_MODULE)
    script = (SESSION_READS.replace("WORKDIR", repr(str(tmp_path / "w"))).replace("SETTING", setting)
              .replace("READ", read))
    for again in (False, True):
        done = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, check=False)
        if expected == "DONE":
            assert "STATE DONE" in done.stdout, done.stdout + done.stderr
            assert "total CACHED" in done.stderr if again else "total DONE" in done.stderr, done.stderr
            assert _total(tmp_path) == [value]
            continue
        assert "STATE FAILED" in done.stdout, done.stdout + done.stderr
        assert f"it reads {expected}, which this session set on an imported module" in done.stdout, done.stdout
        assert not list((tmp_path / "w" / "runs").glob("*/datasets/total/_manifest*"))


# ------------------------------------------------------------------ the example notebook, in a real kernel
NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebook" / "pipeline.ipynb"


def test_the_example_notebook_runs_reruns_what_an_edited_cell_changes_and_replaces_a_redefined_stage(
        tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ["".join(o["text"] for o in cell.get("outputs", []) if o.get("name") == "stdout")
               for cell in notebook.cells if cell.cell_type == "code"]
    runs = [re.sub(r"since run \S+\)", "since run ...)", text) for text in printed if "total:" in text]
    assert runs == [
        "generate: DONE (no earlier execution)\ngrid: DONE (no earlier execution)\n"
        "combine: DONE (no earlier execution)\ntotal: 216\n",
        "generate: DONE (code of calibrate() changed)\ngrid: CACHED (unchanged since run ...)\n"
        "combine: DONE (input events changed)\ntotal: 234\n",
        "generate: CACHED (unchanged since run ...)\ngrid: CACHED (unchanged since run ...)\n"
        "combine: DONE (code of combine() changed)\ntotal: 25\n",
        "generate: CACHED (unchanged since run ...)\ngrid: CACHED (unchanged since run ...)\n"
        "combine: DONE (forced)\ntotal: 25\n",
    ]
    # the background run's handle, shown at once, and the run it ended as: tables of their stages
    started, ended = (notebook.cells[-2].outputs[0]["data"], notebook.cells[-1].outputs[-1]["data"])
    assert started["text/plain"].startswith("RunHandle('notebook-") and "generate" in started["text/html"]
    assert re.search(r"<td[^>]*>combine</td><td[^>]*><span[^>]*>DONE</span></td><td[^>]*>ran</td>"
                     r"<td[^>]*>forced</td>", ended["text/html"]), ended["text/html"]


def _execute(cells: list[str], where: Path) -> list[str]:
    """Execute ``cells`` as a notebook in a real kernel started in ``where``; what each printed."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(where)}}).execute()
    return ["".join(o["text"] for o in cell.get("outputs", []) if o.get("name") == "stdout") for cell in notebook.cells]


def test_a_module_beside_a_notebook_counts_in_the_key_of_a_stage_declared_in_a_cell(tmp_path: Path) -> None:
    """A cell's code has a file name like /tmp/ipykernel_*/*.py: the notebook's own directory is user code."""
    (tmp_path / "mylocal.py").write_text("def value():\n    return 1\n")
    run = ("run = pipe.run(workdir='w')\n"
           "print(run.stages[0].state, run.stages[0].cache_reason, "
           "hf.open_dataset(run.datasets['total']).to_table()['value'].to_pylist())")
    printed = _execute([
        "import importlib, pyarrow as pa, hetflow as hf, mylocal\npipe = hf.Pipeline('local')\n"
        "@pipe.stage(outputs=['total'])\ndef total(ctx):\n    return {'total': pa.table({'value': [mylocal.value()]})}",
        run,
        run,
        "open('mylocal.py', 'w').write('def value():\\n    return 2\\n')\nimportlib.reload(mylocal)\n" + run,
    ], tmp_path)
    assert printed[1] == "DONE no earlier execution [1]\n"
    assert printed[2].startswith("CACHED unchanged since run ")
    assert printed[3] == "DONE module mylocal changed [2]\n"


SLOW = '''
import os, time, pyarrow as pa, hetflow as hf
pipe = hf.Pipeline("slow")

@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": pa.table({"value": [1]})}

@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    if not os.environ.get("QUICK"):
        open(STARTED, "w").close()
        time.sleep(600)
    return {"b": pa.table({"value": [2]})}
'''


def test_the_kernels_interrupt_stops_a_run_as_interrupted_and_it_resumes_from_the_notebook(tmp_path: Path) -> None:
    import asyncio
    import threading
    import time

    import nbformat
    from nbclient import NotebookClient

    started = tmp_path / "started"
    cells = [
        SLOW.replace("STARTED", repr(str(started))),
        "try:\n    pipe.run(workdir='w')\nexcept KeyboardInterrupt as exc:\n    stopped = exc\n"
        "    print(type(exc).__name__, exc)",
        "from pathlib import Path\nfrom hetflow.store import Store\n"
        "print([run.state for run in Store.for_workdir(Path('w')).runs()])",
        "os.environ['QUICK'] = '1'\nrun = pipe.run(workdir='w', run_id=stopped.run_id)\n"
        "print(run.state, [(s.name, s.state, s.attempts) for s in run.stages])",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})

    def interrupt_when_the_stage_runs() -> None:
        deadline = time.monotonic() + 240
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        asyncio.run(client.km.interrupt_kernel())  # what the notebook's stop button does (an async method)

    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            interrupter = threading.Thread(target=interrupt_when_the_stage_runs) if index == 1 else None
            if interrupter is not None:
                interrupter.start()
            client.execute_cell(cell, index)
            if interrupter is not None:
                interrupter.join()
    printed = ["".join(o["text"] for o in cell.get("outputs", []) if o.get("name") == "stdout")
               for cell in notebook.cells]
    run_id = re.search(r"run (\S+) interrupted", printed[1])
    assert run_id is not None, printed
    assert printed[1] == (f"RunInterrupted run {run_id[1]} interrupted; running tasks were stopped; "
                          f"resume it with: pipe.run(run_id={run_id[1]!r}) from the same code, "
                          f"or from a shell: hetflow resume {run_id[1]} --workdir w\n")
    assert printed[2] == "['INTERRUPTED']\n"
    assert printed[3] == "DONE [('first', 'DONE', 1), ('second', 'DONE', 2)]\n"


OTHER_BACKENDS = {
    "dask-tcp": 'hf.PilotDescription(name="two", backend="dask", nodes=2, cores_per_node=1, gpus_per_node=0, '
                'memory_per_node=2**33, options={"dask": {"communicator": "tcp"}})',
    "parsl": 'hf.PilotDescription(name="one", backend="parsl", nodes=1, cores_per_node=2, gpus_per_node=0, '
             'memory_per_node=2**33)',
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(OTHER_BACKENDS))
def test_a_pipeline_piped_to_python_runs_on_another_backend(tmp_path: Path, backend: str) -> None:
    """The shipped function travels in the attempt directory, which every backend's worker reads
    (with two Dask workers as nodes, the 2-rank stage spans both)."""
    script = _pipeline(tmp_path, 5).replace("pipe.run(workdir=", f"pipe.run(pilot={OTHER_BACKENDS[backend]}, workdir=")
    stages = _run([sys.executable, "-"], tmp_path, stdin=script)
    assert {name: state for name, (state, _) in stages.items()} == {"generate": "DONE", "total": "DONE"}
    assert _total(tmp_path) == [5 + 6 + 100]


def test_a_function_file_is_not_loaded_through_a_symlinked_directory(tmp_path: Path) -> None:
    from hetflow.tasks.errors import UnsafeShippedFunction
    from hetflow.tasks.shipping import load

    files = _attempt(tmp_path)
    linked = tmp_path / "linked"
    linked.symlink_to(files.directory)
    with pytest.raises(UnsafeShippedFunction) as refused:
        load(linked / AttemptFiles.FUNCTION, "marker")
    assert str(refused.value) == (f"stage 'marker': refusing the directory {linked} of its shipped function: it is "
                                  "a symbolic link (expected the attempt directory hetflow made)")
    assert callable(load(files.function, "marker"))  # the same file, reached without the link


def test_a_stage_that_pickles_large_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from hetflow.tasks import shipping

    namespace: dict[str, object] = {"__name__": "__main__", "DATA": b"x" * 4096}
    exec("def reads(ctx):\n    return len(DATA)\n", namespace)
    stage = SimpleNamespace(name="reads", func=namespace["reads"], module="__main__")
    monkeypatch.setattr(shipping, "LARGE", 4000)  # the bytes it reads are pickled with it
    with pytest.warns(UserWarning, match=r"^stage 'reads' pickles to 0 MiB \(the values of the notebook it reads"):
        assert list(shipping.pickled([stage])) == ["reads"]


SCRIPT_WITHOUT_RUN = '''
import pyarrow as pa
import hetflow as hf
import consts

consts.K = 7  # the script's top level, which each worker must execute again
pipe = hf.Pipeline("bare")


@pipe.stage(outputs=["k"])
def read(ctx):
    return {"k": pa.table({"v": [consts.K]})}
'''


def test_a_script_that_leaves_the_run_to_hetflow_run_is_executed_by_its_workers_not_shipped(tmp_path: Path) -> None:
    """``hetflow run script.py`` runs a script that never calls ``pipe.run()`` itself after ``runpy`` has put
    hetflow's own ``__main__`` back: its stages are still the file's, executed by each worker (so what the
    top level sets is there), not shipped by value without it (which gave 0 here)."""
    (tmp_path / "consts.py").write_text("K = 0\n")
    (tmp_path / "bare.py").write_text(SCRIPT_WITHOUT_RUN)
    done = subprocess.run([str(Path(sys.executable).parent / "hetflow"), "run", "bare.py", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list((tmp_path / ".hetflow").rglob("function.pickle"))
    (path,) = (tmp_path / ".hetflow" / "runs").glob("*/datasets/k")
    assert Dataset(path).to_table().to_pylist() == [{"v": 7}]
