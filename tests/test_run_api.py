"""The run API as a script sees it: ``pipe.run()`` raises ``hf.RunFailed``, ``check=False`` returns
the status, a failed ``python script.py`` exits non-zero with one line, and the README's tour runs
as printed, guarded or not (real subprocesses, real mpiexec, real SQLite)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

import hetflow as hf

ROOT = Path(__file__).resolve().parents[1]
LOCAL_1 = hf.PilotDescription(name="one", cores_per_node=1, gpus_per_node=0, memory_per_node=2**33)

FAILING = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("failing")

@pipe.stage(outputs=["t"])
def make(ctx):
    return {"t": pa.table({"x": [1, 2]})}

@pipe.stage(inputs=["t"], outputs=["u"])
def boom(ctx, t):
    raise ValueError("the detector file is empty")

@pipe.stage(inputs=["u"], outputs=["v"])
def after(ctx, u):
    return {"v": u}
'''


def _make(ctx: hf.StageContext) -> dict[str, pa.Table]:
    return {"t": pa.table({"x": [1, 2]})}


def _boom(ctx: hf.StageContext, t: pa.Table) -> dict[str, pa.Table]:
    raise ValueError("the detector file is empty")


def test_run_raises_run_failed_carrying_the_status_and_check_false_returns_it(tmp_path: Path) -> None:
    pipe = hf.Pipeline("failing", pilot=LOCAL_1, workdir=tmp_path / "w")
    pipe.stage(outputs=["t"])(_make)
    pipe.stage(inputs=["t"], outputs=["u"])(_boom)
    with pytest.raises(hf.RunFailed) as caught:
        pipe.run(progress=False)
    status = caught.value.status
    assert isinstance(status, hf.RunStatus) and status.state == "FAILED"
    assert status.stage("_boom").state == "FAILED" and status.stage("_make").state == "DONE"
    message = str(caught.value)
    assert status.id in message and "_boom FAILED" in message and "the detector file is empty" in message
    assert "\n" not in message
    # started from Python code (no script of its own): the resume is pipe.run(run_id=...)
    assert f"pipe.run(run_id={status.id!r})" in message
    # a run is not a task: one tree, one root (issue 29)
    assert isinstance(caught.value, hf.HetflowError) and not isinstance(caught.value, hf.TaskFailed)
    again = pipe.run(progress=False, check=False, run_id=status.id)
    assert isinstance(again, hf.RunStatus) and again.id == status.id and again.state == "FAILED"


def _progress_line(line: str) -> bool:
    return re.match(r"hetflow: (run \S+ started|\[\s*[\d.]+s\] )", line) is not None


@pytest.mark.parametrize("guarded", [False, True])
def test_a_failed_script_exits_1_with_one_line_naming_run_stage_and_resume(tmp_path: Path, guarded: bool) -> None:
    body = FAILING + ('\nif __name__ == "__main__":\n    pipe.run()\n    print("after run")\n' if guarded
                      else '\npipe.run()\nprint("after run")\n')
    (tmp_path / "flow.py").write_text(body)
    done = subprocess.run([sys.executable, "flow.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "after run" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    # off a terminal the run prints plain progress lines as it goes (docs/observing.md); the
    # outcome is the one line after them
    lines = [line for line in done.stderr.splitlines() if line.strip() and not _progress_line(line)]
    assert len(lines) == 1, done.stderr
    run_id = re.search(r"run (failing-\S+) ended FAILED", lines[0])
    assert run_id is not None, lines[0]
    assert "boom FAILED (rank 0 raised ValueError: the detector file is empty)" in lines[0]
    assert "skipped: after" in lines[0]
    assert lines[0].endswith(f"resume it with: hetflow resume {run_id.group(1)}")
    # and the command it names works: the script is fixed, the resume finishes the run
    (tmp_path / "flow.py").write_text(body.replace('raise ValueError("the detector file is empty")',
                                                   'return {"u": t}'))
    resumed = subprocess.run([sys.executable, "-m", "hetflow.cli", "resume", run_id.group(1), "--no-progress"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"run {run_id.group(1)}: DONE" in resumed.stdout


def test_other_errors_in_a_script_keep_their_traceback(tmp_path: Path) -> None:
    """Only a run's outcome is shortened: a bug in the script itself still shows where it is."""
    (tmp_path / "flow.py").write_text("import hetflow as hf\n1 / 0\n")
    done = subprocess.run([sys.executable, "flow.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr and "ZeroDivisionError" in done.stderr


def test_hetflow_run_keeps_exit_code_1_and_prints_the_summary_for_a_failed_script(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text(FAILING)
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "flow.py", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"boom +FAILED +\S+ +attempts=1 +rank 0 raised ValueError", done.stdout), done.stdout
    assert "resume it with: hetflow resume failing-" in done.stdout


def _quickstart() -> tuple[str, str]:
    """The README quickstart's two blocks: the data it makes, and ``quickstart.py`` as printed."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    script = [b for b in blocks if "hf.Pipeline(" in b]
    data = [b for b in blocks if "hf.Pipeline(" not in b and "write_csv" in b]
    assert script and data, "README.md: no quickstart (a data block and a pipeline block)"
    return data[0], script[0]


@pytest.mark.parametrize("guarded", [False, True])
def test_the_readme_tour_runs_as_printed(tmp_path: Path, guarded: bool) -> None:
    """The README's quickstart as printed (guarded), and the same without its ``__main__`` guard."""
    data, code = _quickstart()
    subprocess.run([sys.executable, "-c", data], cwd=tmp_path, check=True, timeout=120)
    guard = code[code.index('if __name__ == "__main__":'):]
    if not guarded:
        code = code.replace(guard, textwrap.dedent(guard.split("\n", 1)[1]))
        assert "__main__" not in code
    (tmp_path / "tour.py").write_text(code + ("\n    " if guarded else "\n") + "print('tour state', run.state)\n")
    done = subprocess.run([sys.executable, "tour.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tour state DONE" in done.stdout
    runs = subprocess.run([sys.executable, "-m", "hetflow.cli", "runs", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert [r["state"] for r in json.loads(runs.stdout)] == ["DONE"]


def _spread(ctx: hf.StageContext) -> dict[str, pa.Table]:
    return {"t": pa.table({"x": [5, 3, 9, 1][ctx.rank::ctx.size]})}


def _sorted(ctx: hf.StageContext, t: pa.Table) -> dict[str, object]:
    return {"s": ctx.dtable(t).sort_by("x")}  # a DTable, as the operators hand it back


def test_a_stage_may_return_the_dtable_its_operators_made(tmp_path: Path) -> None:
    two = hf.PilotDescription(name="two", cores_per_node=2, gpus_per_node=0, memory_per_node=2**33)
    pipe = hf.Pipeline("dtables", pilot=two, workdir=tmp_path / "w")
    pipe.stage(ranks=2, outputs=["t"])(_spread)
    pipe.stage(ranks=2, inputs=["t"], outputs=["s"])(_sorted)
    status = pipe.run(progress=False)
    assert status.dataset("s").to_table().column("x").to_pylist() == [1, 3, 5, 9]


def test_a_missing_relative_file_says_where_stages_run_and_how_to_declare_it() -> None:
    from hetflow.tasks.worker import error_message

    import pyarrow.parquet as pq

    with pytest.raises(FileNotFoundError) as pyarrow_style:  # pyarrow: the path only, no .filename
        pq.read_table("obs-that-is-not-here.parquet")
    for exc in (pyarrow_style.value, FileNotFoundError(2, "No such file or directory", "cat.csv")):
        text = error_message(exc)
        assert "attempt directory" in text and "files=[" in text and "ctx.files" in text, text
    assert "files=['cat.csv']" in error_message(FileNotFoundError(2, "No such file or directory", "cat.csv"))
    absolute = FileNotFoundError(2, "No such file or directory", "/data/cat.csv")
    assert error_message(absolute) == str(absolute)  # nothing to add for an absolute path
    # a stage that declares files: the hint is ctx.files, which it already has, not to declare them
    hinted = error_message(FileNotFoundError(2, "No such file or directory", "data/obs-1.csv"),
                           ["/home/me/data/obs-1.csv"])
    assert "ctx.files" in hinted and "/home/me/data/obs-1.csv" in hinted and "files=[" not in hinted, hinted
    assert "ctx.files['obs-1.csv']" in hinted, hinted   # the spelling that works (a fresh user tried it)


def _read_by_name(ctx: hf.StageContext) -> dict[str, object]:
    refused = []
    for name in ("nope.csv", "obs.csv"):
        try:
            ctx.files[name]
        except KeyError as exc:
            refused.append(str(exc))
    return {"t": pa.table({"one": [ctx.files["a/obs.csv"].read_text()], "two": [ctx.files["./b/obs.csv"].read_text()],
                           "first": [str(ctx.files[0])], "n": [len(ctx.files)], "refused": [refused]})}


def test_declared_files_are_found_in_ctx_files_by_the_name_declared(tmp_path: Path) -> None:
    """A scientist's first try was ``ctx.files["obs.csv"]``: a ``TypeError`` (tuple indices must be integers).
    The name as declared, or its last components, finds the one file; a name matching none or several says so."""
    for folder, text in (("a", "1"), ("b", "2")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "obs.csv").write_text(text)
    pipe = hf.Pipeline("by-name", workdir=tmp_path / "w")
    pipe.stage(outputs=["t"], files=[str(tmp_path / "a" / "obs.csv"), str(tmp_path / "b" / "obs.csv")],
               name="by_name")(_read_by_name)
    status = pipe.run(progress=False)
    assert status.state == "DONE", status
    row, = status.dataset("t").to_table().to_pylist()
    refused = row.pop("refused")
    assert row == {"one": "1", "two": "2", "first": str(tmp_path / "a" / "obs.csv"), "n": 2}
    assert re.search(r"stage 'by_name' declared no file 'nope.csv' \(declared: .*a/obs.csv", refused[0]), refused
    assert "'obs.csv' names 2 declared files" in refused[1], refused


RESOLVED_AT_TOP = '''
from pathlib import Path
import pyarrow as pa
import hetflow as hf

DATA = Path("data").resolve()
pipe = hf.Pipeline("resolved", pilot="local")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"n": [len(open(DATA / "x.csv").read())]})}


if __name__ == "__main__":
    pipe.run(workdir="w")
'''


def test_a_path_resolved_at_the_scripts_top_says_it_was_resolved_in_the_attempt_directory(tmp_path: Path) -> None:
    """``DATA = Path("data").resolve()`` at the top is resolved again in each rank, in its attempt directory:
    the stage's FileNotFoundError names an absolute path under it, and had none of the hint that the plain
    ``open("data/x.csv")`` gets."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_text("a\n1\n")
    (tmp_path / "p.py").write_text(RESOLVED_AT_TOP)
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "FileNotFoundError" in last and "/stages/make/attempt-1/data/x.csv'" in last, last
    assert ("(a relative path made absolute at the script's top (Path('data').resolve(), os.path.abspath) is "
            "resolved in each rank's attempt directory ") in last, last
    assert "declare the file with files=['data/x.csv'] (relative to the script) and open it from ctx.files" in last


def _takes_ctx_only(ctx):  # type: ignore[no-untyped-def]
    return {"u": None}


def _takes_any(ctx, *tables):  # type: ignore[no-untyped-def]
    return {"u": None}


def test_a_stage_function_that_cannot_take_its_inputs_is_refused_where_it_is_declared() -> None:
    """``func(ctx, *inputs)`` is how every rank calls it: ``def f(ctx)`` with ``inputs=["t"]`` failed only when
    it ran, after everything upstream, with Python's 'takes 1 positional argument but 2 were given'."""
    pipe = hf.Pipeline("signatures")
    with pytest.raises(hf.PipelineError) as caught:
        pipe.stage(inputs=["t"], outputs=["u"])(_takes_ctx_only)
    assert str(caught.value) == ("pipeline 'signatures', stage '_takes_ctx_only': _takes_ctx_only(ctx) cannot be called "
                                 "as _takes_ctx_only(ctx, t) (too many positional arguments): a stage function takes "
                                 "ctx, then one argument per input, in the order of inputs=['t']")

    def two(ctx, a, b):  # type: ignore[no-untyped-def]
        return {}

    with pytest.raises(hf.PipelineError, match=r"stage 'two': two\(ctx, a, b\) cannot be called as two\(ctx, a\) "
                                               r"\(missing a required argument: 'b'\).*inputs=\['a'\]"):
        pipe.stage(inputs=["a"], outputs=["c"])(two)

    def keyword_only(ctx, *, t):  # type: ignore[no-untyped-def]
        return {}

    with pytest.raises(hf.PipelineError, match=r"keyword_only\(ctx, \*, t\) cannot be called as keyword_only\(ctx, t\)"):
        pipe.stage(inputs=["t"], outputs=["k"])(keyword_only)
    assert not pipe.stages  # nothing half-declared
    # what can take the call is declared: *args, defaults, and a function without inputs
    pipe.stage(name="any", inputs=["t", "x"], outputs=["u"])(_takes_any)
    pipe.stage(name="defaults", inputs=["t"], outputs=["d"])(lambda ctx, t, scale=2: {"d": None})
    pipe.stage(name="alone", outputs=["t"])(_takes_ctx_only)
    assert list(pipe.stages) == ["any", "defaults", "alone"]


GLOBS = '''
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import hetflow as hf

pipe = hf.Pipeline("globs")


@pipe.stage(outputs=["a"])
def first(ctx):
    (Path(__file__).parent / "first-ran").touch()
    return {"a": pa.table({"x": [1]})}


@pipe.stage(inputs=["a"], outputs=["b"], files=["data/obs-*.csv"])
def second(ctx, a):
    return {"b": pa.concat_tables([pcsv.read_csv(f) for f in ctx.files])}


if __name__ == "__main__":
    import sys

    if "--make" in sys.argv:  # an earlier step of the script makes the files the stage declares
        Path(__file__).parent.joinpath("data").mkdir(exist_ok=True)
        pcsv.write_csv(pa.table({"y": [2]}), Path(__file__).parent / "data" / "obs-1.csv")
    pipe.run()
'''


def test_a_files_glob_that_matches_nothing_is_refused_when_the_run_starts(tmp_path: Path) -> None:
    """Before anything runs, naming the stage, the pattern and the directory it was resolved against; files
    an earlier step of the script makes are there by then."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "flow.py").write_text(GLOBS)
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "project/flow.py", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == (f"hetflow: error: pipeline 'globs', stage 'second': declared files glob "
                                   f"'data/obs-*.csv' matches no file in {project} (the script's directory: "
                                   "relative patterns are resolved against it)")
    assert not (project / "first-ran").exists() and not (tmp_path / ".hetflow" / "runs").exists()
    made = subprocess.run([sys.executable, "project/flow.py", "--make"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    from hetflow.store import Store

    store = Store.for_workdir(tmp_path / ".hetflow")
    try:
        (run,) = store.runs()
        assert run.state == "DONE"
    finally:
        store.close()


DISAGREE = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("disagree", pilot=hf.PilotDescription(name="four", cores_per_node=4, gpus_per_node=0,
                                                          memory_per_node=2**33))


@pipe.stage(ranks=2, outputs=["pair"])
def pair(ctx):
    if ctx.rank == 1:
        return {"pair": pa.table({"x": [1.5], "tag": ["b"]})}
    return {"pair": pa.table({"x": [1], "tag": ["a"]})}


@pipe.stage(ranks=3, outputs=["trio"])
def trio(ctx):
    if ctx.rank == 1:
        return {"trio": pa.table({"x": [1], "extra": [True]})}
    return {"trio": pa.table({"x": [ctx.rank]})}
'''


def test_ranks_that_return_different_schemas_are_named_with_both_schemas_in_the_summary_and_run_failed(
        tmp_path: Path) -> None:
    """The whole error (bounded), not its first line; with two ranks neither is the odd one out, so both are
    named; with three, the one whose schema differs from the other two."""
    (tmp_path / "flow.py").write_text(DISAGREE)
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "flow.py", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"pair +FAILED +\S+ +attempts=1  ranks 0 and 1: SchemaDisagreement: stage 'pair', output "
                     r"'pair': ranks 0 and 1 returned different schemas, and none is returned by more ranks than the "
                     r"others", out), out
    for line in ("rank 0: x: int64, tag: string", "rank 1: x: double, tag: string",
                 "rank 1 against rank 0: ~ column 'x': double, expected int64",
                 ("rank 1: SchemaDisagreement: stage 'trio', output 'trio': rank 1 returned a schema that differs "
                 "from the one ranks 0 and 2 returned"), "ranks 0 and 2: x: int64", "rank 1: x: int64, extra: bool",
                 "rank 1 against ranks 0 and 2: + unexpected column 'extra' (bool)"):
        assert line in out, (line, out)
    status = json.loads(subprocess.run([sys.executable, "-m", "hetflow.cli", "status", "--json"], cwd=tmp_path,
                                       capture_output=True, text=True, timeout=120).stdout)
    stages = {s["name"]: s for s in status["stages"]}
    assert stages["pair"]["failed_rank"] == 0 and stages["trio"]["failed_rank"] == 1
    # RunFailed, as pipe.run() raises it in Python: the same lines
    from hetflow.status import run_status
    from hetflow.store import Store

    store = Store.for_workdir(tmp_path / ".hetflow")
    try:
        message = str(hf.RunFailed(run_status(store, None)))
    finally:
        store.close()
    assert "rank 0: x: int64, tag: string" in message and "rank 1: x: double, tag: string" in message, message
    assert "rank 1 against ranks 0 and 2: + unexpected column 'extra' (bool)" in message, message


def test_a_long_error_is_cut_to_its_first_lines_saying_how_many_are_left_out() -> None:
    from hetflow.errors import ERROR_LINES, error_text

    assert error_text("one line") == "one line"
    assert error_text("head:\n  a\n  b\n") == "head:\n    a\n    b"
    long = error_text("\n".join(f"line {i}" for i in range(50)))
    assert long.splitlines()[:2] == ["line 0", "  line 1"] and len(long.splitlines()) == ERROR_LINES + 1
    assert long.splitlines()[-1] == f"  ... {50 - ERROR_LINES} more lines (hetflow status shows them)"
